"""SLO-aware admission: choose each engine step's token budget and admitted-request count from the predictor.

Before every ``schedule()`` the plugin hands the controller a :class:`QueueView` (what is running, mid-prefill
and waiting) and the live clock ratio. The controller picks the **largest** token budget whose corrected
prediction stays under ``slo_s * (1 - margin)``:

* the step is modelled the way vLLM's V1 scheduler fills it: every running decode takes one token, then the
  running partial prefills take chunks in order, then waiting prompts are admitted first-come-first-served,
  each taking ``min(prompt, budget left)`` (chunked prefill). Long prompts therefore make progress in chunks at
  the head of the queue and are never skipped in favour of shorter ones;
* the prediction is the mechanistic one at ``min(live f_clk, clock forecast of that candidate step)`` (a
  heavier step may pull the clock lower than the one measured on the lighter step before it; devices without
  a power model, such as the CPU device, skip the forecast), passed through the residual
  tracker's upper quantile (``ResidualTracker.upper``) when a tracker is given: on a CPU engine the per-step host
  floor the mechanistic model does not know is learnt there;
* the search over the budget: the full demand is tried first (one prediction when everything fits); then the
  last binding budget and one probe a tolerance (~3 %) above it (the queue changes little between steps, so
  this usually closes the bracket: three predictions); otherwise zero prefill and a bracketed secant with a
  bisection safeguard (the step time is close to linear in the prefill tokens — for fp8 on Hopper a sawtooth about
  that line: a step whose GEMMs' last row of activation tiles is mostly empty runs slower than one a few dozen
  tokens larger, as measured, ``efficiency`` tma_oob; there one probe at the next full tile row above the answer,
  kept out of the search's evaluations, takes it when it fits: more tokens and a faster step). At most
  ``max_evaluations``;
* the budget never exceeds vLLM's configured ``max_num_batched_tokens`` / ``max_num_seqs``;
* decodes of running requests always proceed: when even the decode-only step (no prefill) cannot meet the SLO
  the step is allowed, the decision is flagged and counted, and no new requests are admitted until a step can
  meet it again (running prefills also wait, so the running set drains);
* it never starves on a bad prior: while the residual tracker's correction has not converged (``converged``
  false: too few steps, or its recent out-of-sample error above its bound), or after ``fallback_after``
  consecutive decisions in which no step could meet the SLO, the controller **falls back to vLLM's own
  budget** — in bounded steps: the budget doubles from the last decided one each step up to vLLM's configured
  limit, admissions up to vLLM's limit — and flags (``Decision.fallback``) and counts (``fallbacks``) every such
  decision. It leaves the fallback as soon as the correction has converged and a step can meet the SLO again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from .predictor import Prediction, Predictor, clock_as_ratio, has_power_model
from .step import Step


class ResidualModel(Protocol):
    """What the controller needs of ``m2live.residuals.ResidualTracker``."""

    def upper(self, prediction: Prediction, step: Step, q: float = 0.95) -> float: ...

    # optional: ``converged`` (bool) — whether the correction can be trusted yet (absent: always trusted)


@dataclass
class QueueView:
    """The scheduler's state just before ``schedule()``, as the admission controller sees it."""

    decode_contexts: list[int]  # running requests that decode this step: tokens already computed
    partial_prefills: list[tuple[int, int]]  # running requests mid-prefill: (remaining prompt tokens, computed)
    waiting_prompts: list[int]  # waiting requests' prompt lengths, in scheduling order
    max_num_batched_tokens: int  # vLLM's configured limits (never exceed)
    max_num_seqs: int

    @property
    def num_running(self) -> int:
        return len(self.decode_contexts) + len(self.partial_prefills)

    @property
    def prefill_demand(self) -> int:
        """Prefill tokens the queue could use this step if the limits allowed (before any budget)."""
        room = max(0, self.max_num_seqs - self.num_running)
        return sum(r for r, _ in self.partial_prefills) + sum(self.waiting_prompts[:room])


