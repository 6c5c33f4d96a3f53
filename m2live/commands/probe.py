"""Measure clock droop and step times on this GPU; score m2live's predictions (live, forecast, boost clock).

Needs PyTorch with CUDA and nvidia-ml-py; --dry-run runs the same pipeline on the CPU with tiny shapes, a
replayed clock and perf_counter timing."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..hardware import get_gpu


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="DIR",
                   help="where probe.json and probe.png go (default results/probe/<gpu>-<date>)")
    p.add_argument("--quick", action="store_true",
                   help="M in {1,16,64,256,1024,4096,16384}, 8-layer steps, ~2-3 min (capped by --time-limit 330)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, replayed clock, perf_counter timing: exercises the pipeline only")
    p.add_argument("--gpu", metavar="NAME",
                   help="GPU to predict for: a catalog name or a GPU spec file (.json) (default: the device measured — its "
                        "catalog row, or for a GPU the catalog lacks its spec read from the driver)")
    p.add_argument("--time-limit", type=float, metavar="S",
                   help="stop starting new cells after S seconds and write what was measured "
                        "(default: 330 with --quick, 110 with --calibrate, none otherwise)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random cell order and weights")
    p.add_argument("--no-plot", action="store_true", help="write probe.json only")
    p.add_argument("--calibrate", action="store_true",
                   help="instead: measure this GPU's calibration plan (~1-2 min) and write the tables and "
                        "calibration.json into --out (m2live calibrate)")
    p.add_argument("--holdout", type=float, default=0.0, metavar="S",
                   help="with --calibrate: then measure shapes outside the plan for S seconds into --out/holdout/ "
                        "and score the zero-shot and calibrated predictions on them")


MAX_SECONDS = 86400.0  # --time-limit and --holdout: a day at most (a device lent for minutes, in practice)


def _seconds(value: float | None, flag: str, allow_zero: bool) -> None:
    """``value`` (seconds) finite, positive (or 0 where ``allow_zero``) and at most MAX_SECONDS, else ProbeError."""
    from ..probe import ProbeError

    if value is None:
        return
    if not (math.isfinite(value) and (value > 0 or (allow_zero and value == 0)) and value <= MAX_SECONDS):
        span = "from 0 to" if allow_zero else "more than 0 and at most"
        raise ProbeError(f"{flag} must be {span} {MAX_SECONDS:.0f} seconds, got {value:g}")


def run(args: argparse.Namespace) -> int:
    """Check the flags and the GPU before anything is created; an output folder this run made and left empty is
    removed when the run fails."""
    _seconds(args.time_limit, "--time-limit", allow_zero=False)
    _seconds(args.holdout, "--holdout", allow_zero=True)
    if args.gpu is not None:
        get_gpu(args.gpu)  # an unknown name: one line, before any folder exists
    out = Path(args.out) if args.out else None
    existed = out is not None and out.exists()
    try:
        return _run(args)
    except BaseException:
        if out is not None and not existed and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..probe import ProbeError, run_probe

    console = Console(highlight=False, soft_wrap=True)
    if args.calibrate:
        from ..probe.calibrate import run_calibrate

        if args.quick:
            raise ProbeError("--quick is the clock-and-step sweep's; --calibrate measures the calibration plan "
                             "(--time-limit caps it)")
        run_calibrate(args.out, dry_run=args.dry_run, gpu=args.gpu, say=console.print, holdout_s=args.holdout,
                      seed=args.seed, **({} if args.time_limit is None else {"time_limit_s": args.time_limit}))
        return 0
    if args.holdout:
        raise ProbeError("--holdout checks a calibration: give it with --calibrate")
    doc = run_probe(args.out, quick=args.quick, dry_run=args.dry_run, gpu=args.gpu, seed=args.seed,
                    time_limit_s=args.time_limit, say=console.print, plot=not args.no_plot)
    gm, sm = doc["mape"].get("gemm", {}), doc["mape"].get("steps", {})

    def fmt(m: dict) -> str:
        return "  ".join(f"{k} {v:.1f}%" for k, v in m.items() if v is not None) or "n/a"

    console.print(f"GEMM MAPE: {fmt(gm)}")
    for mode, m in sm.items():
        console.print(f"step MAPE ({mode}): {fmt(m)}")
    km = doc.get("steps", {}).get("kernel_mape")
    if km:
        console.print("per operator inside the steps (MAPE; share of the measured time): " + "  ".join(
            f"{g} {v:.1f}% ({100 * km['measured_share'][g]:.0f}%)" for g, v in km["mape_by_group"].items()
            if v is not None and km["measured_share"].get(g) is not None))
    cf = doc["mape"].get("clock_forecast", {})
    if cf.get("gemm") is not None:
        console.print(f"clock forecast vs measured clock, MAPE: GEMMs {cf['gemm']:.1f}%"
                      + (f", steps {cf['steps']:.1f}%" if cf.get("steps") is not None else ""))
    peak = doc.get("peak_memory_gb")
    console.print(f"{'complete' if doc['complete'] else 'PARTIAL'} in {doc['duration_s']:.0f} s"
                  f"{f', peak device memory {peak:.1f} GB' if peak else ''}; wrote {doc['out_dir']}")
    for e in doc["errors"]:
        console.print(f"[yellow]warning:[/yellow] {e}")
    return 0 if doc["complete"] else 1
