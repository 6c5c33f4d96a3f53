"""Calibrated mode: a GPU's own constants, fitted on a few of its measured shapes, on top of its architecture's.

Layers of knowledge: datasheet -> architecture constants (``efficiency.ARCH``, fitted once per kernel family) ->
**a GPU's calibration** (this module) -> the plugin's online correction. A calibration is a small JSON file that
replaces the values of the constants named in ``CALIBRATED`` for one GPU; everything else (kernel facts, the
datasheet) stays as it is, and a constant that the measured rows cannot pin stays at its architecture's value
(the fit is regularised toward it).

- ``plan(gpu, kind, budget)``: which shapes of the standard opbench grid to measure. Greedy D-optimal design over
  the sensitivities d log t / d theta of the predicted latency to the calibrated constants, each pick from the
  stratum (regime — latency-, memory-, ridge- or compute-bound — x quartile of the predicted latency) furthest
  behind its share of the grid, so that every regime and size of work is pinned in proportion.
- ``fit(gpu, rows)``: robust least squares on log(latency) (soft-L1, Levenberg-Marquardt with a numeric
  Jacobian, constants fitted as log theta within bounds) with a ridge toward the prior in parameter space; how
  far the rows may move the prior (all calibrated constants or only the PRIMARY ones, and the ridge's weight) is
  chosen by 4-fold cross-validation on the rows themselves, the prior being a candidate too.
- ``Calibration``: the versioned JSON (``load`` / ``save``), ``constants()`` gives the ``ArchConstants`` to
  predict with; ``check_gpu`` refuses a calibration of another GPU.

numpy only: the core package imports without scipy, torch or vLLM.
"""

from __future__ import annotations

import csv
import datetime as dt
import gzip
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from .efficiency import ArchConstants, constants_for
from .hardware import GpuSpec, get_gpu
from .predictor import OpModel
from .validate import ATTN_COLS, GEMM_COLS, RowPredictor, TableError, in_core_region, measured, read_table

SCHEMA = "m2live.calibration/1"
KINDS = ("gemm", "prefill", "decode")
TABLE_KIND = {"gemm": "gemm", "prefill_attention": "prefill", "decode_attention": "decode"}  # validate's -> ours
ROW_KIND = {v: k for k, v in TABLE_KIND.items()}
FILES = {"gemm": "gemm_bf16.csv", "prefill": "prefill_attention_bf16.csv", "decode": "decode_attention_bf16.csv"}
SHAPE_COLS = {"gemm": GEMM_COLS, "prefill": ATTN_COLS, "decode": ATTN_COLS}
DEFAULT_BUDGET = {"gemm": 32, "prefill": 16, "decode": 16}
MIN_ROWS = 4  # fewer measured rows of a kind than this cannot pin anything: refused

# The constants a calibration fits, by the rows that see them. Every name is a field of ArchConstants (checked
# below); a constant shared by two kinds (the attention floor) is fitted on both kinds' rows together.
CALIBRATED: dict[str, tuple[str, ...]] = {
    "gemm": ("eta_tc", "i_crit", "k0", "t_kernel", "eta_mem", "t_ramp", "overlap", "k_split"),
    "prefill": ("t_attn", "t_attn_over", "eta_attn", "k0_attn", "block_cost"),
    "decode": ("t_attn", "t_attn_over", "eta_attn_mem", "item_cost", "cta_bw", "t_split", "t_relayout"),
}
# The few constants that are most plainly this GPU's own rather than its kernel library's (tensor ceiling, DRAM
# efficiency and its ramp, kernel latency; the attention call's floor and fixed part, the attention kernels'
# tensor and streaming efficiency): a fit may move only these when cross-validation says the rest overfit.
PRIMARY: dict[str, tuple[str, ...]] = {
    "gemm": ("eta_tc", "t_kernel", "eta_mem", "t_ramp"),
    "prefill": ("t_attn", "t_attn_over", "eta_attn"),
    "decode": ("t_attn", "t_attn_over", "eta_attn_mem", "cta_bw"),
}
_FIELDS = {f.name for f in fields(ArchConstants)}
for _kind, _names in CALIBRATED.items():
    for _n in (*_names, *PRIMARY[_kind]):
        if _n not in _FIELDS:
            raise ImportError(f"calibrate.CALIBRATED/PRIMARY[{_kind!r}] names {_n!r}, not an ArchConstants field")
