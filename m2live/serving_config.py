"""One serving benchmark's configuration, vLLM's API-server defaults for a device, and its KV-cache capacity.

``ServingConfig``: the engine's limits and the client's closed loop (``None``: vLLM's default for the device).
``vllm_batch_defaults`` / ``cuda_graph_capture_max``: what vLLM's OpenAI server picks on a device
(``engine/arg_utils.py:get_batch_defaults``, ``VllmConfig._set_cudagraph_sizes``). ``kv_capacity``: weights,
activations and the KV cache on one GPU, by the planner's memory fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from .hardware import GpuSpec
from .limits import GOODPUT_MS, PERCENTILE, STEP_SEQS, STEP_TOKENS
from .shapes import ModelShape
from .vllm_release import (
    DEFAULT_GPU_RELEASE,
    UTILIZATION_WITH_GRAPH_PROFILE,
    ReleaseError,
    VllmRelease,
    allreduce_fusion_default,
    async_scheduling_default,
    batch_defaults,
    default_release,
    engine_limits,
    graph_capture_ceiling,
    utilization_default,
)

if TYPE_CHECKING:
    from .planner.memory import MemoryFit

# vLLM's default --gpu-memory-utilization: 0.92 since CUDA-graph memory entered its start-up profile (on by default
# since v0.21; config/cache.py of 0.32, and a vLLM 0.31 start-up log: "Desired GPU memory utilization is (0.92,
# 72.91 GiB)"); 0.9 before (vllm_release.utilization_default). Until 2026-12-06 m2live took 0.9.
GPU_MEMORY_UTILIZATION = UTILIZATION_WITH_GRAPH_PROFILE
BLOCK_SIZE = 16  # vLLM's default KV-cache block size on CUDA (CacheConfig.DEFAULT_BLOCK_SIZE)
MAX_GPU_BLOCKS = 2**31 - 1  # vLLM's block tables hold int32 block ids
CPU_BLOCK_SIZE = 128  # ... on the CPU backend (platforms/cpu.py)
DEFAULT_PROMPTS_PER_CONCURRENCY = 10  # num_prompts = 10 x C (e.g. InferenceMAX's sweeps)
MAX_REQUESTS = 1_000_000  # requests in one simulated benchmark: the engine keeps per-request arrays
FRONTEND_S = 1e-3  # prior: client <-> engine one way (HTTP, streaming) per request
# prior: the API server's serial work per request besides tokenising (HTTP, parsing and validating, the hand-off to
# the engine, the final response), fitted apart from the per-token work by bench/api_server_cost.py on the CPU
# server: 3.6 / 1.7 ms at 4 / 16 users in one run, 4.5 / 1.3 in another (results/api_server_cost.json), ~3 ms
# their level; with 1 ms each way it makes the ~6 ms path the CPU serving bench measured at one user (it was
# 1 ms until 2026-12-05)
FRONTEND_SERVICE_S = 3e-3
# The API server tokenises each text prompt on one worker thread (vLLM 0.32 renderers/base.py: the renderer's pool
# has ModelConfig.renderer_num_workers = 1 worker by default), serially with the other requests' tokenisation.
# Measured (bench/tokenize_cost.py -> results/tokenize_cost.json): a 128k-entry byte-level BPE with Llama 3's split
# pattern on prompts made as vLLM's random dataset makes them, 1.6 / 2.6 / 3.5 us per token at 1k / 4k / 8k tokens
# on this project's 2.6 GHz Xeon (~1.1 us even for a word-level tokenizer: most of it is the call's own per-token
# work); 2.5 us is that range's level. A prior, host-CPU and tokenizer dependent (ServingConfig.tokenize_s_per_token;
# 0 for prompts sent as token ids).
TOKENIZE_S_PER_TOKEN = 2.5e-6


class SimulationError(ValueError):
    """A serving configuration that cannot run (weights do not fit, bad counts)."""


SWITCH_CHOICES = ("auto", "on", "off")  # the command lines' --async-scheduling and --allreduce-fusion


def parse_switch(text: object, what: str) -> bool | None:
    """A vLLM feature switch (a flag or a batch cell: ``async_scheduling``, ``allreduce_fusion``): None (auto or
    blank: vLLM's default for the device), True (on) or False (off)."""
    s = str(text if text is not None else "").strip().lower()
    if s in ("", "auto"):
        return None
    if s in ("on", "true", "1", "yes"):
        return True
    if s in ("off", "false", "0", "no"):
        return False
    raise SimulationError(f"{what} must be auto, on or off, got {text!r}")


def cached_prefix(prompt_tokens: int, block_size: int) -> int:
    """Tokens of a prompt found in vLLM's prefix cache when the same prompt ran before: its full blocks, but
    never the last token (``KVCacheManager.get_computed_blocks`` caps a hit at the request's tokens - 1, since
    the last one must run to sample)."""
    return max(0, (prompt_tokens - 1) // block_size * block_size)


# ---- vLLM's defaults ----------------------------------------------------------------------------------------
def vllm_batch_defaults(gpu: GpuSpec, tp: int = 1, release: VllmRelease | None = None) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of vLLM's OpenAI server on this device in ``release`` (None: the
    release simulated by default, ``vllm_release.default_release``): ``vllm_release.batch_defaults``."""
    return batch_defaults(gpu, tp, release or default_release(gpu))


def send_schedule(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """When vllm bench serve sends each of ``n`` requests at ``rate`` requests/s (benchmarks/serve.py get_request,
    burstiness 1): exponential gaps, cumulated, then scaled so the last is sent at n / rate."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    t = np.cumsum(gaps)
    return t * (n / rate) / t[-1]


def cuda_graph_capture_max(gpu: GpuSpec, max_num_seqs: int, max_num_batched_tokens: int,
                           release: VllmRelease | None = None) -> int:
    """Largest captured CUDA-graph batch (``VllmConfig._set_cudagraph_sizes``): min(2 x max_num_seqs, the
    release's ceiling — 512, or 1024 on compute capability 10.x from vLLM 0.28), never above the token budget; 0 on
    the CPU backend (no graphs)."""
    if gpu.arch == "cpu":
        return 0
    ceiling = graph_capture_ceiling(gpu, release or default_release(gpu))
    return min(2 * max_num_seqs, ceiling, max_num_batched_tokens)


def range_ratios(r: object, what: str = "random_range_ratio") -> tuple[float, float]:
    """(input, output) of a --random-range-ratio: one ratio for both, or a pair; each in [0, 1), as vLLM's benchmark
    requires (one line naming ``what`` otherwise)."""
    pair = r if isinstance(r, tuple) else (r, r)
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1 for v in pair):
        raise SimulationError(f"{what} must be in [0, 1) (as vLLM's benchmark requires), got {r!r}")
    return pair


GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # vllm bench serve --goodput's names (benchmarks/serve.py)


def _items(value: object, sep: str | None) -> list:
    """A flag's items: text split at ``sep`` (None: whitespace), a list or tuple as it is, one value alone, or none."""
    if isinstance(value, str):
        return value.split(sep)
    if isinstance(value, list | tuple):
        return list(value)
    return [] if value is None else [value]


def goodput_slos(slos: object, what: str = "--goodput") -> tuple[tuple[str, float], ...]:
    """vllm bench serve's --goodput SLOs as ((metric, ms), ...): ``KEY:VALUE`` texts (a list, or one text of them
    separated by spaces: a batch cell) or (metric, ms) pairs; each metric ttft, tpot or e2el, each value a number
    of ms >= 0; a metric given twice keeps its last value (as the benchmark's dict does). One line otherwise."""
    items = _items(slos, None)
    if not items:
        raise SimulationError(f"{what} needs KEY:VALUE pairs (ttft, tpot or e2el, in ms), got none")
    out: dict[str, float] = {}
    for item in items:
        key, value, ok = None, None, False
        if isinstance(item, str):
            key, sep, value = item.partition(":")
            ok = bool(sep) and key in GOODPUT_METRICS
        elif isinstance(item, tuple) and len(item) == 2:
            key, value = item
            ok = key in GOODPUT_METRICS
        if not ok:
            raise SimulationError(f"{what} takes KEY:VALUE pairs with KEY one of {', '.join(GOODPUT_METRICS)} and "
                                  f"VALUE in ms, got {item!r}")
        read = GOODPUT_MS.parse if isinstance(value, str) else GOODPUT_MS.check
        out[key] = float(read(value, f"{what} {key}", SimulationError))
    return tuple(out.items())


