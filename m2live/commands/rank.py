"""Rank GPU SKUs and tensor-parallel layouts for a model and workload (capacity planning), or score the ranking.

    m2live rank --model MODEL --workload SPEC [--gpus LIST|all] [--tp 1,2,4,8] [--slo-ms X]
                [--price GPU=$/h,...] [--plot FILE.png] [--json]
    m2live rank --validate DIR [DIR ...] [--json] [--plot FILE.png]

SPEC: a preset (chat, summarisation, long-context; optionally followed by overrides such as ``chat,rate=4``),
``prompt=DIST,output=DIST[,rate=REQ_PER_S]`` with DIST one of ``N``, ``fixed:N``, ``uniform:LO:HI``,
``normal:MEAN:STD``, ``lognormal:MEDIAN:SIGMA``, or ``trace:PATH`` (an m2live JSONL trace).
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from ..calibration_file import Calibrations
from ..forkmap import jobs_arg
from ..planner import PlanError, rank, validate_opbench
from ..quantization import KV_AUTO_HELP, KV_CACHE_BYTES
from ..workload import parse_workload
from .engine_args import add_allreduce_fusion, add_async_scheduling, add_vllm_version
from .rank_args import nonneg_int, parse_gpus, parse_tp_list, plan_config, png_path
from .rank_output import json_default, plot_ranking, plot_validation, print_ranking, print_validation


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="preset name or path to config.json / model directory")
    p.add_argument("--workload", help="preset, prompt=DIST,output=DIST[,rate=R], or trace:PATH")
    p.add_argument("--gpus", default="all", help="comma-separated NVML names, aliases or GPU spec files (.json), or 'all' (default)")
    p.add_argument("--tp", default="1,2,4,8", help="tensor-parallel sizes to consider (default 1,2,4,8)")
    p.add_argument("--slo-ms", help="per-step latency SLO in ms (= inter-token latency); default: none")
    p.add_argument("--price", help="$ per GPU-hour, e.g. 'h100-sxm=2.5,a100-80gb=1.6'; ranks per dollar "
                                   "when every fitting GPU has a price")
    p.add_argument("--rank-by", default="auto", choices=("auto", "gpu", "dollar", "layout"),
                   help="gpu: generated tokens/s per GPU; dollar: tokens per $; layout: tokens/s per replica")
    p.add_argument("--clock", default="forecast", choices=("forecast", "boost"),
                   help="SM clock for the predictions (default: forecast from the power cap)")
    p.add_argument("--precision", choices=("bf16", "fp8"),
                   help="linear-layer weights: bf16, or fp8 (vLLM's W8A8 e4m3 with per-tensor scales; attention "
                        "and the KV cache stay bf16; GPUs without fp8 tensor cores are excluded); default: the "
                        "checkpoint's (its config.json's quantization_config, or FP8 in its name), else bf16")
    p.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_BYTES),
                   help=KV_AUTO_HELP + " (twice the cache's "
                        "tokens, half the bytes attention streams; priced by its bytes)")
    add_async_scheduling(p)
    add_allreduce_fusion(p)
    add_vllm_version(p)
    p.add_argument("--max-seqs", help="vLLM max_num_seqs (default: vLLM's for each device, e.g. 1024 on an H100, "
                                       "256 on an L40S)")
    p.add_argument("--max-batched-tokens", help="vLLM max_num_batched_tokens (default: vLLM's for each device, e.g. "
                                                "8192 on an H100, 2048 on an A100 or L40S)")
    p.add_argument("--top", default="0", help="show only the best N layouts in the table (default: all)")
    p.add_argument("--plot", metavar="FILE.png", help="write a picture: throughput vs SLO and ranked bars")
    p.add_argument("--validate", nargs="+", metavar="DIR",
                   help="instead of ranking: decision quality on measured opbench folders")
    p.add_argument("--calibration", metavar="CAL.json", action="append",
                   help="a GPU's own constants (m2live calibrate fit), once per GPU calibrated; each GPU must be "
                        "among --gpus (the others are priced from their datasheets)")
    p.add_argument("--jobs", metavar="N", help="evaluate the layouts in N processes (default: one per CPU core this "
                   "process may use, at most 8, and one per 2 layouts; 1: in this process); the same ranking")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(ranking_defaults={d: p.get_default(d) for d in RANKING_ONLY})


# what only a ranking reads: given with --validate (which scores the planner on measured tables), refused
RANKING_ONLY = ("model", "workload", "gpus", "tp", "slo_ms", "price", "rank_by", "clock", "precision",
                "kv_cache_dtype", "async_scheduling", "allreduce_fusion", "vllm_version", "max_seqs",
                "max_batched_tokens", "top", "calibration", "jobs")


def _said(value: object) -> object:
    """A flag's value as compared with its default (--gpus ALL is --gpus all)."""
    return value.strip().lower() if isinstance(value, str) else value


def run(args: argparse.Namespace) -> int:
    if args.validate:
        given = [d for d in RANKING_ONLY if _said(getattr(args, d)) != _said(args.ranking_defaults[d])]
        if given:
            raise PlanError(f"--validate scores the ranking on measured tables; --{given[0].replace('_', '-')} "
                            "is a ranking's: drop it")
        return run_validate(args)
    if not args.model:
        raise PlanError("--model is required (a preset such as meta-llama/Llama-3.1-8B or a config.json path)")
    if not args.workload:
        raise PlanError("--workload is required (chat, summarisation, long-context, "
                        "prompt=DIST,output=DIST[,rate=R] or trace:PATH)")
    wl = parse_workload(args.workload)
    Calibrations.load(args.calibration)  # first: a GPU only a calibration describes (gpu_spec) is known by name
    gpus = parse_gpus(args.gpus)
    tps = parse_tp_list(args.tp)
    cfg = plan_config(args, gpus)
    top = nonneg_int(args.top, "--top")
    plot = png_path(args.plot)
    layouts = len(gpus) * len(set(tps))
    jobs = None if args.jobs is None else jobs_arg(args.jobs, layouts, PlanError)
    r = rank(args.model, wl, gpus, tps, cfg, curve=bool(plot), jobs=jobs)
    if plot:
        plot_ranking(r, plot)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2, default=json_default))
        return 0
    print_ranking(r, top)
    if plot:
        Console(width=140).print(f"plot written to {plot}")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    out = validate_opbench(args.validate)
    plot = png_path(args.plot)
    if plot:
        plot_validation(out, plot)
    if args.json:
        print(json.dumps(out, indent=2, default=json_default))
        return 0
    print_validation(out)
    return 0
