"""List the GPU catalog: datasheet numbers and their sources (or, with --device, the spec of this machine's GPU)."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from ..hardware import GpuSpec, all_gpus, spec_to_dict
from ..limits import GPU_INDEX


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="JSON rows; one row, saved to a file, is a GPU spec every --gpu takes (FILE.json; cuda_total_gib, "
                        "inline_ecc and data_bw_gbs are recomputed from the other fields, not read)")
    p.add_argument("--device", nargs="?", const="0", default=None, metavar="INDEX",
                   help="the spec m2live uses for this machine's NVIDIA GPU INDEX (default 0): its catalog row, "
                        "or, for a GPU the catalog lacks, what its driver reports (NVML)")


def device_spec(index_text: str) -> GpuSpec:
    from ..device_spec import catalog_or_device
    from ..telemetry import TelemetryError, nvml_device_name

    index = int(GPU_INDEX.parse(index_text, "--device"))
    try:  # the name first: a catalog GPU needs nothing more from NVML
        return catalog_or_device(nvml_device_name(index), index)
    except TelemetryError as e:
        raise ValueError(f"--device {index}: {e}") from None


def run(args: argparse.Namespace) -> int:
    gpus = [device_spec(args.device)] if args.device is not None else all_gpus()
    if args.json:
        print(json.dumps([{**spec_to_dict(g), "cuda_total_gib": round(g.mem_bytes / 2**30, 2),
                           "inline_ecc": g.inline_ecc, "data_bw_gbs": round(g.data_bw / 1e9, 1)} for g in gpus],
                         indent=2))
        return 0
    t = Table(title="m2live GPU catalog (dense tensor TFLOP/s; datasheet numbers; "
                    "DRAM GB/s * : inline ECC takes 1/16)" if args.device is None else
                    f"NVIDIA GPU {args.device}: {gpus[0].source}")
    for col in ("NVML name", "arch", "SMs", "boost MHz", "bf16 TF", "fp8 TF", "DRAM GB/s", "mem GB", "CUDA GiB",
                "L2 MB", "TDP W", "link", "aliases"):
        t.add_column(col)
    for g in gpus:
        t.add_row(g.name, g.arch, str(g.sms), f"{g.boost_mhz:.0f}", f"{g.bf16_tflops:g}",
                  "-" if g.fp8_tflops is None else f"{g.fp8_tflops:g}",
                  f"{g.mem_bw_gbs:g}" + (" *" if g.inline_ecc else ""), f"{g.mem_gb:g}",
                  f"{g.mem_bytes / 2**30:.1f}", f"{g.l2_mb:g}", f"{g.tdp_w:g}",
                  f"{g.interconnect} {g.interconnect_gbs:g}", ", ".join(g.aliases))
    Console(width=240).print(t)
    return 0
