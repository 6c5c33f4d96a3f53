"""Decision quality: does the predicted order of GPUs (or GPU x TP layouts) match the measured one?

A ``DecisionPoint`` is one workload made of GEMMs at M tokens, with its measured time on every item (a GPU, or a
GPU x TP layout). ``score_points`` compares a predictor's pick and order with the measured ones: top-1 hit
(within ``HIT_TOLERANCE`` of the measured best), Spearman rho, regret of the predicted pick, pairwise order and
the error of the predicted speed ratios; the loaders of measured tables are ``opbench.py`` and ``vidur.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..hardware import get_gpu
from ..validate import RowPredictor

VALIDATION_MS = (1, 16, 64, 256, 1024, 4096, 8192)
HIT_TOLERANCE = 0.03

GemmFn = Callable[[str, int, int, int], float]  # (gpu, m, n, k) -> ms
Shapes = tuple[tuple[int, int], ...]  # (N, K) of each GEMM


def _ranks(xs: Sequence[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for t in range(i, j + 1):
            r[order[t]] = (i + j) / 2.0 + 1
        i = j + 1
    return r


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties); nan when either side is constant."""
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    if n < 2:
        return float("nan")
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    if va == 0 or vb == 0:
        return float("nan")
    return cov / math.sqrt(va * vb)


@dataclass
class DecisionPoint:
    name: str
    m: int
    shapes: Shapes
    measured_ms: dict[str, float]  # item -> summed measured time (an item is a GPU, or a GPU x TP layout)
    exact: bool = True
    # item -> (gpu, its shapes, GPUs it occupies); None: items are GPUs running ``shapes``
    items: dict[str, tuple[str, Shapes, int]] | None = None

    def item(self, label: str) -> tuple[str, Shapes, int]:
        if self.items is not None and label in self.items:
            return self.items[label]
        return label, self.shapes, 1


def _pair_agreement(pred: list[float], meas: list[float]) -> tuple[int, int]:
    """Pairs of items whose measured times differ by more than HIT_TOLERANCE, and how many the prediction
    orders the same way."""
    pairs = agree = 0
    for i in range(len(meas)):
        for j in range(i + 1, len(meas)):
            if abs(meas[i] - meas[j]) <= HIT_TOLERANCE * min(meas[i], meas[j]):
                continue  # a measured tie: either order is right
            pairs += 1
            agree += (pred[i] < pred[j]) == (meas[i] < meas[j])
    return pairs, agree


def _decide(fn: GemmFn, gpus: list[str], meas: list[float], pt: DecisionPoint) -> dict:
    """One point: the predicted pick, its regret, rank agreement and speed-ratio error."""
    best = min(meas)
    pred = []
    for label in gpus:
        gpu, shapes, ngpu = pt.item(label)
        pred.append(ngpu * sum(fn(gpu, pt.m, n, k) for n, k in shapes))
    pick = min(range(len(gpus)), key=lambda i: pred[i])
    regret = meas[pick] / best - 1.0
    pairs, agree = _pair_agreement(pred, meas)
    # relative-speed error: each GPU's time relative to the measured best, predicted vs measured
    ib = min(range(len(gpus)), key=lambda i: meas[i])
    rel = [abs((pred[i] / pred[ib]) / (meas[i] / meas[ib]) - 1.0) for i in range(len(gpus)) if i != ib]
    return {"predicted_ms": dict(zip(gpus, pred, strict=True)), "pick": gpus[pick],
            "hit": regret <= HIT_TOLERANCE, "regret": regret, "spearman": spearman(pred, meas),
            "pairs": pairs, "pairs_agree": agree, "relative_speed_error": sum(rel) / len(rel)}


_BASELINE_KEYS = ("pick", "hit", "regret", "spearman", "pairs", "pairs_agree", "relative_speed_error")


def _score_row(pt: DecisionPoint, predict: GemmFn, baseline: GemmFn | None) -> dict:
    gpus = sorted(pt.measured_ms)
    meas = [pt.measured_ms[g] for g in gpus]
    row = {"name": pt.name, "m": pt.m, "shapes": [list(s) for s in pt.shapes], "exact": pt.exact,
           "measured_ms": dict(zip(gpus, meas, strict=True)),
           "measured_order": [gpus[i] for i in sorted(range(len(gpus)), key=lambda i: meas[i])],
           "measured_best": gpus[min(range(len(gpus)), key=lambda i: meas[i])]}
    row.update(_decide(predict, gpus, meas, pt))
    row["predicted_order"] = sorted(gpus, key=lambda g: row["predicted_ms"][g])
    if baseline is not None:
        b = _decide(baseline, gpus, meas, pt)
        row["baseline"] = {k: b[k] for k in _BASELINE_KEYS}
    return row


def _summarise(rows: list[dict], sub: str | None = None) -> dict:
    """Hit rate, mean Spearman, regret, pairwise accuracy and speed-ratio error over scored rows (of the
    predictor, or of ``row[sub]``)."""
    if not rows:
        return {"points": 0}
    rs = [r[sub] for r in rows] if sub else rows
    rhos = [r["spearman"] for r in rs if not math.isnan(r["spearman"])]
    pairs = sum(r["pairs"] for r in rs)
    return {
        "points": len(rs),
        "top1_hit_rate": sum(r["hit"] for r in rs) / len(rs),
        "spearman_mean": sum(rhos) / len(rhos) if rhos else None,
        "regret_mean": sum(r["regret"] for r in rs) / len(rs),
        "regret_max": max(r["regret"] for r in rs),
        "pairwise_accuracy": (sum(r["pairs_agree"] for r in rs) / pairs) if pairs else None,
        "relative_speed_error_mean": sum(r["relative_speed_error"] for r in rs) / len(rs),
    }


def score_points(points: Sequence[DecisionPoint], predict: GemmFn, baseline: GemmFn | None = None) -> dict:
    """Predicted vs measured GPU order for each point; summary metrics overall and per M."""
    rows = [_score_row(pt, predict, baseline) for pt in points if len(pt.measured_ms) >= 2]
    by_m: dict[int, list[dict]] = {}
    winners: dict[str, int] = {}
    for r in rows:
        by_m.setdefault(r["m"], []).append(r)
        winners[r["measured_best"]] = winners.get(r["measured_best"], 0) + 1
    out = {"summary": _summarise(rows), "by_m": {str(m): _summarise(v) for m, v in sorted(by_m.items())},
           "measured_winners": winners, "points": rows}
    if baseline is not None:
        out["baseline_summary"] = _summarise(rows, "baseline")
    return out


def gemm_predictor(clock: str | float = "power", l2_warm: bool = True) -> GemmFn:
    """The same per-row GEMM prediction ``m2live validate`` uses (ms)."""
    rp = RowPredictor(clock=clock, l2_warm=l2_warm)

    def fn(gpu: str, m: int, n: int, k: int) -> float:
        return rp.predict_row("gemm", {"device": gpu, "m": str(m), "n": str(n), "k": str(k)}, 0, "planner")

    return fn


def roofline_predictor(eta: float = 0.75) -> GemmFn:
    """Baseline: datasheet roofline with one constant efficiency (what a spec-sheet comparison does): the
    vendor's dense bf16 TFLOP/s as quoted, and the datasheet bandwidth."""

    def fn(gpu: str, m: int, n: int, k: int) -> float:
        g = get_gpu(gpu)
        return 1e3 * max(2.0 * m * n * k / (eta * g.bf16_tflops * 1e12), 2.0 * (m * k + n * k + m * n) / (eta * g.mem_bw))

    return fn
