"""Calibrate one GPU: plan the shapes to measure on it, then fit its own constants on the measured rows.

    m2live calibrate plan --gpu NAME --kind gemm|prefill|decode|gemm_fp8 [--budget N] [-o PLAN.csv]
    m2live calibrate fit DIR --gpu NAME -o CAL.json

``plan`` writes shapes of the standard opbench grid in the opbench schema (the kind's shape columns and
``device``, no ``latency_ms``); measure them (``m2live probe --calibrate`` does it on the GPU) into DIR as
``gemm_bf16.csv``, ``prefill_attention_bf16.csv``, ``decode_attention_bf16.csv``, ``gemm_fp8.csv`` (vLLM's fp8
linear layer, on GPUs with fp8 tensor cores; any subset), then ``fit`` writes CAL.json for ``--calibration`` (ops,
validate, predict, simulate, rank) and ``M2LIVE_CALIBRATION`` (the plugin). The fp8 GEMM constants take what the
bf16 rows say of the GPU even without a gemm_fp8.csv.
"""

from __future__ import annotations

import argparse
import sys

from .. import calibrate as cal


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    pl = sub.add_parser("plan", help="the shapes to measure on a GPU (opbench schema, no latency_ms)")
    pl.add_argument("--gpu", required=True, help="NVML name or alias of the GPU to calibrate")
    pl.add_argument("--kind", required=True, help=" | ".join(cal.KINDS))
    pl.add_argument("--budget", help="at most this many shapes (default: " + ", ".join(
        f"{n} {k}" for k, n in cal.DEFAULT_BUDGET.items()) + ")")
    pl.add_argument("-o", "--output", help="write the plan here instead of stdout")
    ft = sub.add_parser("fit", help="fit the GPU's constants on measured opbench tables; write CAL.json")
    ft.add_argument("directory", help="folder with " + " / ".join(cal.FILES.values())
                    + " (any subset) with latency_ms")
    ft.add_argument("--gpu", required=True, help="NVML name or alias of the GPU the rows were measured on")
    ft.add_argument("-o", "--output", required=True, help="the calibration JSON to write")


def _budget(text: str | None) -> int | None:
    if text is None:
        return None
    s = str(text).strip()
    if not s.isdigit() or int(s) < 1:
        raise cal.CalibrationError(f"--budget must be a positive integer, got {text!r}")
    return int(s)


def run(args: argparse.Namespace) -> int:
    if args.action == "plan":
        rows = cal.plan(args.gpu, args.kind, _budget(args.budget))
        if args.output:
            with open(args.output, "w", newline="") as f:
                cal.write_plan(rows, args.kind, args.gpu, f)
            print(f"wrote {len(rows)} {args.kind} shapes to {args.output}", file=sys.stderr)
        else:
            cal.write_plan(rows, args.kind, args.gpu, sys.stdout)
        return 0
    c = cal.fit(args.directory, args.gpu)
    c.save(args.output)
    res = "; ".join(f"{k} {n} rows, MAPE {c.residual[k]['mape_prior']:.2f}% -> {c.residual[k]['mape_fitted']:.2f}%"
                    for k, n in c.rows.items() if n)
    print(f"wrote {args.output}: {c.gpu} ({c.arch} constants refined): {res}", file=sys.stderr)
    return 0
