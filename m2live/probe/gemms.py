"""Phase 1: the projection GEMMs. Each cell (op, M, repeat) is a CUDA graph of back-to-back ``F.linear`` calls
cycling through enough copies of the weight that it never stays in L2 (serving reads weights cold), replayed for
a sustained phase; time, clock and power are read over its settled half and scored against ``OpModel.gemm`` at
the live, forecast and boost clocks."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from ..predictor import OpModel
from .device import _Device, one_line
from .env import Window, _Env
from .output import _Writer
from .plan import ProbePlan, gemm_order, ring_copies
from .score import clock_summary, error_line, errors, gemm_predictions, summarise_gemm


def _weight_rings(env: _Env, plan: ProbePlan) -> dict[str, list[Any]]:
    """Per op, the copies of its weight a cell cycles through (together at least l2_ring_factor L2 sizes)."""
    torch, dev = env.torch, env.dev
    rings: dict[str, list[Any]] = {}
    for op, (n, k) in plan.gemm_ops.items():
        copies = ring_copies(2 * n * k, env.l2_bytes, plan.l2_ring_factor)
        rings[op] = [torch.randn(n, k, device=dev.device, dtype=dev.dtype) * 0.02 for _ in range(copies)]
    return rings


def _calls_per_rep(dev: _Device, body: Callable[[int], None], plan: ProbePlan) -> int:
    """Calls per timed repetition, so that one repetition takes about plan.target_rep_s (from a pilot)."""
    body(1)  # first call: library heuristics, workspace
    dev.sync()
    pilot = min(dev.time_once(lambda: body(1)) for _ in range(3))
    return max(1, min(plan.max_calls, math.ceil(plan.target_rep_s / max(pilot, 1e-7))))


def _launcher(dev: _Device, fn: Callable[[], Any]) -> tuple[Callable[[], Any], str, str | None]:
    """(launch, method, why capture failed): a CUDA graph of ``fn`` on a GPU, else ``fn`` itself, eagerly."""
    if not dev.cuda:
        return fn, "eager", None
    try:
        return dev.graph(fn), "cuda-graph", None
    except Exception as e:  # noqa: BLE001 - fall back to eager back-to-back calls, and say so
        return fn, "eager", one_line(e)


def _cell_record(key: tuple[str, int, int, int], nk: tuple[int, int], method: str, calls: int, w: Window,
                 om: OpModel, t0: float) -> dict:
    """The JSON record of one measured cell: per-call time (median and spread of the settled half), clock and
    power there, and the three predictions with their errors."""
    (op, m, rep, i), (n, k) = key, nk
    t_cell = statistics.median(w.per_rep_s()) / calls
    per_call = sorted(dt / calls for dt in w.per_rep_s())
    return {
        "op": op, "m": m, "n": n, "k": k, "repeat": rep, "order": i, "method": method,
        "calls_per_rep": calls, "reps": len(w.reps), "reps_settled": len(w.settled),
        "time_s": t_cell, "time_p10_s": per_call[len(per_call) // 10],
        "time_p90_s": per_call[-1 - len(per_call) // 10],
        "time_early_s": statistics.median(dt for _, _, dt in w.early) / calls if w.early else None,
        "clock_early_mhz": w.early_stats.get("clock_mhz"),
        "tflops": 2.0 * m * n * k / t_cell / 1e12,
        "t_start_s": w.t_start - t0, "t_end_s": w.t_end - t0,
        **w.stats,
        "pred": gemm_predictions(om, m, n, k, w.stats.get("clock_mhz")),
    }


def _measure_cell(env: _Env, plan: ProbePlan, om: OpModel, ring: list[Any], key: tuple[str, int, int, int],
                  t0: float) -> dict:
    """Cool down, time one cell (op, M, repeat, order) over a sustained phase, and score it."""
    torch, dev = env.torch, env.dev
    F = torch.nn.functional
    op, m = key[0], key[1]
    n, k = plan.gemm_ops[op]
    time.sleep(plan.cooldown_s)
    x = torch.randn(m, k, device=dev.device, dtype=dev.dtype)

    def body(count: int) -> None:
        for j in range(count):
            F.linear(x, ring[j % len(ring)])

    calls = _calls_per_rep(dev, body, plan)
    launch, method, capture_error = _launcher(dev, lambda: body(calls))
    dev.repeat(launch, plan.warmup_s, 1)
    w = env.sustain(launch, plan.sustain_s, min_reps=4)
    cell = _cell_record(key, (n, k), method, calls, w, om, t0)
    if capture_error:
        cell["graph_error"] = capture_error
    cell["err"] = errors(cell["pred"], cell["time_s"])
    return cell


def _progress(c: dict, total: int) -> str:
    reasons = ",".join(c.get("event_reason_names") or [])
    return (f"[{c['order'] + 1}/{total}] {c['op']:8s} M={c['m']:<6d} {c['time_s'] * 1e6:10.1f} us  "
            f"{c['tflops']:6.1f} TF/s  clock {c.get('clock_mhz') or 0:6.0f} MHz  power {c.get('power_w') or 0:5.0f} W  "
            f"{error_line(c['err'])}{'  ' + reasons if reasons else ''}")


def run_gemms(env: _Env, plan: ProbePlan, doc: dict, writer: _Writer, say: Callable[[str], None],
              deadline: float | None) -> None:
    """Measure every GEMM cell of the plan in its random order (until the deadline), into ``doc["gemm"]``."""
    sec = doc["gemm"]
    om = OpModel(env.spec)
    env.torch.manual_seed(plan.seed)
    rings = _weight_rings(env, plan)
    sec["weight_copies"] = {op: len(r) for op, r in rings.items()}
    cells: list[dict] = sec["cells"]
    order = gemm_order(plan)
    for i, (op, m, rep) in enumerate(order):
        if deadline is not None and time.monotonic() + plan.cell_s > deadline:
            sec["skipped"] = [{"op": o, "m": mm, "repeat": r} for o, mm, r in order[i:]]
            say(f"time limit: {len(order) - i} GEMM cells skipped")
            break
        cells.append(_measure_cell(env, plan, om, rings[op], (op, m, rep, i), writer.t0))
        sec.update(summarise_gemm(cells))
        writer.flush()
        say(_progress(cells[-1], len(order)))
    del rings
    env.dev.empty_cache()
    sec["clock_summary"] = clock_summary(cells, env.gpu_info.get("max_sm_mhz"))
