"""The planner's configuration and the memory fit of one GPU x TP layout.

Per GPU: ``usable = memory x (1 - reserve_fraction) - reserve_bytes`` (vLLM's default
``gpu_memory_utilization`` 0.92 leaves 8 %; ``engine_reserve_bytes`` covers the non-torch workspaces and CUDA
graphs vLLM counts against the rest). From it come the weight shard, the activation peak of vLLM's start-up
profile (``activation_bytes``) and the KV cache; the KV cache must hold at least one request of the workload's p99
length. A layout that fails says which term did not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..efficiency import ArchConstants
from ..hardware import GIB, GpuSpec
from ..shapes import ModelShape
from ..vllm_release import (
    DEFAULT_GPU_RELEASE,
    SAMPLER_TRITON_TOPK_FROM,
    VllmRelease,
    engine_limits,
    utilization_default,
)
from ..workload import WorkloadStats

# What vLLM's KV-cache sizing (gpu_worker.determine_available_memory) takes besides weights and the activation peak:
# memory outside torch created after its start-up snapshot (cuBLAS and attention workspaces; the CUDA context and
# NCCL come before it and are outside the budget) and its estimate of the CUDA graphs' pool. Public start-up logs
# (never fitted on): one GPU 0.49 GiB (vLLM 0.31, Llama-3.1-8B on an A100: 0.26 non-torch + 0.23 graphs), graphs
# 0.22-0.78 GiB in five other single-GPU logs; under tensor parallelism the custom all-reduce and FlashInfer's
# all-reduce + RMSNorm fusion workspaces register with the graphs (a TP 2 log: 1.97 GiB of graphs). Until 2026-12-06
# 1.5 GiB whatever the TP.
ENGINE_RESERVE_BYTES = 0.5 * GIB
TP_RESERVE_BYTES = 1.0 * GIB


def engine_reserve_bytes(tp: int) -> float:
    """Non-torch memory and CUDA graphs that vLLM counts against one GPU's budget (ENGINE_RESERVE_BYTES, plus
    TP_RESERVE_BYTES under tensor parallelism)."""
    return ENGINE_RESERVE_BYTES + (TP_RESERVE_BYTES if tp > 1 else 0.0)


def reserve_label(reserve_bytes: float | None) -> str:
    """The fixed reserve a PlanConfig takes, in words: its own figure, or engine_reserve_bytes's rule."""
    if reserve_bytes is None:
        return f"{ENGINE_RESERVE_BYTES / GIB:g} GiB (+{TP_RESERVE_BYTES / GIB:g} under TP) of workspaces and CUDA graphs"
    return f"{reserve_bytes / GIB:g} GiB"


class PlanError(ValueError):
    """Planner input that cannot describe a real deployment."""


@dataclass(frozen=True)
class PlanConfig:
    slo_s: float | None = None  # per-step latency SLO (= inter-token latency); None: no latency limit
    # vLLM's max_num_seqs and max_num_batched_tokens (the token budget per step); None: its OpenAI server's defaults
    # for each device in ``vllm_version`` (``for_gpu``: vllm_release.engine_limits)
    max_num_seqs: int | None = None
    max_batched_tokens: int | None = None
    # what vLLM's gpu_memory_utilization leaves out; None: what ``vllm_version``'s default share leaves
    reserve_fraction: float | None = None
    reserve_bytes: float | None = None  # None: engine_reserve_bytes(tp) (non-torch memory and CUDA graphs)
    # the vLLM release whose start-up profile sizes the KV cache (its sampler's dummy run: vllm_release)
    vllm_version: VllmRelease = DEFAULT_GPU_RELEASE
    clock: str = "forecast"  # "forecast" (power-cap model) | "boost"
    prices: dict[str, float] = field(default_factory=dict)  # canonical GPU name -> $ per GPU-hour
    rank_by: str = "auto"  # auto | gpu | dollar | layout
    # GPU name -> its calibration's Predictor constants (Calibration.predictor_constants: bf16 and fp8)
    constants: dict[str, dict[str, ArchConstants]] = field(default_factory=dict)
    precision: str = "bf16"  # the four projections' weights: bf16, or fp8 (vLLM's W8A8; attention/KV stay bf16)
    act_scale: str = "static"  # fp8: the inputs' scales, "static" (the checkpoint's) or "dynamic" (per step)
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype (fp8: one byte per element)
    async_scheduling: bool | None = None  # vLLM's async scheduling in the simulated serving (None: its default)
    allreduce_fusion: bool | None = None  # vLLM's all-reduce + RMSNorm fusion under TP (None: its default)

    def for_gpu(self, gpu: GpuSpec, tp: int) -> PlanConfig:
        """This configuration with the engine limits left unset taken as vLLM's OpenAI server sets them on ``gpu``
        (``vllm_release.engine_limits``)."""
        if self.max_num_seqs is not None and self.max_batched_tokens is not None:
            return self
        tokens, seqs = engine_limits(gpu, tp, self.vllm_version, self.max_batched_tokens, self.max_num_seqs)
        return replace(self, max_batched_tokens=tokens, max_num_seqs=seqs)

    def __post_init__(self) -> None:
        if self.reserve_fraction is None:
            object.__setattr__(self, "reserve_fraction", 1.0 - utilization_default(self.vllm_version))
        if self.slo_s is not None and not (self.slo_s > 0 and math.isfinite(self.slo_s)):
            raise PlanError(f"SLO must be a positive number of seconds, got {self.slo_s!r}")
        for name in ("max_num_seqs", "max_batched_tokens"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"{name} must be a positive integer, got {v!r}")
        if not 0 <= self.reserve_fraction < 1:
            raise PlanError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")
        if self.clock not in ("forecast", "boost"):
            raise PlanError(f"clock must be 'forecast' or 'boost', got {self.clock!r}")
        if self.precision not in ("bf16", "fp8"):
            raise PlanError(f"precision must be bf16 or fp8, got {self.precision!r}")
        if self.act_scale not in ("static", "dynamic"):
            raise PlanError(f"act_scale must be static or dynamic, got {self.act_scale!r}")
        if self.rank_by not in ("auto", "gpu", "dollar", "layout"):
            raise PlanError(f"rank_by must be auto, gpu, dollar or layout, got {self.rank_by!r}")
        for g, p in self.prices.items():
            if not (p > 0 and math.isfinite(p)):
                raise PlanError(f"price for {g} must be a positive $/GPU-hour, got {p!r}")


