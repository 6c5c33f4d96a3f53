"""Calibrate one GPU: plan the shapes to measure on it, then fit its own constants on the measured rows.

    m2live calibrate plan --gpu NAME --kind gemm|prefill|decode|gemm_fp8 [--budget N] [-o PLAN.csv]
    m2live calibrate plan --gpu NAME --kind all -o DIR [--budget N]
    m2live calibrate fit DIR --gpu NAME -o CAL.json

``plan`` writes shapes of the standard opbench grid in the opbench schema (the kind's shape columns and
``device``, no ``latency_ms``); measure them (``m2live probe --calibrate`` does it on the GPU) into DIR as
``gemm_bf16.csv``, ``prefill_attention_bf16.csv``, ``decode_attention_bf16.csv``, ``gemm_fp8.csv`` (vLLM's fp8
linear layer, on GPUs with fp8 tensor cores; any subset), then ``fit`` writes CAL.json for ``--calibration`` (ops,
validate, predict, simulate, rank) and ``M2LIVE_CALIBRATION`` (the plugin). The fp8 GEMM constants take what the
bf16 rows say of the GPU even without a gemm_fp8.csv. ``--kind all -o DIR`` writes every kind's plan into DIR under
those file names (gemm_fp8.csv only on a GPU with fp8 tensor cores; ``--budget N``: N GEMM and fp8 GEMM shapes,
N/2 of each attention kind), ready to be measured in place and fitted with ``calibrate fit DIR``; a file already
there is never overwritten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import calibrate as cal
from ..limits import digits


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    pl = sub.add_parser("plan", help="the shapes to measure on a GPU (opbench schema, no latency_ms)")
    pl.add_argument("--gpu", required=True, help="NVML name or alias of the GPU to calibrate, or a GPU spec file (.json)")
    pl.add_argument("--kind", required=True, help=" | ".join(cal.KINDS) + " | all (every kind into the -o folder)")
    pl.add_argument("--budget", help="at most this many shapes (default: " + ", ".join(
        f"{n} {k}" for k, n in cal.DEFAULT_BUDGET.items()) + ")")
    pl.add_argument("-o", "--output", help="write the plan here instead of stdout (with --kind all: a folder)")
    ft = sub.add_parser("fit", help="fit the GPU's constants on measured opbench tables; write CAL.json")
    ft.add_argument("directory", help="folder with " + " / ".join(cal.FILES.values())
                    + " (any subset) with latency_ms")
    ft.add_argument("--gpu", required=True, help="NVML name or alias of the GPU the rows were measured on, or a GPU spec file (.json)")
    ft.add_argument("-o", "--output", required=True, help="the calibration JSON to write")


def _budget(text: str | None) -> int | None:
    if text is None:
        return None
    s = str(text).strip()
    if not digits(s) or int(s) < 1:
        raise cal.CalibrationError(f"--budget must be a positive integer, got {text!r}")
    return int(s)


def plan_all(gpu_name: str, out: str, budget: int | None) -> list[tuple[str, int, Path]]:
    """Every kind's plan for ``gpu_name`` into the folder ``out`` under the opbench file names: (kind, shapes,
    file) each; refuses before writing anything if a file is already there."""
    gpu = cal.get_gpu(gpu_name)
    kinds = cal.kinds_for(gpu.name)
    d = Path(out)
    if d.exists() and not d.is_dir():
        raise cal.CalibrationError(f"{out}: not a folder (--kind all writes one file per kind into -o DIR)")
    taken = [str(d / cal.FILES[k]) for k in kinds if (d / cal.FILES[k]).exists()]
    if taken:
        raise cal.CalibrationError(f"{taken[0]} already exists: measured rows are never overwritten (remove it or "
                                   "choose another folder)")
    plans = {k: cal.plan(gpu.name, k, None if budget is None else
                         (budget if k in cal.GEMM_KINDS else max(1, budget // 2))) for k in kinds}
    d.mkdir(parents=True, exist_ok=True)
    out_files = []
    for k, rows in plans.items():
        with open(d / cal.FILES[k], "x", newline="") as f:
            cal.write_plan(rows, k, gpu.name, f)
        out_files.append((k, len(rows), d / cal.FILES[k]))
    return out_files


def run(args: argparse.Namespace) -> int:
    if args.action == "plan" and args.kind == "all":
        if not args.output:
            raise cal.CalibrationError("--kind all writes one file per kind: give the folder with -o DIR")
        for k, n, path in plan_all(args.gpu, args.output, _budget(args.budget)):
            print(f"wrote {n} {k} shapes to {path}", file=sys.stderr)
        return 0
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
    for k, why in c.fit.get("left_at_prior", {}).items():
        print(f"m2live calibrate fit: warning: {k}: {why}; its constants stay at the {c.arch} prior", file=sys.stderr)
    res = "; ".join(f"{k} {n} rows, MAPE {c.residual[k]['mape_prior']:.2f}% -> {c.residual[k]['mape_fitted']:.2f}%"
                    for k, n in c.rows.items() if n)
    print(f"wrote {args.output}: {c.gpu} ({c.arch} constants refined): {res}", file=sys.stderr)
    return 0
