"""The plan of a GPU calibration: which shapes of the standard opbench grid to measure on it.

``plan(gpu, kind, budget)``: the medoids of ``budget`` clusters of the grid's shapes (k-means in the space of
their log dimensions, standardised), so that the measured rows are a representative sample of the shapes the
accuracy is scored on — every size of work and, through it, every regime (latency-, memory-, ridge- and
compute-bound) in proportion — and only shapes every opbench GPU was measured on (the grid's ``common`` subset),
so that a table from the same collector for another GPU holds them. ``write_plan`` writes it in the opbench
schema (shape columns and ``device``, no ``latency_ms``). The standard grid is ``data/opbench_grid.json.gz``
(the shapes of the opbench tables).

Why medoids and not an optimal design over the constants' sensitivities (measured on the opbench GPUs with
bench/accuracy_calibrated.py's protocol, held-out MAPE summed over A100, B300 and H100 with both priors, 32 GEMM
and 16 + 16 attention rows): greedy D-optimal picks (stratified by regime and latency quartile, then moved to
medoids in sensitivity space) scored GEMM 52.3, prefill 62.2, decode 54.2; the same picks restricted to the
common grid 49.0 / 62.2 / 54.2 (on the A100 only 10 of the 32 GEMM picks were in its table); medoids in shape
space 43.2 / 58.4 / 51.2, as good as uniform random samples of the same size (44.6 / 62.9 / 58.8). An
optimal design picks the rows where the prior's constants are most sensitive: extremes, where a mechanism
borrowed from another kernel family is most wrong, and a fit that follows them moves the constants for the rest
(A100 from Hopper's constants: GEMM 13.3 % held out after the D-optimal plan, 8.4 % after the medoids).

numpy only: the core package imports without scipy, torch or vLLM.
"""

from __future__ import annotations

import csv
import gzip
import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from .calibration_params import DTYPE, GEMM_KINDS, KINDS, ROW_KIND, SHAPE_COLS, CalibrationError
from .hardware import get_gpu
from .predictor import OpModel
from .validate import ATTN_COLS, in_core_region

DEFAULT_BUDGET = {"gemm": 32, "prefill": 16, "decode": 16, "gemm_fp8": 32}


# ---- the standard grid ---------------------------------------------------------------------------------------
GRID_FILE = Path(__file__).parent / "data" / "opbench_grid.json.gz"


@lru_cache(maxsize=1)
def _grid() -> dict:
    with gzip.open(GRID_FILE, "rt") as f:
        return json.load(f)


@lru_cache(maxsize=16)
def _grid_rows(kind: str, region: bool, common: bool) -> tuple[dict[str, str], ...]:
    g = _grid()[kind]
    all_rows = _grid()[g["rows_of"]]["rows"] if "rows_of" in g else g["rows"]  # gemm_fp8: bf16's GEMM grid
    shapes = all_rows if not common or g["common"] == "all" else [all_rows[i] for i in g["common"]]
    rows = [{c: str(v) for c, v in zip(g["columns"], r, strict=True)} for r in shapes]
    rows = [r for r in rows if (int(r["step"]) == 0) == (kind == "prefill")] if kind not in GEMM_KINDS else rows
    if region:
        rows = [r for r in rows if in_core_region(ROW_KIND[kind], r)]
    return tuple(rows)


def grid_rows(kind: str, region: bool = True, common: bool = False) -> list[dict[str, str]]:
    """The standard opbench grid's shapes of ``kind`` as table rows (strings, as read_table gives them), in the
    accuracy region only unless ``region`` is False; ``common``: only the shapes every opbench GPU's table has."""
    _check_kind(kind)
    return [dict(r) for r in _grid_rows(kind, region, common)]


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise CalibrationError(f"unknown kind {kind!r}: give one of {', '.join(KINDS)}")


def shape_key(kind: str, row: dict[str, str]) -> tuple[int, ...]:
    return tuple(int(float(row[c])) for c in SHAPE_COLS[kind])


