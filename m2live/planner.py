"""Capacity planning: rank GPU SKUs and tensor-parallel layouts for a model and a workload, from datasheets.

For every GPU x TP layout:

1. **Memory fit.** Per GPU: ``usable = memory x (1 - reserve_fraction) - reserve_bytes`` (vLLM's default
   ``gpu_memory_utilization=0.9`` leaves 10 %; 1.5 GiB covers the CUDA context, cuBLAS/NCCL workspaces and
   captured CUDA graphs). From it come the weight shard, the activation peak of one forward pass at the token
   budget (``activation_bytes``) and the KV cache; the KV cache must hold at least one request of the
   workload's p99 length. A layout that fails says which term did not fit.
2. **Steady state under continuous batching with chunked prefill.** With B requests decoding, each step
   generates B tokens and must also prefill ``B x E[p]/E[d]`` prompt tokens to keep the batch full. Decode
   contexts average ``E[d (p + (d-1)/2)] / E[d]`` (token-weighted); the prefill share is laid out as whole
   prompts plus one chunk in the middle of a prompt, sized so its causal-attention work is the workload's mean
   (prompt length ``E[p^2]/E[p]``). The step time of that steady step comes from the Predictor (forecast
   clock by default).
3. **Search.** B is limited by the KV cache, ``max_num_seqs`` and the token budget ``max_batched_tokens``;
   with an SLO the largest B whose predicted step time meets it is found by bisection (step time grows with B).
   Throughput = B / t_step generated tokens per second (and (B + prefill) / t_step tokens processed); the
   chunk budget is the largest prefill chunk that can ride along the operating point's decodes within the SLO.
4. **What bounds it**: each op's predicted time summed by the branch that bound it (compute / memory /
   communication; fixed kernel latency, launches, host work and sampling count as host).
5. **Ranking** by generated tokens/s per GPU, or per dollar when prices are given for every layout.

``decision_quality`` scores the ranking machinery itself on measured per-operator tables (opbench, Vidur):
for GEMM-sum workloads made of Llama-like projection shapes it compares the predicted and measured order of
the GPUs (top-1 hit within 3 %, Spearman rho, regret of the predicted pick).
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .efficiency import ArchConstants
from .hardware import GpuSpec, get_gpu
from .predictor import Prediction, Predictor
from .shapes import ModelShape, ModelShapeError, get_model
from .step import Step
from .validate import RowPredictor, TableError, find_tables, measured, positive_float, read_table
from .workload import Workload, WorkloadStats

GIB = 1024**3
BOUND_CLASSES = ("compute", "memory", "communication", "host")
SLO_SWEEP_MS = (5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0)
TRACE_REPLAY_MAX = 128  # recorded steps replayed per layout (evenly spaced)


class PlanError(ValueError):
    """Planner input that cannot describe a real deployment."""


@dataclass(frozen=True)
class PlanConfig:
    slo_s: float | None = None  # per-step latency SLO (= inter-token latency); None: no latency limit
    max_num_seqs: int = 1024  # vLLM V1 default max_num_seqs (OpenAI server, GPUs with >= 70 GiB)
    max_batched_tokens: int = 8192  # vLLM max_num_batched_tokens (token budget per step)
    reserve_fraction: float = 0.10  # vLLM gpu_memory_utilization = 0.9
    reserve_bytes: float = 1.5 * GIB  # CUDA context, cuBLAS/NCCL workspaces, CUDA graphs
    clock: str = "forecast"  # "forecast" (power-cap model) | "boost"
    prices: dict[str, float] = field(default_factory=dict)  # canonical GPU name -> $ per GPU-hour
    rank_by: str = "auto"  # auto | gpu | dollar | layout
    constants: dict[str, ArchConstants] = field(default_factory=dict)  # GPU name -> its calibration's constants
    precision: str = "bf16"  # the four projections' weights: bf16, or fp8 (vLLM's W8A8; attention/KV stay bf16)

    def __post_init__(self) -> None:
        if self.slo_s is not None and not (self.slo_s > 0 and math.isfinite(self.slo_s)):
            raise PlanError(f"SLO must be a positive number of seconds, got {self.slo_s!r}")
        for name in ("max_num_seqs", "max_batched_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"{name} must be a positive integer, got {v!r}")
        if not 0 <= self.reserve_fraction < 1:
            raise PlanError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")
        if self.clock not in ("forecast", "boost"):
            raise PlanError(f"clock must be 'forecast' or 'boost', got {self.clock!r}")
        if self.precision not in ("bf16", "fp8"):
            raise PlanError(f"precision must be bf16 or fp8, got {self.precision!r}")
        if self.rank_by not in ("auto", "gpu", "dollar", "layout"):
            raise PlanError(f"rank_by must be auto, gpu, dollar or layout, got {self.rank_by!r}")
        for g, p in self.prices.items():
            if not (p > 0 and math.isfinite(p)):
                raise PlanError(f"price for {g} must be a positive $/GPU-hour, got {p!r}")


# ---- memory -----------------------------------------------------------------------------------------------
def activation_bytes(shard: ModelShape, max_tokens: int, max_seqs: int, precision: str = "bf16") -> float:
    """Peak activation memory of one forward pass at the token budget, on one GPU (conservative: every
    intermediate of one layer live at once) plus fp32 logits and probabilities for the sampled sequences.
    Activations stay bf16 under fp8; the e4m3 copies of the four projections' inputs add 1 byte per element."""
    d = shard.dtype_bytes
    tp = shard.tp
    per_token = (2 * shard.hidden + (shard.heads_per_gpu + 2 * shard.kv_heads_per_gpu) * shard.head_dim
                 + shard.heads_per_gpu * shard.head_dim + 3 * shard.intermediate // tp)
    quant = 2 * shard.hidden + shard.heads_per_gpu * shard.head_dim + shard.intermediate // tp
    logits = 2 * 4 * max_seqs * -(-shard.vocab // tp)
    return float(d * max_tokens * per_token + (max_tokens * quant if precision == "fp8" else 0) + logits)


@dataclass(frozen=True)
class MemoryFit:
    total_bytes: float
    reserve_bytes: float
    weight_bytes: float
    activation_bytes: float
    kv_bytes: float  # left for the KV cache (may be negative)
    kv_bytes_per_token: int
    kv_tokens: int
    request_tokens_p99: int
    fits: bool
    reason: str

    def to_dict(self) -> dict:
        g = 1e9
        return {"total_gb": self.total_bytes / g, "reserve_gb": self.reserve_bytes / g,
                "weights_gb": self.weight_bytes / g, "activations_gb": self.activation_bytes / g,
                "kv_cache_gb": max(0.0, self.kv_bytes) / g, "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_tokens": self.kv_tokens, "request_tokens_p99": self.request_tokens_p99,
                "fits": self.fits, "reason": self.reason}


def weight_bytes(shard: ModelShape, precision: str = "bf16") -> float:
    """Weights on one GPU; under fp8 (W8A8) the four projections hold 1 byte per weight, the embeddings, the
    LM head and the norms stay bf16."""
    return float(shard.weight_bytes(precision))


def memory_fit(gpu: GpuSpec, shard: ModelShape, stats: WorkloadStats, cfg: PlanConfig,
               precision: str = "bf16") -> MemoryFit:
    total = gpu.mem_bytes
    reserve = total * cfg.reserve_fraction + cfg.reserve_bytes
    weights = weight_bytes(shard, precision)
    act = activation_bytes(shard, cfg.max_batched_tokens, cfg.max_num_seqs, precision)
    kv = total - reserve - weights - act
    per_tok = shard.kv_bytes_per_token()
    kv_tokens = max(0, int(kv // per_tok))
    need = int(math.ceil(stats.total_p["p99"]))
    g = 1e9
    reason = ""
    if weights > total - reserve:
        reason = (f"weights {weights / g:.1f} GB/GPU exceed the {(total - reserve) / g:.1f} GB usable of "
                  f"{total / g:.0f} GB (reserve {reserve / g:.1f} GB)")
    elif kv <= 0:
        reason = (f"weights {weights / g:.1f} GB + activations {act / g:.1f} GB leave no KV cache in "
                  f"{(total - reserve) / g:.1f} GB usable")
    elif kv_tokens < need:
        reason = (f"KV cache {kv / g:.1f} GB holds {kv_tokens} tokens, less than one p99 request "
                  f"({need} tokens = {need * per_tok / g:.1f} GB)")
    return MemoryFit(total, reserve, weights, act, kv, per_tok, kv_tokens, need, not reason, reason)


# ---- bounds -----------------------------------------------------------------------------------------------
def bound_shares(pred: Prediction) -> dict[str, float]:
    """Share of the step's time in ops bound by compute / memory / communication / host."""
    acc = dict.fromkeys(BOUND_CLASSES, 0.0)
    for op, t in pred.ops.items():
        b = pred.bound.get(op, "host")
        acc[b if b in acc else "host"] += t  # "latency" (fixed kernel latency) counts as host-like overhead
    tot = sum(acc.values()) or 1.0
    return {k: v / tot for k, v in acc.items()}


def dominant_bound(shares: dict[str, float]) -> str:
    return max(BOUND_CLASSES, key=lambda k: shares.get(k, 0.0))


def _max_true(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """Largest x in [lo, hi] with ok(x), for ok monotone (true then false); lo - 1 when none."""
    if hi < lo or not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---- one layout -------------------------------------------------------------------------------------------
class LayoutModel:
    """Step times of one GPU x TP layout for one workload (memoised: the searches revisit batch sizes)."""

    def __init__(self, gpu: GpuSpec, model: ModelShape, tp: int, stats: WorkloadStats, cfg: PlanConfig):
        self.gpu, self.tp, self.stats, self.cfg = gpu, tp, stats, cfg
        self.pred = Predictor(gpu, model, tp=tp, dtype=cfg.precision, constants=cfg.constants.get(gpu.name))
        self.shard = self.pred.model
        self.mem = memory_fit(gpu, self.shard, stats, cfg, cfg.precision)
        self.ratio = stats.prefill_per_decode
        self.p_attn = max(1, round(stats.prompt_attn))
        self.ctx = max(1, round(stats.decode_ctx))
        self._t: dict[int, float] = {}

    # steady state
    def prefill_layout(self, tokens: int) -> list[tuple[int, int]]:
        """``tokens`` prefill tokens as whole prompts plus one chunk in the middle of a prompt."""
        if tokens <= 0:
            return []
        full, rem = divmod(tokens, self.p_attn)
        out = [(self.p_attn, 0)] * full
        if rem:
            out.append((rem, (self.p_attn - rem) // 2))
        return out

    def prefill_tokens(self, b: int) -> int:
        return int(round(b * self.ratio))

    def steady_step(self, b: int) -> Step:
        return Step.build(self.prefill_layout(self.prefill_tokens(b)), [self.ctx] * b)

    def kv_needed(self, b: int) -> int:
        pre = self.prefill_layout(self.prefill_tokens(b))
        return b * (self.ctx + 1) + sum(n + c for n, c in pre)

    def resource_cap(self) -> tuple[int, str]:
        """Largest decode batch the KV cache, max_num_seqs and the token budget allow, and which binds."""
        cfg = self.cfg
        limits = {
            "kv_memory": lambda b: self.kv_needed(b) <= self.mem.kv_tokens,
            "max_num_seqs": lambda b: b + len(self.prefill_layout(self.prefill_tokens(b))) <= cfg.max_num_seqs,
            "token_budget": lambda b: b + self.prefill_tokens(b) <= cfg.max_batched_tokens,
        }
        caps = {k: _max_true(1, cfg.max_num_seqs, f) for k, f in limits.items()}
        which = min(caps, key=lambda k: caps[k])
        return caps[which], which

    def time(self, step: Step) -> float:
        if self.cfg.clock == "boost":
            return self.pred.predict_total(step, 1.0)
        return self.pred.predict_total(step, self.pred.forecast_f_clk(step))

    def predict(self, step: Step) -> Prediction:
        return self.pred.predict(step, f_clk=1.0 if self.cfg.clock == "boost" else None)

    def t_steady(self, b: int) -> float:
        t = self._t.get(b)
        if t is None:
            t = self._t[b] = self.time(self.steady_step(b))
        return t

    def max_batch(self, slo_s: float | None, cap: int) -> int:
        if slo_s is None:
            return cap
        return _max_true(1, cap, lambda b: self.t_steady(b) <= slo_s)

    def best_batch(self, b_max: int) -> int:
        """The batch in [1, b_max] with the most generated tokens/s. Usually b_max itself; on a tight power cap
        the forecast clock can droop faster than the batch grows, and a smaller batch wins (seed: L40S)."""
        if b_max < 2:
            return b_max
        cands = {b_max} | {max(1, round(b_max * 2 ** (-j / 4))) for j in range(1, 13)}
        return max(sorted(cands, reverse=True), key=lambda b: b / self.t_steady(b))

    def chunk_budget(self, b: int, slo_s: float) -> int:
        """Largest prefill chunk (tokens) that fits with ``b`` decodes in one step within the SLO."""
        hi = self.cfg.max_batched_tokens - b
        mid_ctx = self.p_attn

        def ok(c: int) -> bool:
            chunk = min(c, mid_ctx)
            pre = [(c, max(0, (mid_ctx - chunk) // 2))]
            return self.time(Step.build(pre, [self.ctx] * b)) <= slo_s

        return max(0, _max_true(1, hi, ok))


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


SERVING_PROMPTS_PER_SLOT = 3  # simulated requests per request in flight: the first wave, then steady state
SERVING_SEARCH_STEPS = 4  # concurrency reductions tried when the simulated TPOT misses the SLO


def serving_point(lm: LayoutModel, wl: Workload, concurrency: int, slo_s: float | None) -> dict:
    """The layout served the way vLLM serves it: ``m2live.simulate``'s closed loop at ``concurrency`` requests
    in flight (the steady-state decode batch as the first guess), requests drawn from the workload (seed 0),
    every step timed by this layout's predictor. Under an SLO the concurrency is lowered until the simulated
    mean TPOT (the mean inter-token latency) meets it. Throughput is the simulator's steady state (after the
    first wave, before the drain)."""
    import numpy as np

    from .simulate import ServingConfig, simulate

    c = max(1, concurrency)
    rng = np.random.default_rng(0)
    n = max(8, SERVING_PROMPTS_PER_SLOT * c)
    prompts, outputs = wl.prompt.sample(rng, n), wl.output.sample(rng, n)
    cfg = lm.cfg
    tried = []
    for _ in range(SERVING_SEARCH_STEPS + 1):
        scfg = ServingConfig(concurrency=c, num_prompts=max(8, SERVING_PROMPTS_PER_SLOT * c),
                             max_num_batched_tokens=cfg.max_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                             kv_tokens=max(1, lm.mem.kv_tokens), clock=cfg.clock)
        r = simulate(lm.pred.model, lm.gpu, lm.tp, prompts, outputs, scfg, precision=cfg.precision,
                     predictor=lm.pred)
        tried.append(c)
        meets = slo_s is None or r.tpot_ms <= slo_s * 1e3
        if meets or c == 1:
            break
        c = max(1, min(c - 1, int(c * 0.9 * slo_s * 1e3 / r.tpot_ms)))
    return {"concurrency": c, "ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms,
            "output_tokens_per_s": r.steady_output_tokens_per_s,
            "benchmark_output_tokens_per_s": r.output_tokens_per_s, "num_prompts": r.requests,
            "meets_slo": bool(meets), "concurrency_tried": tried, "preemptions": r.steps["preemptions"],
            "mean_tokens_per_step": r.steps["mean_tokens_per_step"]}


def trace_replay(lm: LayoutModel, wl: Workload, slo_s: float | None) -> dict:
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


def evaluate_layout(gpu: GpuSpec, model: ModelShape, tp: int, wl: Workload, cfg: PlanConfig,
                    curve: bool = False) -> LayoutResult:
    """Memory fit, operating point under the SLO, throughput, bounds and representative steps of a layout."""
    gpu = get_gpu(gpu)
    stats = wl.stats()
    if cfg.precision == "fp8" and gpu.fp8_tflops is None:
        why = f"{gpu.name} has no fp8 tensor cores (fp8 weights need Ada, Hopper or Blackwell)"
        return LayoutResult(gpu.name, tp, MemoryFit(gpu.mem_bytes, 0, 0, 0, 0, 0, 0, 0, False, why),
                            fits=False, reason=why)
    try:
        lm = LayoutModel(gpu, model, tp, stats, cfg)
    except ModelShapeError as e:
        empty = MemoryFit(gpu.mem_bytes, 0, 0, 0, 0, 0, 0, 0, False, str(e))
        return LayoutResult(gpu.name, tp, empty, fits=False, reason=str(e))
    if tp > 1 and gpu.interconnect == "none":
        return LayoutResult(gpu.name, tp, lm.mem, fits=False, reason=f"{gpu.name} has no GPU interconnect for TP")
    res = LayoutResult(gpu.name, tp, lm.mem, fits=lm.mem.fits, reason=lm.mem.reason,
                       price_per_gpu_hour=cfg.prices.get(gpu.name))
    if not lm.mem.fits:
        return res
    cap, which = lm.resource_cap()
    if cap < 1:
        res.fits = False
        res.reason = f"{which}: not even one request fits (token budget {cfg.max_batched_tokens})"
        return res
    slo = cfg.slo_s
    b_max = lm.max_batch(slo, cap)
    b = lm.best_batch(b_max)
    res.steps = representative_steps(lm)
    if b < 1:
        t1 = lm.t_steady(1)
        res.reason = (f"one decode with its prefill share takes {t1 * 1e3:.2f} ms, over the "
                      f"{slo * 1e3:g} ms SLO" if slo is not None else "no feasible batch")
        res.step_ms = t1 * 1e3
        p = lm.predict(lm.steady_step(1))
        res.bound_shares = bound_shares(p)
        res.bound = dominant_bound(res.bound_shares)
        res.f_clk = p.f_clk
    else:
        res.feasible = True
        res.limited_by = "throughput_peak" if b < b_max else ("slo" if (slo is not None and b < cap) else which)
        step = lm.steady_step(b)
        p = lm.predict(step)
        t = p.total_s
        res.decode_batch = b
        res.prefill_tokens_per_step = step.num_prefill_tokens
        res.step_ms = t * 1e3
        res.f_clk = p.f_clk
        res.output_tokens_per_s = b / t
        res.tokens_per_s = step.num_tokens / t
        res.bound_shares = bound_shares(p)
        res.bound = dominant_bound(res.bound_shares)
        res.serving = serving_point(lm, wl, b, slo)
        res.output_tokens_per_s = res.serving["output_tokens_per_s"]
        res.tokens_per_s = res.output_tokens_per_s * (1.0 + stats.prefill_per_decode)
        if slo is not None:
            res.chunk_budget = lm.chunk_budget(b, slo)
        if wl.rate:
            demand = wl.rate * stats.mean_output
            replicas = max(1, math.ceil(demand / res.output_tokens_per_s))
            res.fleet = {"demand_output_tokens_per_s": demand, "replicas": replicas, "gpus": replicas * tp,
                         "cost_per_hour": (replicas * tp * res.price_per_gpu_hour
                                           if res.price_per_gpu_hour else None)}
    if curve:
        for slo_ms in SLO_SWEEP_MS:
            bb = lm.best_batch(lm.max_batch(slo_ms / 1e3, cap))
            tt = lm.t_steady(bb) if bb >= 1 else float("nan")
            res.curve.append({"slo_ms": slo_ms, "decode_batch": max(0, bb),
                              "output_tokens_per_s_per_gpu": (bb / tt / tp) if bb >= 1 else 0.0})
    if wl.trace_steps:
        res.replay = trace_replay(lm, wl, slo)
    return res


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
                "clock": c.clock, "precision": c.precision,
                "max_num_seqs": c.max_num_seqs, "max_batched_tokens": c.max_batched_tokens,
                "memory_reserve_fraction": c.reserve_fraction, "memory_reserve_gib": c.reserve_bytes / GIB,
                "steady_state": "continuous batching with chunked prefill: B decodes + B*E[p]/E[d] prefill "
                                "tokens per step",
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


def rank(model: ModelShape | str, workload: Workload, gpus: Sequence[GpuSpec | str],
         tps: Sequence[int] = (1, 2, 4, 8), cfg: PlanConfig | None = None, curve: bool = False) -> Ranking:
    cfg = cfg or PlanConfig()
    shape = get_model(model)
    specs = [get_gpu(g) for g in gpus]
    if not specs:
        raise PlanError("no GPUs to rank")
    for t in tps:
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise PlanError(f"TP sizes must be positive integers, got {t!r}")
    results = [evaluate_layout(g, shape, t, workload, cfg, curve=curve) for g in specs for t in sorted(set(tps))]
    fitting = [r for r in results if r.fits]
    excluded = [r for r in results if not r.fits]
    by = cfg.rank_by
    if by == "auto":
        by = "dollar" if fitting and all(r.price_per_gpu_hour for r in fitting) else "gpu"
    if by == "dollar" and not all(r.price_per_gpu_hour for r in fitting):
        missing = sorted({r.gpu for r in fitting if not r.price_per_gpu_hour})
        raise PlanError(f"ranking per dollar needs a price for every GPU; missing: {', '.join(missing)}")
    feasible = sorted((r for r in fitting if r.feasible), key=lambda r: (-_score(r, by), r.tp, r.gpu))
    for i, r in enumerate(feasible, start=1):
        r.rank = i
        r.score = _score(r, by)
    infeasible = sorted((r for r in fitting if not r.feasible), key=lambda r: r.step_ms)
    return Ranking(shape, workload, cfg, by, feasible + infeasible, excluded)


# ---- parsing helpers shared by the CLI --------------------------------------------------------------------
def parse_tp_list(text: str) -> list[int]:
    items = [s.strip() for s in str(text).split(",")]
    out = []
    for s in items:
        if not re.fullmatch(r"[0-9]+", s or "x") or int(s) < 1 or int(s) > 64:
            raise PlanError(f"--tp {text!r}: expected comma-separated integers in 1..64, e.g. 1,2,4,8")
        out.append(int(s))
    return sorted(set(out))


def parse_prices(text: str | None) -> dict[str, float]:
    """``GPU=$/h,...`` (per GPU-hour; '$' optional) -> {canonical NVML name: price}."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for item in str(text).split(","):
        item = item.strip()
        if "=" not in item:
            raise PlanError(f"--price {item!r}: expected GPU=DOLLARS_PER_HOUR, e.g. h100-sxm=2.5")
        name, val = (s.strip() for s in item.rsplit("=", 1))
        val = val.removeprefix("$").removesuffix("/h").strip()
        out[get_gpu(name).name] = positive_float(val, f"--price {item!r}: dollars per GPU-hour", PlanError)
    return out


# ---- decision quality on measured tables ------------------------------------------------------------------
VALIDATION_MS = (1, 16, 64, 256, 1024, 4096, 8192)
HIT_TOLERANCE = 0.03


@dataclass
class GemmTable:
    """Measured bf16 GEMM latencies of one GPU: (m, n, k) -> ms."""

    gpu: str
    source: str
    cells: dict[tuple[int, int, int], float]


def load_gemm_tables(dirs: Iterable[str]) -> list[GemmTable]:
    """Every GEMM table (columns m, n, k, latency_ms, device) under the given opbench folders, one per GPU."""
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
            if "device" not in table.header:
                raise TableError(f"{path}: a GEMM table needs a 'device' column to tell the GPU")
            meas = measured(table)
            if meas is None:
                raise TableError(f"{path}: no latency_ms column")
            found = True
            names: dict[str, str] = {}
            for i, (row, ms) in enumerate(zip(table.rows, meas, strict=True), start=2):
                raw = (row.get("device") or "").strip()
                name = names.get(raw)
                if name is None:
                    name = names[raw] = get_gpu(raw or "?").name
                try:
                    key = (int(row["m"]), int(row["n"]), int(row["k"]))
                except (TypeError, ValueError):
                    raise TableError(f"{path}:{i}: m, n, k must be integers") from None
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
    shapes: tuple[tuple[int, int], ...]
    exact: bool  # every shape is the model's real shape (not a nearest-grid analogue)


def _nearest(target: tuple[int, int], grid: Iterable[tuple[int, int]]) -> tuple[int, int]:
    n, k = target
    return min(grid, key=lambda g: (abs(math.log(g[0] / n)) + abs(math.log(g[1] / k)), g))


def projection_workloads(tables: Sequence[GemmTable], ms: Sequence[int] = VALIDATION_MS,
                         models: Iterable[str] | None = None, tps: Sequence[int] = (1, 2, 4, 8)
                         ) -> list[GemmWorkload]:
    """Llama-like projection workloads on the (N, K) grid every table shares: each preset model's four
    projections at each TP, mapped to the nearest common (N, K) (log distance) where the exact shape is
    absent; de-duplicated; only M values measured for all of them in every table."""
    from .shapes import PRESETS

    if not tables:
        return []
    grid_sets = [{(n, k) for (_, n, k) in t.cells} for t in tables]
    common = set.intersection(*grid_sets)
    common = {(n, k) for n, k in common if n >= 512 and k >= 512}
    if not common:
        return []
    out: list[GemmWorkload] = []
    seen: set[tuple] = set()
    for name in models or PRESETS:
        shape = get_model(name)
        for tp in tps:
            try:
                sh = shape.sharded(tp)
            except ModelShapeError:
                continue
            real = tuple(sh.gemms().values())
            mapped = tuple(nk if nk in common else _nearest(nk, common) for nk in real)
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
    shapes: tuple[tuple[int, int], ...]
    measured_ms: dict[str, float]  # item -> summed measured time (an item is a GPU, or a GPU x TP layout)
    exact: bool = True
    # item -> (gpu, its shapes, GPUs it occupies); None: items are GPUs running ``shapes``
    items: dict[str, tuple[str, tuple[tuple[int, int], ...], int]] | None = None

    def item(self, label: str) -> tuple[str, tuple[tuple[int, int], ...], int]:
        if self.items is not None and label in self.items:
            return self.items[label]
        return label, self.shapes, 1


def _decide(fn: Callable[[str, int, int, int], float], gpus: list[str], meas: list[float],
            pt: DecisionPoint) -> dict:
    """One point: the predicted pick, its regret, rank agreement and speed-ratio error."""
    best = min(meas)
    pred = []
    for label in gpus:
        gpu, shapes, ngpu = pt.item(label)
        pred.append(ngpu * sum(fn(gpu, pt.m, n, k) for n, k in shapes))
    pick = min(range(len(gpus)), key=lambda i: pred[i])
    regret = meas[pick] / best - 1.0
    pairs = agree = 0
    for i in range(len(gpus)):
        for j in range(i + 1, len(gpus)):
            if abs(meas[i] - meas[j]) <= HIT_TOLERANCE * min(meas[i], meas[j]):
                continue  # a measured tie: either order is right
            pairs += 1
            agree += (pred[i] < pred[j]) == (meas[i] < meas[j])
    # relative-speed error: each GPU's time relative to the measured best, predicted vs measured
    ib = min(range(len(gpus)), key=lambda i: meas[i])
    rel = [abs((pred[i] / pred[ib]) / (meas[i] / meas[ib]) - 1.0) for i in range(len(gpus)) if i != ib]
    return {"predicted_ms": dict(zip(gpus, pred, strict=True)), "pick": gpus[pick],
            "hit": regret <= HIT_TOLERANCE, "regret": regret, "spearman": spearman(pred, meas),
            "pairs": pairs, "pairs_agree": agree, "relative_speed_error": sum(rel) / len(rel)}


def score_points(points: Sequence[DecisionPoint], predict: Callable[[str, int, int, int], float],
                 baseline: Callable[[str, int, int, int], float] | None = None) -> dict:
    """Predicted vs measured GPU order for each point; summary metrics overall and per M."""
    rows = []
    for pt in points:
        gpus = sorted(pt.measured_ms)
        if len(gpus) < 2:
            continue
        meas = [pt.measured_ms[g] for g in gpus]
        row = {"name": pt.name, "m": pt.m, "shapes": [list(s) for s in pt.shapes], "exact": pt.exact,
               "measured_ms": dict(zip(gpus, meas, strict=True)),
               "measured_order": [gpus[i] for i in sorted(range(len(gpus)), key=lambda i: meas[i])],
               "measured_best": gpus[min(range(len(gpus)), key=lambda i: meas[i])]}
        row.update(_decide(predict, gpus, meas, pt))
        row["predicted_order"] = sorted(gpus, key=lambda g: row["predicted_ms"][g])
        if baseline is not None:
            b = _decide(baseline, gpus, meas, pt)
            row["baseline"] = {k: b[k] for k in ("pick", "hit", "regret", "spearman", "pairs", "pairs_agree",
                                                 "relative_speed_error")}
        rows.append(row)

    def summarise(rs: list[dict], sub: str | None = None) -> dict:
        get = (lambda r: r[sub]) if sub else (lambda r: r)
        if not rs:
            return {"points": 0}
        rhos = [get(r)["spearman"] for r in rs if not math.isnan(get(r)["spearman"])]
        pairs = sum(get(r)["pairs"] for r in rs)
        return {
            "points": len(rs),
            "top1_hit_rate": sum(get(r)["hit"] for r in rs) / len(rs),
            "spearman_mean": sum(rhos) / len(rhos) if rhos else None,
            "regret_mean": sum(get(r)["regret"] for r in rs) / len(rs),
            "regret_max": max(get(r)["regret"] for r in rs),
            "pairwise_accuracy": (sum(get(r)["pairs_agree"] for r in rs) / pairs) if pairs else None,
            "relative_speed_error_mean": sum(get(r)["relative_speed_error"] for r in rs) / len(rs),
        }

    by_m: dict[int, list[dict]] = {}
    for r in rows:
        by_m.setdefault(r["m"], []).append(r)
    winners: dict[str, int] = {}
    for r in rows:
        winners[r["measured_best"]] = winners.get(r["measured_best"], 0) + 1
    out = {"summary": summarise(rows), "by_m": {str(m): summarise(v) for m, v in sorted(by_m.items())},
           "measured_winners": winners, "points": rows}
    if baseline is not None:
        out["baseline_summary"] = summarise(rows, "baseline")
    return out


def gemm_predictor(clock: str | float = "power", l2_warm: bool = True) -> Callable[[str, int, int, int], float]:
    """The same per-row GEMM prediction ``m2live validate`` uses (ms)."""
    rp = RowPredictor(clock=clock, l2_warm=l2_warm)

    def fn(gpu: str, m: int, n: int, k: int) -> float:
        return rp.predict_row("gemm", {"device": gpu, "m": str(m), "n": str(n), "k": str(k)}, 0, "planner")

    return fn


def roofline_predictor(eta: float = 0.75) -> Callable[[str, int, int, int], float]:
    """Baseline: datasheet roofline with one constant efficiency (what a spec-sheet comparison does): the
    vendor's dense bf16 TFLOP/s as quoted, and the datasheet bandwidth."""

    def fn(gpu: str, m: int, n: int, k: int) -> float:
        g = get_gpu(gpu)
        return 1e3 * max(2.0 * m * n * k / (eta * g.bf16_tflops * 1e12), 2.0 * (m * k + n * k + m * n) / (eta * g.mem_bw))

    return fn


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
    out["workloads"] = sorted({(w.name, tuple(map(tuple, w.shapes))) for w in workloads})
    out["workloads"] = [{"name": n, "shapes": [list(s) for s in sh]} for n, sh in out["workloads"]]
    out["ms"] = sorted({w.m for w in workloads})
    out["layouts"] = score_points(opbench_layout_points(tables, ms), gemm_predictor(), roofline_predictor())
    out["layouts"]["what"] = ("rank every GPU x TP layout of one model by GPU-time of its projections "
                              "(TP x per-GPU shard time: the cost a per-GPU throughput ranking sees; no "
                              "communication, the tables hold none)")
    out["predictor"] = "OpModel.gemm via validate.RowPredictor (boost clock, L2-warm as in the opbench loops)"
    out["baseline"] = "roofline max(FLOPs/peak, bytes/BW) with constant eta = 0.75"
    if len(tables) < 2:
        out["note"] = "fewer than two GPUs: nothing to rank"
    return out


def opbench_layout_points(tables: Sequence[GemmTable], ms: Sequence[int] = VALIDATION_MS) -> list[DecisionPoint]:
    """Per preset model and M: every GPU x TP layout as one item, valued at its GPU-time (TP x the time of its
    TP-sharded projections, mapped to the nearest common (N, K)), so layouts of different GPUs and degrees
    compete the way the planner's per-GPU throughput ranking makes them."""
    from .shapes import PRESETS

    if len(tables) < 1:
        return []
    common = set.intersection(*[{(n, k) for (_, n, k) in t.cells} for t in tables])
    common = {(n, k) for n, k in common if n >= 512 and k >= 512}
    if not common:
        return []
    points: list[DecisionPoint] = []
    seen: set[tuple] = set()
    for name in PRESETS:
        shape = get_model(name)
        sig = (shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim)
        if sig in seen:
            continue
        seen.add(sig)
        by_tp: dict[int, tuple[tuple[int, int], ...]] = {}
        for tp in (1, 2, 4, 8):
            try:
                real = tuple(shape.sharded(tp).gemms().values())
            except ModelShapeError:
                continue
            by_tp[tp] = tuple(nk if nk in common else _nearest(nk, common) for nk in real)
        for m in ms:
            items: dict[str, tuple[str, tuple[tuple[int, int], ...], int]] = {}
            meas: dict[str, float] = {}
            for t in tables:
                for tp, shapes in by_tp.items():
                    if all((m, n, k) in t.cells for n, k in shapes):
                        label = f"{t.gpu} tp{tp}"
                        items[label] = (t.gpu, shapes, tp)
                        meas[label] = tp * sum(t.cells[(m, n, k)] for n, k in shapes)
            if len(items) >= 2:
                points.append(DecisionPoint(f"{shape.name.split('/')[-1]} layouts", m, (), meas, False, items))
    return points


# ---- Vidur's per-operator profiles ------------------------------------------------------------------------
VIDUR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")


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


def load_vidur_points(root: str | Path, ms: Sequence[int] | None = VALIDATION_MS) -> tuple[list[DecisionPoint], dict]:
    """GEMM-sum decision points from Vidur ``mlp.csv`` profiles: per (model, TP, num_tokens) the summed median
    time of qkv, o, gate_up and down, for every GPU folder that profiled that model. ``ms=None``: every
    num_tokens value."""
    root = Path(root)
    folders = vidur_folders(root)
    meas: dict[tuple[str, int, int], dict[str, list[float]]] = {}
    shapes: dict[tuple[str, int], tuple[tuple[int, int], ...]] = {}
    skipped: dict[str, str] = {}
    used: dict[str, list[str]] = {}
    for folder, nvml in sorted(folders.items()):
        try:
            gpu = get_gpu(nvml).name
        except KeyError as e:
            skipped[nvml] = str(e)
            continue
        for csv_path in sorted((root / folder).glob("*/mlp.csv")):
            model = csv_path.parent.name
            used.setdefault(gpu, []).append(model)
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
                    shapes[(model, tp)] = (((h + 2 * kvh) * d // tp, e), (e, h * d // tp),
                                           ((2 if gated else 1) * ex // tp, e), (e, ex // tp))
                    meas.setdefault((model, tp, m), {}).setdefault(gpu, []).append(t)
    points = [DecisionPoint(f"{model} tp{tp}", m, shapes[(model, tp)],
                            {g: sum(v) / len(v) for g, v in per.items()})
              for (model, tp, m), per in sorted(meas.items())]
    layouts: dict[tuple[str, int], DecisionPoint] = {}
    for (model, tp, m), per in sorted(meas.items()):
        lp = layouts.setdefault((model, m), DecisionPoint(f"{model} layouts", m, (), {}, True, {}))
        for g, v in per.items():
            lp.measured_ms[f"{g} tp{tp}"] = tp * sum(v) / len(v)
            assert lp.items is not None
            lp.items[f"{g} tp{tp}"] = (g, shapes[(model, tp)], tp)
    return points, {"gpus_used": used, "skipped": skipped,
                    "layout_points": [p for p in layouts.values() if len(p.measured_ms) >= 2]}


def validate_vidur(root: str | Path, ms: Sequence[int] | None = VALIDATION_MS) -> dict:
    points, info = load_vidur_points(root, ms)
    layout_points = info.pop("layout_points")
    # Vidur times each operator over repeated runs (sustained load, not opbench's short bursts): the clock is the
    # power-cap forecast, as in bench/accuracy.py's Vidur validation
    pred = gemm_predictor(clock="forecast")
    out = score_points(points, pred, roofline_predictor())
    out.update(info)
    out["predictor"] = "OpModel.gemm via validate.RowPredictor (forecast clock: sustained repeats)"
    out["layouts"] = score_points(layout_points, pred, roofline_predictor())
    out["layouts"]["what"] = ("rank every GPU x TP layout by GPU-time of its projections (TP x the time "
                              "Vidur measured for a 1/TP weight shard; no communication)")
    out["ms"] = "all" if ms is None else sorted({p.m for p in points})
    return out
