"""Predict every row of a per-operator CSV (opbench schema) and write it back with a predicted_ms column."""

from __future__ import annotations

import argparse
import csv
import os
import sys

from .. import limits
from ..calibration_file import Calibrations
from ..validate import RowPredictor, read_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="CSV in the opbench schema (m,n,k for GEMMs; attention columns otherwise)")
    p.add_argument("--gpu", help="NVML name or alias, or a GPU spec file (.json: a row of `m2live gpus --json`); default: each row's 'device' column")
    p.add_argument("-o", "--output", help="write here instead of stdout")
    p.add_argument("--clock", default="power",
                   help="'power' (default: the power model over the collector's burst of calls — opbench rows are "
                        "short bursts), 'forecast' (sustained serving load), 'boost', or an SM clock in MHz")
    p.add_argument("--cold", action="store_true",
                   help="weights always come from DRAM (serving); default models L2 re-reads of a benchmark loop")
    add_calibration_flag(p)
    p.add_argument("--dtype", choices=("bf16", "fp8"),
                   help="GEMM precision of the table's rows (default: from the file name — *_fp8.csv is fp8, "
                        "vLLM's W8A8 linear layer with its input quantisation; anything else bf16)")


def add_calibration_flag(p: argparse.ArgumentParser, refused: str = "rows of a GPU none of them is for are") -> None:
    """--calibration, once per GPU calibrated (``refused``: what is refused, as the help says it)."""
    p.add_argument("--calibration", metavar="CAL.json", action="append",
                   help=f"a GPU's own constants (m2live calibrate fit); give it once per GPU calibrated — {refused} "
                        "refused")


def parse_clock(value: str) -> str | float:
    if value in ("power", "boost", "forecast"):
        return value
    try:
        float(value)
    except ValueError:
        raise ValueError(f"--clock must be 'power', 'boost', 'forecast' or a clock in MHz, got {value[:40]!r}") \
            from None
    return float(limits.CLOCK_MHZ.parse(value, "--clock (MHz)"))


def run(args: argparse.Namespace) -> int:
    table = read_table(args.file, args.dtype)
    if not table.rows:
        raise ValueError(f"{args.file}: no rows to predict (the table has a header only)")
    rp = RowPredictor(args.gpu, clock=parse_clock(args.clock), l2_warm=not args.cold,
                      calibration=Calibrations.load(args.calibration))
    pred = rp.predict_table(table)  # everything computed before anything is written: no half-written output
    header = [c for c in table.header if c != "predicted_ms"] + ["predicted_ms"]
    where = args.output or "stdout"
    try:
        out = open(args.output, "w", newline="") if args.output else sys.stdout
        try:
            w = csv.DictWriter(out, fieldnames=header, extrasaction="ignore")
            w.writeheader()
            for row, p in zip(table.rows, pred, strict=True):
                w.writerow({**row, "predicted_ms": f"{p:.6g}"})
            out.flush()
        finally:
            if out is not sys.stdout:
                out.close()
    except BrokenPipeError:
        raise
    except OSError as e:
        if args.output and os.path.isfile(args.output):  # never leave a half-written table behind
            try:
                os.remove(args.output)
            except OSError:
                pass
        raise ValueError(f"cannot write {where}: {e.strerror or type(e).__name__}") from None
    if args.output:
        print(f"wrote {len(pred)} predictions to {args.output}", file=sys.stderr)
    return 0