@dataclass
class Decision:
    token_budget: int  # set as scheduler.max_num_scheduled_tokens for this step
    max_active: int  # set as scheduler.max_num_active_reqs for this step
    predicted_s: float  # corrected (upper-quantile) prediction of the step this budget allows
    flagged: bool  # no budget meets the SLO: decodes run anyway, admissions stopped
    evaluations: int = 0  # predictions spent on this decision
    prefill_tokens: int = 0  # prefill tokens the budget leaves after the decodes
    admitted: int = 0  # waiting requests this budget admits (at least one token each)
    fallback: bool = False  # vLLM's own budget (ramped): the correction is not trusted, or nothing met the SLO
    trusted: bool | None = None  # whether the correction had converged when this was decided (None: admission off)

    @property
    def no_budget(self) -> bool:
        """No budget met the SLO: a decision that looked and found none. A fallback while the correction is not
        trusted is flagged too (it stops admissions the same way), but it never looked."""
        return self.flagged and self.trusted is not False


class _PlannedStep(Step):
    """A Step built by the controller: already validated, with the views the predictor reads precomputed.

    ``Step.__init__`` validates every sequence, and its properties rescan the sequences on every access; with
    a hundred decodes that would cost more than the prediction itself. ``dec_seqs`` is the decodes' part of
    ``seqs``, built once per decision.
    """

    def __init__(self, decodes: list[int], dec_seqs: tuple[tuple[int, int], ...],
                 prefills: list[tuple[int, int]]) -> None:
        object.__setattr__(self, "seqs", tuple(prefills) + dec_seqs)
        object.__setattr__(self, "prefill", (True,) * len(prefills) + (False,) * len(decodes))
        object.__setattr__(self, "_pre", prefills)
        object.__setattr__(self, "_dec", decodes)
        object.__setattr__(self, "_ntok", sum(n for n, _ in prefills) + len(decodes))

    @property
    def prefill_seqs(self) -> list[tuple[int, int]]:
        return self._pre

    @property
    def decode_contexts(self) -> list[int]:
        return self._dec

    @property
    def num_tokens(self) -> int:
        return self._ntok

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)


@dataclass
class _Plan:
    budget: int
    step: Step
    admitted: int
    prefill_tokens: int


