"""The vLLM engine switches that several subcommands take (``--async-scheduling``, ``--allreduce-fusion``), with
one help text each: auto (vLLM's default for the device), on or off (``serving_config.parse_switch``)."""

from __future__ import annotations

import argparse

from ..serving_config import SWITCH_CHOICES


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