def metric_percentiles(qs: object, what: str = "--metric-percentiles") -> tuple[float, ...]:
    """vllm bench serve's --metric-percentiles: percentiles in [0, 100], as comma-separated text ("50,90,99") or
    numbers; one line otherwise."""
    items = _items(qs, ",")
    if not items:
        raise SimulationError(f"{what} needs percentiles in [0, 100], got none")
    return tuple(float((PERCENTILE.parse if isinstance(q, str) else PERCENTILE.check)(q, what, SimulationError))
                 for q in items)


def percentile_name(q: float) -> str:
    """The benchmark's name of a percentile: p99, p99.9 (its p_word: the number as Python writes it)."""
    return f"p{int(q)}" if int(q) == q else f"p{q}"


@dataclass(frozen=True)
class ServingConfig:
    """One serving benchmark: the engine's limits and the client's closed loop."""

    concurrency: int
    num_prompts: int | None = None  # None: DEFAULT_PROMPTS_PER_CONCURRENCY x concurrency
    max_num_batched_tokens: int | None = None  # None: vLLM's API-server default for the device
    max_num_seqs: int | None = None  # None: vLLM's API-server default for the device
    block_size: int | None = None  # None: 16 on GPUs, 128 on the CPU backend
    long_prefill_token_threshold: int = 0  # vLLM default: no cap on one request's chunk
    # None: vLLM's default (GPU_MEMORY_UTILIZATION) — raised by simulate, in steps of 0.01, to the least share at
    # which vLLM starts when the default's cache cannot hold one request at full length; a given share is kept
    gpu_memory_utilization: float | None = None
    reserve_bytes: float | None = None  # None: non-torch memory and CUDA graphs (planner.memory.engine_reserve_bytes)
    async_scheduling: bool | None = None  # None: on for GPUs, off for the CPU backend (vLLM's defaults)
    # vLLM's all-reduce + RMSNorm fusion under TP (predictor.allreduce_fusion_max_bytes): None its default since
    # 0.16 (Hopper and Blackwell data-centre GPUs over NVLink), False a server without it (older vLLM)
    allreduce_fusion: bool | None = None
    clock: str = "forecast"  # "forecast" (power-cap model) | "boost"
    frontend_s: float = FRONTEND_S
    frontend_service_s: float = FRONTEND_SERVICE_S
    tokenize_s_per_token: float = TOKENIZE_S_PER_TOKEN  # the API server's tokenisation, per prompt token (serial)
    # vllm bench serve --request-rate: None or inf sends every request as soon as one of the ``concurrency`` slots
    # is free (the closed loop); a rate sends them on its Poisson schedule (exponential gaps, seeded, scaled so
    # the last is sent at num_prompts / rate, as the benchmark does), ``concurrency`` still capping those in flight
    request_rate: float | None = None
    seed: int = 0  # of that schedule and of the sampled lengths (the benchmark's --seed: both)
    # vllm bench serve --random-range-ratio: each request's prompt and output lengths drawn uniformly from
    # [L(1 - r), L(1 + r)] around --isl / --osl (``sampled_lengths``), r for both or (r_input, r_output); 0 (the
    # benchmark's default): every request exactly --isl in and --osl out
    random_range_ratio: float | tuple[float, float] = 0.0
    # vLLM's --max-model-len: its cache must hold one request this long to start, and it refuses longer requests;
    # None: the longest request's length (what a server started for the benchmark is given)
    max_model_len: int | None = None
    kv_tokens: int | None = None  # override the KV-cache capacity (tokens); None: from the memory fit
    # vLLM's --num-gpu-blocks-override: the cache is this many blocks of block_size (one the null block), whatever
    # the memory leaves; exclusive with kv_tokens
    num_gpu_blocks: int | None = None
    # vllm bench serve sends the first request's prompt before the timed run when asked — its initial test run
    # (--ready-check-timeout-sec > 0; older releases always sent it) or --num-warmups copies of it — and vLLM V1
    # caches prefixes by default: the first timed request then finds its prompt's full blocks cached and prefills
    # only the rest (at least its last token). Off (vLLM 0.32's benchmark defaults): no such request.
    test_run_cached: bool = False
    # vLLM's prefix caching (on by default; off: --no-enable-prefix-caching, which benchmark harnesses often pass):
    # between random prompts it only matters to a preempted request, which finds what is left of its own prefix
    # cached, and to the benchmark's test run
    prefix_caching: bool = True
    # the vLLM release whose defaults the server runs with (vllm_release): None the release simulated by default
    # (vllm_release.default_release: the one m2live's GPU kernel tables were measured in)
    vllm_version: VllmRelease | None = None
    # vllm bench serve --goodput: SLOs ((metric, ms), ...) a request must meet, every one, to count as good;
    # () reports no goodput
    goodput: tuple[tuple[str, float], ...] = ()
    # vllm bench serve --metric-percentiles beyond the median and p99 always reported (p90, p99.9, ...)
    metric_percentiles: tuple[float, ...] = ()

    def release(self, gpu: GpuSpec) -> VllmRelease:
        """The vLLM release simulated on ``gpu``: the one given, else the default for the device."""
        return self.vllm_version or default_release(gpu)

    @property
    def utilization(self) -> float:
        """The share of device memory vLLM may use (``gpu_memory_utilization``, or the release's default; a GPU
        release when none was given — the CPU backend sizes its cache by VLLM_CPU_KVCACHE_SPACE instead)."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return utilization_default(self.vllm_version or DEFAULT_GPU_RELEASE)

    @property
    def range_ratios(self) -> tuple[float, float]:
        """(input, output) range ratios of the sampled lengths."""
        return range_ratios(self.random_range_ratio)

    @property
    def open_loop(self) -> bool:
        """Requests sent on the --request-rate schedule rather than as soon as a slot is free."""
        return self.request_rate is not None and math.isfinite(self.request_rate)

    def __post_init__(self) -> None:
        if self.vllm_version is not None and not isinstance(self.vllm_version, VllmRelease):
            try:  # a version string ("0.24", "0.32.0"): the release
                object.__setattr__(self, "vllm_version", VllmRelease.parse(self.vllm_version))
            except ReleaseError as e:
                raise SimulationError(str(e)) from None
        for name in ("concurrency", "num_prompts", "max_num_batched_tokens", "max_num_seqs", "block_size",
                     "kv_tokens", "num_gpu_blocks", "max_model_len"):
            v = getattr(self, name)
            if v is None and name != "concurrency":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SimulationError(f"{name} must be a positive integer, got {v!r}")
        for name, bound in (("max_num_seqs", STEP_SEQS), ("max_num_batched_tokens", STEP_TOKENS)):
            v = getattr(self, name)
            if v is not None and v > bound.hi:
                raise SimulationError(f"{name} {v:.3g} is past what one engine step holds (at most {int(bound.hi)} "
                                      f"{bound.unit})")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks > MAX_GPU_BLOCKS:
            raise SimulationError(f"num_gpu_blocks {self.num_gpu_blocks} is more blocks than vLLM's block tables "
                                  f"address (int32 block ids: at most {MAX_GPU_BLOCKS})")
        if self.kv_tokens is not None and self.num_gpu_blocks is not None:
            raise SimulationError("kv_tokens (--kv-cache-gib) and num_gpu_blocks (--num-gpu-blocks-override) both size "
                                  "the KV cache: give one")
        requests = self.num_prompts or DEFAULT_PROMPTS_PER_CONCURRENCY * self.concurrency
        if requests > MAX_REQUESTS:
            raise SimulationError(f"{requests} requests ({'num_prompts' if self.num_prompts else '10 x concurrency'})"
                                  f" is more than the simulator holds (at most {MAX_REQUESTS})")
        if self.request_rate is not None and not self.request_rate > 0:
            raise SimulationError(f"request_rate must be a positive number of requests/s, got {self.request_rate!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise SimulationError(f"seed must be a non-negative integer, got {self.seed!r}")
        range_ratios(self.random_range_ratio)  # its bounds
        if self.goodput:
            object.__setattr__(self, "goodput", goodput_slos(self.goodput, "goodput"))
        if self.metric_percentiles:
            object.__setattr__(self, "metric_percentiles", metric_percentiles(self.metric_percentiles,
                                                                              "metric_percentiles"))
        if self.long_prefill_token_threshold < 0:
            raise SimulationError("long_prefill_token_threshold must be >= 0")
        if not 0 < self.utilization <= 1:
            raise SimulationError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.clock not in ("forecast", "boost"):
            raise SimulationError(f"clock must be 'forecast' or 'boost', got {self.clock!r}")
        for name in ("frontend_s", "frontend_service_s", "tokenize_s_per_token"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise SimulationError(f"{name} must be >= 0, got {v!r}")


@dataclass(frozen=True)
class ServerSettings:
    """What the simulated server runs with on one device: the configuration's limits and switches where given, else
    its vLLM release's defaults for the device (``server_settings``)."""

    release: VllmRelease
    max_num_batched_tokens: int
    max_num_seqs: int
    cuda_graph_max_batch: int
    async_scheduling: bool
    allreduce_fusion: bool | None  # None: the predictor's rule (on where vLLM turns it on)


