"""One GPU x TP layout under continuous batching with chunked prefill, and what bounds its steps.

With B requests decoding, each step generates B tokens and must also prefill ``B x E[p]/E[d]`` prompt tokens to
keep the batch full. Decode contexts average ``E[d (p + (d-1)/2)] / E[d]`` (token-weighted); the prefill share is
laid out as whole prompts plus one chunk in the middle of a prompt, sized so its causal-attention work is the
workload's mean (prompt length ``E[p^2]/E[p]``). The step time of that steady step comes from the Predictor
(forecast clock by default). B is limited by the KV cache, ``max_num_seqs`` and the token budget; with an SLO the
largest B whose predicted step time meets it is found by bisection (step time grows with B — but for fp8
on Hopper only as a sawtooth: a GEMM whose last row of activation tiles is mostly past M runs slower than one
that fills it, as measured (efficiency tma_oob); there the search goes on from each answer to the step that
fills the next tile row, ``max_true_sawtooth``, and the B found meets the SLO, usually the largest).
"""

from __future__ import annotations

from collections.abc import Callable

from ..hardware import GpuSpec
from ..predictor import Prediction, Predictor
from ..shapes import ModelShape
from ..step import Step
from ..vllm_release import allreduce_fusion_default
from ..workload import WorkloadStats
from .memory import PlanConfig, memory_fit

BOUND_CLASSES = ("compute", "memory", "communication", "host")


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


def max_true(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
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


def max_true_sawtooth(lo: int, hi: int, ok: Callable[[int], bool], tokens: Callable[[int], int],
                      row_end: Callable[[int], int]) -> int:
    """``max_true`` where ok is monotone only between the sizes that fill a tile row: the step time is a sawtooth
    in the step's ``tokens(x)`` (``Predictor.tile_row_end``: fp8 on Hopper), so past each answer the largest x
    whose step fills the next tile row is tried, and the search goes on above it while that fits. On 720
    H100 / H200 fp8 planning searches (Llama-3.1-8B TP 1, 70B TP 2 / 4; three workloads; step SLOs 8-86 ms,
    every B tried for the truth) bisection alone stopped short of the largest B in 20 (up to 14 % fewer decodes
    but for one of 26 %, and twice none where 3 fit: a one-token chunk's step is slower than a 13-token one),
    this in 3 (the same 26 % among them: a step that fits inside a tile row whose full end does not)."""
    x = max_true(lo, hi, ok)
    while x < hi:
        start = max(x + 1, lo)
        end = row_end(tokens(start))
        nxt = max_true(start, hi, lambda y, end=end: tokens(y) <= end)  # >= start: tokens(start) <= end
        if not ok(nxt):
            break
        x = max_true(nxt, hi, ok)
    return x


class LayoutModel:
    """Step times of one GPU x TP layout for one workload (memoised: the searches revisit batch sizes)."""

    def __init__(self, gpu: GpuSpec, model: ModelShape, tp: int, stats: WorkloadStats, cfg: PlanConfig):
        cfg = cfg.for_gpu(gpu, tp)  # vLLM's engine limits for this device where none were given
        self.gpu, self.tp, self.stats, self.cfg = gpu, tp, stats, cfg
        self.pred = Predictor(gpu, model, tp=tp, dtype=cfg.precision, act_scale=cfg.act_scale,
                              kv_cache_dtype=cfg.kv_cache_dtype,
                              **cfg.constants.get(gpu.name, {}),
                              allreduce_fusion=allreduce_fusion_default(cfg.vllm_version, cfg.allreduce_fusion))
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
            "token_budget": lambda b: self.step_tokens(b) <= cfg.max_batched_tokens,
        }
        caps = {k: max_true(1, cfg.max_num_seqs, f) for k, f in limits.items()}
        which = min(caps, key=lambda k: caps[k])
        return caps[which], which

    # predictions
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

    # searches
    def step_tokens(self, b: int) -> int:
        """Tokens in the steady step of ``b`` decodes: the decodes and their share of prefill."""
        return b + self.prefill_tokens(b)

    def search(self, lo: int, hi: int, ok: Callable[[int], bool], tokens: Callable[[int], int]) -> int:
        """Largest x in [lo, hi] whose step (of ``tokens(x)`` tokens) is ok: bisection, and on a sawtooth step
        time (fp8 on Hopper) ``max_true_sawtooth``."""
        if not self.pred.sawtooth:
            return max_true(lo, hi, ok)
        return max_true_sawtooth(lo, hi, ok, tokens, self.pred.tile_row_end)

    def max_batch(self, slo_s: float | None, cap: int) -> int:
        if slo_s is None:
            return cap
        return self.search(1, cap, lambda b: self.t_steady(b) <= slo_s, self.step_tokens)

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

        return max(0, self.search(1, hi, ok, lambda c: b + c))
