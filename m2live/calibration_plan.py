"""The plan of a GPU calibration: which shapes of the standard opbench grid to measure on it.

``plan(gpu, kind, budget)``: a greedy D-optimal design over the sensitivities d log t / d theta of the predicted
latency to the calibrated constants, each pick from the stratum (regime — latency-, memory-, ridge- or
compute-bound — x quartile of the predicted latency) furthest behind its share of the grid, so that every regime
and size of work is pinned in proportion; for the kinds in ``SPREAD_KINDS`` the picks then move to the medoids
of the grid's clusters. ``write_plan`` writes it in the opbench schema (shape columns and ``device``, no
``latency_ms``). The standard grid is ``data/opbench_grid.json.gz`` (the shapes of the opbench tables).
"""

from __future__ import annotations

import csv
import gzip
import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from .calibration_params import (
    CALIBRATED,
    KINDS,
    LINEAR,
    RESID_SCALE,
    ROW_KIND,
    SHAPE_COLS,
    SIGMA,
    SIGMA_DEFAULT,
    CalibrationError,
    Params,
    Row,
    active,
    predict_rows,
)
from .efficiency import ArchConstants, constants_for
from .hardware import GpuSpec, get_gpu
from .predictor import OpModel
from .validate import ATTN_COLS, in_core_region

DEFAULT_BUDGET = {"gemm": 32, "prefill": 16, "decode": 16}


# ---- the standard grid ---------------------------------------------------------------------------------------
GRID_FILE = Path(__file__).parent / "data" / "opbench_grid.json.gz"


@lru_cache(maxsize=1)
def _grid() -> dict:
    with gzip.open(GRID_FILE, "rt") as f:
        return json.load(f)


def grid_rows(kind: str, region: bool = True) -> list[dict[str, str]]:
    """The standard opbench grid's shapes of ``kind`` as table rows (strings, as read_table gives them), in the
    accuracy region only unless ``region`` is False."""
    _check_kind(kind)
    g = _grid()[kind]
    rows = [{c: str(v) for c, v in zip(g["columns"], r, strict=True)} for r in g["rows"]]
    rows = [r for r in rows if (int(r["step"]) == 0) == (kind == "prefill")] if kind != "gemm" else rows
    if region:
        rows = [r for r in rows if in_core_region(ROW_KIND[kind], r)]
    return rows


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise CalibrationError(f"unknown kind {kind!r}: give one of {', '.join(KINDS)}")


def shape_key(kind: str, row: dict[str, str]) -> tuple[int, ...]:
    return tuple(int(float(row[c])) for c in SHAPE_COLS[kind])


# ---- the plan: which shapes to measure ----------------------------------------------------------------------
def regime(om: OpModel, kind: str, row: dict[str, str]) -> str:
    """latency | memory | ridge | compute: which term bounds this shape's predicted time (ridge: the two
    branches within a factor 2 of each other)."""
    if kind == "gemm":
        t = om.gemm(int(row["m"]), int(row["n"]), int(row["k"]), 1.0, l2_warm=True)
    else:
        b, isl, h, kv, d, step = (int(row[c]) for c in ATTN_COLS)
        t = (om.prefill_attention([(isl, 0)] * b, h, kv, d) if kind == "prefill"
             else om.decode_attention(b * step, b, h, kv, d))
    if t.bound == "latency":
        return "latency"
    lo, hi = sorted((t.t_compute, t.t_memory))
    if hi <= 0:
        return "latency"
    if lo / hi >= 0.5:
        return "ridge"
    return t.bound


def sensitivities(gpu: GpuSpec, prior: ArchConstants, names: list[str], rows: Sequence[Row],
                  h: float = 0.1) -> np.ndarray:
    """d log t / d x for each row and constant (x = log theta; central differences of +-h, wide enough to see
    through the tile heuristic's kinks)."""
    par = Params(names, prior)
    J = np.zeros((len(rows), len(names)))
    for j in range(len(names)):
        xp, xm = par.x0.copy(), par.x0.copy()
        hj = h * par.step[j] / 2e-3 if names[j] in LINEAR else h
        xp[j] += hj
        xm[j] -= hj
        up = np.log(predict_rows(gpu, par.constants(par.clip(xp)), rows))
        dn = np.log(predict_rows(gpu, par.constants(par.clip(xm)), rows))
        span = par.clip(xp)[j] - par.clip(xm)[j]
        J[:, j] = (up - dn) / span if span > 0 else 0.0
        if names[j] in LINEAR:  # in prior deviations, like the log constants' ~0.5
            J[:, j] *= SIGMA.get(names[j], SIGMA_DEFAULT) / SIGMA_DEFAULT
    return J


