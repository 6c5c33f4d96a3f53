"""Phase 2: whole engine steps without vLLM. The torch decoder runs each planned step, replayed as a CUDA graph
(GPU body only, as vLLM's graphs) and eagerly (torch's own launch overhead), and m2live predicts the same step
for the same layer count. The torch model has no vLLM host work, so the predictions use
``HostConstants(alpha=0, t_samp=0)``. Each step is then profiled per operator (``kernels``): the device time
of its GEMMs, attention and light kernels against the prediction's per-op times."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from ..predictor import HostConstants, Predictor
from ..shapes import ModelShape
from ..step import Step
from . import kernels
from .decoder import TorchDecoder
from .device import one_line
from .env import Window, _Env
from .output import _Writer
from .plan import ProbePlan, StepSpec, step_memory_gb, step_order
from .score import clock_forecast_mape, error_line, errors, summarise_steps

HOSTS = {
    # the torch model has no vLLM host work: no per-sequence host term, no sampling tail
    "graph": HostConstants(alpha=0.0, t_samp=0.0, graph_max_tokens=1 << 40),
    "eager": HostConstants(alpha=0.0, t_samp=0.0, graph_max_tokens=0),
}
NOTE = ("torch decoder, not vLLM: random bf16 weights, contiguous KV cache, SDPA attention; "
        "predictions use HostConstants(alpha=0, t_samp=0): no scheduler or sampler work. "
        "'graph' replays the whole step as one CUDA graph (GPU body, launch term = graph "
        "replays); 'eager' launches every torch kernel from Python (predicted with eager "
        "launches at HostConstants.t_launch per kernel, 11 kernels per layer; this torch "
        "model launches more, unfused kernels than vLLM; each operator also passes an empty profiler hook, "
        "~0.2 us of host time, ~2 % of an eager layer's launches).")
ATTENTION = ("SDPA: prefill as MHA with KV heads repeated (causal, bottom-right over the cache), decode "
             "as the G query heads of each KV head against its cache")


def _step_shape(plan: ProbePlan) -> ModelShape:
    """The plan's model cut to the layers the step phase runs."""
    return replace(plan.model, layers=plan.step_layers,
                   name=f"{plan.model.name} ({plan.step_layers} of {plan.model.layers} layers)")


def _predict(p: Predictor, step: Step, clock_mhz: float | None) -> dict[str, dict]:
    """m2live's step prediction at boost, at the clock forecast and (when measured) at the live clock."""
    runs: dict[str, dict] = {"boost": {"f_clk": 1.0}, "forecast": {"f_clk": None}}
    if clock_mhz:
        runs["live"] = {"clock_mhz": clock_mhz}
    pred: dict[str, dict] = {}
    for src, kw in runs.items():
        r = p.predict(step, **kw)
        pred[src] = {"time_s": r.total_s, "f_clk": r.f_clk, "t_blocks_s": r.t_blocks}
        if src == "live":
            pred[src]["ops_s"] = {op: v for op, v in r.ops.items() if v > 0}
    return pred


def _cell_record(sp: StepSpec, step: Step, mode: str, w: Window, p: Predictor, t0: float) -> dict:
    t_meas = statistics.median(w.per_rep_s())
    pred = _predict(p, step, w.stats.get("clock_mhz"))
    return {
        "name": sp.name, "kind": sp.kind, "mode": mode,
        "prefills": [list(x) for x in sp.prefills], "decode_batch": sp.decode_batch,
        "decode_ctx": sp.decode_ctx, "num_tokens": step.num_tokens, "num_seqs": step.num_seqs,
        "time_s": t_meas, "time_min_s": min(w.per_rep_s()), "reps": len(w.reps),
        "t_start_s": w.t_start - t0, "t_end_s": w.t_end - t0, **w.stats, "pred": pred,
        "err": errors(pred, t_meas),
    }


def _measure_mode(env: _Env, plan: ProbePlan, model: TorchDecoder, inp: dict, mode: str) -> Window | str:
    """Time one step in one mode ("graph": a CUDA-graph replay; "eager"); the capture error if it fails."""
    dev = env.dev

    def fn() -> Any:
        return model.forward(inp)

    fn()
    fn()
    dev.sync()
    launch: Callable[[], Any] = fn
    if mode == "graph":
        try:
            launch = dev.graph(fn)
        except Exception as e:  # noqa: BLE001 - keep going with the next mode; say why
            return one_line(e)
    dev.repeat(launch, 0.0, 2)
    return env.sustain(launch, plan.step_min_s, plan.step_min_reps)


def _skip(env: _Env, plan: ProbePlan, sp: StepSpec) -> str | None:
    """Why a step cannot run here (more memory than the plan's cap allows), or None."""
    need_gb = step_memory_gb(plan, sp)
    if env.dev.cuda and need_gb > plan.memory_cap_gb * 0.9:
        return f"needs ~{need_gb:.1f} GB"
    return None


