"""Predict one engine step (prefill chunks + decodes) with the full per-operator, per-factor breakdown."""

from __future__ import annotations

import argparse
import json
import re

from rich.console import Console
from rich.table import Table

from ..predictor import Predictor
from ..step import Step

_SPEC = re.compile(r"^(\d+)(?:@(\d+))?(?:x(\d+))?$")


def parse_spec(text: str, what: str) -> tuple[int, int, int]:
    """'LEN[@CTX][xCOUNT]' → (len, ctx, count); all positive integers (ctx may be 0)."""
    m = _SPEC.match(text.strip())
    if not m:
        raise ValueError(f"{what} {text!r}: expected a positive integer, optionally @CONTEXT and xCOUNT (e.g. 512x4)")
    n, ctx, count = int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 1)
    if n <= 0 or count <= 0:
        raise ValueError(f"{what} {text!r}: lengths and counts must be positive")
    return n, ctx, count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", required=True, help="NVML name (e.g. 'NVIDIA H100 80GB HBM3') or alias (h100-sxm)")
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B", help="preset name or path to config.json / dir")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--prefill", action="append", default=[], metavar="LEN[@CTX][xCOUNT]",
                   help="prefill chunk(s) of LEN tokens over CTX cached tokens (default 0), COUNT sequences")
    p.add_argument("--decode", action="append", default=[], metavar="CTX[xCOUNT]",
                   help="decode sequence(s) with CTX tokens already cached")
    clk = p.add_mutually_exclusive_group()
    clk.add_argument("--clock-mhz", type=float, help="live SM clock in MHz")
    clk.add_argument("--clock", choices=("forecast", "boost"), default="forecast",
                     help="clock source when no --clock-mhz (default: forecast from the power cap)")
    p.add_argument("--json", action="store_true")


def build_step(prefills: list[str], decodes: list[str]) -> Step:
    pre: list[tuple[int, int]] = []
    dec: list[int] = []
    for s in prefills:
        n, ctx, count = parse_spec(s, "--prefill")
        pre += [(n, ctx)] * count
    for s in decodes:
        ctx, extra, count = parse_spec(s, "--decode")
        if extra:
            raise ValueError(f"--decode {s!r}: give CTX[xCOUNT]")
        dec += [ctx] * count
    if not pre and not dec:
        raise ValueError("an empty step: give at least one --prefill or --decode")
    return Step.build(pre, dec)


def run(args: argparse.Namespace) -> int:
    step = build_step(args.prefill, args.decode)
    p = Predictor.for_gpu(args.gpu, model=args.model, tp=args.tp)
    if args.clock_mhz is not None:
        if not args.clock_mhz > 0:
            raise ValueError(f"--clock-mhz must be positive, got {args.clock_mhz}")
        r = p.predict(step, clock_mhz=args.clock_mhz)
    else:
        r = p.predict(step, f_clk=1.0 if args.clock == "boost" else None)
        r.clock_source = args.clock
    if args.json:
        out = r.to_dict()
        out["step"] = {"seqs": [list(s) for s in step.seqs], **step.counts()}
        print(json.dumps(out, indent=2))
        return 0
    c = Console(width=120)
    t = Table(title=f"{p.model.name} on {p.gpu.name} (TP={p.tp}): {step.num_prefill_tokens} prefill + "
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
            f"T_blocks = {r.t_blocks * 1e3:.3f} ms")
    return 0