ALL_CALIBRATED = tuple(dict.fromkeys(n for names in CALIBRATED.values() for n in names))

# How far the rows may move each constant from its prior, and how hard the ridge pulls it back. Constants are
# fitted as log(theta) (positive, multiplicative errors) unless named in LINEAR (a prior of 0 is a valid value).
# SIGMA: one prior standard deviation (in log units; in the constant's own units for LINEAR ones).
# t_split / t_relayout are linear: a prior of 0 is a kernel path the prior's kernels never take, which another
# GPU's kernels may (a zero-shot prior borrowed from Hopper for an FA2 GPU).
LINEAR: frozenset[str] = frozenset({"t_split", "t_relayout"})
SIGMA_DEFAULT = 0.5
SIGMA: dict[str, float] = {"eta_tc": 0.2, "eta_mem": 0.15, "eta_attn": 0.2, "eta_attn_mem": 0.15, "overlap": 0.3,
                           "t_ramp": 0.7, "k_split": 0.7, "t_split": 4e-6, "t_relayout": 4e-6}
BOUNDS_REL = (0.1, 10.0)  # theta within [prior * lo, prior * hi] unless in BOUNDS
BOUNDS: dict[str, tuple[float, float]] = {"eta_tc": (0.2, 1.3), "eta_mem": (0.2, 1.1), "eta_attn": (0.1, 1.3),
                                          "eta_attn_mem": (0.1, 1.1), "overlap": (1.1, 12.0),
                                          "k_split": (128.0, 8192.0), "t_split": (0.0, 4e-5),
                                          "t_relayout": (0.0, 4e-5)}
# Piecewise-constant in the loss (a library heuristic's threshold): chosen on a grid around the prior, not by LM.
DISCRETE: dict[str, tuple[float, ...]] = {"k_split": (256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072)}
RESID_SCALE = 0.03  # log-latency residual that counts as "one unit" in the robust loss (soft-L1 knee)


class CalibrationError(ValueError):
    """Bad calibration input or file: one line for the user."""


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


# ---- predicting rows with a candidate set of constants ------------------------------------------------------
@dataclass
class Row:
    kind: str  # gemm | prefill | decode
    cells: dict[str, str]  # shape columns (and device) as in the table
    ms: float = float("nan")  # measured latency; nan for a plan row


def _predictor(gpu: GpuSpec, c: ArchConstants) -> RowPredictor:
    return RowPredictor(gpu.name, constants={gpu.kernel_family: c})


def predict_rows(gpu: GpuSpec, c: ArchConstants, rows: Sequence[Row]) -> np.ndarray:
    """Predicted ms of each row with constants ``c`` — the same code path as ``m2live ops``."""
    rp = _predictor(gpu, c)
    return np.array([rp.predict_row(ROW_KIND[r.kind], r.cells, i, "calibration") for i, r in enumerate(rows)])


def _active(names: Iterable[str], prior: ArchConstants) -> list[str]:
    """Constants worth fitting: a log-fitted constant whose prior is 0 is a path this architecture's kernels never
    take (e.g. FA2's relayout on Hopper), so it stays 0."""
    return [n for n in dict.fromkeys(names) if n in LINEAR or getattr(prior, n) > 0]