def plan(gpu_name: str, kind: str, budget: int | None = None,
         prior: ArchConstants | None = None) -> list[dict[str, str]]:
    """At most ``budget`` shapes of the standard grid (accuracy region) to measure on ``gpu_name``, in the order
    the design picked them (prefill: a smaller budget's plan is a prefix of a larger one's; GEMM and decode:
    medoids per budget, SPREAD_KINDS). Deterministic. ``prior``: the constants to design around (default: the
    GPU's own, ``constants_for``)."""
    gpu = get_gpu(gpu_name)
    _check_kind(kind)
    n = DEFAULT_BUDGET[kind] if budget is None else budget
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise CalibrationError(f"--budget must be a positive integer, got {budget!r}")
    if kind in SPREAD_KINDS:
        return [dict(r) for r in _spread_plan(gpu.name, kind, n, prior)]
    order = _plan_order(gpu.name, kind) if prior is None else design(gpu, kind, prior, max(n, PLAN_MAX))
    return [dict(r) for r in order[:n]]


# Kinds whose plan moves the D-optimal picks to the medoids of the grid's clusters (k-means in the space of the
# sensitivities and log latency, seeded by the picks): chosen on the opbench GPUs (bench/accuracy_calibrated.py,
# 32 GEMM / 16 + 16 attention rows, held-out MAPE summed over A100, B300, H100 and both priors): decode 68.5 ->
# 57.7 (FlashInfer's decode on the B300 alone 18.9 -> 8.3 % zero-shot), prefill 61.6 -> 75.2 (kept D-optimal).
# GEMM: no difference under the first clock model (47.4 -> 47.5); with the burst-headroom clock the D-optimal
# picks misled the fit on a borrowed prior (B300 <- Hopper held out 8.4 -> 12.2 %: the extremes are where the
# borrowed tile constants are most wrong, and the fit moved eta_tc and eta_mem to compensate), the medoids do not
# (zero-shot held out A100 13.4 -> 13.4, B300 8.4 -> 8.4, H100 8.6 -> 8.2 %; in-sample unchanged). The medoids are
# representative shapes; pure D-optimal picks are extremes, which a kernel family the mechanism describes less
# well fits to the detriment of the rest.
SPREAD_KINDS: frozenset[str] = frozenset({"decode", "gemm"})
_DATA: dict = {}


def _spread_plan(gpu_name: str, kind: str, n: int, prior: ArchConstants | None) -> list[dict[str, str]]:
    """The D-optimal picks moved to the medoids of the grid's clusters in (sensitivity, log latency) space."""
    gpu = get_gpu(gpu_name)
    prior = prior or constants_for(gpu)
    key = (gpu.name, kind, repr(prior))
    if key not in _DATA:
        cands = grid_rows(kind)
        rows = [Row(kind, r) for r in cands]
        names = active(CALIBRATED[kind], prior)
        J = sensitivities(gpu, prior, names, rows)
        logt = np.log(predict_rows(gpu, prior, rows))
        F = np.column_stack([J, 2.0 * logt[:, None] / max(1e-9, float(np.std(logt)))])
        sd = F.std(axis=0)
        F = F[:, sd > 1e-9] / sd[sd > 1e-9]
        index = {shape_key(kind, r): i for i, r in enumerate(cands)}
        order = design(gpu, kind, prior, PLAN_MAX)
        _DATA[key] = (cands, F, [index[shape_key(kind, r)] for r in order])
    cands, F, seeds = _DATA[key]
    cent = F[seeds[:n]].copy()
    for _ in range(15):
        d = ((F[:, None, :] - cent[None, :, :]) ** 2).sum(-1)
        lab = d.argmin(1)
        for j in range(len(cent)):
            if (lab == j).any():
                cent[j] = F[lab == j].mean(0)
    d = ((F[:, None, :] - cent[None, :, :]) ** 2).sum(-1)
    out: list[int] = []
    for j in range(len(cent)):
        for i in np.argsort(d[:, j]):
            if int(i) not in out:
                out.append(int(i))
                break
    return [cands[i] for i in out]


