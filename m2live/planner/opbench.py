"""Decision quality of the GPU ranking on opbench's measured bf16 GEMM tables.

Workloads are Llama-like: each validation model's (``VALIDATION_MODELS``) four projections (qkv, o, gate_up, down)
at TP 1/2/4/8, mapped to the nearest (N, K) every table measured where the exact shape is absent, summed at each M
of ``VALIDATION_MS``.
Two rankings are scored: the GPUs on each workload, and every GPU x TP layout of one model by GPU-time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..hardware import get_gpu
from ..shapes import ModelShape, ModelShapeError, get_model
from ..validate import Table, TableError, find_tables, measured, read_table
from .decision import VALIDATION_MS, DecisionPoint, Shapes, gemm_predictor, roofline_predictor, score_points
from .memory import PlanError

TPS = (1, 2, 4, 8)  # tensor-parallel degrees whose projection shards make the workloads
MIN_NK = 512  # smallest N and K of a grid cell used (a real model's projections are larger)


@dataclass
class GemmTable:
    """Measured bf16 GEMM latencies of one GPU: (m, n, k) -> ms."""

    gpu: str
    source: str
    cells: dict[tuple[int, int, int], float]


def _gemm_cells(path: Path, table: Table) -> list[tuple[str, tuple[int, int, int], float]]:
    """(canonical GPU name, (m, n, k), measured ms) of every row of one GEMM table."""
    if "device" not in table.header:
        raise TableError(f"{path}: a GEMM table needs a 'device' column to tell the GPU")
    meas = measured(table)
    if meas is None:
        raise TableError(f"{path}: no latency_ms column")
    names: dict[str, str] = {}
    out = []
    for i, (row, ms) in enumerate(zip(table.rows, meas, strict=True), start=2):
        if math.isnan(ms):  # a shape the table holds but did not measure
            continue
        raw = (row.get("device") or "").strip()
        name = names.get(raw)
        if name is None:
            name = names[raw] = get_gpu(raw or "?").name
        try:
            key = (int(row["m"]), int(row["n"]), int(row["k"]))
        except (TypeError, ValueError):
            raise TableError(f"{path}:{i}: m, n, k must be integers") from None
        out.append((name, key, ms))
    if not out:
        raise TableError(f"{path}: no measured rows (every latency_ms blank or NaN)")
    return out


def load_gemm_tables(dirs: Iterable[str]) -> list[GemmTable]:
    """Every GEMM table (columns m, n, k, latency_ms, device) under the given opbench folders, one per GPU
    (repeated cells averaged)."""
    by_gpu: dict[str, GemmTable] = {}
    sums: dict[str, dict[tuple[int, int, int], list[float]]] = {}
    dirs = [d for d in dirs if Path(d).is_dir() or str(d).lower().endswith(".csv") or not Path(d).exists()]
    if not dirs:
        raise TableError("no opbench folder or CSV among the given paths")
    for d in dirs:
        found = False
        for path in find_tables(d):
            table = read_table(path)
            if not table.kinds or table.kinds[0] != "gemm":
                continue
            cells = _gemm_cells(path, table)
            found = True
            for name, key, ms in cells:
                if name not in by_gpu:
                    by_gpu[name] = GemmTable(name, str(d), {})
                    sums[name] = {}
                sums[name].setdefault(key, []).append(ms)
        if not found:
            raise TableError(f"{d}: no GEMM table (CSV with columns m, n, k) found")
    for name, t in by_gpu.items():
        t.cells = {k: sum(v) / len(v) for k, v in sums[name].items()}
    return list(by_gpu.values())


@dataclass(frozen=True)
class GemmWorkload:
    """A GEMM-sum workload: the four projections of one layer (as (N, K) pairs) at M tokens."""

    name: str
    m: int
    shapes: Shapes
    exact: bool  # every shape is the model's real shape (not a nearest-grid analogue)


def _common_grid(tables: Sequence[GemmTable]) -> set[tuple[int, int]]:
    """The (N, K) pairs every table measured, both at least MIN_NK."""
    if not tables:
        return set()
    common = set.intersection(*[{(n, k) for (_, n, k) in t.cells} for t in tables])
    return {(n, k) for n, k in common if n >= MIN_NK and k >= MIN_NK}


def _nearest(target: tuple[int, int], grid: Iterable[tuple[int, int]]) -> tuple[int, int]:
    n, k = target
    return min(grid, key=lambda g: (abs(math.log(g[0] / n)) + abs(math.log(g[1] / k)), g))


# The models whose projections make the decision points (the presets m2live had when this check was defined,
# 2026-12; a fixed set, so that adding a preset does not move results/ranking.json)
VALIDATION_MODELS = ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.2-1B",
                     "meta-llama/Llama-2-7b-hf", "meta-llama/Meta-Llama-3-8B", "Qwen/Qwen2.5-7B",
                     "mistralai/Mistral-7B-v0.3", "Qwen/Qwen3-8B", "Qwen/Qwen3-32B")


def _on_grid(real: Shapes, grid: set[tuple[int, int]]) -> Shapes:
    """Each shape, or the nearest grid cell (log distance) where the grid lacks it."""
    return tuple(nk if nk in grid else _nearest(nk, grid) for nk in real)


def _projections(shape: ModelShape) -> dict[int, Shapes]:
    """TP degree -> the model's four projection shapes on one GPU (degrees it cannot be sharded to left out)."""
    out = {}
    for tp in TPS:
        try:
            out[tp] = tuple(shape.sharded(tp).gemms().values())
        except ModelShapeError:
            continue
    return out


