"""The calibrated mode's whole path on tables m2live never saw, as the outside check runs it: for each trial a GPU
of the outside check (H200, B200, L40S, RTX PRO 6000 Server), the default plan looked up in one opbench GPU's
tables, every kind scaled by its own factor (0.2-5 x: a GPU much faster or slower than its prior says), noise
(0-10 % lognormal), a share of the planned rows dropped (0-30 %: "plan rows a GPU's table lacks are simply not
given"), relabelled as that GPU (and the fp8 GEMMs where the source has them) — then `m2live calibrate fit` and `m2live validate --calibration` in real
processes. Every trial must write a calibration that loads and predicts; the fitted rows' MAPE before and after
is recorded. Not an accuracy figure (the rows are another GPU's): a check that no input the fit can meet makes a
file the reader refuses (two such were found with it, 2026-12-06).

    python bench/calibration_robustness.py --trials 40 [--seed 0] --out results/calibration_robustness.json
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from m2live import calibrate as cal  # noqa: E402

OPBENCH = ROOT.parent / "shared" / "data" / "opbench"
OPBENCH_FP8 = ROOT.parent / "shared" / "data" / "opbench_fp8"  # H100 and B300 only
GPUS = ("NVIDIA H200", "NVIDIA B200", "NVIDIA L40S", "NVIDIA RTX PRO 6000 Blackwell Server Edition")
SOURCES = ("a100_sxm", "h100_sxm", "b300_sxm")
KINDS = ("gemm", "prefill", "decode", "gemm_fp8")
SCALES = (0.2, 0.4, 0.7, 1.0, 1.5, 2.5, 5.0)


def m2live(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "m2live", *args], capture_output=True, text=True, cwd=ROOT)


def trial(rng: random.Random, work: Path) -> dict:
    gpu, src = rng.choice(GPUS), rng.choice(SOURCES)
    scale = {k: rng.choice(SCALES) for k in KINDS}
    noise, drop = rng.choice((0.0, 0.03, 0.1)), rng.choice((0.0, 0.1, 0.3))
    rows_given = {}
    for k in KINDS:
        path = (OPBENCH_FP8 if k == "gemm_fp8" else OPBENCH) / src / cal.FILES[k]
        if not path.is_file():
            continue
        table = cal.read_table(path)
        want = {cal.shape_key(k, p) for p in cal.plan(gpu, k)}
        keep = [r for r in table.rows if cal.shape_key(k, r) in want and rng.random() >= drop]
        rows_given[k] = len(keep)
        if not keep:
            continue
        with open(work / cal.FILES[k], "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(keep[0]))
            w.writeheader()
            for r in keep:
                ms = float(r["latency_ms"]) * scale[k] * (rng.lognormvariate(0.0, noise) if noise else 1.0)
                w.writerow({**r, "device": gpu, "latency_ms": f"{ms:.6g}"})
    out = {"gpu": gpu, "rows_of": src, "scale": scale, "noise": noise, "dropped": drop, "rows": rows_given}
    fit = m2live("calibrate", "fit", str(work), "--gpu", gpu, "-o", str(work / "cal.json"))
    if fit.returncode != 0:
        return {**out, "ok": False, "failed": "calibrate fit", "error": fit.stderr.strip()[-300:]}
    out["fit"] = {k: [float(a), float(b)] for k, a, b in
                  re.findall(r"(\w+) \d+ rows, MAPE ([\d.]+)% -> ([\d.]+)%", fit.stderr)}
    val = m2live("validate", str(work), "--calibration", str(work / "cal.json"), "--json")
    if val.returncode != 0:
        return {**out, "ok": False, "failed": "validate --calibration", "error": val.stderr.strip()[-300:]}
    return {**out, "ok": True}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/calibration_robustness.json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    t0 = time.perf_counter()
    trials = []
    for i in range(a.trials):
        with tempfile.TemporaryDirectory() as d:
            t = trial(rng, Path(d))
        trials.append(t)
        print(f"{i + 1}/{a.trials} {'ok' if t['ok'] else 'FAILED ' + t['failed']}: {t['gpu']} from {t['rows_of']}, "
              f"x{t['scale']}, noise {t['noise']}, dropped {t['dropped']}" + ("" if t["ok"] else f": {t['error']}"),
              file=sys.stderr)
    failed = [t for t in trials if not t["ok"]]
    doc = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "seed": a.seed, "trials": len(trials),
           "failed": len(failed), "seconds": round(time.perf_counter() - t0, 1), "runs": trials}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(trials) - len(failed)} of {len(trials)} trials wrote a calibration that loads and predicts -> "
          f"{a.out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
