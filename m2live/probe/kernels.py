"""Per-operator times inside whole steps: the torch decoder's forward runs under ``torch.profiler`` with every
operator wrapped in a named range (``m2live::qkv``, ``m2live::attn_decode``, ``m2live::light`` …, the names of
``Predictor``'s ops), and the device time of the kernels each range launched is summed per operator and per
repetition. That turns a whole-step check into a per-operator one: which of GEMMs, attention and light kernels
the step prediction gets wrong, on a real GPU, with no kernel-name matching (names differ across cuBLAS, cuDNN
and FlashAttention versions; the ranges do not).

On the CPU (``--dry-run``) there are no kernels: a range's time is its CPU time, children included, so the same
pipeline runs in CI. torch comes from the caller (``_Device.torch``), never from an import here.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import statistics
from collections.abc import Callable, Iterable
from typing import Any

from ..validate import mape

Scope = Callable[[str], contextlib.AbstractContextManager]

PREFIX = "m2live::"
STEP_RANGE = PREFIX + "step"  # one repetition of the forward: the per-repetition sums are taken inside it
GEMM_OPS = ("qkv", "o", "gate_up", "down", "lm_head")
ATTN_OPS = ("attn_prefill", "attn_decode")
GROUPS = {"gemm": GEMM_OPS, "attention": ATTN_OPS, "light": ("light",)}
NOTE = ("per-operator device time inside the step: the torch decoder's forward under torch.profiler, every "
        "operator in a named range, the kernels each range launched summed per repetition (median over the "
        "repetitions), eager launches; predicted at the clock of the step's graph-mode cell (its eager cell's "
        "without one; the forecast where no clock was read). The torch decoder's 'light' is its unfused norms, "
        "RoPE, SiLU*mul, residual adds, embedding and sampled-row gather (more kernels and bytes than vLLM's "
        "fused ones); its attention ranges hold the KV-cache copies and SDPA (prefill repeats the KV heads).")


def scopes(torch: Any) -> Scope:
    """``name -> context manager`` that opens the profiler range ``m2live::name``."""
    record = torch.profiler.record_function
    return lambda name: record(PREFIX + name)


_NO_RANGE = contextlib.nullcontext()  # reusable: the timed forward pays one call and an empty with per operator


def no_scopes(_name: str) -> contextlib.AbstractContextManager:
    """The forward's default: no ranges (~0.2 us of host time per operator, ~2 % of an eager layer's launches)."""
    return _NO_RANGE


def _event_time_s(e: Any, cuda: bool) -> float:
    """Seconds the range took: its kernels' device time on CUDA, its CPU time (children included) on the CPU."""
    if cuda:
        us = getattr(e, "device_time_total", None)
        if us is None:  # torch before 2.4 names it for CUDA only
            us = e.cuda_time_total
        return us / 1e6
    return e.cpu_time_total / 1e6


def per_rep_times(events: Iterable[Any], cuda: bool) -> list[dict[str, float]]:
    """Seconds per operator in each repetition: every ``m2live::op`` range (CPU-side ones: the profiler's
    device-side copies of a range carry no kernels) assigned to the ``m2live::step`` range it starts in."""
    ranges = [e for e in events if e.name.startswith(PREFIX) and str(e.device_type).endswith("CPU")]
    steps = sorted((e.time_range.start, e.time_range.end) for e in ranges if e.name == STEP_RANGE)
    starts = [s for s, _ in steps]
    reps: list[dict[str, float]] = [{} for _ in steps]
    for e in ranges:
        if e.name == STEP_RANGE:
            continue
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        if i < 0 or e.time_range.start > steps[i][1]:
            continue  # outside every repetition (cannot happen with the forward below; never counted)
        op = e.name[len(PREFIX):]
        reps[i][op] = reps[i].get(op, 0.0) + _event_time_s(e, cuda)
    return reps


def profile_forward(dev: Any, forward: Callable[[Callable[[str], Any]], Any], reps: int) -> dict:
    """Run ``forward(scope)`` ``reps`` times under the profiler (after one warm-up call with the ranges on) and
    return the median seconds per operator over the repetitions, with the repetitions' own figures."""
    torch = dev.torch
    scope = scopes(torch)
    forward(scope)
    dev.sync()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        # one profiler session per step, with CUDA graphs captured between them: CUPTI torn down and brought up
        # again around graph capture has crashed (CUDA 11-12) or recorded nothing; torch's own answer for graph
        # users (torch/profiler/profiler.py) is to leave CUPTI up between sessions
        os.environ.setdefault("TEARDOWN_CUPTI", "0")
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps + 1):  # the first is dropped: kernel events at a session's start can go missing
            with scope("step"):
                forward(scope)
            dev.sync()
    per_rep = per_rep_times(prof.events(), dev.cuda)[1:]
    ops = sorted({op for r in per_rep for op in r})
    measured = {op: statistics.median(r.get(op, 0.0) for r in per_rep) for op in ops}
    if not per_rep or sum(measured.values()) <= 0:  # e.g. a profiler build that links no kernels to CPU ranges
        raise RuntimeError(f"the profiler attributed no time to the operator ranges ({len(per_rep)} repetitions)")
    return {"reps": len(per_rep), "timing": "cuda kernels" if dev.cuda else "cpu ranges",
            "measured_s": measured, "sum_s": sum(measured.values())}


def grouped(ops: dict[str, float]) -> dict[str, float]:
    """Operator seconds summed into GEMMs, attention and light kernels."""
    return {g: sum(ops.get(op, 0.0) for op in members) for g, members in GROUPS.items()}


def compare(measured: dict[str, float], predicted: dict[str, float]) -> dict:
    """Per operator and per group: predicted and measured seconds and the signed error (pred − meas) / meas,
    for every operator measured with a positive time."""
    pred = {op: predicted.get(op, 0.0) for op in measured}
    err = {op: (pred[op] - t) / t for op, t in measured.items() if t > 0}
    gm, gp = grouped(measured), grouped(predicted)
    return {"pred_s": pred, "err": err, "groups": {
        g: {"measured_s": gm[g], "pred_s": gp[g], "err": (gp[g] - gm[g]) / gm[g] if gm[g] > 0 else None}
        for g in GROUPS if gm[g] > 0}}


def summarise(records: list[dict]) -> dict:
    """MAPE over the profiled steps, per operator and per group; and each group's share of the measured time."""
    done = [r for r in records if r.get("measured_s")]
    ops = sorted({op for r in done for op in r["err"]})
    by_op = {op: mape((r["pred_s"][op], r["measured_s"][op]) for r in done if op in r["err"]) for op in ops}
    by_group = {g: mape((r["groups"][g]["pred_s"], r["groups"][g]["measured_s"]) for r in done
                        if g in r["groups"]) for g in GROUPS}
    total = sum(r["sum_s"] for r in done)
    share = {g: sum(r["groups"].get(g, {}).get("measured_s", 0.0) for r in done) / total if total else None
             for g in GROUPS}
    return {"steps": len(done), "mape_by_op": by_op, "mape_by_group": by_group, "measured_share": share}