PLAN_MAX = 128  # the design is computed this far once; every budget up to it is a prefix


@lru_cache(maxsize=16)
def _plan_order(gpu_name: str, kind: str) -> tuple[dict[str, str], ...]:
    gpu = get_gpu(gpu_name)
    return design(gpu, kind, constants_for(gpu), PLAN_MAX)


def design(gpu: GpuSpec, kind: str, prior: ArchConstants, max_rows: int) -> tuple[dict[str, str], ...]:
    """Greedy D-optimal order over the grid: each pick maximises log det of the information matrix (the prior's
    plus the picked rows' J^T J), within the stratum (regime x latency quartile) furthest behind its share of the
    grid, so that every regime and size of work pins the constants in proportion to the shapes it decides."""
    cands = grid_rows(kind)
    rows = [Row(kind, r) for r in cands]
    names = active(CALIBRATED[kind], prior)
    J = sensitivities(gpu, prior, names, rows) / RESID_SCALE
    sig = np.array([SIGMA_DEFAULT if n in LINEAR else SIGMA.get(n, SIGMA_DEFAULT) for n in names])
    om = OpModel(gpu, constants=prior)
    stratum = np.array([REGIMES.index(regime(om, kind, r)) for r in cands])
    n_strata = len(REGIMES)
    if TIME_BINS > 1:  # and by the size of the work: quantiles of the predicted latency
        t = predict_rows(gpu, prior, rows)
        edges = np.quantile(np.log(t), np.linspace(0, 1, TIME_BINS + 1)[1:-1])
        stratum = stratum * TIME_BINS + np.searchsorted(edges, np.log(t))
        n_strata *= TIME_BINS
    share = np.bincount(stratum, minlength=n_strata) / len(cands)
    info = np.diag(1.0 / sig**2)  # the prior's information: a direction the prior already pins gains little
    chosen: list[int] = []
    picked = np.zeros(n_strata)
    taken = np.zeros(len(cands), dtype=bool)
    while len(chosen) < min(max_rows, len(cands)):
        inv = np.linalg.inv(info)
        gain = np.einsum("ij,jk,ik->i", J, inv, J)  # log det gain of a row = log(1 + J A^-1 J^T)
        gain[taken] = -1.0
        # the regime furthest behind its share of the grid takes the pick; every regime first gets one
        left = np.array([((stratum == s) & ~taken).any() for s in range(n_strata)])
        need = np.where(left & (picked == 0), np.inf, share * (len(chosen) + 1) - picked)
        need[~left] = -np.inf
        s = int(np.argmax(need))
        in_s = np.flatnonzero((stratum == s) & ~taken)
        pick = int(in_s[int(np.argmax(gain[in_s]))])  # ties: the first in grid order
        chosen.append(pick)
        picked[s] += 1
        taken[pick] = True
        info = info + np.outer(J[pick], J[pick])
    return tuple(cands[i] for i in chosen)


REGIMES = ("latency", "memory", "ridge", "compute")
# Strata of the design: regime x quartile of the predicted latency. Chosen on the opbench GPUs (zero-shot prior,
# 32 GEMM rows, held-out MAPE; bench/accuracy_calibrated.py): regimes alone 12.5 / 8.2 / 9.3 % (A100 / B300 /
# H100), with the latency quartiles 9.7 / 7.3 / 6.9 %; unstratified D-optimal picks the extremes and fits them.
TIME_BINS = 4


def write_plan(rows: Sequence[dict[str, str]], kind: str, gpu_name: str, out) -> None:
    cols = [*SHAPE_COLS[kind], "device"]
    w = csv.DictWriter(out, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({**r, "device": get_gpu(gpu_name).name})