def _run_step(env: _Env, plan: ProbePlan, model: TorchDecoder, preds: dict[str, Predictor], sp: StepSpec,
              seed: int, writer: _Writer, say: Callable[[str], None]) -> None:
    """Every mode of one step: measured, predicted, appended to doc["steps"]["cells"], flushed to disk."""
    sec = writer.doc["steps"]
    cells: list[dict] = sec["cells"]
    time.sleep(plan.step_cooldown_s)
    inp = model.inputs(sp, seed=seed)
    step = sp.step()
    for mode in plan.step_modes:
        w = _measure_mode(env, plan, model, inp, mode)
        if isinstance(w, str):
            cells.append({"name": sp.name, "mode": mode, "error": w})
            say(f"{sp.name} [{mode}]: capture failed: {w}")
            continue
        cell = _cell_record(sp, step, mode, w, preds[mode], writer.t0)
        cells.append(cell)
        sec["mape"] = summarise_steps(cells)
        sec["clock_forecast_mape"] = clock_forecast_mape(cells)
        writer.flush()
        say(f"step {sp.name:34s} [{mode:5s}] {cell['time_s'] * 1e3:9.3f} ms  clock "
            f"{cell.get('clock_mhz') or 0:6.0f} MHz  {error_line(cell['err'])}")
    if plan.step_profile_reps > 0:
        _profile_step(env, plan, model, inp, preds["graph"], sp, step, writer, say)  # per-op times: either host
    del inp
    env.dev.empty_cache()


def _profile_step(env: _Env, plan: ProbePlan, model: TorchDecoder, inp: dict, pred: Predictor, sp: StepSpec,
                  step: Step, writer: _Writer, say: Callable[[str], None]) -> None:
    """The step's per-operator device times (``kernels.profile_forward``) against the prediction's per-op
    times at the clock its graph-mode cell ran at (the forecast where no clock was read), into
    doc["steps"]["kernels"] with their summary in doc["steps"]["kernel_mape"]."""
    sec = writer.doc["steps"]
    records: list[dict] = sec.setdefault("kernels", [])
    try:
        prof = kernels.profile_forward(env.dev, lambda scope: model.forward(inp, scope), plan.step_profile_reps)
    except Exception as e:  # noqa: BLE001 - a profiler that cannot run here costs this record, not the probe
        records.append({"name": sp.name, "error": one_line(e)})
        say(f"{sp.name}: per-operator profile failed: {one_line(e)}")
        return
    mine = [c for c in sec["cells"] if c["name"] == sp.name and c.get("clock_mhz")]
    cell = next((c for c in mine if c["mode"] == "graph"), mine[-1] if mine else None)  # graph first: the body
    clock = cell["clock_mhz"] if cell else None
    p = pred.predict(step, clock_mhz=clock) if clock else pred.predict(step)
    records.append({"name": sp.name, "kind": sp.kind, "clock_mhz": clock, "clock_of": cell["mode"] if cell else None,
                    "clock_source": p.clock_source, **prof, **kernels.compare(prof["measured_s"], p.ops)})
    sec["kernel_mape"] = kernels.summarise(records)
    sec["kernel_note"] = kernels.NOTE
    writer.flush()
    g = records[-1]["groups"]
    say(f"step {sp.name:34s}  by operator: " + "  ".join(
        f"{name} {v['measured_s'] * 1e3:.3f} ms {100 * v['err']:+.0f}%" for name, v in g.items()
        if v.get("err") is not None))


def _build(env: _Env, plan: ProbePlan, sec: dict) -> TorchDecoder:
    """The torch decoder with the plan's layer count, long enough for every planned step."""
    max_pos = max(s.max_position for s in plan.steps) + 1
    t_build = time.monotonic()
    model = TorchDecoder(env.dev, plan.model, plan.step_layers, max_pos, seed=plan.seed)
    env.dev.sync()
    sec["build_s"] = time.monotonic() - t_build
    sec["attention"] = ATTENTION
    return model


def run_steps(env: _Env, plan: ProbePlan, doc: dict, writer: _Writer, say: Callable[[str], None],
              deadline: float | None) -> None:
    """Measure every planned step in its random order (until the deadline), into ``doc["steps"]``."""
    shape = _step_shape(plan)
    # the torch decoder stops at the logits: no sampler, no vocab gather
    preds = {mode: Predictor(env.spec, shape, host=h, sampler=False) for mode, h in HOSTS.items()}
    sec = doc["steps"]
    sec.update({"model": shape.name, "layers": plan.step_layers, "modes": list(plan.step_modes),
                "host_constants": {mode: asdict(h) for mode, h in HOSTS.items() if mode in plan.step_modes},
                "note": NOTE})
    model = _build(env, plan, sec)
    order = step_order(plan)
    for i, sp in enumerate(order):
        if deadline is not None and time.monotonic() + plan.step_s > deadline:
            sec["skipped"] = [s.name for s in order[i:]]
            say(f"time limit: {len(order) - i} steps skipped")
            break
        why = _skip(env, plan, sp)
        if why:
            sec.setdefault("skipped", []).append(sp.name)
            say(f"{sp.name}: skipped, {why}")
            continue
        _run_step(env, plan, model, preds, sp, plan.seed + i, writer, say)
    del model
    env.dev.empty_cache()
