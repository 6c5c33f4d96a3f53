"""Evaluate every GPU x TP layout for a model and workload, and rank them.

For each layout: the memory fit (``memory.py``), the steady-state operating point under the SLO
(``layout.py``), the throughput, TTFT and TPOT of that operating point served the way vLLM serves it
(``m2live.simulate``), what bounds its steps, a few representative steps, and optionally the throughput reachable
under a sweep of SLOs and a replay of a recorded trace. Layouts are ranked by generated tokens/s per GPU, or per
dollar when prices are given for every layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..forkmap import default_jobs, fork_map
from ..hardware import GpuSpec, get_gpu, tp_beyond_node
from ..predictor import Prediction
from ..shapes import ModelShape, ModelShapeError, get_model
from ..step import Step
from ..workload import Workload, WorkloadStats
from .layout import LayoutModel, bound_shares, dominant_bound
from .memory import GIB, MemoryFit, PlanConfig, PlanError, reserve_label

SLO_SWEEP_MS = (5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0)
TRACE_REPLAY_MAX = 128  # recorded steps replayed per layout (evenly spaced)
SERVING_PROMPTS_PER_SLOT = 3  # simulated requests per request in flight: the first wave, then steady state
SERVING_SEARCH_STEPS = 4  # concurrency reductions tried when the simulated TPOT misses the SLO


@dataclass
class LayoutResult:
    gpu: str
    tp: int
    memory: MemoryFit
    fits: bool
    feasible: bool = False
    reason: str = ""
    limited_by: str = ""
    decode_batch: int = 0
    prefill_tokens_per_step: int = 0
    step_ms: float = float("nan")
    f_clk: float = float("nan")
    output_tokens_per_s: float = 0.0
    tokens_per_s: float = 0.0
    price_per_gpu_hour: float | None = None
    bound: str = ""
    bound_shares: dict[str, float] = field(default_factory=dict)
    chunk_budget: int | None = None
    steps: list[dict] = field(default_factory=list)
    curve: list[dict] = field(default_factory=list)  # throughput vs SLO
    replay: dict | None = None
    fleet: dict | None = None
    serving: dict | None = None  # the operating point served as vLLM's benchmark would see it (simulate.py)
    engine_limits: dict | None = None  # max_num_seqs and max_batched_tokens this layout ran with (PlanConfig.for_gpu)
    rank: int | None = None
    score: float | None = None

    @property
    def output_tokens_per_s_per_gpu(self) -> float:
        return self.output_tokens_per_s / self.tp

    @property
    def output_tokens_per_dollar(self) -> float | None:
        if not self.price_per_gpu_hour or not self.feasible:
            return None
        return self.output_tokens_per_s * 3600.0 / (self.tp * self.price_per_gpu_hour)

    def to_dict(self) -> dict:
        d = {
            "rank": self.rank, "gpu": self.gpu, "tp": self.tp, "fits": self.fits, "feasible": self.feasible,
            "reason": self.reason, "memory": self.memory.to_dict(), "score": self.score,
            **({"engine_limits": self.engine_limits} if self.engine_limits else {}),
        }
        if not self.fits:
            return d
        d.update({
            "limited_by": self.limited_by,
            "operating_point": {"decode_batch": self.decode_batch,
                                "prefill_tokens_per_step": self.prefill_tokens_per_step,
                                "step_ms": self.step_ms, "f_clk": self.f_clk, "chunk_budget": self.chunk_budget},
            "output_tokens_per_s": self.output_tokens_per_s,
            "output_tokens_per_s_per_gpu": self.output_tokens_per_s_per_gpu,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s / self.tp,
            "price_per_gpu_hour": self.price_per_gpu_hour,
            "output_tokens_per_dollar": self.output_tokens_per_dollar,
            "bound": self.bound, "bound_shares": self.bound_shares,
            "steps": self.steps, "slo_curve": self.curve, "trace_replay": self.replay, "fleet": self.fleet,
            "serving": self.serving,
        })
        return d

    def set_bounds(self, p: Prediction) -> None:
        """The clock and what bounds the step ``p`` predicted."""
        self.f_clk = p.f_clk
        self.bound_shares = bound_shares(p)
        self.bound = dominant_bound(self.bound_shares)


# ---- what a layout reports besides its operating point ------------------------------------------------------
def _step_entry(name: str, step: Step, p: Prediction) -> dict:
    shares = bound_shares(p)
    return {"name": name, "prefill_tokens": step.num_prefill_tokens, "decode_seqs": step.num_decode_tokens,
            "decode_kv_tokens": sum(step.decode_contexts), "step_ms": p.total_s * 1e3, "f_clk": p.f_clk,
            "bound": dominant_bound(shares)}


def representative_steps(lm: LayoutModel) -> list[dict]:
    """Pure decode at several batch sizes and contexts, and mixed chunked-prefill steps."""
    st = lm.stats
    out = []
    ctxs = sorted({lm.ctx, max(1, round(st.total_p["p90"]))})
    for b in (1, 16, 64, 256):
        for c in ctxs:
            if b * (c + 1) > lm.mem.kv_tokens or b > lm.cfg.max_num_seqs:
                continue
            s = Step.build([], [c] * b)
            out.append(_step_entry(f"decode {b}x@{c}", s, lm.predict(s)))
    for chunk in (512, 2048):
        b = min(32, lm.cfg.max_num_seqs - 1)
        if chunk + b > lm.cfg.max_batched_tokens or 32 * (lm.ctx + 1) + chunk > lm.mem.kv_tokens:
            continue
        s = Step.build([(chunk, 0)], [lm.ctx] * b)
        out.append(_step_entry(f"prefill {chunk} + decode {b}x@{lm.ctx}", s, lm.predict(s)))
    return out


def _simulate_at(lm: LayoutModel, prompts, outputs, concurrency: int):
    """``m2live.simulate``'s closed loop for this layout at ``concurrency`` requests in flight."""
    from ..simulate import ServingConfig, simulate

    cfg = lm.cfg
    scfg = ServingConfig(concurrency=concurrency, num_prompts=max(8, SERVING_PROMPTS_PER_SLOT * concurrency),
                         max_num_batched_tokens=cfg.max_batched_tokens,
                         max_num_seqs=min(cfg.max_num_seqs, cfg.max_batched_tokens),  # as vLLM lowers it
                         kv_tokens=max(1, lm.mem.kv_tokens), clock=cfg.clock,
                         test_run_cached=False,  # a server under its workload: no benchmark test run
                         async_scheduling=cfg.async_scheduling, vllm_version=cfg.vllm_version)
    return simulate(lm.pred.model, lm.gpu, lm.tp, prompts, outputs, scfg, precision=cfg.precision,
                    predictor=lm.pred)