class _Params:
    """theta <-> x (log theta, or theta for LINEAR constants) with bounds and the ridge's prior."""

    def __init__(self, names: list[str], prior: ArchConstants, strength: float = 1.0):
        self.names = names
        self.prior = prior
        p = np.array([float(getattr(prior, n)) for n in names])
        self.x0 = np.array([v if n in LINEAR else math.log(v) for n, v in zip(names, p, strict=True)])
        self.sigma = np.array([SIGMA.get(n, SIGMA_DEFAULT) for n in names]) / math.sqrt(strength)
        # numeric-derivative steps: 0.002 in log units, 1/250 of a prior deviation for LINEAR constants
        self.step = np.array([SIGMA.get(n, SIGMA_DEFAULT) / 250 if n in LINEAR else 2e-3 for n in names])
        lo, hi = [], []
        for n, v in zip(names, p, strict=True):
            a, b = BOUNDS.get(n, (v * BOUNDS_REL[0], v * BOUNDS_REL[1]))
            a, b = min(a, v), max(b, v)  # the prior is always inside its bounds
            if n in LINEAR:
                lo.append(a)
                hi.append(b)
            else:
                lo.append(math.log(max(a, 1e-30)))
                hi.append(math.log(b))
        self.lo, self.hi = np.array(lo), np.array(hi)

    def clip(self, x: np.ndarray) -> np.ndarray:
        return np.minimum(np.maximum(x, self.lo), self.hi)

    def values(self, x: np.ndarray) -> dict[str, float]:
        return {n: float(v if n in LINEAR else math.exp(v)) for n, v in zip(self.names, x, strict=True)}

    def constants(self, x: np.ndarray, base: ArchConstants | None = None) -> ArchConstants:
        return replace(base or self.prior, **self.values(x))


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
    par = _Params(names, prior)
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
    the design picked them (GEMM and prefill: a smaller budget's plan is a prefix of a larger one's; decode:
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
# 57.7 (FlashInfer's decode on the B300 alone 18.9 -> 8.3 % zero-shot), prefill 61.6 -> 75.2, GEMM 47.4 -> 47.5.
# The medoids are representative shapes; pure D-optimal picks are extremes, which a kernel family the mechanism
# describes less well (decode) fits to the detriment of the rest.
SPREAD_KINDS: frozenset[str] = frozenset({"decode"})
_DATA: dict = {}


def _spread_plan(gpu_name: str, kind: str, n: int, prior: ArchConstants | None) -> list[dict[str, str]]:
    """The D-optimal picks moved to the medoids of the grid's clusters in (sensitivity, log latency) space."""
    gpu = get_gpu(gpu_name)
    prior = prior or constants_for(gpu)
    key = (gpu.name, kind, repr(prior))
    if key not in _DATA:
        cands = grid_rows(kind)
        rows = [Row(kind, r) for r in cands]
        names = _active(CALIBRATED[kind], prior)
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
    names = _active(CALIBRATED[kind], prior)
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


# ---- the fit ------------------------------------------------------------------------------------------------
def _loss_terms(par: _Params, x: np.ndarray, gpu: GpuSpec, rows: Sequence[Row], logm: np.ndarray,
                base: ArchConstants) -> tuple[np.ndarray, np.ndarray]:
    r = np.log(predict_rows(gpu, par.constants(x, base), rows)) - logm
    return r / RESID_SCALE, (x - par.x0) / par.sigma


def _objective(r: np.ndarray, q: np.ndarray) -> float:
    return float(np.sum(2.0 * (np.sqrt(1.0 + r**2) - 1.0)) + np.sum(q**2))  # soft-L1 data + ridge


def _lm(par: _Params, gpu: GpuSpec, rows: Sequence[Row], logm: np.ndarray, base: ArchConstants,
        x: np.ndarray, iters: int = 40) -> np.ndarray:
    """Levenberg-Marquardt on the soft-L1 loss by iteratively reweighted least squares, projected on the bounds."""
    lam = 1e-2
    r, q = _loss_terms(par, x, gpu, rows, logm, base)
    f = _objective(r, q)
    for _ in range(iters):
        w = 1.0 / np.sqrt(np.sqrt(1.0 + r**2))  # sqrt of the soft-L1 IRLS weight
        J = np.zeros((len(rows), len(x)))
        for j in range(len(x)):
            xj = x.copy()
            h = par.step[j]
            step = h if x[j] + h <= par.hi[j] else -h
            xj[j] += step
            rj, _ = _loss_terms(par, xj, gpu, rows, logm, base)
            J[:, j] = (rj - r) / step
        A = np.vstack([w[:, None] * J, np.diag(1.0 / par.sigma)])
        b = np.concatenate([w * r, q])
        AtA, Atb = A.T @ A, A.T @ b
        improved = False
        for _ in range(8):
            dx = -np.linalg.solve(AtA + lam * np.diag(np.diag(AtA) + 1e-9), Atb)
            xn = par.clip(x + dx)
            rn, qn = _loss_terms(par, xn, gpu, rows, logm, base)
            fn = _objective(rn, qn)
            if fn < f:
                x, r, q, f = xn, rn, qn, fn
                lam = max(lam / 3.0, 1e-6)
                improved = True
                break
            lam *= 4.0
        if not improved or np.max(np.abs(dx)) < 1e-4:
            break
    return x


def _mape(pred: np.ndarray, meas: np.ndarray) -> float:
    return float(100.0 * np.mean(np.abs(pred - meas) / meas)) if len(meas) else float("nan")


# Kinds whose constants overlap are fitted together (the attention floor is in prefill and decode rows alike);
# GEMM constants are independent of attention's.
FIT_GROUPS: tuple[tuple[str, ...], ...] = (("gemm",), ("prefill", "decode"))


# How much a fit may move the constants, chosen per fit group by cross-validation on the measured rows: which
# constants (all of CALIBRATED, or only PRIMARY) and how hard the ridge pulls toward the prior (x prior precision).
# The prior itself is always a candidate: rows that cannot beat it out of sample leave it alone.
CV_CONFIGS: tuple[tuple[str, float], ...] = (("primary", 1.0), ("all", 0.25), ("all", 1.0), ("all", 4.0))
CV_FOLDS = 4
CV_MIN_ROWS = 8  # fewer rows: no cross-validation, all constants at the default ridge


def fit_constants(gpu: GpuSpec, rows: Sequence[Row], prior: ArchConstants | None = None,
                  report: dict | None = None) -> dict[str, float]:
    """The calibrated constants' values for ``rows`` (measured), regularised toward ``prior``: every kind's MAPE
    on its rows is at most the prior's. ``report`` (optional) receives, per fit group, the configuration that
    cross-validation chose and its out-of-fold MAPE."""
    prior = prior or constants_for(gpu)
    # groups in turn, each fitted on top of the ones before (attention's KV-cache write streams at the GEMM
    # group's eta_mem); then one guard over all rows: the combination of points on each group's way from its
    # prior to its fit with the least MAPE that leaves no kind worse than under the prior
    ref = _kind_mapes(gpu, prior, rows)
    base = prior
    paths: list[list[dict[str, float]]] = []
    for group in FIT_GROUPS:
        sub = [r for r in rows if r.kind in group]
        if not sub:
            continue
        present = [k for k in group if any(r.kind == k for r in sub)]
        names = {"all": _active((n for k in present for n in CALIBRATED[k]), base),
                 "primary": _active((n for k in present for n in PRIMARY[k]), base)}
        choice, cv = (_cross_validate(gpu, sub, base, names) if len(sub) >= CV_MIN_ROWS and CV_CONFIGS
                      else (("all", 1.0), {}))
        start = {n: float(getattr(base, n)) for n in names["all"]}
        if choice is None:  # the prior predicts left-out rows best
            paths.append([start])
        else:
            fitted = {**start, **_fit_group(gpu, sub, base, names[choice[0]], choice[1])}
            paths.append(_path(base, start, fitted))
        base = replace(base, **paths[-1][0])
        if report is not None:
            report["+".join(present)] = {"constants": "prior" if choice is None else choice[0],
                                         "ridge": None if choice is None else choice[1], "cv_mape": cv}
    # (a group left at its prior can hold another group's fit back: on the A100's plan rows GEMM's fit moves the KV
    # write of attention; letting a mild attention fit compensate was tried and made the held-out rows worse)
    best = _guard(gpu, prior, rows, ref, paths)
    return best if best is not None else {n: v for pa in paths for n, v in pa[-1].items()}


def _path(prior: ArchConstants, start: dict[str, float], fitted: dict[str, float]) -> list[dict[str, float]]:
    """Points from ``fitted`` (t = 1) back to ``start`` (t = 0) in x space (discrete constants switch half way)."""
    out = []
    for t in (1.0, 0.75, 0.5, 0.25, 0.0):
        pt = {}
        for n, v in fitted.items():
            a = start[n]
            if n in DISCRETE:
                pt[n] = v if t >= 0.5 else a
            elif n in LINEAR or a <= 0 or v <= 0:
                pt[n] = a + t * (v - a)
            else:
                pt[n] = a * (v / a) ** t
        out.append(pt)
    return out


def _guard(gpu: GpuSpec, prior: ArchConstants, rows: Sequence[Row], ref: dict[str, float],
           paths: list[list[dict[str, float]]]) -> dict[str, float] | None:
    """The combination of path points with the least total MAPE and no kind above ``ref``; None if even the
    paths' ends (t = 0) do not qualify."""
    import itertools

    best, best_total = None, math.inf
    for combo in itertools.product(*paths):
        vals = {n: v for pt in combo for n, v in pt.items()}
        m = _kind_mapes(gpu, replace(prior, **vals), rows)
        if all(m[k] <= ref[k] + 1e-9 for k in ref) and sum(m.values()) < best_total - 1e-12:
            best, best_total = vals, sum(m.values())
    return best


def _cross_validate(gpu: GpuSpec, rows: Sequence[Row], prior: ArchConstants, names: dict[str, list[str]]
                    ) -> tuple[tuple[str, float] | None, dict[str, float]]:
    """K-fold MAPE of each configuration (and of the prior); the best one (None: the prior)."""
    fold = np.arange(len(rows)) % CV_FOLDS
    meas = np.array([r.ms for r in rows])
    scores: dict[str, float] = {"prior": _mape(predict_rows(gpu, prior, rows), meas)}
    best: tuple[tuple[str, float] | None, float] = (None, scores["prior"])
    for which, strength in CV_CONFIGS:
        pred = np.zeros(len(rows))
        for f in range(CV_FOLDS):
            train = [r for r, g in zip(rows, fold, strict=True) if g != f]
            test = [r for r, g in zip(rows, fold, strict=True) if g == f]
            if not test or not train:
                continue
            vals = _fit_group(gpu, train, prior, names[which], strength)
            pred[fold == f] = predict_rows(gpu, replace(prior, **vals), test)
        key = f"{which} x{strength:g}"
        scores[key] = _mape(pred, meas)
        if scores[key] < best[1] - 1e-9:
            best = ((which, strength), scores[key])
    return best[0], {k: round(v, 3) for k, v in scores.items()}


def _kind_mapes(gpu: GpuSpec, c: ArchConstants, rows: Sequence[Row]) -> dict[str, float]:
    p = predict_rows(gpu, c, rows)
    meas = np.array([r.ms for r in rows])
    kinds = np.array([r.kind for r in rows])
    return {k: _mape(p[kinds == k], meas[kinds == k]) for k in sorted(set(kinds))}


def _fit_group(gpu: GpuSpec, rows: Sequence[Row], prior: ArchConstants, names: list[str],
               strength: float = 1.0) -> dict[str, float]:
    """Fit ``names`` on ``rows`` from ``prior`` (``strength``: the ridge's weight, x the prior precision)."""
    discrete = [n for n in names if n in DISCRETE]
    cont = [n for n in names if n not in DISCRETE]
    logm = np.log(np.array([r.ms for r in rows]))
    par = _Params(cont, prior, strength)
    base = prior
    x = par.x0.copy()
    for _ in range(2 if discrete else 1):  # coordinate descent: continuous constants by LM, discrete on a grid
        x = _lm(par, gpu, rows, logm, base, x)
        for n in discrete:
            p0 = float(getattr(prior, n))
            sig = SIGMA.get(n, SIGMA_DEFAULT)
            scores = {}
            for v in sorted({*DISCRETE[n], p0}):
                r, q = _loss_terms(par, x, gpu, rows, logm, replace(base, **{n: float(v)}))
                scores[v] = _objective(r, q) + strength * (math.log(v / p0) / sig) ** 2
            base = replace(base, **{n: float(min(scores, key=scores.__getitem__))})
    return {**par.values(x), **{n: float(getattr(base, n)) for n in discrete}}


# ---- the calibration file -----------------------------------------------------------------------------------
@dataclass
class Calibration:
    gpu: str  # canonical NVML name
    arch: str  # kernel family whose constants it refines (GpuSpec.kernel_family)
    constants: dict[str, dict[str, float]]  # name -> {"prior": x, "fitted": y}
    rows: dict[str, int]  # rows used per kind
    residual: dict[str, dict[str, float]]  # kind -> {"mape_prior": x, "mape_fitted": y} on the rows used
    m2live_version: str = ""
    created: str = ""
    fit: dict = field(default_factory=dict)  # per fit group: what cross-validation chose, out-of-fold MAPEs
    path: str | None = field(default=None, compare=False)

    def fitted(self) -> dict[str, float]:
        return {n: v["fitted"] for n, v in self.constants.items()}

    def arch_constants(self) -> ArchConstants:
        """The architecture's constants with this GPU's fitted values."""
        used = ", ".join(f"{n} {k}" for k, n in self.rows.items() if n)
        return replace(constants_for(get_gpu(self.gpu)), **self.fitted(),
                       fitted_on=f"calibration of {self.gpu} ({used} measured rows)"
                       + (f", {self.path}" if self.path else ""))

    def label(self) -> str:
        """What the info metric and the CLI say about this calibration."""
        return f"{Path(self.path).name if self.path else 'calibration'} ({self.gpu}, {self.created})"

    def check_gpu(self, gpu: GpuSpec | str) -> None:
        name = get_gpu(gpu).name if isinstance(gpu, str) else gpu.name
        if name != self.gpu:
            src = f" ({self.path})" if self.path else ""
            raise CalibrationError(f"calibration{src} is for {self.gpu}, not {name}: calibrate this GPU "
                                   "with `m2live calibrate plan/fit` or drop --calibration")

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "gpu": self.gpu, "arch": self.arch, "m2live_version": self.m2live_version,
                "created": self.created, "constants": self.constants, "rows": self.rows, "residual": self.residual,
                "fit": self.fit}

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, doc: object, path: str | None = None) -> Calibration:
        where = path or "calibration"
        if not isinstance(doc, dict):
            raise CalibrationError(f"{where}: not a calibration (a JSON object is expected)")
        if doc.get("schema") != SCHEMA:
            raise CalibrationError(f"{where}: schema {doc.get('schema')!r} is not {SCHEMA!r}")
        try:
            gpu = get_gpu(str(doc["gpu"]))
        except KeyError as e:
            raise CalibrationError(f"{where}: {e}") from None
        if doc.get("arch") != gpu.kernel_family:
            raise CalibrationError(f"{where}: arch {doc.get('arch')!r} is not {gpu.name}'s ({gpu.kernel_family})")
        consts = doc.get("constants")
        if not isinstance(consts, dict) or not consts:
            raise CalibrationError(f"{where}: no constants")
        clean: dict[str, dict[str, float]] = {}
        for n, v in consts.items():
            if n not in ALL_CALIBRATED:
                raise CalibrationError(f"{where}: {n!r} is not a calibrated constant ({', '.join(ALL_CALIBRATED)})")
            try:
                prior, val = float(v["prior"]), float(v["fitted"])
            except (TypeError, KeyError, ValueError):
                raise CalibrationError(f"{where}: constant {n!r} needs numeric 'prior' and 'fitted'") from None
            if not (math.isfinite(val) and (val > 0 or (n in LINEAR and val >= 0))):
                raise CalibrationError(f"{where}: constant {n!r} has an invalid fitted value {v['fitted']!r}")
            clean[n] = {"prior": prior, "fitted": val}
        return cls(gpu.name, gpu.arch, clean, dict(doc.get("rows") or {}), dict(doc.get("residual") or {}),
                   str(doc.get("m2live_version", "")), str(doc.get("created", "")),
                   dict(doc.get("fit") or {}), path)


