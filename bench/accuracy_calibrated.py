"""Calibrated mode on the opbench GPUs: plan -> measure (look the planned shapes up) -> fit -> score the rest.

For each opbench GPU, the protocol of ``m2live calibrate`` exactly: the plan's shapes (default budgets 32 GEMM,
16 prefill, 16 decode; and the error against the budget) are looked up in that GPU's tables (a shape the table
lacks is simply not given), the constants are fitted on those rows only, and every *other* row of the accuracy
region (GEMM N,K in [1024, 16384]; attention head_dim 128) is scored. Two priors:

- ``in_sample``: the constants m2live ships for that GPU's kernel family — fitted on that GPU's *whole* table, so
  the calibration here can only refine an in-sample fit;
- ``zero_shot``: the constants of another family's calibration GPU (leave-one-GPU-out, as for a GPU m2live never
  saw: A100 <- Hopper, H100 <- Blackwell, B300 <- Hopper) with this GPU's datasheet and kernel facts. This is the
  honest stand-in for the outside check on GPUs m2live never sees.

Where ../shared/data/opbench_fp8 has the GPU's fp8 GEMM table (H100, B300), the fp8 GEMMs too (kind ``gemm_fp8``,
B planned rows): the fp8 constants (the family's, or another family's for zero_shot) take what the bf16 fit says
of the GPU (``calibrate.carry_to_fp8``), then are fitted on the planned fp8 rows; ``mape_carried`` is the held-out
error after the bf16 calibration alone (no fp8 row measured).

    .venv/bin/python bench/accuracy_calibrated.py [--out results/accuracy_calibrated.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from m2live import calibrate as cal  # noqa: E402
from m2live.efficiency import ARCH, ARCH_FP8, constants_for, transfer, transfer_fp8  # noqa: E402
from m2live.hardware import get_gpu  # noqa: E402

OPBENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "opbench"
OPBENCH_FP8 = OPBENCH.parent / "opbench_fp8"
BUDGETS = (8, 16, 32, 64)  # GEMM rows; attention gets half as many of each kind (the default 32 / 16 / 16)
ZERO_SHOT_FROM = {"ampere": "hopper", "hopper": "blackwell", "blackwell": "hopper"}  # as accuracy.py OTHER


def _mape(pred: np.ndarray, meas: np.ndarray) -> float:
    return round(float(100.0 * np.mean(np.abs(pred - meas) / meas)), 2) if len(meas) else float("nan")


def budgets_for(b: int) -> dict[str, int]:
    return {"gemm": b, "prefill": max(1, b // 2), "decode": max(1, b // 2), "gemm_fp8": b}


def run_gpu(folder: Path, budgets: tuple[int, ...] = BUDGETS, priors: tuple[str, ...] = ("in_sample", "zero_shot"),
            say=print) -> dict:
    paths = [p for d in (folder, OPBENCH_FP8 / folder.name) for p in (d / f for f in cal.FILES.values())
             if p.is_file()]
    rows = cal.rows_from_tables(paths)
    gpu = get_gpu(cal.read_table(paths[0]).rows[0]["device"])
    kinds = [k for k in cal.KINDS if any(r.kind == k for r in rows)]
    by_kind = {k: {cal.shape_key(k, r.cells): r for r in rows if r.kind == k} for k in kinds}
    own = constants_for(gpu)
    other = ZERO_SHOT_FROM[gpu.kernel_family]
    # borrowed, as Ada's and GB202's constants are: the calibration does not privilege it
    tag = f"{other} (zero-shot check)"
    prior_consts = {"in_sample": own, "zero_shot": replace(transfer(own, ARCH[other]), borrowed_from=tag)}
    prior_fp8 = {}
    if "gemm_fp8" in kinds:
        own8 = constants_for(gpu, "fp8")
        prior_fp8 = {"in_sample": own8, "zero_shot": replace(transfer_fp8(own8, ARCH_FP8[other]), borrowed_from=tag)}
    out: dict = {"gpu": gpu.name, "kernel_family": gpu.kernel_family,
                 "region_rows": {k: len(v) for k, v in by_kind.items()}, "priors": {}}
    for pname in priors:
        prior = prior_consts[pname]
        t0 = time.time()
        res: dict = {"constants_from": gpu.kernel_family if pname == "in_sample" else
                     ZERO_SHOT_FROM[gpu.kernel_family], "by_budget": {}}
        for b in budgets:
            nb = budgets_for(b)
            fit_rows, missing = [], 0
            for k in kinds:
                for r in cal.plan(gpu.name, k, nb[k]):
                    hit = by_kind[k].get(cal.shape_key(k, r))
                    if hit is None:
                        missing += 1
                    else:
                        fit_rows.append(hit)
            how: dict = {}
            values, carried, values8 = cal.fit_precisions(gpu, fit_rows, prior, prior_fp8.get(pname), report=how)
            consts = {"bf16": (prior, cal.replace(prior, **values))}  # (prior, calibrated) per precision
            if carried is not None:
                consts["fp8"] = (prior_fp8[pname], cal.replace(carried, **values8))
            used = {id(r) for r in fit_rows}
            entry: dict = {"plan_rows": {k: nb[k] for k in kinds},
                           "rows_given": {k: sum(r.kind == k for r in fit_rows) for k in kinds},
                           "plan_rows_missing_from_table": missing, "held_out": {}}
            for k in kinds:
                p0, p1 = consts[cal.DTYPE[k]]
                held = [r for r in by_kind[k].values() if id(r) not in used]
                meas = np.array([r.ms for r in held])
                fitted_rows = [r for r in fit_rows if r.kind == k]
                fm = np.array([r.ms for r in fitted_rows])
                entry["held_out"][k] = {
                    "rows": len(held),
                    "mape_prior": _mape(cal.predict_rows(gpu, p0, held), meas),
                    "mape_calibrated": _mape(cal.predict_rows(gpu, p1, held), meas),
                    "fitted_rows_mape_prior": _mape(cal.predict_rows(gpu, p0, fitted_rows), fm),
                    "fitted_rows_mape_calibrated": _mape(cal.predict_rows(gpu, p1, fitted_rows), fm),
                }
                if k == "gemm_fp8":
                    entry["held_out"][k]["mape_carried"] = _mape(cal.predict_rows(gpu, carried, held), meas)
            entry["fit"] = how
            entry["constants"] = {n: {"prior": float(getattr(prior, n)), "fitted": v} for n, v in values.items()}
            if values8:
                entry["constants_fp8"] = {n: {"prior": float(getattr(prior_fp8[pname], n)), "fitted": v}
                                          for n, v in values8.items()}
            res["by_budget"][str(b)] = entry
            say(f"{gpu.name:24s} {pname:9s} budget {b:3d}: " + "  ".join(
                f"{k} {e['mape_prior']:5.2f}% -> {e['mape_calibrated']:5.2f}%" for k, e in entry["held_out"].items()))
        res["seconds"] = round(time.time() - t0, 1)
        out["priors"][pname] = res
    return out


def calibrated_section(opbench: Path = OPBENCH, budgets: tuple[int, ...] = BUDGETS,
                       priors: tuple[str, ...] = ("in_sample", "zero_shot"), gpus: tuple[str, ...] | None = None,
                       say=print) -> dict:
    """The ``calibrated`` section of results/accuracy.json."""
    folders = sorted(p for p in opbench.iterdir() if p.is_dir() and (gpus is None or p.name in gpus))
    default = str(cal.DEFAULT_BUDGET["gemm"])
    sec: dict = {
        "protocol": "m2live calibrate plan (default budgets 32 GEMM / 16 prefill / 16 decode, and the budget "
                    "sweep: B GEMM, B/2 of each attention kind) -> those shapes looked up in the GPU's own tables -> "
                    "calibrate fit on those rows only -> MAPE of every other row of the region (GEMM N,K in "
                    "[1024,16384], every M; attention head_dim 128). in_sample prior: the shipped constants, fitted "
                    "on the whole table of that GPU; zero_shot prior: another family's calibration GPU's constants "
                    "(A100 <- Hopper, H100 <- Blackwell, B300 <- Hopper) with this GPU's datasheet. gemm_fp8 (GPUs "
                    "with an opbench_fp8 table, B planned rows): the fp8 constants with what the bf16 fit says of "
                    "the GPU (mape_carried: no fp8 row measured), then fitted on the planned fp8 rows",
        "default_budget": default, "gpus": {},
    }
    for f in folders:
        r = run_gpu(f, budgets, priors, say)
        sec["gpus"][r["gpu"]] = r
    sec["summary"] = {g: {p: {k: e["mape_calibrated"] for k, e in v["by_budget"][default]["held_out"].items()}
                          for p, v in r["priors"].items() if default in v["by_budget"]}
                      for g, r in sec["gpus"].items()}
    return sec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/accuracy_calibrated.json")
    ap.add_argument("--gpus", help="opbench folders (default: all), e.g. h100_sxm,b300_sxm")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--priors", default="in_sample,zero_shot")
    args = ap.parse_args()
    sec = calibrated_section(budgets=tuple(int(b) for b in args.budgets.split(",")),
                             priors=tuple(args.priors.split(",")),
                             gpus=tuple(args.gpus.split(",")) if args.gpus else None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(sec, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