def serving_point(lm: LayoutModel, wl: Workload, concurrency: int, slo_s: float | None) -> dict:
    """The layout served the way vLLM serves it: ``m2live.simulate``'s closed loop at ``concurrency`` requests
    in flight (the steady-state decode batch as the first guess), requests drawn from the workload (seed 0),
    every step timed by this layout's predictor. Under an SLO the concurrency is lowered until the simulated
    mean TPOT (the mean inter-token latency) meets it. Throughput is the simulator's steady state (after the
    first wave, before the drain)."""
    import numpy as np

    c = max(1, concurrency)
    rng = np.random.default_rng(0)
    n = max(8, SERVING_PROMPTS_PER_SLOT * c)
    prompts, outputs = wl.prompt.sample(rng, n), wl.output.sample(rng, n)
    # a request longer than the model's context is refused by the server at once (its OpenAI API answers 400):
    # it never reaches the engine, and the benchmark's means leave it out
    ctx = lm.pred.model.max_context
    within = np.ones(n, dtype=bool) if ctx is None else (prompts + outputs) <= ctx
    if not within.any():
        raise PlanError(f"every sampled request is longer than {lm.pred.model.name}'s context ({ctx} tokens)")
    prompts, outputs = prompts[within], outputs[within]
    tried = []
    for _ in range(SERVING_SEARCH_STEPS + 1):
        r = _simulate_at(lm, prompts, outputs, c)
        tried.append(c)
        meets = slo_s is None or r.tpot_ms <= slo_s * 1e3
        if meets or c == 1:
            break
        c = max(1, min(c - 1, int(c * 0.9 * slo_s * 1e3 / r.tpot_ms)))
    return {"concurrency": c, "ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms,
            "output_tokens_per_s": r.steady_output_tokens_per_s,
            "benchmark_output_tokens_per_s": r.output_tokens_per_s, "num_prompts": r.requests,
            "meets_slo": bool(meets), "concurrency_tried": tried, "preemptions": r.steps["preemptions"],
            "mean_tokens_per_step": r.steps["mean_tokens_per_step"],
            "requests_past_context": int(n - within.sum())}