def load(path: str | os.PathLike) -> Calibration:
    p = str(path)
    try:
        text = Path(p).read_text()
    except FileNotFoundError:
        raise CalibrationError(f"no such calibration file: {p}") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise CalibrationError(f"cannot read calibration {p}: {e.__class__.__name__}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{p}: not JSON ({e.msg}, line {e.lineno})") from None
    return Calibration.from_json(doc, p)


def load_for(path: str | os.PathLike | None, gpu: GpuSpec | str) -> ArchConstants | None:
    """The constants to predict ``gpu`` with under the calibration at ``path`` (None: no calibration); refuses a
    calibration of another GPU."""
    if not path:
        return None
    cal = load(path)
    cal.check_gpu(gpu)
    return cal.arch_constants()


# ---- reading measured tables --------------------------------------------------------------------------------
def read_rows(directory: str | os.PathLike, gpu: GpuSpec) -> list[Row]:
    """The measured rows of DIR's opbench tables (any subset of FILES), checked to be of ``gpu``."""
    d = Path(directory)
    if not d.is_dir():
        raise CalibrationError(f"{directory}: not a directory (give the folder holding {', '.join(FILES.values())})")
    paths = [d / name for name in FILES.values() if (d / name).is_file()]
    if not paths:
        raise CalibrationError(f"{directory}: none of {', '.join(FILES.values())} found")
    rows: list[Row] = []
    for p in paths:
        try:
            t = read_table(p)
            meas = measured(t)
        except TableError as e:
            raise CalibrationError(str(e)) from None
        if meas is None:
            raise CalibrationError(f"{p}: no latency_ms column (measure the plan's shapes first)")
        n_kind: dict[str, int] = {}
        for i, (kind, row, ms) in enumerate(zip(t.kinds, t.rows, meas, strict=True), start=2):
            dev = (row.get("device") or "").strip()
            if dev:
                try:
                    other = get_gpu(dev).name
                except KeyError:
                    other = dev
                if other != gpu.name:
                    raise CalibrationError(f"{p}:{i}: a row of {dev}, not {gpu.name}: calibrate one GPU per folder")
            k = TABLE_KIND[kind]
            try:
                cells = {c: str(int(float(row[c]))) for c in SHAPE_COLS[k]}
            except (KeyError, ValueError):
                raise CalibrationError(f"{p}:{i}: malformed shape cells") from None
            if k != "gemm" and int(cells["head_dim"]) % 8:
                raise CalibrationError(f"{p}:{i}: head_dim {cells['head_dim']} is not a multiple of 8")
            rows.append(Row(k, cells, ms))
            n_kind[k] = n_kind.get(k, 0) + 1
        for k, n in n_kind.items():
            if n < MIN_ROWS:
                raise CalibrationError(f"{p}: only {n} {k} rows; a calibration needs at least {MIN_ROWS} per kind")
    return rows