def projection_workloads(tables: Sequence[GemmTable], ms: Sequence[int] = VALIDATION_MS) -> list[GemmWorkload]:
    """Llama-like projection workloads on the (N, K) grid every table shares: each validation model's four
    projections at each TP, mapped to the nearest common (N, K) (log distance) where the exact shape is
    absent; de-duplicated; only M values measured for all of them in every table."""
    common = _common_grid(tables)
    if not common:
        return []
    out: list[GemmWorkload] = []
    seen: set[tuple] = set()
    for name in VALIDATION_MODELS:
        shape = get_model(name)
        for tp, real in _projections(shape).items():
            mapped = _on_grid(real, common)
            key = tuple(sorted(mapped))
            if key in seen:
                continue
            seen.add(key)
            exact = mapped == real
            label = f"{shape.name.split('/')[-1]} tp{tp}" + ("" if exact else " analogue")
            for m in ms:
                if all((m, n, k) in t.cells for t in tables for n, k in mapped):
                    out.append(GemmWorkload(label, m, mapped, exact))
    return out


def _layout_point(name: str, m: int, tables: Sequence[GemmTable], by_tp: dict[int, Shapes]) -> DecisionPoint:
    """Every GPU x TP layout measured at M as one item, valued at its GPU-time."""
    items: dict[str, tuple[str, Shapes, int]] = {}
    meas: dict[str, float] = {}
    for t in tables:
        for tp, shapes in by_tp.items():
            if all((m, n, k) in t.cells for n, k in shapes):
                label = f"{t.gpu} tp{tp}"
                items[label] = (t.gpu, shapes, tp)
                meas[label] = tp * sum(t.cells[(m, n, k)] for n, k in shapes)
    return DecisionPoint(f"{name} layouts", m, (), meas, False, items)


def opbench_layout_points(tables: Sequence[GemmTable], ms: Sequence[int] = VALIDATION_MS) -> list[DecisionPoint]:
    """Per validation model and M: every GPU x TP layout as one item, valued at its GPU-time (TP x the time of its
    TP-sharded projections, mapped to the nearest common (N, K)), so layouts of different GPUs and degrees
    compete the way the planner's per-GPU throughput ranking makes them."""
    common = _common_grid(tables)
    if not common:
        return []
    points: list[DecisionPoint] = []
    seen: set[tuple] = set()
    for name in VALIDATION_MODELS:
        shape = get_model(name)
        sig = (shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim)
        if sig in seen:
            continue
        seen.add(sig)
        by_tp = {tp: _on_grid(real, common) for tp, real in _projections(shape).items()}
        for m in ms:
            pt = _layout_point(shape.name.split("/")[-1], m, tables, by_tp)
            if len(pt.items or {}) >= 2:
                points.append(pt)
    return points


def _workload_summary(workloads: list[GemmWorkload]) -> list[dict]:
    names = sorted({(w.name, tuple(map(tuple, w.shapes))) for w in workloads})
    return [{"name": n, "shapes": [list(s) for s in sh]} for n, sh in names]


def validate_opbench(dirs: Sequence[str], ms: Sequence[int] = VALIDATION_MS) -> dict:
    """Decision quality of the GPU ranking on opbench GEMM tables (any number of folders)."""
    if not dirs:
        raise PlanError("--validate needs at least one opbench folder")
    tables = load_gemm_tables(dirs)
    workloads = projection_workloads(tables, ms)
    points = [DecisionPoint(w.name, w.m, w.shapes,
                            {t.gpu: sum(t.cells[(w.m, n, k)] for n, k in w.shapes) for t in tables}, w.exact)
              for w in workloads]
    out = score_points(points, gemm_predictor(), roofline_predictor())
    out["tables"] = [{"gpu": t.gpu, "source": t.source, "cells": len(t.cells)} for t in tables]
    out["gpus"] = [t.gpu for t in tables]
    out["workloads"] = _workload_summary(workloads)
    out["ms"] = sorted({w.m for w in workloads})
    out["layouts"] = score_points(opbench_layout_points(tables, ms), gemm_predictor(), roofline_predictor())
    out["layouts"]["what"] = ("rank every GPU x TP layout of one model by GPU-time of its projections "
                              "(TP x per-GPU shard time: the cost a per-GPU throughput ranking sees; no "
                              "communication, the tables hold none)")
    out["predictor"] = ("OpModel.gemm via validate.RowPredictor (the power model's burst clock over the collector's "
                        "calls, L2-warm as in the opbench loops: what m2live validate predicts)")
    out["baseline"] = "roofline max(FLOPs/peak, bytes/BW) with constant eta = 0.75"
    if len(tables) < 2:
        out["note"] = "fewer than two GPUs: nothing to rank"
    return out