def trace_replay(lm: LayoutModel, wl: Workload, slo_s: float | None) -> dict:
    """The recorded trace's own batches (up to TRACE_REPLAY_MAX of them) timed on this layout."""
    steps = wl.trace_steps
    if len(steps) > TRACE_REPLAY_MAX:
        stride = len(steps) / TRACE_REPLAY_MAX
        steps = tuple(steps[int(i * stride)] for i in range(TRACE_REPLAY_MAX))
    peak_kv = max(s.prefill_kv_tokens + s.prefill_tokens + s.decode_kv_tokens + s.decode_reqs for s in steps)
    times, tokens = [], 0
    for s in steps:
        step = Step.from_counts(s.prefill_tokens, s.prefill_kv_tokens, s.decode_reqs, s.decode_kv_tokens)
        times.append(lm.time(step))
        tokens += step.num_tokens
    times.sort()
    tot = sum(times)
    out = {"steps": len(times), "mean_step_ms": 1e3 * tot / len(times),
           "p99_step_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))],
           "tokens_per_s": tokens / tot if tot > 0 else 0.0,
           "peak_kv_tokens": peak_kv, "fits_recorded_batches": peak_kv <= lm.mem.kv_tokens}
    if slo_s is not None:
        out["within_slo"] = sum(t <= slo_s for t in times) / len(times)
    return out


def slo_curve(lm: LayoutModel, cap: int) -> list[dict]:
    """Best decode batch and generated tokens/s per GPU reachable under each SLO of SLO_SWEEP_MS."""
    out = []
    for slo_ms in SLO_SWEEP_MS:
        bb = lm.best_batch(lm.max_batch(slo_ms / 1e3, cap))
        tt = lm.t_steady(bb) if bb >= 1 else float("nan")
        out.append({"slo_ms": slo_ms, "decode_batch": max(0, bb),
                    "output_tokens_per_s_per_gpu": (bb / tt / lm.tp) if bb >= 1 else 0.0})
    return out


def fleet(res: LayoutResult, wl: Workload, stats: WorkloadStats) -> dict:
    """Replicas of this layout that serve the workload's arrival rate."""
    demand = wl.rate * stats.mean_output
    replicas = max(1, math.ceil(demand / res.output_tokens_per_s))
    return {"demand_output_tokens_per_s": demand, "replicas": replicas, "gpus": replicas * res.tp,
            "cost_per_hour": (replicas * res.tp * res.price_per_gpu_hour if res.price_per_gpu_hour else None)}


# ---- one layout ---------------------------------------------------------------------------------------------
def _layout_model(gpu: GpuSpec, model: ModelShape, tp: int, stats: WorkloadStats,
                  cfg: PlanConfig) -> tuple[LayoutModel | None, LayoutResult | None]:
    """The layout's model, or the result that refuses the layout before any step is predicted."""
    if cfg.precision == "fp8" and not gpu.has_fp8:
        why = gpu.no_fp8_reason()
        return None, LayoutResult(gpu.name, tp, MemoryFit.refused(gpu, why), fits=False, reason=why)
    try:
        lm = LayoutModel(gpu, model, tp, stats, cfg)
    except ModelShapeError as e:
        return None, LayoutResult(gpu.name, tp, MemoryFit.refused(gpu, str(e)), fits=False, reason=str(e))
    if tp > 1 and gpu.interconnect == "none":
        return None, LayoutResult(gpu.name, tp, lm.mem, fits=False,
                                  reason=f"{gpu.name} has no GPU interconnect for TP")
    if beyond := tp_beyond_node(gpu, tp):
        return None, LayoutResult(gpu.name, tp, lm.mem, fits=False, reason=beyond)
    return lm, None


