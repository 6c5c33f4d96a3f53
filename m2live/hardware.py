"""GPU catalog: datasheet numbers per SKU, each row with its source, and lookup by NVML name or alias.

Every number here is a datasheet (or vendor whitepaper) figure, never a fitted one. Conventions:
- ``boost_mhz`` is the maximum SM clock NVML reports (``nvmlDeviceGetMaxClockInfo(SM)``); f_clk is the live
  SM clock divided by it.
- ``bf16_tflops`` / ``fp16_tflops`` / ``fp8_tflops`` are *dense* tensor-core figures (no 2:4 sparsity),
  quoted by the vendor at ``tflops_at_mhz``; peak at clock f is ``tflops * f / tflops_at_mhz``.
- ``mem_bw_gbs`` is the peak DRAM bandwidth in GB/s (1e9 B/s); ``l2_mb`` the L2 cache in MiB.
- ``interconnect_gbs`` is the per-GPU, per-direction bandwidth to peers in GB/s (NVLink, else PCIe).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace


class UnknownGpuError(KeyError):
    """Raised for a GPU name the catalog does not know; the message lists close matches."""

    def __str__(self) -> str:  # KeyError quotes its message; we want a clean line
        return str(self.args[0]) if self.args else "unknown GPU"


@dataclass(frozen=True)
class GpuSpec:
    name: str  # canonical NVML name (nvmlDeviceGetName)
    arch: str  # "ampere" | "ada" | "hopper" | "blackwell" | "cpu"
    compute_capability: tuple[int, int]
    sms: int
    base_mhz: float
    boost_mhz: float
    bf16_tflops: float  # dense
    fp16_tflops: float  # dense
    fp8_tflops: float | None  # dense; None where the tensor cores have no fp8
    tflops_at_mhz: float  # the SM clock the vendor's TFLOP/s figures are quoted at
    mem_bw_gbs: float
    mem_gb: float
    l2_mb: float
    tdp_w: float
    interconnect: str  # "nvlink" | "pcie" | "c2c" | "none"
    interconnect_gbs: float  # per direction, per GPU
    source: str
    aliases: tuple[str, ...] = ()
    nvml_names: tuple[str, ...] = ()  # other exact NVML strings the same part reports

    def peak_flops(self, dtype: str = "bf16", clock_mhz: float | None = None) -> float:
        """Dense tensor FLOP/s at ``clock_mhz`` (default: boost)."""
        tf = {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops, "fp8": self.fp8_tflops}.get(dtype)
        if tf is None:
            raise ValueError(f"{self.name} has no dense {dtype} tensor throughput")
        f = self.boost_mhz if clock_mhz is None else clock_mhz
        return tf * 1e12 * f / self.tflops_at_mhz

    @property
    def mem_bw(self) -> float:
        """Peak DRAM bandwidth in B/s."""
        return self.mem_bw_gbs * 1e9

    @property
    def l2_bytes(self) -> float:
        return self.l2_mb * 1024 * 1024

    @property
    def link_bw(self) -> float:
        """Per-direction interconnect bandwidth in B/s."""
        return self.interconnect_gbs * 1e9

    @property
    def mem_bytes(self) -> float:
        return self.mem_gb * 1e9

    def with_overrides(self, **kw) -> GpuSpec:
        return replace(self, **kw)


# fmt: off
CATALOG: tuple[GpuSpec, ...] = (
    GpuSpec(
        name="NVIDIA A100-SXM4-80GB", arch="ampere", compute_capability=(8, 0), sms=108,
        base_mhz=1275, boost_mhz=1410, bf16_tflops=312, fp16_tflops=312, fp8_tflops=None, tflops_at_mhz=1410,
        mem_bw_gbs=2039, mem_gb=80, l2_mb=40, tdp_w=400, interconnect="nvlink", interconnect_gbs=300,
        source="NVIDIA A100 datasheet (2021) + A100 whitepaper table 'A100 SXM4 80GB'",
        aliases=("a100-80gb", "a100-sxm", "a100-sxm4-80gb", "a100"),
    ),
    GpuSpec(
        name="NVIDIA H100 80GB HBM3", arch="hopper", compute_capability=(9, 0), sms=132,
        base_mhz=1590, boost_mhz=1980, bf16_tflops=989.4, fp16_tflops=989.4, fp8_tflops=1978.9,
        tflops_at_mhz=1830,
        mem_bw_gbs=3350, mem_gb=80, l2_mb=50, tdp_w=700, interconnect="nvlink", interconnect_gbs=450,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5) + H100 whitepaper (TFLOP/s at 1830 MHz)",
        aliases=("h100-sxm", "h100-sxm5", "h100", "h100-80gb"),
    ),
)
# fmt: on


def _norm(s: str) -> str:
    return "".join(ch for ch in s.lower() if ch.isalnum())


def _index() -> dict[str, GpuSpec]:
    idx: dict[str, GpuSpec] = {}
    for g in CATALOG:
        for key in (g.name, *g.nvml_names, *g.aliases):
            idx[_norm(key)] = g
    return idx


_INDEX = _index()
_CUSTOM: dict[str, GpuSpec] = {}


def register(spec: GpuSpec) -> GpuSpec:
    """Add a device at run time (e.g. the CPU device measured by a microbenchmark)."""
    _CUSTOM[_norm(spec.name)] = spec
    for a in spec.aliases:
        _CUSTOM[_norm(a)] = spec
    return spec


def get_gpu(name: str | GpuSpec) -> GpuSpec:
    """Resolve an exact NVML name (``NVIDIA H100 80GB HBM3``) or a short alias (``h100-sxm``)."""
    if isinstance(name, GpuSpec):
        return name
    if not isinstance(name, str) or not name.strip():
        raise UnknownGpuError(f"GPU name must be a non-empty string, got {name!r}")
    key = _norm(name)
    spec = _CUSTOM.get(key) or _INDEX.get(key)
    if spec is not None:
        return spec
    choices = sorted({g.name for g in CATALOG} | {a for g in CATALOG for a in g.aliases})
    close = difflib.get_close_matches(name, choices, n=4, cutoff=0.4)
    if not close:
        close = [c for c in choices if key[:4] and key[:4] in _norm(c)][:4]
    hint = f"; close matches: {', '.join(close)}" if close else "; see `m2live gpus` for the catalog"
    raise UnknownGpuError(f"unknown GPU {name!r}{hint}")


def all_gpus() -> list[GpuSpec]:
    return list(CATALOG)
