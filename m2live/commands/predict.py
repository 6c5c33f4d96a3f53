"""Predict one engine step (prefill chunks + decodes) with the full per-operator, per-factor breakdown."""

from __future__ import annotations

import argparse
import json
import re

from rich.console import Console
from rich.table import Table

from .. import limits
from ..calibration_file import Calibrations
from ..hardware import tp_beyond_node
from ..predictor import Predictor
from ..quantization import KV_AUTO_HELP, KV_CACHE_BYTES, model_kv_cache_dtype, weights_for
from ..serving_config import parse_switch
from ..step import Step
from .engine_args import add_allreduce_fusion
from .ops import add_calibration_flag

_SPEC = re.compile(r"^(\d+)(?:@(\d+))?(?:x(\d+))?$")


def parse_spec(text: str, what: str, length: limits.Bound = limits.NEW_TOKENS) -> tuple[int, int, int]:
    """'LEN[@CTX][xCOUNT]' → (len, ctx, count); all positive integers (ctx may be 0), each within its bound in
    ``m2live.limits`` (checked on the digits, before any list is built)."""
    m = _SPEC.match(text.strip())
    if not m:
        raise ValueError(f"{what} {text[:40]!r}: expected a positive integer, optionally @CONTEXT and xCOUNT "
                         "(e.g. 512x4)")
    n = int(length.parse(m.group(1), f"{what} length"))
    ctx = int(limits.CONTEXT_TOKENS.parse(m.group(2) or "0", f"{what} context"))
    count = int(limits.STEP_SEQS.parse(m.group(3) or "1", f"{what} count"))
    return n, ctx, count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", required=True, help="NVML name (e.g. 'NVIDIA H100 80GB HBM3') or alias (h100-sxm), or a GPU spec file (.json: a row of `m2live gpus --json`, edited)")
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B", help="preset name or path to config.json / dir")
    p.add_argument("--tp", default="1", help="tensor-parallel size")
    p.add_argument("--prefill", action="append", default=[], metavar="LEN[@CTX][xCOUNT]",
                   help="prefill chunk(s) of LEN tokens over CTX cached tokens (default 0), COUNT sequences")
    p.add_argument("--decode", action="append", default=[], metavar="CTX[xCOUNT]",
                   help="decode sequence(s) with CTX tokens already cached")
    clk = p.add_mutually_exclusive_group()
    clk.add_argument("--clock-mhz", help=f"live SM clock in MHz ({limits.CLOCK_MHZ.describe()})")
    clk.add_argument("--clock", choices=("forecast", "boost"), default="forecast",
                     help="clock source when no --clock-mhz (default: forecast from the power cap)")
    add_calibration_flag(p, "a GPU none of them is for is")
    p.add_argument("--precision", choices=("bf16", "fp8"),
                   help="linear-layer weights: bf16, or fp8 (vLLM's W8A8 e4m3 with per-tensor scales: the fp8 "
                        "tensor peak, 1 byte per weight, the input quantisation as a light op; attention, the KV "
                        "cache and the LM head stay bf16); default: the checkpoint's (its config.json's "
                        "quantization_config, or FP8 in its name), else bf16")
    p.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_BYTES),
                   help=KV_AUTO_HELP + " (one byte per element: "
                        "attention streams and writes half the bytes; priced by its bytes)")
    add_allreduce_fusion(p)
    p.add_argument("--json", action="store_true")


def build_step(prefills: list[str], decodes: list[str]) -> Step:
    pre: list[tuple[int, int]] = []
    dec: list[int] = []
    seqs = tokens = 0

    def add(count: int, new: int) -> None:  # the whole step's bounds, before its lists grow
        nonlocal seqs, tokens
        seqs += count
        tokens += count * new
        if seqs > limits.STEP_SEQS.hi:
            raise ValueError(f"a step of more than {int(limits.STEP_SEQS.hi)} sequences (m2live.limits.STEP_SEQS)")
        if tokens > limits.STEP_TOKENS.hi:
            raise ValueError(f"a step of more than {int(limits.STEP_TOKENS.hi)} new tokens "
                             "(m2live.limits.STEP_TOKENS)")

    for s in prefills:
        n, ctx, count = parse_spec(s, "--prefill")
        add(count, n)
        pre += [(n, ctx)] * count
    for s in decodes:
        ctx, extra, count = parse_spec(s, "--decode", limits.CONTEXT_TOKENS)
        if extra:
            raise ValueError(f"--decode {s!r}: give CTX[xCOUNT]")
        add(count, 1)
        dec += [ctx] * count
    if not pre and not dec:
        raise ValueError("an empty step: give at least one --prefill or --decode")
    return Step.build(pre, dec)


