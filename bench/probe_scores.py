"""Score m2live on the tables a GPU probe measured (``m2live probe --calibrate --holdout``): validation only.

DIR is a probe result folder (``results/probe/<gpu>-<date>``) holding ``cal/gemm_bf16.csv`` (the plan's rows) and
``cal/holdout/gemm_bf16.csv`` (grid shapes outside the plan). Together they are that GPU's measured grid; on them,
the protocol of ``bench/accuracy_calibrated.py``: for each budget, the plan's shapes are fitted on and every other
row is scored, next to the shipped constants (the zero-shot prediction: a probed GPU is never fitted on). With
``--ceiling`` also the fit on every row, scored on the same rows: what the mechanism can reach on this table at
best (several minutes). Writes DIR/scores.json.

    .venv/bin/python bench/probe_scores.py results/probe/h200-20261204 [--ceiling]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from m2live import calibrate as cal  # noqa: E402
from m2live.calibration_file import read_rows  # noqa: E402
from m2live.hardware import get_gpu  # noqa: E402

BUDGETS = (8, 16, 32, 64, 128)


def score_dir(d: Path, ceiling: bool, say=print) -> dict:
    gpu = get_gpu(json.loads((d / "cal" / "summary.json").read_text())["gpu"])
    rows = read_rows(d / "cal", gpu) + read_rows(d / "cal" / "holdout", gpu)
    by_key = {cal.shape_key(r.kind, r.cells): r for r in rows if r.kind == "gemm"}
    out: dict = {"gpu": gpu.name, "kernel_family": gpu.kernel_family, "rows": len(by_key),
                 "note": "measured by m2live probe on a lent GPU; validation only, never fitted on",
                 "zero_shot_mape": round(cal.score(None, gpu.name, list(by_key.values())), 2), "by_budget": {}}
    for b in BUDGETS:
        plan = {cal.shape_key("gemm", p) for p in cal.plan(gpu.name, "gemm", b)}
        fit_rows = [by_key[k] for k in plan if k in by_key]
        held = [r for k, r in by_key.items() if k not in plan]
        c = cal.fit(None, gpu.name, rows=fit_rows, created="-")
        res = {"fit_rows": len(fit_rows), "scored_rows": len(held),
               "zero_shot": round(cal.score(None, gpu.name, held), 2),
               "calibrated": round(cal.score(c, gpu.name, held), 2)}
        out["by_budget"][str(b)] = res
        say(f"{gpu.name} budget {b}: {res}")
    if ceiling:
        t0 = time.time()
        c = cal.fit(None, gpu.name, rows=list(by_key.values()), created="-")
        out["ceiling_all_rows_in_sample"] = {"mape": round(cal.score(c, gpu.name, list(by_key.values())), 2),
                                             "constants": {n: round(v["fitted"], 6) for n, v in c.constants.items()},
                                             "fit_s": round(time.time() - t0, 1)}
        say(f"ceiling (fit and score on all {len(by_key)} rows): {out['ceiling_all_rows_in_sample']['mape']} %")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--ceiling", action="store_true")
    a = ap.parse_args()
    try:
        out = score_dir(a.dir, a.ceiling)
    except (OSError, KeyError, ValueError) as e:
        print(f"probe_scores: {a.dir}: {e}", file=sys.stderr)
        return 2
    (a.dir / "scores.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.dir / 'scores.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