def server_settings(cfg: ServingConfig, gpu: GpuSpec, tp: int) -> ServerSettings:
    """``cfg`` on ``gpu`` at ``tp`` as vLLM settles it at start-up: a defaulted max_num_seqs lowered to the token
    budget, a given one above it refused (``EngineArgs._set_default_args``, ``SchedulerConfig``), the CUDA-graph
    sizes, async scheduling and the all-reduce fusion of the release."""
    release = cfg.release(gpu)
    max_tokens, max_seqs = engine_limits(gpu, tp, release, cfg.max_num_batched_tokens, cfg.max_num_seqs)
    if max_tokens < max_seqs:  # only a given max_num_seqs can exceed the budget
        raise SimulationError(f"max_num_batched_tokens ({max_tokens}) must be at least max_num_seqs "
                              f"({max_seqs}): vLLM refuses to start with a smaller token budget")
    return ServerSettings(
        release, max_tokens, max_seqs, cuda_graph_capture_max(gpu, max_seqs, max_tokens, release),
        cfg.async_scheduling if cfg.async_scheduling is not None else async_scheduling_default(gpu, release),
        allreduce_fusion_default(release, cfg.allreduce_fusion))


# ---- memory -------------------------------------------------------------------------------------------------
def kv_capacity(gpu: GpuSpec, shard: ModelShape, max_tokens: int, max_seqs: int, cfg: ServingConfig,
                need_tokens: int, precision: str = "bf16") -> MemoryFit:
    """Weights, activations and the KV cache on one GPU (the planner's memory fit, vLLM's
    gpu_memory_utilization); raises when the weights alone do not fit. A cache short of one request is the
    simulator's to settle (simulate raises the share: ``MemoryFit.share_to_hold``), so the fit says it fits."""
    from .planner.memory import PlanConfig, memory_fit
    from .workload import WorkloadStats

    pc = PlanConfig(max_num_seqs=max_seqs, max_batched_tokens=max_tokens,
                    reserve_fraction=1.0 - cfg.utilization, reserve_bytes=cfg.reserve_bytes,
                    vllm_version=cfg.release(gpu))
    pct = {"p50": float(need_tokens), "p90": float(need_tokens), "p99": float(need_tokens)}
    stats = WorkloadStats(0.0, 0.0, 0.0, 0.0, 0.0, pct, pct, pct)
    fit = memory_fit(gpu, shard, stats, pc, precision)
    if fit.weight_bytes > fit.total_bytes - fit.reserve_bytes:
        raise SimulationError(f"does not fit: {fit.reason}")
    return replace(fit, fits=True, reason="")