# ---- the plan: which shapes to measure ----------------------------------------------------------------------
def regime(om: OpModel, kind: str, row: dict[str, str]) -> str:
    """latency | memory | ridge | compute: which term bounds this shape's predicted time (ridge: the two
    branches within a factor 2 of each other)."""
    if kind in GEMM_KINDS:
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


def kinds_for(gpu_name: str) -> list[str]:
    """The kinds a calibration of ``gpu_name`` plans and measures: every one, less the fp8 GEMMs on a GPU without
    fp8 tensor cores."""
    gpu = get_gpu(gpu_name)
    return [k for k in KINDS if DTYPE[k] != "fp8" or gpu.has_fp8]


def plan(gpu_name: str, kind: str, budget: int | None = None) -> list[dict[str, str]]:
    """At most ``budget`` shapes of the standard grid (accuracy region, shapes every opbench GPU was measured on)
    to measure on ``gpu_name``: the medoids of as many clusters (``medoids``). Deterministic."""
    gpu = get_gpu(gpu_name)  # an unknown GPU is an error before any work
    _check_kind(kind)
    if DTYPE[kind] == "fp8":
        gpu.require_fp8()
    n = DEFAULT_BUDGET[kind] if budget is None else budget
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise CalibrationError(f"--budget must be a positive integer, got {budget!r}")
    cands = _grid_rows(kind, True, True)
    return [dict(cands[i]) for i in medoids(kind, min(n, len(cands)))]


def shape_features(kind: str, rows: Sequence[dict[str, str]]) -> np.ndarray:
    """Each shape as its log dimensions (GEMM: M, N, K; attention: batch, query or context length, heads, KV
    heads), standardised over ``rows``: the space in which the plan spreads its picks."""
    if kind in GEMM_KINDS:
        X = np.log([[int(r["m"]), int(r["n"]), int(r["k"])] for r in rows])
    else:
        length = "isl" if kind == "prefill" else "step"
        X = np.log([[int(r["batch_size"]), int(r[length]) + (kind == "decode"), int(r["num_heads"]),
                     int(r["num_key_value_heads"])] for r in rows])
    sd = X.std(axis=0)
    return (X - X.mean(axis=0)) / np.where(sd > 0, sd, 1.0)


@lru_cache(maxsize=32)
def medoids(kind: str, n: int, iterations: int = 30) -> tuple[int, ...]:
    """Indices into ``grid_rows(kind, common=True)`` of the medoids of ``n`` k-means clusters of its shapes
    (k-means++ seeding from a fixed seed, then Lloyd's iterations; each centre's nearest shape not yet taken)."""
    X = shape_features(kind, _grid_rows(kind, True, True))
    rng = np.random.default_rng(0)
    centres = [int(rng.integers(len(X)))]
    d2 = ((X - X[centres[0]]) ** 2).sum(axis=1)
    while len(centres) < n:
        i = int(rng.choice(len(X), p=d2 / d2.sum())) if d2.sum() > 0 else int(np.argmax(d2))
        centres.append(i)
        d2 = np.minimum(d2, ((X - X[i]) ** 2).sum(axis=1))
    cent = X[centres].copy()
    for _ in range(iterations):
        label = _sq_dist(X, cent).argmin(axis=1)
        for j in range(n):
            if (label == j).any():
                cent[j] = X[label == j].mean(axis=0)
    dist = _sq_dist(X, cent)
    out: list[int] = []
    for j in range(n):
        out.append(next(int(i) for i in np.argsort(dist[:, j], kind="stable") if int(i) not in out))
    return tuple(out)


def _sq_dist(X: np.ndarray, cent: np.ndarray) -> np.ndarray:
    """Squared distance of every row of X to every centre: (rows x centres)."""
    return ((X[:, None, :] - cent[None, :, :]) ** 2).sum(axis=-1)


def write_plan(rows: Sequence[dict[str, str]], kind: str, gpu_name: str, out) -> None:
    cols = [*SHAPE_COLS[kind], "device"]
    w = csv.DictWriter(out, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({**r, "device": get_gpu(gpu_name).name})