def fit(directory: str | os.PathLike | None, gpu_name: str, rows: Sequence[Row] | None = None,
        created: str | None = None) -> Calibration:
    """Calibrate ``gpu_name`` on the measured tables in ``directory`` (or on ``rows``)."""
    from . import __version__

    gpu = get_gpu(gpu_name)
    if gpu.arch == "cpu":
        raise CalibrationError("the CPU device has no architecture constants to calibrate")
    rows = list(rows) if rows is not None else read_rows(directory or ".", gpu)
    if not rows:
        raise CalibrationError("no measured rows to calibrate on")
    prior = constants_for(gpu)
    how: dict = {}
    values = fit_constants(gpu, rows, prior, report=how)
    fitted = replace(prior, **values)
    residual: dict[str, dict[str, float]] = {}
    counts: dict[str, int] = {}
    for k in KINDS:
        sub = [r for r in rows if r.kind == k]
        counts[k] = len(sub)
        if sub:
            meas = np.array([r.ms for r in sub])
            residual[k] = {"mape_prior": round(_mape(predict_rows(gpu, prior, sub), meas), 3),
                           "mape_fitted": round(_mape(predict_rows(gpu, fitted, sub), meas), 3)}
    consts = {n: {"prior": float(getattr(prior, n)), "fitted": v} for n, v in values.items()}
    return Calibration(gpu.name, gpu.kernel_family, consts, counts, residual, __version__,
                       created or dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), fit=how)