# Bytes per (sampled row x vocabulary entry) live at the peak of vLLM's dummy sampler run: the gathered bf16
# logits (kept by the caller), their fp32 copy (Sampler.forward), the fp32 probabilities and the fp32 exponential
# noise of random_sample; top-k/top-p masks in place (the Triton kernel, apply_top_k_top_p_triton). From vLLM
# 0.32's code (v1/sample/sampler.py, ops/topk_topp_sampler.py), not fitted.
SAMPLER_PROFILE_BYTES_PER_LOGIT = 2 + 4 + 4 + 4
# ... and in the releases before it (vllm_release.SAMPLER_TRITON_TOPK_FROM), whose top-k/top-p masking sorts the
# logits: ~28 B of live tensors at its scatter (the bf16 and fp32 logits, the sorted values and their int64
# indices, the softmax, the masks, the scattered copy) plus the radix sort's buffers, ~40 B; start-up logs of
# 0.8.5-0.31 at 256 sequences show 1.2-1.45 GiB of activation peak, ~39 B a logit. Not fitted: with it the two
# pre-0.32 start-up logs of bench/kv_capacity.py (0.21, 0.31) come out +0.2 / +0.35 % where 14 B gave +2.1 / +1.6 %.
SAMPLER_SORT_PROFILE_BYTES_PER_LOGIT = 40


def sampler_profile_bytes_per_logit(release: VllmRelease) -> int:
    """Bytes per sampled row x vocabulary entry at the peak of ``release``'s dummy sampler run."""
    return (SAMPLER_PROFILE_BYTES_PER_LOGIT if release >= SAMPLER_TRITON_TOPK_FROM
            else SAMPLER_SORT_PROFILE_BYTES_PER_LOGIT)


