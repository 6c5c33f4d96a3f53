"""Calibrated mode against a wrong datasheet → results/calibration_sibling.json (a stress check, never fitted).

The outside check calibrates GPUs m2live never measured from their family's constants: an H200 on the H100's, a
B200 on the B300's. The nearest thing these tables allow: one opbench GPU's rows *presented as its sibling* — the
device column rewritten, so m2live prices them with the sibling's datasheet (an H200's 4.8 TB/s for rows the H100
measured at 3.35; a B200's 1965 MHz boost and 1000 W for rows the B300 measured at 2032 MHz and 1100 W) — then the
user's workflow exactly, through the command line: ``m2live calibrate plan`` (default budgets) → those rows handed
to ``m2live calibrate fit`` → ``m2live validate --calibration`` on the whole table, the core region. A datasheet
30 % off in bandwidth is a harder prior than a real sibling's; how much of it the planned rows put right is what
this measures.

    .venv/bin/python bench/calibration_sibling.py [--out results/calibration_sibling.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from m2live.calibration_params import FILES, SHAPE_COLS  # noqa: E402

OPBENCH = REPO.parent / "shared" / "data" / "opbench"
PAIRS = (("h100_sxm", "NVIDIA H200"), ("b300_sxm", "NVIDIA B200"))  # (rows of, presented as)
KINDS = ("gemm", "prefill", "decode")  # the bf16 tables of opbench


def m2live(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "m2live", *args], cwd=REPO, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"m2live {' '.join(args)} failed: {r.stderr.strip().splitlines()[-1:]}")
    return r.stdout or r.stderr  # calibrate fit reports on stderr


def relabel(src: Path, dst: Path, device: str) -> list[dict[str, str]]:
    with open(src, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["device"] = device
    with open(dst, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return rows


def core_mapes(folder: Path, calibration: Path | None) -> dict[str, float]:
    args = ["validate", str(folder), "--json"] + (["--calibration", str(calibration)] if calibration else [])
    return {r["kind"]: round(r["mape"], 2) for r in json.loads(m2live(*args)) if r["region"] == "core"}


def run_pair(folder: str, sibling: str, tmp: Path) -> dict:
    table, plan_dir, meas = tmp / "all", tmp / "plan", tmp / "measured"
    for d in (table, plan_dir, meas):
        d.mkdir(parents=True)
    for kind in KINDS:
        name = FILES[kind]
        rows = relabel(OPBENCH / folder / name, table / name, sibling)
        m2live("calibrate", "plan", "--gpu", sibling, "--kind", kind, "-o", str(plan_dir / name))
        with open(plan_dir / name, newline="") as f:
            plan = list(csv.DictReader(f))
        cols = SHAPE_COLS[kind]
        by_shape = {tuple(r[c] for c in cols): r for r in rows}
        picked = [by_shape[k] for k in (tuple(p[c] for c in cols) for p in plan) if k in by_shape]
        with open(meas / name, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(picked)
    cal = tmp / "calibration.json"
    fit_line = m2live("calibrate", "fit", str(meas), "--gpu", sibling, "-o", str(cal)).strip().splitlines()[-1]
    report = json.loads(cal.read_text())
    return {"rows_of": folder, "presented_as": sibling, "fit": fit_line,
            "fit_groups": {g: v["constants"] for g, v in report.get("fit", {}).items()},
            "core_mape_prior": core_mapes(table, None), "core_mape_calibrated": core_mapes(table, cal)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/calibration_sibling.json")
    args = ap.parse_args()
    out = {"what": __doc__.split("\n\n")[1].replace("\n", " "), "pairs": []}
    for folder, sibling in PAIRS:
        with tempfile.TemporaryDirectory() as d:
            r = run_pair(folder, sibling, Path(d))
        out["pairs"].append(r)
        print(f"{folder} as {sibling}: " + "  ".join(
            f"{k} {r['core_mape_prior'][k]:.2f}% -> {r['core_mape_calibrated'][k]:.2f}%"
            for k in sorted(r["core_mape_prior"])))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
