"""The CPU device measured again in a process of its own (``PriorCheck.idle`` starts it beside a running engine).

    python -m m2live.cpu_remeasure --dtype bf16 --threads N [--model JSON] [--budget-s S]

Measures the engine's kernels at the engine's thread count (``cpu_device.measurement(refresh=True)``, which keys
the entry as the engine's process did) and stores the result in the cache the next start reads. Niced: an engine
that resumes meanwhile keeps its cores, and the measurement it disturbed is marked shared, so the next start
measures again. Exit 0 when stored; 2 with one line on bad arguments; 1 with
one line when the measurement fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .cpu_device import measurement
from .shapes import ModelShape


def _model(text: str | None) -> ModelShape | None:
    if not text:
        return None
    try:
        return ModelShape(**json.loads(text))
    except (ValueError, TypeError) as e:
        raise ValueError(f"--model is not a model shape: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m m2live.cpu_remeasure", description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--threads", type=int, required=True, help="the engine's torch threads")
    ap.add_argument("--budget-s", type=float, default=1.6, help="the microbenchmark's time budget (s)")
    ap.add_argument("--model", help="the served model's shape, as JSON (ModelShape's fields)")
    args = ap.parse_args(argv)
    try:
        model = _model(args.model)
        if args.threads < 1 or not args.budget_s > 0:
            raise ValueError("--threads must be at least 1 and --budget-s positive")
    except ValueError as e:
        print(f"m2live.cpu_remeasure: {e}", file=sys.stderr)
        return 2
    try:
        os.nice(10)
    except OSError:
        pass
    try:
        measurement(refresh=True, budget_s=args.budget_s, model=model, dtype=args.dtype, threads=args.threads)
    except Exception as e:  # noqa: BLE001 - one line for the engine's log, never a traceback
        print(f"m2live.cpu_remeasure: measurement failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