def run(args: argparse.Namespace) -> int:
    step = build_step(args.prefill, args.decode)
    tp = int(limits.TP.parse(args.tp, "--tp"))
    clock_mhz = None if args.clock_mhz is None else float(limits.CLOCK_MHZ.parse(args.clock_mhz, "--clock-mhz"))
    w = weights_for(args.precision, args.model)
    cals = Calibrations.load(args.calibration)
    own = cals.for_gpu(args.gpu) if cals else None  # this GPU's calibration among --calibration's
    p = Predictor.for_gpu(args.gpu, model=args.model, tp=tp, **(own.predictor_constants() if own else {}),
                          dtype=w.precision, act_scale=w.act_scale,
                          kv_cache_dtype=model_kv_cache_dtype(args.kv_cache_dtype, args.model)[0],
                          allreduce_fusion=parse_switch(args.allreduce_fusion, "--allreduce-fusion"))
    if beyond := tp_beyond_node(p.gpu, tp):
        raise ValueError(beyond)
    ctx = p.model.max_context
    longest = max([new + c for new, c in step.prefill_seqs] + [c + 1 for c in step.decode_contexts], default=0)
    if ctx is not None and longest > ctx:
        raise ValueError(f"a sequence of {longest} tokens is longer than {p.model.name}'s context ({ctx} tokens): "
                         "vLLM serves none that long")
    if clock_mhz is not None:
        r = p.predict(step, clock_mhz=clock_mhz)
    else:
        r = p.predict(step, f_clk=1.0 if args.clock == "boost" else None)
        r.clock_source = args.clock
    cal = p.ops.c.fitted_on if own else None  # what this GPU's calibration was fitted on
    if args.json:
        out = r.to_dict()
        out["step"] = {"seqs": [list(s) for s in step.seqs], **step.counts()}
        out["calibration"] = cal
        print(json.dumps(out, indent=2))
        return 0
    c = Console(width=120)
    t = Table(title=f"{p.model.name} on {p.gpu.name} (TP={p.tp}, {p.dtype}): {step.num_prefill_tokens} prefill + "
                    f"{step.num_decode_tokens} decode tokens, {step.num_seqs} sequences")
    for col in ("op", "time ms", "share", "bound", "eta_wave", "eta_active", "eta_duty", "eta_mem"):
        t.add_column(col, justify="left" if col in ("op", "bound") else "right")
    for op, secs in r.ops.items():
        if secs <= 0:
            continue
        def fac(name: str, op: str = op) -> str:
            v = r.factors.get(name, {}).get(op)
            return "" if v is None else f"{v:.3f}"
        t.add_row(op, f"{secs * 1e3:.3f}", f"{secs / r.total_s:5.1%}", r.bound.get(op, ""),
                  fac("eta_wave"), fac("eta_active"), fac("eta_duty"), fac("eta_mem"))
    t.add_section()
    t.add_row("step total", f"{r.total_s * 1e3:.3f}", "100%", "", "", "", "", "")
    c.print(t)
    c.print(f"f_clk = {r.f_clk:.3f} ({r.clock_mhz:.0f} of {p.gpu.boost_mhz:.0f} MHz, {r.clock_source}); "
            f"T_blocks = {r.t_blocks * 1e3:.3f} ms"
            + ("; all-reduces fused with the RMSNorms after them (vLLM's fuse_allreduce_rms)"
               if step.num_tokens <= p.fusion_max_tokens else "")
            + (f"; this GPU's own constants: {cal}" if cal else ""))
    return 0