def _slo_unmet(res: LayoutResult, lm: LayoutModel) -> None:
    """Not even one decode with its prefill share meets the SLO: report that step."""
    slo = lm.cfg.slo_s
    t1 = lm.t_steady(1)
    res.reason = (f"one decode with its prefill share takes {t1 * 1e3:.2f} ms, over the "
                  f"{slo * 1e3:g} ms SLO" if slo is not None else "no feasible batch")
    res.step_ms = t1 * 1e3
    res.set_bounds(lm.predict(lm.steady_step(1)))


def _operating_point(res: LayoutResult, lm: LayoutModel, wl: Workload, b: int, limited_by: str) -> None:
    """The steady step at decode batch ``b``, served through the simulator for throughput, TTFT and TPOT."""
    slo = lm.cfg.slo_s
    res.feasible = True
    res.limited_by = limited_by
    step = lm.steady_step(b)
    p = lm.predict(step)
    res.decode_batch = b
    res.prefill_tokens_per_step = step.num_prefill_tokens
    res.step_ms = p.total_s * 1e3
    res.set_bounds(p)
    res.serving = serving_point(lm, wl, b, slo)
    res.output_tokens_per_s = res.serving["output_tokens_per_s"]
    res.tokens_per_s = res.output_tokens_per_s * (1.0 + lm.stats.prefill_per_decode)
    if slo is not None:
        res.chunk_budget = lm.chunk_budget(b, slo)
    if wl.rate:
        res.fleet = fleet(res, wl, lm.stats)


def evaluate_layout(gpu: GpuSpec, model: ModelShape, tp: int, wl: Workload, cfg: PlanConfig,
                    curve: bool = False) -> LayoutResult:
    """Memory fit, operating point under the SLO, throughput, bounds and representative steps of a layout."""
    gpu = get_gpu(gpu)
    lm, refused = _layout_model(gpu, model, tp, wl.stats(), cfg)
    if lm is None:
        assert refused is not None
        return refused
    res = LayoutResult(gpu.name, tp, lm.mem, fits=lm.mem.fits, reason=lm.mem.reason,
                       price_per_gpu_hour=cfg.prices.get(gpu.name),
                       engine_limits={"max_num_seqs": lm.cfg.max_num_seqs,
                                      "max_batched_tokens": lm.cfg.max_batched_tokens})
    if not lm.mem.fits:
        return res
    cap, which = lm.resource_cap()
    if cap < 1:
        res.fits = False
        res.reason = f"{which}: not even one request fits (token budget {lm.cfg.max_batched_tokens})"
        return res
    slo = cfg.slo_s
    b_max = lm.max_batch(slo, cap)
    b = lm.best_batch(b_max)
    res.steps = representative_steps(lm)
    if b < 1:
        _slo_unmet(res, lm)
    else:
        limited_by = "throughput_peak" if b < b_max else ("slo" if (slo is not None and b < cap) else which)
        _operating_point(res, lm, wl, b, limited_by)
    if curve:
        res.curve = slo_curve(lm, cap)
    if wl.trace_steps:
        res.replay = trace_replay(lm, wl, slo)
    return res


