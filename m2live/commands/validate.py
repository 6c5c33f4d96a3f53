"""Score the predictor against every per-operator CSV in a directory: MAPE per file and operator kind."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from ..calibration_file import Calibrations
from ..validate import score_directory
from .ops import add_calibration_flag, parse_clock


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="directory of opbench-style CSVs with a latency_ms column (or one CSV)")
    p.add_argument("--gpu", help="NVML name or alias, or a GPU spec file (.json: a row of `m2live gpus --json`); default: each row's 'device' column")
    p.add_argument("--clock", default="power",
                   help="'power' (default: the power model over the collector's burst of calls), 'forecast' "
                        "(sustained serving load), 'boost', or an SM clock in MHz")
    p.add_argument("--cold", action="store_true", help="no L2 re-reads (serving conditions)")
    add_calibration_flag(p, "rows of a GPU none of them is for are")
    p.add_argument("--dtype", choices=("bf16", "fp8"),
                   help="GEMM precision of every table (default: each file's from its name — *_fp8.csv is fp8, "
                        "vLLM's W8A8 linear layer with its input quantisation, as in opbench_fp8; else bf16)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    results = score_directory(args.directory, gpu=args.gpu, clock=parse_clock(args.clock), l2_warm=not args.cold,
                               calibration=Calibrations.load(args.calibration), dtype=args.dtype)
    for r in results:  # on stderr with --json too: the scores are over fewer rows than the table holds
        if r["region"] == "all" and r["unmeasured"]:
            print(f"m2live validate: {r['file']}: {r['unmeasured']} {r['kind']} rows without a measurement "
                  f"(latency_ms blank or NaN) left out", file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    t = Table(title="m2live validate: predicted vs measured per-operator latency")
    for col in ("GPU", "kind", "region", "rows", "MAPE %", "median APE %", "bias %"):
        t.add_column(col, justify="right" if col[0].isupper() and col != "GPU" else "left")
    for r in results:
        t.add_row(r["gpu"], r["kind"] + (" fp8" if r.get("dtype") == "fp8" else ""), "N,K∈[1k,16k]" if r["region"] == "core" and r["kind"] == "gemm"
                  else ("head_dim 128" if r["region"] == "core" else "all rows"),
                  str(r["rows"]), f"{r['mape']:.2f}", f"{r['median_ape']:.2f}", f"{r['bias']:+.2f}")
    Console(width=120).print(t)
    return 0
