"""Admission on a real vLLM-CPU engine: the budget vLLM actually schedules with each step is the controller's
decision, and vLLM fills it.

One process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the shipped bench-llama config with dummy weights, the plugin
switched on only through the documented environment (``M2LIVE_ENABLE=1``, ``M2LIVE_SLO_MS``). The test reads the
engine's own scheduler after every ``schedule()`` (``max_num_scheduled_tokens``, ``max_num_active_reqs``,
``total_num_scheduled_tokens``) and compares it with the decision the controller made for that call.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from m2live.trace import json_lines

SLO_MS = 60.0  # at start-up only: the phases' SLOs are set live, relative to this engine's measured steps
LIMIT_TOKENS = 2048
LIMIT_SEQS = 64


def _prompts(n: int, seed: int, lo: int = 150, hi: int = 600) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 8000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _trace_median(trace: Path, t0: float, t1: float, value) -> float:
    """Median of ``value(record)`` over the trace's measured steps in [t0, t1] (1.0 when there are none)."""
    recs = [r for _, r in json_lines(trace) if isinstance(r, dict) and r.get("measured_s")
            and r.get("predicted_s", 0) > 0 and t0 <= r["time"] <= t1]
    v = sorted(value(r) for r in recs)
    return v[len(v) // 2] if v else 1.0


def _slowness(trace: Path, t0: float, t1: float) -> float:
    """How slow the machine ran in [t0, t1]: the median measured / raw predicted step time of the trace's steps
    (the raw prediction does not depend on the machine's load, so the ratio does only on that)."""
    return _trace_median(trace, t0, t1, lambda r: r["measured_s"] / r["predicted_s"])


def _corrected_error(trace: Path, t0: float, t1: float) -> float:
    """Median |corrected − measured| / measured of the trace's steps in [t0, t1]."""
    return _trace_median(trace, t0, t1, lambda r: abs(r["corrected_s"] - r["measured_s"]) / r["measured_s"])


@pytest.mark.engine
def test_applied_budget_equals_the_decision(engine_lock, bench_model_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.jsonl"
    for k, v in {"M2LIVE_ENABLE": "1", "M2LIVE_SLO_MS": str(SLO_MS), "M2LIVE_TRACE": str(trace),
                 "M2LIVE_PROM": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                 "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("M2LIVE_MQTT_URL", raising=False)
    monkeypatch.delenv("M2LIVE_CONFIG", raising=False)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(bench_model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=4096, max_num_batched_tokens=LIMIT_TOKENS, max_num_seqs=LIMIT_SEQS, seed=0)
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        mon = sched._m2live
        assert mon is not None, "the m2live scheduler is not active"
        ctrl = mon.admission
        assert ctrl is not None and ctrl.slo_s == pytest.approx(SLO_MS / 1e3)

        calls: list[dict] = []
        original = sched.schedule

        def schedule(*args, **kwargs):  # read what vLLM actually used for this call
            before = ctrl.decisions
            waiting_before = len(sched.waiting)
            running_before = len(sched.running)
            converged = mon.residuals.converged  # what the controller sees for this decision
            out = original(*args, **kwargs)
            calls.append({
                "decided": ctrl.decisions - before, "decision": ctrl.last,
                "budget": sched.max_num_scheduled_tokens, "active": sched.max_num_active_reqs,
                "scheduled": out.total_num_scheduled_tokens, "running": len(sched.running),
                "running_before": running_before, "waiting_before": waiting_before,
                "slo_s": ctrl.slo_s,
                # the record thread may update the tracker during the call: only a reading that held is used
                "converged": converged if converged == mon.residuals.converged else None,
            })
            return out

        sched.schedule = schedule
        params = SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False)

        # phase 0, admission off: how long this engine's steps take on this machine (the SLOs below are relative
        # to it, so the test means the same on a fast AVX-512/AMX CPU and on a slow AVX2 one)
        mon.set_slo_ms(None)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in _prompts(4, 0, 32, 64)], params, use_tqdm=False)
        mon.flush()
        decode_ms = 1e3 * sorted(mon.step_times)[len(mon.step_times) // 2]
        slo1, slo2 = 5.0 * decode_ms, 2.5 * decode_ms
        n0 = len(calls)
        # phase 1: SLO slo1; phase 2: tighter SLO set live (as the MQTT control does); phase 3: admission off
        t_phase = [time.time()]
        mon.set_slo_ms(slo1)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in _prompts(10, 1)], params, use_tqdm=False)
        n1 = len(calls)
        t_phase.append(time.time())
        mon.set_slo_ms(slo2)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in _prompts(8, 2)], params, use_tqdm=False)
        n2 = len(calls)
        t_phase.append(time.time())
        mon.flush()
        mon.set_slo_ms(None)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in _prompts(3, 3)], params, use_tqdm=False)
    finally:
        sched.schedule = original
        llm.llm_engine.engine_core.shutdown()

    for i, c in enumerate(calls):  # shown when an assertion fails
        d = c["decision"]
        print(i, c["slo_s"], c["scheduled"], c["budget"], c["active"], c["running_before"], c["waiting_before"],
              d.flagged if d else None, round(1e3 * d.predicted_s, 1) if d else None)
    work = [c for c in calls[n0:] if c["scheduled"] > 0]
    assert len(work) >= 30
    on = [c for c in calls[n0:n2] if c["scheduled"] > 0]
    for c in on:
        d = c["decision"]
        assert c["decided"] == 1  # one decision per schedule() call ...
        assert c["budget"] == d.token_budget <= LIMIT_TOKENS  # ... and it is the budget vLLM used
        assert c["active"] == d.max_active <= LIMIT_SEQS
        assert c["scheduled"] <= d.token_budget
        assert c["running"] <= d.max_active or c["running"] <= c["running_before"]
        if d.flagged and not d.fallback:  # zero prefill could not meet the SLO: no new request was admitted
            assert c["running"] <= max(1, c["running_before"])  # (an idle engine takes one, in a minimal chunk)
        if d.fallback:  # the correction not yet trusted: vLLM's own budget, reached by doubling
            assert d.flagged and d.max_active == LIMIT_SEQS
    # the budget bound: with prompts waiting it was below vLLM's limit, and vLLM filled it exactly
    binding = [c for c in on if c["decision"].token_budget < LIMIT_TOKENS and c["waiting_before"] > 0]
    assert len(binding) >= 5
    # fallbacks to vLLM's budget are counted, and happen exactly when they should: every decision made while the
    # correction had not converged, and otherwise only after a long stretch in which no step could meet the SLO
    decided = [c for c in calls if c["decided"]]
    assert ctrl.fallbacks == sum(c["decision"].fallback for c in decided)
    # the streak counts only decisions made under an SLO with something to schedule (trusted is None on the
    # others: admission off, or an empty queue, which neither extends nor breaks a stretch of late steps)
    counted = [c for c in decided if c["decision"].trusted is not None]
    for i, c in enumerate(counted):
        if c["decision"].trusted is False:  # what the controller itself read (the record thread may flip it)
            assert c["decision"].fallback, i
        elif c["decision"].trusted and c["decision"].fallback:
            # (the streak includes the decision itself: fallback_after - 1 flagged ones before it)
            assert all(x["decision"].flagged for x in counted[max(0, i - ctrl.fallback_after + 1):i]), i
    assert any(c["converged"] for c in on), "the correction never converged on this engine's steps"
    assert sum(c["scheduled"] == c["budget"] for c in binding) >= 0.8 * len(binding)
    # a tighter SLO set live is what the next decisions aim at: every unflagged decision after the change
    # predicts a step within the new target, and budgets do not grow (on this CPU both SLOs sit close to the
    # per-step floor, so the budgets may be equal at the median; the strict shrink is a unit test)
    target2 = (slo2 / 1e3) * (1 - ctrl.margin)
    phase2 = [c for c in calls[n1:n2] if c["scheduled"] > 0]
    assert phase2 and all(c["decision"].predicted_s <= target2 * 1.0001 for c in phase2
                          if not c["decision"].flagged)
    b1 = sorted(c["budget"] for c in calls[n0:n1] if c["waiting_before"] > 0 and not c["decision"].fallback)
    b2 = sorted(c["budget"] for c in calls[n1:n2] if c["waiting_before"] > 0 and not c["decision"].fallback)
    # (on a loaded machine the correction may not converge in a phase: its decisions then all fell back to vLLM's
    # budget, justified above, and there is no SLO-driven budget to compare; where the correction's own error
    # over the two phases was within the bound it is trusted at, some budget must have been the controller's)
    noise = _corrected_error(trace, t_phase[0], t_phase[2])
    print("corrected median error over phases 1-2:", round(noise, 3))
    if noise <= 0.5 * mon.residuals.converged_error:
        assert b1 or b2
    # (and a machine that got faster between the phases — a CPU-heavy neighbour that stopped — may rightly take
    # bigger chunks within a tighter SLO: the comparison holds when its speed, measured / raw predicted on each
    # phase's own steps, stayed within 15 %)
    if len(b1) >= 3 and len(b2) >= 3 and (
            _slowness(trace, t_phase[1], t_phase[2]) >= 0.85 * _slowness(trace, t_phase[0], t_phase[1])):
        assert b2[len(b2) // 2] <= b1[len(b1) // 2]
    # admission off: the configured limits again
    for c in calls[n2:]:
        assert c["decided"] == 0
        assert (c["budget"], c["active"]) == (LIMIT_TOKENS, LIMIT_SEQS)

    # the trace records the decision applied to each step, in order
    records = [r for _, r in json_lines(trace)]
    budgets_traced = [r["token_budget"] for r in records if r.get("token_budget") is not None]
    assert budgets_traced == [c["decision"].token_budget for c in on][: len(budgets_traced)]
    assert len(budgets_traced) >= len(on) - 2
    assert all(r["slo_s"] == pytest.approx(slo1 / 1e3) or r["slo_s"] == pytest.approx(slo2 / 1e3)
               for r in records if r.get("token_budget") is not None)