def score(cal: Calibration | None, gpu_name: str, rows: Sequence[Row]) -> float:
    """MAPE (%) of ``rows`` under ``cal`` (None: the architecture's constants)."""
    gpu = get_gpu(gpu_name)
    c = cal.arch_constants() if cal else constants_for(gpu)
    return _mape(predict_rows(gpu, c, rows), np.array([r.ms for r in rows]))


def rows_from_tables(paths: Iterable[str | os.PathLike], region: bool = True,
                     keep: Callable[[str, dict[str, str]], bool] | None = None) -> list[Row]:
    """Measured rows of opbench tables (for the bench and tests), optionally filtered."""
    out: list[Row] = []
    for p in paths:
        t = read_table(p)
        meas = measured(t)
        if meas is None:
            raise CalibrationError(f"{p}: no latency_ms column")
        for kind, row, ms in zip(t.kinds, t.rows, meas, strict=True):
            if region and not in_core_region(kind, row):
                continue
            if keep is None or keep(TABLE_KIND[kind], row):
                out.append(Row(TABLE_KIND[kind], {c: row[c] for c in SHAPE_COLS[TABLE_KIND[kind]]}, ms))
    return out


__all__ = ["CALIBRATED", "replace", "Calibration", "CalibrationError", "DEFAULT_BUDGET", "FILES", "KINDS", "Row", "fit",
           "fit_constants", "grid_rows", "load", "load_for", "plan", "predict_rows", "read_rows",
           "score", "write_plan"]