# ---- the ranking --------------------------------------------------------------------------------------------
@dataclass
class Ranking:
    model: ModelShape
    workload: Workload
    config: PlanConfig
    rank_by: str
    layouts: list[LayoutResult]  # fitting layouts: ranked feasible first, then infeasible under the SLO
    excluded: list[LayoutResult]

    def to_dict(self) -> dict:
        c = self.config
        return {
            "model": {"name": self.model.name, "params": self.model.param_count(),
                      "weight_bytes": self.model.weight_bytes(c.precision), "layers": self.model.layers},
            "workload": self.workload.to_dict(),
            "slo_ms": None if c.slo_s is None else c.slo_s * 1e3,
            "rank_by": self.rank_by,
            "assumptions": {
                "clock": c.clock, "precision": c.precision, "act_scale": c.act_scale,
                "kv_cache_dtype": c.kv_cache_dtype,
                # None: vLLM's OpenAI server defaults for each device (each layout's engine_limits)
                "max_num_seqs": c.max_num_seqs, "max_batched_tokens": c.max_batched_tokens,
                "memory_reserve_fraction": c.reserve_fraction,
                # None: by TP, as memory_reserve says
                "memory_reserve_gib": None if c.reserve_bytes is None else c.reserve_bytes / GIB,
                "memory_reserve": reserve_label(c.reserve_bytes),
                "vllm_version": str(c.vllm_version),
                "async_scheduling": f"vLLM {c.vllm_version}'s default (on for GPUs from 0.14)"
                if c.async_scheduling is None else c.async_scheduling,
                "allreduce_fusion": f"vLLM {c.vllm_version}'s default (from 0.16 on for Hopper and Blackwell "
                                    "data-centre GPUs under TP)" if c.allreduce_fusion is None else c.allreduce_fusion,
                "steady_state": "continuous batching with chunked prefill: B decodes + B*E[p]/E[d] prefill "
                                "tokens per step",
                # GPU -> what its calibration was fitted on (--calibration); the others from their datasheets
                "calibrations": {g: k["constants"].fitted_on for g, k in sorted(c.constants.items())},
                "serving": "throughput, TTFT and TPOT from m2live.simulate (vLLM V1's scheduler, closed loop at "
                           "the operating point's concurrency, lowered until the simulated TPOT meets the SLO)",
            },
            "prices": dict(c.prices),
            "ranking": [r.to_dict() for r in self.layouts],
            "excluded": [r.to_dict() for r in self.excluded],
        }


def _score(r: LayoutResult, by: str) -> float:
    if by == "dollar":
        return r.output_tokens_per_dollar or 0.0
    if by == "layout":
        return r.output_tokens_per_s
    return r.output_tokens_per_s_per_gpu


def _rank_by(cfg: PlanConfig, fitting: list[LayoutResult]) -> str:
    """``cfg.rank_by`` with ``auto`` resolved: per dollar when every fitting layout has a price, else per GPU."""
    by = cfg.rank_by
    if by == "auto":
        by = "dollar" if fitting and all(r.price_per_gpu_hour for r in fitting) else "gpu"
    if by == "dollar" and not all(r.price_per_gpu_hour for r in fitting):
        missing = sorted({r.gpu for r in fitting if not r.price_per_gpu_hour})
        raise PlanError(f"ranking per dollar needs a price for every GPU; missing: {', '.join(missing)}")
    return by


def rank(model: ModelShape | str, workload: Workload, gpus: Sequence[GpuSpec | str],
         tps: Sequence[int] = (1, 2, 4, 8), cfg: PlanConfig | None = None, curve: bool = False,
         jobs: int | None = None) -> Ranking:
    """Every layout of ``gpus`` x ``tps`` evaluated, the fitting ones ranked. The layouts are evaluated in ``jobs``
    forked processes (``forkmap.fork_map``; None: one per core and per two layouts, at most 8; 1: here) — the same
    results as one process — so a library caller that runs torch or other native threads passes ``jobs=1``."""
    cfg = cfg or PlanConfig()
    shape = get_model(model)
    specs = [get_gpu(g) for g in gpus]
    if not specs:
        raise PlanError("no GPUs to rank")
    for t in tps:
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise PlanError(f"TP sizes must be positive integers, got {t!r}")
    layouts = [(g, t) for g in specs for t in sorted(set(tps))]
    results = fork_map(lambda gt: evaluate_layout(gt[0], shape, gt[1], workload, cfg, curve=curve), layouts,
                       default_jobs(len(layouts), per=2) if jobs is None else jobs)
    fitting = [r for r in results if r.fits]
    excluded = [r for r in results if not r.fits]
    by = _rank_by(cfg, fitting)
    feasible = sorted((r for r in fitting if r.feasible), key=lambda r: (-_score(r, by), r.tp, r.gpu))
    for i, r in enumerate(feasible, start=1):
        r.rank = i
        r.score = _score(r, by)
    infeasible = sorted((r for r in fitting if not r.feasible), key=lambda r: r.step_ms)
    return Ranking(shape, workload, cfg, by, feasible + infeasible, excluded)
