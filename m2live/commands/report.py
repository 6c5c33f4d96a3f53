"""Render a JSONL step trace (M2LIVE_TRACE) as a PNG: predicted/corrected vs measured, residuals, ops, clock."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="JSONL trace written by the plugin (M2LIVE_TRACE)")
    p.add_argument("-o", "--out", default="report.png", help="PNG to write (default report.png)")
    p.add_argument("--warmup", default="20", help="steps left out of the error summary (default 20)")


def run(args: argparse.Namespace) -> int:
    from m2live.report import write_report

    if not str(args.out).lower().endswith(".png"):
        raise ValueError(f"output must be a .png file, got {args.out}")
    from m2live.limits import WARMUP_STEPS

    warmup = int(WARMUP_STEPS.parse(args.warmup, "--warmup"))
    s = write_report(args.trace, args.out, warmup=warmup)
    er, ec = s["median_abs_error_raw"], s["median_abs_error_corrected"]
    skipped = (f"; {s['skipped_lines']} torn or garbled line(s) skipped (first: {s['first_skipped']})"
               if s["skipped_lines"] else "")
    over = ("after warm-up" if s["after_warmup"]
            else f"over every measured step (none after the {warmup}-step warm-up)")
    print(f"{args.out}: {s['steps']} steps; median |error| {over}: raw {er:.1%}, corrected {ec:.1%}{skipped}")
    return 0
