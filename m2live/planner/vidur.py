"""Decision quality of the GPU ranking on Vidur's per-operator profiles (an independent software stack).

Vidur's ``mlp.csv`` holds, per model, TP degree and num_tokens, the median time of each projection; their sum is
one GEMM-sum decision point per (model, TP, num_tokens), scored on every GPU folder that profiled that model.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..hardware import get_gpu
from ..validate import TableError
from .decision import VALIDATION_MS, DecisionPoint, Shapes, gemm_predictor, roofline_predictor, score_points
from .memory import PlanError

VIDUR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")

Measured = dict[tuple[str, int, int], dict[str, list[float]]]  # (model, tp, num_tokens) -> GPU -> times (ms)


def vidur_folders(root: str | Path) -> dict[str, str]:
    """folder -> NVML name, from the table in the dataset's NOTICE.md (``| folder | NVML name | model |``)."""
    notice = Path(root) / "NOTICE.md"
    if not notice.is_file():
        raise PlanError(f"{root}: no NOTICE.md mapping folders to GPUs")
    out = {}
    for line in notice.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and (Path(root) / cells[0]).is_dir() and cells[1].startswith("NVIDIA"):
            out[cells[0]] = cells[1]
    return out


def _mlp_rows(csv_path: Path, ms: Sequence[int] | None) -> Iterator[tuple[int, int, Shapes, float]]:
    """(TP, num_tokens, the four projections' (N, K) on one GPU, their summed median ms) of each row of one
    ``mlp.csv`` whose num_tokens is in ``ms`` (every row when ``ms`` is None)."""
    with open(csv_path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            try:
                h, kvh, e, ex = (int(row[c]) for c in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd"))
                tp = int(row["num_tensor_parallel_workers"])
                m = int(row["num_tokens"])
                gated = str(row.get("use_gated_mlp", "True")).strip().lower() in ("true", "1")
                t = sum(float(row[f"time_stats.{op}.median"]) for op in VIDUR_OPS)
            except (KeyError, ValueError) as err:
                raise TableError(f"{csv_path}:{i}: bad or missing column ({err})") from None
            if ms is not None and m not in ms:
                continue
            d = e // h
            shapes = (((h + 2 * kvh) * d // tp, e), (e, h * d // tp), ((2 if gated else 1) * ex // tp, e),
                      (e, ex // tp))
            yield tp, m, shapes, t


def _layout_points(meas: Measured, shapes: dict[tuple[str, int], Shapes]) -> list[DecisionPoint]:
    """Per (model, num_tokens): every GPU x TP layout as one item, valued at its GPU-time (TP x shard time)."""
    layouts: dict[tuple[str, int], DecisionPoint] = {}
    for (model, tp, m), per in sorted(meas.items()):
        lp = layouts.setdefault((model, m), DecisionPoint(f"{model} layouts", m, (), {}, True, {}))
        for g, v in per.items():
            lp.measured_ms[f"{g} tp{tp}"] = tp * sum(v) / len(v)
            assert lp.items is not None
            lp.items[f"{g} tp{tp}"] = (g, shapes[(model, tp)], tp)
    return [p for p in layouts.values() if len(p.measured_ms) >= 2]


def load_vidur_points(root: str | Path, ms: Sequence[int] | None = VALIDATION_MS) -> tuple[list[DecisionPoint], dict]:
    """GEMM-sum decision points from Vidur ``mlp.csv`` profiles: per (model, TP, num_tokens) the summed median
    time of qkv, o, gate_up and down, for every GPU folder that profiled that model. ``ms=None``: every
    num_tokens value."""
    root = Path(root)
    meas: Measured = {}
    shapes: dict[tuple[str, int], Shapes] = {}
    skipped: dict[str, str] = {}
    used: dict[str, list[str]] = {}
    for folder, nvml in sorted(vidur_folders(root).items()):
        try:
            gpu = get_gpu(nvml).name
        except KeyError as e:
            skipped[nvml] = str(e)
            continue
        for csv_path in sorted((root / folder).glob("*/mlp.csv")):
            model = csv_path.parent.name
            used.setdefault(gpu, []).append(model)
            for tp, m, sh, t in _mlp_rows(csv_path, ms):
                shapes[(model, tp)] = sh
                meas.setdefault((model, tp, m), {}).setdefault(gpu, []).append(t)
    points = [DecisionPoint(f"{model} tp{tp}", m, shapes[(model, tp)],
                            {g: sum(v) / len(v) for g, v in per.items()})
              for (model, tp, m), per in sorted(meas.items())]
    return points, {"gpus_used": used, "skipped": skipped, "layout_points": _layout_points(meas, shapes)}


def validate_vidur(root: str | Path, ms: Sequence[int] | None = VALIDATION_MS) -> dict:
    """Decision quality of the GPU ranking (and of the GPU x TP layout ranking) on Vidur's profiles."""
    points, info = load_vidur_points(root, ms)
    layout_points = info.pop("layout_points")
    # Vidur times each operator over repeated runs (sustained load, not opbench's short bursts): the clock is the
    # power-cap forecast, as in bench/accuracy.py's Vidur validation; its loop re-runs the whole layer, so a
    # weight comes back from DRAM, not from the L2 the opbench collector's six copies of one operator fit in
    pred = gemm_predictor(clock="forecast", l2_warm=False)
    out = score_points(points, pred, roofline_predictor())
    out.update(info)
    out["predictor"] = ("OpModel.gemm via validate.RowPredictor (forecast clock: sustained repeats; weights from "
                        "DRAM: the whole layer re-runs)")
    out["layouts"] = score_points(layout_points, pred, roofline_predictor())
    out["layouts"]["what"] = ("rank every GPU x TP layout by GPU-time of its projections (TP x the time "
                              "Vidur measured for a 1/TP weight shard; no communication)")
    out["ms"] = "all" if ms is None else sorted({p.m for p in points})
    return out