class AdmissionController:
    """Per-step token budget and admission under a step-latency SLO (see the module docstring)."""

    def __init__(self, predictor: Predictor, residuals: ResidualModel | None, slo_s: float | None,
                 margin: float = 0.1, *, quantile: float = 0.95, min_chunk: int = 16,
                 max_evaluations: int = 8, fallback_after: int = 32) -> None:
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"admission margin must be in [0, 1), got {margin}")
        if not 0.5 <= quantile < 1.0:
            raise ValueError(f"admission quantile must be in [0.5, 1), got {quantile}")
        if min_chunk < 1:
            raise ValueError(f"min_chunk must be >= 1, got {min_chunk}")
        self.predictor = predictor
        self.residuals = residuals
        self.margin = margin
        self.quantile = quantile
        self.min_chunk = min_chunk
        self.max_evaluations = max(3, max_evaluations)
        self.fallback_after = max(1, fallback_after)
        self._lock = threading.Lock()  # set_slo may come from the MQTT thread
        self.slo_s: float | None = None
        self.set_slo(slo_s)
        self.violations = 0  # measured steps over the SLO (see observe)
        self.flagged = 0  # decisions where even the decode-only step could not meet the SLO
        self.decisions = 0
        self.fallbacks = 0  # decisions that fell back to vLLM's own budget (see the module docstring)
        self._flag_streak = 0  # consecutive decisions in which no step could meet the SLO
        self._fallback_budget: int | None = None  # the ramp towards vLLM's limit while falling back
        self.last: Decision | None = None
        self._forecasts_clock = has_power_model(predictor.gpu.arch)
        self._dec_cache: tuple[list[int], tuple[tuple[int, int], ...]] = ([], ())
        self._warm: int | None = None  # last binding budget (warm start of the next search)
        self._clock_ratio_last: float | None = None
        # where the step time is a sawtooth in the tokens (Predictor.sawtooth: fp8 on Hopper), step 5 of the search
        # probes the next full tile row
        self._sawtooth = predictor.sawtooth

    # ---- configuration ----------------------------------------------------------------------------------
    def set_slo(self, slo_s: float | None) -> None:
        """Change the step SLO (seconds) live; ``None`` turns admission off (decide returns the limits)."""
        if slo_s is not None:
            if isinstance(slo_s, bool) or not isinstance(slo_s, int | float) or not slo_s > 0:
                raise ValueError(f"SLO must be a positive number of seconds, got {slo_s!r}")
            slo_s = float(slo_s)
        with self._lock:
            self.slo_s = slo_s

    @property
    def target_s(self) -> float | None:
        """The bound the corrected prediction must stay under: slo · (1 − margin)."""
        return self._target(self.slo_s)

    def _target(self, slo_s: float | None) -> float | None:
        return None if slo_s is None else slo_s * (1.0 - self.margin)

    def observe(self, measured_s: float, slo_s: float | None = None) -> bool:
        """Count a measured step against ``slo_s`` (the SLO its decision was made under; default: the SLO in
        force now); returns True if it violated it."""
        slo = self.slo_s if slo_s is None else slo_s
        if slo is not None and measured_s > slo:
            self.violations += 1
            return True
        return False

    # ---- the decision ----------------------------------------------------------------------------------
    def decide(self, view: QueueView, f_clk: float | None) -> Decision:
        """Budget and admission cap for the next step. ``f_clk``: live clock ratio (1.0 = boost), a clock in
        MHz (> 5), or None for the power-cap forecast."""
        d = self._decide(view, f_clk)
        if self.target_s is None or d.predicted_s == 0.0 and not d.flagged:
            return d  # admission off, or nothing to schedule
        self._flag_streak = self._flag_streak + 1 if d.flagged else 0
        trusted = bool(getattr(self.residuals, "converged", True)) if self.residuals is not None else True
        if trusted and self._flag_streak < self.fallback_after:
            self._fallback_budget = None
            d.trusted = True
            return d
        fb = self._fallback(view, d)
        fb.trusted = trusted
        return fb

    def _fallback(self, view: QueueView, d: Decision) -> Decision:
        """vLLM's own budget, reached in bounded steps: double the last budget each decision, up to the limit."""
        limit_tokens, limit_seqs = int(view.max_num_batched_tokens), int(view.max_num_seqs)
        prev = self._fallback_budget if self._fallback_budget is not None else d.token_budget
        budget = min(limit_tokens, max(d.token_budget, 2 * prev, self.min_chunk))
        self._fallback_budget = budget
        self.fallbacks += 1
        plan = self._plan(view, budget, limit_seqs)
        t = self._corrected(plan.step, self._step_clock(plan.step, self._clock_ratio_last))
        fb = Decision(token_budget=max(1, budget), max_active=limit_seqs, predicted_s=t, flagged=True,
                      evaluations=d.evaluations + 1, prefill_tokens=plan.prefill_tokens, admitted=plan.admitted,
                      fallback=True)
        self.last = fb
        return fb

    def _decide(self, view: QueueView, f_clk: float | None) -> Decision:
        limit_tokens = int(view.max_num_batched_tokens)
        limit_seqs = int(view.max_num_seqs)
        if limit_tokens < 1 or limit_seqs < 1:
            raise ValueError(f"configured limits must be positive, got max_num_batched_tokens={limit_tokens}, "
                             f"max_num_seqs={limit_seqs}")
        self.decisions += 1
        target = self.target_s
        if target is None:
            d = Decision(limit_tokens, limit_seqs, 0.0, False)
            self.last = d
            return d
        f_live = self._clock_ratio(f_clk)
        self._clock_ratio_last = f_live
        decodes = [int(c) for c in view.decode_contexts]
        self._dec_cache = (decodes, tuple((1, c) for c in decodes))
        n_dec = min(len(decodes), limit_tokens)
        running = view.num_running
        demand = min(limit_tokens, n_dec + view.prefill_demand)
        evals = 0
        if demand <= 0:  # nothing to schedule: the budget is moot, keep vLLM's own limits
            d = Decision(limit_tokens, limit_seqs, 0.0, False)
            self.last = d
            return d

        # Every candidate is priced at the lower of the live clock and the power-cap forecast for that
        # candidate (a heavier step may pull the clock below the one measured on the lighter step before it).
        def cost(plan: _Plan) -> float:
            nonlocal evals
            evals += 1
            return self._corrected(plan.step, self._step_clock(plan.step, f_live))

        # 1. everything the limits allow (the common light step: one prediction)
        hi = self._plan(view, demand, limit_seqs)

        t_hi = cost(hi)
        if t_hi <= target or hi.prefill_tokens == 0:  # fits, or decodes only (flagged if even that is late)
            return self._done(hi, t_hi, running, limit_seqs, flagged=t_hi > target, evals=evals)
        floor_budget = n_dec if n_dec > 0 else min(demand, self.min_chunk)
        # 2. warm start: the last binding budget is usually a few tokens from this step's answer (the queue
        # changes little between steps). One probe a tolerance above it (if it fits) or below it (if not)
        # usually closes the bracket: three predictions in the steady state.
        def tol_at(budget: int) -> int:
            return max(4, n_dec // 8, budget // 32)  # ~3 % of the answer

        lo: _Plan | None = None
        t_lo = 0.0
        warm = self._warm
        if warm is not None and floor_budget < warm < hi.budget:
            g = self._plan(view, warm, limit_seqs)
            t_g = cost(g)
            if t_g <= target:
                lo, t_lo = g, t_g
                x = g.budget + tol_at(g.budget)
            else:
                hi, t_hi = g, t_g
                # far over the target (the clock dropped, the queue changed): a proportional step down, else
                # one tolerance below
                x = g.budget - tol_at(g.budget)
                if t_g > 1.1 * target:
                    x = min(x, int(g.budget * target / t_g))
            if floor_budget < x < hi.budget and (lo is None or x > lo.budget):
                u = self._plan(view, x, limit_seqs)
                t_u = cost(u)
                if t_u <= target:
                    lo, t_lo = u, t_u
                else:
                    hi, t_hi = u, t_u
        if lo is None:
            # 3. the floor: decodes only (or the smallest chunk when nothing decodes)
            lo = self._plan(view, floor_budget, limit_seqs)
            t_lo = cost(lo)
            if t_lo > target:
                # cannot meet the SLO even without new prefill: let the decodes run, stop admitting
                stop = self._plan(view, floor_budget, limit_seqs, admit=n_dec == 0 and running == 0)
                t = t_lo if stop.budget == lo.budget and stop.admitted == lo.admitted else cost(stop)
                return self._done(stop, t, running, limit_seqs, flagged=True, evals=evals)
        # 4. between a feasible lo and an infeasible hi: a secant guess biased half a tolerance low (the step
        # time has kinks: tile waves, chunk boundaries, so a secant guess lands on either side); after a guess
        # that fits, one probe a tolerance above it; a miss doubles the bias of the next guess; two misses in a
        # row fall back to bisection. The tolerance follows the best feasible budget.
        tol = tol_at(lo.budget)
        g_lo, g_hi = t_lo - target, t_hi - target
        probe_up, misses = False, 0
        saw = self._sawtooth
        while hi.budget - lo.budget > tol and evals < self.max_evaluations - (1 if saw else 0):
            if probe_up:
                x = lo.budget + tol
            elif misses >= 2 or g_hi <= g_lo:
                x = (lo.budget + hi.budget) // 2
            else:  # a miss doubles the low bias of the next guess (the curve bends above its chord); the bias is
                # a tolerance at the guess's own scale (lo may still be the decodes-only floor, tens of tokens,
                # while the answer sits just below a tile-wave step hundreds of tokens up)
                x = lo.budget + int(-g_lo / (g_hi - g_lo) * (hi.budget - lo.budget)) - (tol_at(hi.budget) // 2 << misses)
            x = min(max(x, lo.budget + 1), hi.budget - 1)
            mid = self._plan(view, x, limit_seqs)
            t_mid = cost(mid)
            if t_mid <= target:
                lo, t_lo, g_lo = mid, t_mid, t_mid - target
                tol = tol_at(lo.budget)
                probe_up, misses = not probe_up, 0
            else:
                hi, t_hi, g_hi = mid, t_mid, t_mid - target
                probe_up, misses = False, misses + 1
        # 5. where the GEMMs slow as their last tile row empties (fp8 on Hopper, efficiency tma_oob) the step time
        # is a sawtooth in the tokens: a step that fills its next tile row can be faster than the answer found, and
        # the bracket above cannot say so. One probe there (the evaluation the loop kept for it).
        if saw:
            x = self.predictor.tile_row_end(lo.budget + 1)
            if x <= demand and x != hi.budget:
                up = self._plan(view, x, limit_seqs)
                if up.budget > lo.budget:
                    t_up = cost(up)
                    if t_up <= target:
                        lo, t_lo = up, t_up
        self._warm = lo.budget
        return self._done(lo, t_lo, running, limit_seqs, flagged=False, evals=evals)

    # ---- helpers --------------------------------------------------------------------------------------
    def capacity(self, context: int, limit_seqs: int, f_clk: float | None = None,
                 slo_s: float | None = None) -> int | None:
        """How many requests can decode together, each with ``context`` tokens cached, in a step whose corrected
        upper prediction (the rule every decision plans with) stays within the target of ``slo_s`` (default: the
        SLO in force; None with none) — at most ``limit_seqs`` (vLLM's max_num_seqs), 0 when one does not fit.
        A decode-only step: the engine's steady state between prompts. ``f_clk``: the live clock (MHz or a
        ratio), else the power-cap forecast. Bisection, ~log2(limit_seqs) + 2 predictions, on the step growing
        with its requests: where the predicted step dips by microseconds at a tile boundary it can stop a few
        requests short of a larger count that also fits (a review's sweep: 27 for 29 on an L40S at 2k context)."""
        target = self._target(self.slo_s if slo_s is None else slo_s)
        if target is None or limit_seqs < 1:
            return None
        f_live = self._clock_ratio(f_clk)
        ctx = max(1, int(context))

        def fits(n: int) -> bool:
            step = Step.build((), [ctx] * n)
            return self._corrected(step, self._step_clock(step, f_live)) <= target

        if not fits(1):
            return 0
        lo, hi = 1, int(limit_seqs)
        if fits(hi):
            return hi
        while hi - lo > 1:  # fits(lo), not fits(hi)
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _clock_ratio(self, f_clk: float | None) -> float | None:
        return None if f_clk is None else clock_as_ratio(f_clk, self.predictor.gpu.boost_mhz)

    def _step_clock(self, step: Step, f_live: float | None) -> float:
        """min(live clock, power-cap forecast for ``step``); devices without a power model keep the live one."""
        if f_live is None:
            return self.predictor.forecast_f_clk(step)
        if self._forecasts_clock:
            return min(f_live, self.predictor.forecast_f_clk(step))
        return f_live

    def _corrected(self, step: Step, f: float) -> float:
        """Corrected upper prediction of ``step`` at clock ratio ``f``."""
        pred = self.predictor.predict_fast(step, f)
        if self.residuals is None:
            return pred.total_s
        return float(self.residuals.upper(pred, step, self.quantile))

    def _plan(self, view: QueueView, budget: int, limit_seqs: int, admit: bool = True) -> _Plan:
        """The step vLLM's scheduler builds with this token budget: decodes, running chunks, then admissions."""
        decodes, dec_seqs = self._dec_cache
        if len(decodes) > budget:
            decodes, dec_seqs = decodes[:budget], dec_seqs[:budget]
        left = budget - len(decodes)
        prefills: list[tuple[int, int]] = []
        used = 0
        for remaining, computed in view.partial_prefills:
            if left <= 0:
                break
            c = min(remaining, left)
            prefills.append((c, computed))
            left -= c
            used += c
        admitted = 0
        if admit:
            room = limit_seqs - view.num_running
            for prompt in view.waiting_prompts:
                if left <= 0 or admitted >= room:
                    break
                c = min(prompt, left)
                if c <= 0:
                    break
                prefills.append((c, 0))
                left -= c
                used += c
                admitted += 1
        return _Plan(budget=len(decodes) + used, step=_PlannedStep(decodes, dec_seqs, prefills),
                     admitted=admitted, prefill_tokens=used)

    def _done(self, plan: _Plan, t: float, running: int, limit_seqs: int, flagged: bool, evals: int) -> Decision:
        if flagged:
            self.flagged += 1
        budget = max(1, plan.budget)
        max_active = min(limit_seqs, max(1, running + plan.admitted))
        d = Decision(token_budget=budget, max_active=max_active, predicted_s=t, flagged=flagged,
                     evaluations=evals, prefill_tokens=plan.prefill_tokens, admitted=plan.admitted)
        self.last = d
        return d


__all__ = ["AdmissionController", "Decision", "QueueView"]
