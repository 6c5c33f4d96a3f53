"""Text arguments of ``m2live rank`` turned into planner inputs; every malformed value is a ``PlanError``
naming its flag (the CLI prints it as one line, exit 2)."""

from __future__ import annotations

import argparse
import re

from ..calibration_file import Calibrations, Paths
from ..hardware import all_gpus, get_gpu
from ..limits import STEP_SEQS, STEP_TOKENS, digits
from ..planner import PlanConfig, PlanError
from ..quantization import model_kv_cache_dtype, weights_for
from ..serving_config import parse_switch
from ..validate import positive_float
from ..vllm_release import DEFAULT_GPU_RELEASE
from .engine_args import release_arg


def parse_tp_list(text: str) -> list[int]:
    items = [s.strip() for s in str(text).split(",")]
    out = []
    for s in items:
        if not re.fullmatch(r"[0-9]+", s or "x") or int(s) < 1 or int(s) > 64:
            raise PlanError(f"--tp {text!r}: expected comma-separated integers in 1..64, e.g. 1,2,4,8")
        out.append(int(s))
    return sorted(set(out))


def parse_prices(text: str | None) -> dict[str, float]:
    """``GPU=$/h,...`` (per GPU-hour; '$' optional) -> {canonical NVML name: price}."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for item in str(text).split(","):
        item = item.strip()
        if "=" not in item:
            raise PlanError(f"--price {item!r}: expected GPU=DOLLARS_PER_HOUR, e.g. h100-sxm=2.5")
        name, val = (s.strip() for s in item.rsplit("=", 1))
        val = val.removeprefix("$").removesuffix("/h").strip()
        out[get_gpu(name).name] = positive_float(val, f"--price {item!r}: dollars per GPU-hour", PlanError)
    return out


def nonneg_int(text: str, flag: str) -> int:
    s = str(text).strip()
    if not digits(s):
        raise PlanError(f"{flag} must be a non-negative integer, got {text!r}")
    return int(s)


def parse_slo(text: str | None) -> float | None:
    """``--slo-ms`` in seconds (None: no SLO)."""
    if text is None:
        return None
    return positive_float(text, "--slo-ms (milliseconds)", PlanError) / 1e3


def parse_gpus(text: str) -> list[str]:
    """``--gpus``: canonical names, in the order given, without repeats; ``all`` is the whole catalog."""
    if text.strip().lower() == "all":
        return [g.name for g in all_gpus()]
    names = [s.strip() for s in text.split(",")]
    if not names or any(not s for s in names):
        raise PlanError(f"--gpus {text!r}: expected comma-separated GPU names or 'all'")
    out: list[str] = []
    for n in names:
        g = get_gpu(n).name
        if g not in out:
            out.append(g)
    return out


def calibrated_constants(paths: Paths, gpus: list[str]) -> dict:
    """GPU name -> the Predictor's constants of its calibration among ``paths`` (``predictor_constants``: bf16
    and fp8); refused when a calibration's GPU is not among those ranked."""
    cals = Calibrations.load(paths)
    if cals is None:
        return {}
    ranked = {get_gpu(g).name for g in gpus}
    for gpu, cal in cals.by_gpu.items():
        if gpu not in ranked:
            raise PlanError(f"calibration {cal.path} is for {gpu}, which is not among the GPUs ranked "
                            f"({', '.join(sorted(ranked))}): add it to --gpus or drop that --calibration")
    return {gpu: cal.predictor_constants() for gpu, cal in cals.by_gpu.items()}


def plan_config(args: argparse.Namespace, gpus: list[str]) -> PlanConfig:
    """The planner's configuration from the parsed flags (the weights: --precision's, else the model's)."""
    w = weights_for(args.precision, args.model)
    return PlanConfig(slo_s=parse_slo(args.slo_ms),
                      max_num_seqs=None if args.max_seqs is None
                      else int(STEP_SEQS.parse(args.max_seqs, "--max-seqs", PlanError)),
                      max_batched_tokens=None if args.max_batched_tokens is None
                      else int(STEP_TOKENS.parse(args.max_batched_tokens, "--max-batched-tokens", PlanError)),
                      clock=args.clock, prices=parse_prices(args.price), rank_by=args.rank_by,
                      constants=calibrated_constants(args.calibration, gpus), precision=w.precision,
                      act_scale=w.act_scale, kv_cache_dtype=model_kv_cache_dtype(args.kv_cache_dtype, args.model)[0],
                      async_scheduling=parse_switch(args.async_scheduling, "--async-scheduling"),
                      allreduce_fusion=parse_switch(args.allreduce_fusion, "--allreduce-fusion"),
                      vllm_version=release_arg(args.vllm_version) or DEFAULT_GPU_RELEASE)


def png_path(text: str | None) -> str | None:
    """``--plot``: a .png file name, or None."""
    if text and not str(text).lower().endswith(".png"):
        raise PlanError(f"--plot {text!r}: give a .png file name")
    return text