def activation_bytes(shard: ModelShape, max_tokens: int, max_seqs: int, precision: str = "bf16",
                     sampler_bytes_per_logit: float = SAMPLER_PROFILE_BYTES_PER_LOGIT) -> float:
    """The activation peak vLLM's start-up profile measures on one GPU (``gpu_model_runner.profile_run``): the
    larger of its two passes, which run one after the other — the forward pass at the token budget (the
    residual stream and normed input, plus the larger of the attention block's q/k/v and output and the MLP's
    gate_up and activation outputs: the one layer's intermediates live at once; under fp8 the e4m3 copy of a
    projection's input, 1 byte a element) and the sampler's dummy run over min(max_num_seqs, budget) rows of
    the *whole* vocabulary on every GPU (vLLM V1 all-gathers the logits and samples on every rank), with the
    forward's hidden states still held (``sampler_bytes_per_logit``: the release's,
    ``sampler_profile_bytes_per_logit``). Until 2026-12-06 the two were summed, the logits counted per vocab shard
    at 8 bytes and every intermediate of a layer as live at once: Llama-3.1-70B fp8 on one H100 at vLLM's
    defaults 3.47 GB, now 2.01 GB."""
    d = shard.dtype_bytes
    h = shard.hidden
    q = shard.heads_per_gpu * shard.head_dim
    attn = 2 * q + 2 * shard.kv_heads_per_gpu * shard.head_dim  # q, k, v out; attention out
    mlp = 3 * (shard.intermediate // shard.tp)  # gate_up out; SiLU*up out
    forward = d * max_tokens * (2 * h + max(attn, mlp))
    if precision == "fp8":
        forward += max_tokens * max(h, q, shard.intermediate // shard.tp)
    rows = min(max_seqs, max_tokens)
    sampler = sampler_bytes_per_logit * rows * shard.vocab + d * (max_tokens + 2 * rows) * h
    return float(max(forward, sampler))


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

    @classmethod
    def refused(cls, gpu: GpuSpec, reason: str) -> MemoryFit:
        """A layout refused before its memory was counted (no fp8 tensor cores, a shape TP cannot shard)."""
        return cls(gpu.mem_bytes, 0, 0, 0, 0, 0, 0, 0, False, reason)

    def share_to_hold(self, need_tokens: int, utilization: float) -> float:
        """The least gpu_memory_utilization, in 0.01 steps, whose cache holds ``need_tokens`` where this fit was made
        at ``utilization`` (``starting_utilization`` from the cache's signed bytes: a shortfall counts)."""
        return starting_utilization(utilization, self.kv_bytes / self.kv_bytes_per_token, need_tokens,
                                    self.kv_bytes_per_token, self.total_bytes)

    def to_dict(self) -> dict:
        g = 1e9
        return {"total_gb": self.total_bytes / g, "reserve_gb": self.reserve_bytes / g,
                "weights_gb": self.weight_bytes / g, "activations_gb": self.activation_bytes / g,
                "kv_cache_gb": max(0.0, self.kv_bytes) / g, "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_tokens": self.kv_tokens, "request_tokens_p99": self.request_tokens_p99,
                "fits": self.fits, "reason": self.reason}


def memory_fit(gpu: GpuSpec, shard: ModelShape, stats: WorkloadStats, cfg: PlanConfig,
               precision: str = "bf16") -> MemoryFit:
    """Weights (fp8 W8A8: the four projections at 1 byte per weight), activations and the KV cache on one GPU."""
    cfg = cfg.for_gpu(gpu, shard.tp)
    total = gpu.mem_bytes
    fixed = engine_reserve_bytes(shard.tp) if cfg.reserve_bytes is None else cfg.reserve_bytes
    reserve = total * cfg.reserve_fraction + fixed
    weights = float(shard.weight_bytes(precision))
    act = activation_bytes(shard, cfg.max_batched_tokens, cfg.max_num_seqs, precision,
                           sampler_profile_bytes_per_logit(cfg.vllm_version))
    kv = total - reserve - weights - act
    per_tok = shard.kv_bytes_per_token()
    kv_tokens = max(0, int(kv // per_tok))
    need = int(math.ceil(stats.total_p["p99"]))
    reason = _misfit_reason(total, reserve, weights, act, kv, kv_tokens, need, per_tok)
    fit = MemoryFit(total, reserve, weights, act, kv, per_tok, kv_tokens, need, not reason, reason)
    if reason and weights <= total - reserve and kv_tokens < need:  # the share at which it would fit, if any
        u = fit.share_to_hold(need, 1.0 - cfg.reserve_fraction)
        if u <= 1:
            fit = replace(fit, reason=f"{reason} (it would at gpu_memory_utilization {u:.2f})")
    return fit


def starting_utilization(utilization: float, kv_tokens: float, need_tokens: int, kv_bytes_per_token: float,
                         total_bytes: float) -> float:
    """The least gpu_memory_utilization, in steps of 0.01, whose KV cache holds ``need_tokens`` where
    ``utilization`` leaves ``kv_tokens`` (negative where the weights and activations take more than the share: the
    tokens short): the cache grows by the device's memory x the share's rise (the weights, activations and fixed
    reserve stay). Above 1 where no share does."""
    u = utilization + (need_tokens - kv_tokens) * kv_bytes_per_token / total_bytes
    return math.ceil(u * 100 - 1e-9) / 100


def _misfit_reason(total: float, reserve: float, weights: float, act: float, kv: float, kv_tokens: int,
                   need: int, per_tok: int) -> str:
    """Which term did not fit ('' when all do)."""
    g = 1e9
    if weights > total - reserve:
        return (f"weights {weights / g:.1f} GB/GPU exceed the {(total - reserve) / g:.1f} GB usable of "
                f"{total / g:.0f} GB (reserve {reserve / g:.1f} GB)")
    if kv <= 0:
        return (f"weights {weights / g:.1f} GB + activations {act / g:.1f} GB leave no KV cache in "
                f"{(total - reserve) / g:.1f} GB usable")
    if kv_tokens < need:
        return (f"KV cache {kv / g:.1f} GB holds {kv_tokens} tokens, less than one p99 request "
                f"({need} tokens = {need * per_tok / g:.1f} GB)")
    return ""
