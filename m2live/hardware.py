"""GPU catalog: datasheet numbers per SKU, each row with its source, and lookup by NVML name or alias.

Every number here is a datasheet (or vendor whitepaper) figure, never a fitted one. Conventions:
- ``boost_mhz`` is the maximum SM clock NVML reports (``nvmlDeviceGetMaxClockInfo(SM)``); f_clk is the live
  SM clock divided by it.
- ``bf16_tflops`` / ``fp16_tflops`` / ``fp8_tflops`` are *dense* tensor-core figures (no 2:4 sparsity),
  quoted by the vendor at ``tflops_at_mhz``; peak at clock f is ``tflops * f / tflops_at_mhz``.
- ``mem_bw_gbs`` is the peak DRAM bandwidth in GB/s (1e9 B/s); ``l2_mb`` the L2 cache in MiB.
- ``interconnect_gbs`` is the per-GPU, per-direction bandwidth to peers in GB/s (NVLink, else PCIe).
- ``mem_gb`` is the marketed capacity; ``mem_total_mib`` the total the driver reports (``nvidia-smi``'s
  Memory-Usage total, MiB, read off public nvidia-smi outputs) where known: the marketed "GB" is GiB on most HBM
  parts (H100 80 GB: 81559 MiB) and 10^9 B on others (B300 288 GB: 275040 MiB), and GDDR6 boards with ECC on
  give 1/16 of it to the check bits (L40S 48 GB: 46068 MiB). ``mem_bytes`` is what CUDA (and vLLM's memory
  profiling) sees as the device's total.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass

from . import limits

log = logging.getLogger("m2live")

# Inline (in-band) ECC on GDDR: 1 byte of check bits per 16 of data, stored in the same devices and read over the
# same channels — the capacity the driver reports shrinks to 15/16 and so does the bandwidth left for data
GIB = 1024**3  # a GiB, the unit vLLM's memory settings and logs use
INLINE_ECC_DATA_SHARE = 15 / 16


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
    memory: str = "DRAM"  # DRAM technology: HBM2 | HBM2e | HBM3 | HBM3e | GDDR6 | GDDR6X | GDDR7 (datasheets)
    aliases: tuple[str, ...] = ()
    nvml_names: tuple[str, ...] = ()  # other exact NVML strings the same part reports
    mem_total_mib: float | None = None  # nvidia-smi's memory total (MiB, public outputs); None: unknown

    def peak_flops(self, dtype: str = "bf16", clock_mhz: float | None = None) -> float:
        """Dense tensor FLOP/s at ``clock_mhz`` (default: boost)."""
        tf = {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops, "fp8": self.fp8_tflops}.get(dtype)
        if tf is None:
            raise ValueError(f"{self.name} has no dense {dtype} tensor throughput")
        f = self.boost_mhz if clock_mhz is None else clock_mhz
        return tf * 1e12 * f / self.tflops_at_mhz

    @property
    def kernel_family(self) -> str:
        """Which measured kernels this GPU runs, from its compute capability (not its marketing name):
        sm_80/86 Ampere (mma.sync GEMMs, FlashAttention-2), sm_89 Ada (the same instruction family),
        sm_90 Hopper (wgmma + TMA GEMMs, FlashAttention-3), sm_100/103 Blackwell data-centre (tcgen05 + TMEM
        GEMMs, FlashInfer TRT-LLM attention), sm_120 GB202 (RTX Blackwell: no tcgen05/TMEM and no wgmma —
        mma.sync GEMMs and FlashAttention-2, like Ampere/Ada)."""
        if self.arch == "cpu":
            return "cpu"
        major = self.compute_capability[0]
        if major >= 12:
            return "blackwell_rtx"
        if major == 10:
            return "blackwell"
        if major == 9:
            return "hopper"
        return "ada" if self.compute_capability >= (8, 9) else "ampere"

    @property
    def mem_bw(self) -> float:
        """Peak DRAM bandwidth in B/s."""
        return self.mem_bw_gbs * 1e9

    @property
    def inline_ecc(self) -> bool:
        """GDDR memory running ECC in-band: the driver's total (``mem_total_mib``) is 15/16 of the marketed GiB,
        the check bits' carve-out (L4, L40S, A40: ECC on by default on data-centre boards). HBM keeps its check
        bits in side-band devices, at no cost to the data's capacity or bandwidth (NVIDIA V100 whitepaper,
        "ECC Memory Resiliency": the GDDR5 of the K40 reserved 6.25 % for inline ECC; HBM2's side-band ECC has
        "no bandwidth or capacity penalty")."""
        return (self.memory.startswith("GDDR") and self.mem_total_mib is not None
                and self.mem_total_mib <= INLINE_ECC_DATA_SHARE * self.mem_gb * 1024)

    @property
    def has_fp8(self) -> bool:
        """Whether the tensor cores run fp8 (Ada, Hopper, Blackwell)."""
        return self.fp8_tflops is not None

    def no_fp8_reason(self) -> str:
        """Why fp8 weights cannot run here, in the one wording every caller gives."""
        return (f"{self.name} ({self.arch}) has no fp8 tensor cores: fp8 weights need an Ada, Hopper or Blackwell "
                "GPU (use bf16 here)")

    def require_fp8(self) -> None:
        """ValueError (``no_fp8_reason``) when this GPU has no fp8 tensor cores."""
        if not self.has_fp8:
            raise ValueError(self.no_fp8_reason())

    @property
    def data_bw(self) -> float:
        """DRAM bandwidth left for data, B/s: the peak, less the share inline ECC's check bits take on the same
        channels (one byte of check bits per 16 of data: INLINE_ECC_DATA_SHARE)."""
        return self.mem_bw * (INLINE_ECC_DATA_SHARE if self.inline_ecc else 1.0)

    @property
    def l2_bytes(self) -> float:
        return self.l2_mb * 1024 * 1024

    @property
    def sm_limits(self) -> tuple[int, int]:
        """(resident threads, resident CTAs) one SM holds at most, by compute capability (CUDA C++
        Programming Guide, "Technical Specifications per Compute Capability"): 8.0 / 9.0 / 10.x 2048 / 32;
        8.6 1536 / 16; 8.9 1536 / 24; 12.x 1536 / 32. They cap a latency-bound kernel's CTAs in flight."""
        cc = self.compute_capability
        if cc in ((8, 6), (8, 7)):
            return 1536, 16
        if cc == (8, 9):
            return 1536, 24
        if cc[0] >= 12:
            return 1536, 32
        return 2048, 32

    @property
    def exp_per_clk(self) -> int:
        """Base-2 exponentials (MUFU.EX2, the special-function units) one SM retires per clock: 16 on every
        compute capability from 5.0 to 12.x (CUDA C++ Programming Guide, "Arithmetic Instructions" throughput
        table), doubled to 32 on Blackwell Ultra, 10.3 (NVIDIA's Blackwell Ultra technical blogs: "attention
        acceleration" 10.7 TeraExponentials/s on B300 / GB300 against 5 on B200 / GB200). Every attention score
        costs one: it bounds a prefill kernel whose tensor cores retire more query-key pairs per clock. 0 on the
        CPU device: its exponentials are in the attention efficiency it measures."""
        if self.arch == "cpu":
            return 0
        return 32 if self.compute_capability == (10, 3) else 16

    @property
    def fp32_per_clk(self) -> int:
        """32-bit floating-point adds / multiplies / FMAs one SM retires per clock (CUDA C++ Programming Guide,
        "Arithmetic Instructions" throughput table): 64 on compute capability 8.0 (GA100: 64 FP32 lanes per SM),
        128 on 8.6 / 8.7 / 8.9 (GA10x, Ada: a second FP32 datapath), 9.0, 10.x and 12.x. A kernel whose softmax
        runs in the same warps as its MMAs (FlashAttention-2) pays these in series with the tensor cores. 0 on the
        CPU device."""
        if self.arch == "cpu":
            return 0
        return 64 if self.compute_capability == (8, 0) else 128

    @property
    def link_bw(self) -> float:
        """Per-direction interconnect bandwidth in B/s."""
        return self.interconnect_gbs * 1e9

    @property
    def mem_bytes(self) -> float:
        """Device memory CUDA reports as total (``torch.cuda.mem_get_info()[1]``, what vLLM's
        ``gpu_memory_utilization`` is a fraction of): nvidia-smi's total less CUDA_RESERVED_MIB. Where the total is
        not known, the marketed capacity: in GiB on an HBM part (as on the H100 and H200, whose nvidia-smi totals
        sit 361 and 613 MiB below it: one more CUDA_RESERVED_MIB off), in 10^9 B on the others."""
        if self.mem_total_mib:
            return (self.mem_total_mib - CUDA_RESERVED_MIB) * 2**20
        if self.memory.startswith("HBM"):
            return (self.mem_gb * 1024 - 2 * CUDA_RESERVED_MIB) * 2**20
        return self.mem_gb * 1e9


# GPUs one tensor-parallel group spans at most in m2live: an HGX / DGX board's NVLink domain (8), or a server's PCIe
# GPUs; a larger TP reaches across nodes (InfiniBand, ~50 GB/s a GPU), whose all-reduces m2live does not model
MAX_TP_IN_NODE = 8


def tp_beyond_node(gpu: GpuSpec, tp: int) -> str:
    """Why ``tp`` GPUs of ``gpu`` are beyond what m2live models ('' when they are not)."""
    if tp > MAX_TP_IN_NODE:
        return (f"TP={tp} spans more than one node of {MAX_TP_IN_NODE} {gpu.name} GPUs: m2live models all-reduces "
                f"inside one node's NVLink or PCIe fabric (TP <= {MAX_TP_IN_NODE})")
    return ""


# nvidia-smi's total less what CUDA reports as total (MiB): 614 on the H200 the GPU probe ran on (143771 MiB against
# torch's 150.11e9 B, results/probe/h200-20261204, validation only), ~610 on a public RTX PRO 6000 Server log
# (97887 MiB, torch 102.0 GB), 717 on a public B200 one (183359 against 182642 MiB)
CUDA_RESERVED_MIB = 640


# fmt: off
# Derivations used below (stated per row in `source`):
# - "dense = sparse/2": NVIDIA datasheets quote tensor TFLOP/s with 2:4 sparsity (marked *); dense is half.
# - tflops_at_mhz, where not published, is solved from dense TF = SMs x (dense FLOP/clk/SM) x clock with the
#   per-SM tensor rate of that chip: GA100 2048, GA10x pro 1024, Ada pro 1024 (L40 and GeForce 512 with fp32
#   accumulate), GH100 4096, GB100/GB110 8192, GB202 pro 1024 (GeForce 512 with fp32 accumulate).
# - PCIe per direction: Gen4 x16 = 32 GB/s, Gen5 x16 = 64 GB/s (datasheets quote the bidirectional 64 / 128).
# - GeForce/RTX-workstation boards: NVML's max SM clock is a per-vBIOS V/F-table ceiling (~3.1 GHz) that the
#   board does not sustain, so boost_mhz there is the rated boost clock; pass live clocks in MHz.
CATALOG: tuple[GpuSpec, ...] = (
    # ---------------------------------------------------------------- Ampere
    GpuSpec(
        name="NVIDIA A100-SXM4-40GB", arch="ampere", compute_capability=(8, 0), sms=108,
        base_mhz=1095, boost_mhz=1410, bf16_tflops=312, fp16_tflops=312, fp8_tflops=None, tflops_at_mhz=1410,
        memory="HBM2", mem_bw_gbs=1555, mem_gb=40, mem_total_mib=40960, l2_mb=40, tdp_w=400, interconnect="nvlink", interconnect_gbs=300,
        source="NVIDIA A100 datasheet (A100 40GB SXM: 312 TF dense BF16, 1,555 GB/s, 400 W, NVLink3 600 GB/s "
               "total) + A100 whitepaper (108 SMs, 1410 MHz boost, 40 MB L2); base clock 1095 MHz per "
               "nvidia-smi default application clock",
        aliases=("a100-40gb", "a100-sxm4-40gb", "a100-sxm-40gb"),
    ),
    GpuSpec(
        name="NVIDIA A100-SXM4-80GB", arch="ampere", compute_capability=(8, 0), sms=108,
        base_mhz=1275, boost_mhz=1410, bf16_tflops=312, fp16_tflops=312, fp8_tflops=None, tflops_at_mhz=1410,
        memory="HBM2e", mem_bw_gbs=2039, mem_gb=80, mem_total_mib=81920, l2_mb=40, tdp_w=400, interconnect="nvlink", interconnect_gbs=300,
        source="NVIDIA A100 datasheet (2021) + A100 whitepaper table 'A100 SXM4 80GB'",
        aliases=("a100-80gb", "a100-sxm", "a100-sxm4-80gb", "a100", "a100-sxm-80gb"),
    ),
    GpuSpec(
        name="NVIDIA A100-PCIE-40GB", arch="ampere", compute_capability=(8, 0), sms=108,
        base_mhz=765, boost_mhz=1410, bf16_tflops=312, fp16_tflops=312, fp8_tflops=None, tflops_at_mhz=1410,
        memory="HBM2", mem_bw_gbs=1555, mem_gb=40, mem_total_mib=40960, l2_mb=40, tdp_w=250, interconnect="pcie", interconnect_gbs=32,
        source="NVIDIA A100 datasheet (A100 40GB PCIe: 312 TF dense BF16, 1,555 GB/s, 250 W, PCIe Gen4 "
               "64 GB/s bidirectional; the optional 2-GPU NVLink bridge is not assumed) + A100 whitepaper "
               "(108 SMs, 40 MB L2); base 765 MHz per the board's published clocks",
        aliases=("a100-pcie-40gb", "a100-pcie40"),
    ),
    GpuSpec(
        name="NVIDIA A100 80GB PCIe", arch="ampere", compute_capability=(8, 0), sms=108,
        base_mhz=1065, boost_mhz=1410, bf16_tflops=312, fp16_tflops=312, fp8_tflops=None, tflops_at_mhz=1410,
        memory="HBM2e", mem_bw_gbs=1935, mem_gb=80, mem_total_mib=81920, l2_mb=40, tdp_w=300, interconnect="pcie", interconnect_gbs=32,
        source="NVIDIA A100 datasheet (A100 80GB PCIe: 312 TF dense BF16, 1,935 GB/s, 300 W, PCIe Gen4 "
               "64 GB/s bidirectional; optional NVLink bridge not assumed) + A100 whitepaper (108 SMs, 40 MB L2)",
        aliases=("a100-pcie", "a100-pcie-80gb", "a100-80gb-pcie"),
        nvml_names=("NVIDIA A100-PCIE-80GB",),
    ),
    GpuSpec(
        name="NVIDIA A10", arch="ampere", compute_capability=(8, 6), sms=72,
        base_mhz=885, boost_mhz=1695, bf16_tflops=125, fp16_tflops=125, fp8_tflops=None, tflops_at_mhz=1695,
        memory="GDDR6", mem_bw_gbs=600, mem_gb=24, mem_total_mib=23028, l2_mb=6, tdp_w=150, interconnect="pcie",
        interconnect_gbs=32,
        source="NVIDIA A10 datasheet (BF16/FP16 tensor 125 | 250* TF, 24 GB GDDR6 600 GB/s, 150 W, PCIe Gen4); "
               "GA102 config 72 SMs, 885/1695 MHz, 6 MB L2 (125 TF = 72 x 1024 x 1695 MHz); 23028 MiB total in "
               "public nvidia-smi outputs with ECC on (the data-centre default; 24576 with it off)",
        aliases=("a10",),
    ),
    GpuSpec(
        name="NVIDIA A10G", arch="ampere", compute_capability=(8, 6), sms=80,
        base_mhz=885, boost_mhz=1710, bf16_tflops=70, fp16_tflops=70, fp8_tflops=None, tflops_at_mhz=1710,
        memory="GDDR6", mem_bw_gbs=600, mem_gb=24, mem_total_mib=23028, l2_mb=6, tdp_w=300, interconnect="pcie", interconnect_gbs=32,
        source="AWS EC2 G5 (A10G: 80 RT cores = 80 SMs, 24 GB GDDR6, 600 GB/s; nvidia-smi power cap 300 W); "
               "NVIDIA publishes no A10G datasheet: dense BF16 70 TF derived = 80 SMs x 512 FLOP/clk (GA102 "
               "fp32-accumulate rate, as third-party A10G spec sheets list 70 TF) x 1710 MHz boost; base "
               "clock assumed = A10 (885 MHz)",
        aliases=("a10g",),
    ),
    GpuSpec(
        name="NVIDIA A30", arch="ampere", compute_capability=(8, 0), sms=56,
        base_mhz=930, boost_mhz=1440, bf16_tflops=165, fp16_tflops=165, fp8_tflops=None, tflops_at_mhz=1440,
        memory="HBM2", mem_bw_gbs=933, mem_gb=24, l2_mb=24, tdp_w=165, interconnect="pcie", interconnect_gbs=32,
        source="NVIDIA A30 datasheet (BF16/FP16 165 | 330* TF, 24 GB HBM2 933 GB/s, 165 W, PCIe Gen4 64 GB/s; "
               "optional NVLink bridge 200 GB/s not assumed); GA100 config 56 SMs, 930/1440 MHz, 24 MB L2 "
               "(165 TF = 56 x 2048 x 1440 MHz)",
        aliases=("a30",),
    ),
    GpuSpec(
        name="NVIDIA A40", arch="ampere", compute_capability=(8, 6), sms=84,
        base_mhz=1305, boost_mhz=1740, bf16_tflops=149.7, fp16_tflops=149.7, fp8_tflops=None,
        tflops_at_mhz=1740,
        memory="GDDR6", mem_bw_gbs=696, mem_gb=48, mem_total_mib=46068, l2_mb=6, tdp_w=300, interconnect="pcie", interconnect_gbs=32,
        source="NVIDIA A40 datasheet (BF16 w/ FP32 acc 149.7 | 299.4* TF, 48 GB GDDR6 696 GB/s, 300 W, PCIe "
               "Gen4 64 GB/s; optional NVLink bridge 112.5 GB/s not assumed); GA102 84 SMs, 1305/1740 MHz, "
               "6 MB L2 (149.7 TF = 84 x 1024 x 1740 MHz)",
        aliases=("a40",),
    ),
    GpuSpec(
        name="NVIDIA RTX A6000", arch="ampere", compute_capability=(8, 6), sms=84,
        base_mhz=1410, boost_mhz=1800, bf16_tflops=154.8, fp16_tflops=154.8, fp8_tflops=None,
        tflops_at_mhz=1800,
        memory="GDDR6", mem_bw_gbs=768, mem_gb=48, mem_total_mib=49140, l2_mb=6, tdp_w=300, interconnect="pcie", interconnect_gbs=32,
        source="NVIDIA RTX A6000 datasheet (10,752 CUDA cores = 84 SMs, Tensor 309.7* TF -> 154.8 dense = 84 x "
               "1024 x 1800 MHz, 48 GB GDDR6 768 GB/s, 300 W, PCIe Gen4 x16; the 2-way NVLink bridge, 112.5 GB/s, "
               "not assumed); GA102 6 MB L2 as the A40; 49140 MiB as public nvidia-smi outputs show it (ECC off "
               "by default); base clock 1410 MHz a third-party listing",
        aliases=("rtxa6000", "a6000"),
    ),
    # ---------------------------------------------------------------- Ada Lovelace
    GpuSpec(
        name="NVIDIA L4", arch="ada", compute_capability=(8, 9), sms=58,
        base_mhz=795, boost_mhz=2040, bf16_tflops=121, fp16_tflops=121, fp8_tflops=242.5, tflops_at_mhz=2040,
        memory="GDDR6", mem_bw_gbs=300, mem_gb=24, mem_total_mib=23034, l2_mb=48, tdp_w=72, interconnect="pcie", interconnect_gbs=32,
        source="NVIDIA L4 datasheet (BF16/FP16 242* TF, FP8 485* TF -> dense = sparse/2; 24 GB GDDR6 300 GB/s, "
               "72 W, PCIe Gen4 x16 64 GB/s) + Ada whitepaper (AD104, 58 SMs, 795/2040 MHz, 48 MB L2; "
               "121 TF = 58 x 1024 x 2040 MHz)",
        aliases=("l4",),
    ),
    GpuSpec(
        name="NVIDIA L40", arch="ada", compute_capability=(8, 9), sms=142,
        base_mhz=735, boost_mhz=2490, bf16_tflops=181.05, fp16_tflops=181.05, fp8_tflops=362.1,
        tflops_at_mhz=2490,
        memory="GDDR6", mem_bw_gbs=864, mem_gb=48, mem_total_mib=46068, l2_mb=96, tdp_w=300, interconnect="pcie", interconnect_gbs=32,
        source="NVIDIA L40 datasheet (BF16/FP16 181.05 | 362.1* TF, FP8 362 | 724* TF, 48 GB GDDR6 864 GB/s, "
               "300 W, PCIe Gen4; no NVLink); AD102 142 SMs, 735/2490 MHz, 96 MB L2 "
               "(181.05 TF = 142 x 512 x 2490 MHz: fp32-accumulate half rate)",
        aliases=("l40",),
    ),
    GpuSpec(
        name="NVIDIA RTX 6000 Ada Generation", arch="ada", compute_capability=(8, 9), sms=142,
        base_mhz=915, boost_mhz=2505, bf16_tflops=364.2, fp16_tflops=364.2, fp8_tflops=728.5,
        tflops_at_mhz=2505,
        memory="GDDR6", mem_bw_gbs=960, mem_gb=48, mem_total_mib=49140, l2_mb=96, tdp_w=300, interconnect="pcie", interconnect_gbs=32,
        source="NVIDIA RTX 6000 Ada Generation datasheet (18,176 CUDA cores = 142 SMs, Tensor 1,457.0* TF FP8 -> "
               "728.5 dense, BF16 half of it = 142 x 1024 x 2505 MHz, 48 GB GDDR6 960 GB/s, 300 W, PCIe Gen4 x16, "
               "no NVLink); AD102 96 MB L2 as the L40S; 49140 MiB as public nvidia-smi outputs show it (ECC off by "
               "default); base clock 915 MHz a third-party listing",
        aliases=("rtx6000ada", "rtx6000-ada", "rtx-6000-ada"),
    ),
    GpuSpec(
        name="NVIDIA L40S", arch="ada", compute_capability=(8, 9), sms=142,
        base_mhz=1110, boost_mhz=2520, bf16_tflops=362.05, fp16_tflops=362.05, fp8_tflops=724.1,
        tflops_at_mhz=2490,
        memory="GDDR6", mem_bw_gbs=864, mem_gb=48, mem_total_mib=46068, l2_mb=96, tdp_w=350, interconnect="pcie", interconnect_gbs=32,
        source="NVIDIA L40S datasheet (BF16/FP16 362.05 | 733* TF, FP8 733 | 1,466* TF, 48 GB GDDR6 864 GB/s, "
               "350 W, PCIe Gen4 x16 64 GB/s; no NVLink); AD102 142 SMs, 1110/2520 MHz, 96 MB L2. BF16 "
               "362.05 = 142 x 1024 x 2490 MHz, so tflops_at_mhz = 2490; the datasheet FP8 (1,466*/2 = 733) "
               "is quoted at 2520 MHz and is rescaled here to 2490 MHz: 724.1 TF",
        aliases=("l40s", "l40s-48gb"),
    ),
    GpuSpec(
        name="NVIDIA GeForce RTX 4090", arch="ada", compute_capability=(8, 9), sms=128,
        base_mhz=2235, boost_mhz=2520, bf16_tflops=165.2, fp16_tflops=165.2, fp8_tflops=330.3,
        tflops_at_mhz=2520,
        memory="GDDR6X", mem_bw_gbs=1008, mem_gb=24, mem_total_mib=24564, l2_mb=72, tdp_w=450, interconnect="pcie", interconnect_gbs=32,
        source="NVIDIA Ada Lovelace architecture whitepaper, RTX 4090 column: FP16/BF16 tensor with FP32 "
               "accumulate 165.2 | 330.4* TF, FP8 with FP32 accumulate 330.3 | 660.6* TF (fp16-accumulate "
               "rates are 2x; cuBLAS bf16/fp8 GEMMs accumulate in fp32), 128 SMs, 2235/2520 MHz, 72 MB L2, "
               "24 GB GDDR6X 1,008 GB/s, 450 W, PCIe Gen4, no NVLink",
        aliases=("rtx4090", "4090", "geforce-rtx-4090"),
    ),
    # ---------------------------------------------------------------- Hopper
    GpuSpec(
        name="NVIDIA H100 80GB HBM3", arch="hopper", compute_capability=(9, 0), sms=132,
        base_mhz=1590, boost_mhz=1980, bf16_tflops=989.4, fp16_tflops=989.4, fp8_tflops=1978.9,
        tflops_at_mhz=1830,
        memory="HBM3", mem_bw_gbs=3350, mem_gb=80, mem_total_mib=81559, l2_mb=50, tdp_w=700, interconnect="nvlink", interconnect_gbs=450,
        source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (BF16 1,979* TF, FP8 3,958* TF -> dense = "
               "sparse/2; 80 GB HBM3 3.35 TB/s, up to 700 W, NVLink 900 GB/s = 450 per direction) + H100 "
               "whitepaper (132 SMs, 50 MB L2, TFLOP/s at 1830 MHz)",
        aliases=("h100-sxm", "h100-sxm5", "h100", "h100-80gb", "h100-sxm5-80gb", "h100-sxm-80gb"),
    ),
    GpuSpec(
        name="NVIDIA H100 PCIe", arch="hopper", compute_capability=(9, 0), sms=114,
        base_mhz=1125, boost_mhz=1755, bf16_tflops=756.5, fp16_tflops=756.5, fp8_tflops=1513,
        tflops_at_mhz=1620,
        memory="HBM2e", mem_bw_gbs=2000, mem_gb=80, mem_total_mib=81559, l2_mb=50, tdp_w=350, interconnect="pcie", interconnect_gbs=64,
        source="NVIDIA H100 datasheet, H100 PCIe column (BF16 1,513* TF, FP8 3,026* TF -> dense = sparse/2; "
               "80 GB HBM2e 2 TB/s, 300-350 W, PCIe Gen5 128 GB/s; optional NVLink bridge not assumed) + H100 "
               "whitepaper (114 SMs, 50 MB L2); 1125/1755 MHz board clocks; tflops_at_mhz derived: "
               "756.5 TF / (114 SMs x 4096 FLOP/clk) = 1620 MHz",
        aliases=("h100-pcie", "h100-pcie-80gb"),
    ),
    GpuSpec(
        name="NVIDIA H100 NVL", arch="hopper", compute_capability=(9, 0), sms=132,
        base_mhz=1080, boost_mhz=1785, bf16_tflops=835.5, fp16_tflops=835.5, fp8_tflops=1670.5,
        tflops_at_mhz=1545,
        memory="HBM3", mem_bw_gbs=3900, mem_gb=94, mem_total_mib=95830, l2_mb=50, tdp_w=400, interconnect="nvlink", interconnect_gbs=300,
        source="NVIDIA H100 datasheet, H100 NVL column (per GPU: BF16 1,671* TF, FP8 3,341* TF -> dense = "
               "sparse/2; 94 GB HBM3 3.9 TB/s, 350-400 W, NVLink bridge 600 GB/s = 300 per direction, PCIe "
               "Gen5 128 GB/s); 132 SMs, 1080/1785 MHz board clocks; tflops_at_mhz derived: "
               "835.5 TF / (132 x 4096) = 1545 MHz",
        aliases=("h100-nvl",),
    ),
    GpuSpec(
        name="NVIDIA H200", arch="hopper", compute_capability=(9, 0), sms=132,
        base_mhz=1590, boost_mhz=1980, bf16_tflops=989.4, fp16_tflops=989.4, fp8_tflops=1978.9,
        tflops_at_mhz=1830,
        memory="HBM3e", mem_bw_gbs=4800, mem_gb=141, mem_total_mib=143771, l2_mb=60, tdp_w=700, interconnect="nvlink", interconnect_gbs=450,
        source="NVIDIA H200 datasheet, H200 SXM column (BF16 1,979* TF, FP8 3,958* TF -> dense = sparse/2; "
               "141 GB HBM3e 4.8 TB/s, up to 700 W, NVLink 900 GB/s = 450 per direction); same GH100 SM "
               "configuration and clocks as H100 SXM5 (132 SMs, 1590/1980 MHz, TF at 1830 MHz); L2 60 MiB: "
               "cudaDeviceProp.l2CacheSize = 62914560 read on an H200 by m2live probe, 2026-12-04 (the H100 SXM5 "
               "reports 50 MiB)",
        aliases=("h200", "h200-sxm", "h200-141gb", "h200-sxm-141gb"),
    ),
    GpuSpec(
        name="NVIDIA H200 NVL", arch="hopper", compute_capability=(9, 0), sms=132,
        base_mhz=1080, boost_mhz=1785, bf16_tflops=835.5, fp16_tflops=835.5, fp8_tflops=1670.5,
        tflops_at_mhz=1545,
        memory="HBM3e", mem_bw_gbs=4800, mem_gb=141, mem_total_mib=143771, l2_mb=60, tdp_w=600, interconnect="nvlink", interconnect_gbs=450,
        source="NVIDIA H200 datasheet, H200 NVL column (BF16 1,671* TF, FP8 3,341* TF -> dense = sparse/2; "
               "141 GB HBM3e 4.8 TB/s, up to 600 W, 2-/4-way NVLink bridge 900 GB/s = 450 per direction, PCIe "
               "Gen5 128 GB/s); clocks not published: assumed = H100 NVL (1080/1785 MHz), tflops_at_mhz "
               "derived 835.5 TF / (132 x 4096) = 1545 MHz; L2 assumed = H200 SXM (60 MiB, read on one)",
        aliases=("h200-nvl",),
    ),
    GpuSpec(
        name="NVIDIA H20", arch="hopper", compute_capability=(9, 0), sms=78,
        base_mhz=1590, boost_mhz=1980, bf16_tflops=148, fp16_tflops=148, fp8_tflops=296, tflops_at_mhz=1980,
        memory="HBM3", mem_bw_gbs=4000, mem_gb=96, l2_mb=60, tdp_w=400, interconnect="nvlink", interconnect_gbs=450,
        source="NVIDIA H20 product brief as reported (BF16/FP16 148 TF dense, FP8 296 TF, 96 GB HBM3 4.0 TB/s, "
               "60 MB L2, 400 W, NVLink 900 GB/s = 450 per direction); 78 SMs from its Geekbench/CUDA device "
               "report. Its tensor rate is capped by the product definition (148 TF is ~23% of 78 SMs x 4096 "
               "x 1980 MHz), so tflops_at_mhz is set to the boost clock; clocks assumed = H100 SXM5 "
               "(1590/1980 MHz)",
        aliases=("h20",),
    ),
    GpuSpec(
        name="NVIDIA GH200 480GB", arch="hopper", compute_capability=(9, 0), sms=132,
        base_mhz=1590, boost_mhz=1980, bf16_tflops=989.4, fp16_tflops=989.4, fp8_tflops=1978.9,
        tflops_at_mhz=1830,
        memory="HBM3", mem_bw_gbs=4000, mem_gb=96, l2_mb=50, tdp_w=700, interconnect="nvlink", interconnect_gbs=450,
        source="NVIDIA GH200 Grace Hopper Superchip datasheet (GPU: BF16 1,979* TF, FP8 3,958* TF -> dense = "
               "sparse/2, 96 GB HBM3 4 TB/s; module TDP configurable 450-1000 W incl. CPU and LPDDR5X; "
               "NVLink-C2C 900 GB/s to Grace; NVLink4 900 GB/s = 450 per direction to GPU peers); GPU power "
               "cap 700 W as nvidia-smi reports it on the common 480GB configuration (some report 900 W); "
               "H100 SXM5 die configuration (132 SMs, 1590/1980 MHz, 50 MB L2, TF at 1830 MHz). "
               "'NVIDIA GH200 120GB' is the same GPU with less Grace memory",
        aliases=("gh200", "gh200-480gb", "gh200-96gb"),
        nvml_names=("NVIDIA GH200 120GB",),
    ),
    GpuSpec(
        name="NVIDIA GH200 144G HBM3e", arch="hopper", compute_capability=(9, 0), sms=132,
        base_mhz=1590, boost_mhz=1980, bf16_tflops=989.4, fp16_tflops=989.4, fp8_tflops=1978.9,
        tflops_at_mhz=1830,
        memory="HBM3e", mem_bw_gbs=4900, mem_gb=144, l2_mb=50, tdp_w=900, interconnect="nvlink", interconnect_gbs=450,
        source="NVIDIA GH200 datasheet, HBM3e variant (144 GB HBM3e 4.9 TB/s; same Hopper GPU: BF16 1,979* TF, "
               "FP8 3,958* TF -> dense = sparse/2; NVLink4 450 GB/s per direction); GPU power cap 900 W assumed "
               "(module configurable up to 1000 W); die configuration and clocks as H100 SXM5",
        aliases=("gh200-144gb", "gh200-hbm3e"),
    ),
    # ---------------------------------------------------------------- Blackwell
    GpuSpec(
        name="NVIDIA B200", arch="blackwell", compute_capability=(10, 0), sms=148,
        base_mhz=1665, boost_mhz=1965, bf16_tflops=2250, fp16_tflops=2250, fp8_tflops=4500, tflops_at_mhz=1856,
        memory="HBM3e", mem_bw_gbs=8000, mem_gb=180, mem_total_mib=183359, l2_mb=126.5, tdp_w=1000, interconnect="nvlink", interconnect_gbs=900,
        source="NVIDIA DGX/HGX B200 datasheet per GPU (FP16/BF16 36 PF* and FP8 72 PF* per 8 GPUs -> 2.25 / "
               "4.5 PF dense; 1,440 GB and 64 TB/s per 8 GPUs -> 180 GB, 8 TB/s; 1000 W; NVLink5 1.8 TB/s = 900 "
               "per direction); 148 SMs and 126.5 MiB L2 from the CUDA device properties; 1965 MHz = NVML max "
               "SM clock; tflops_at_mhz derived 2250 TF / (148 x 8192) = 1856 MHz; base 1665 MHz is a "
               "third-party listing (not published by NVIDIA)",
        aliases=("b200", "b200-sxm", "b200-180gb", "b200-192gb", "b200-sxm-180gb", "b200-sxm-192gb"),
    ),
    GpuSpec(
        name="NVIDIA B300 SXM6 AC", arch="blackwell", compute_capability=(10, 3), sms=148,
        base_mhz=1665, boost_mhz=2032, bf16_tflops=2250, fp16_tflops=2250, fp8_tflops=4500, tflops_at_mhz=1856,
        memory="HBM3e", mem_bw_gbs=8000, mem_gb=288, mem_total_mib=275040, l2_mb=126.5, tdp_w=1100, interconnect="nvlink", interconnect_gbs=900,
        source="NVIDIA HGX B300 datasheet per GPU (FP16/BF16 2.25 PF dense = 4.5 PF*, FP8 4.5 PF dense = 9 PF*; "
               "288 GB HBM3e 8 TB/s; NVLink5 1.8 TB/s = 900 per direction); 148 SMs (sm_103) and 2032 MHz max "
               "SM clock and 1100 W power cap as nvidia-smi / CUDA report them on HGX B300; L2 and base clock "
               "assumed = B200; tflops_at_mhz derived as for B200 (1856 MHz)",
        aliases=("b300", "b300-sxm6", "b300-sxm"),
    ),
    GpuSpec(
        name="NVIDIA GB200", arch="blackwell", compute_capability=(10, 0), sms=148,
        base_mhz=1665, boost_mhz=2062, bf16_tflops=2500, fp16_tflops=2500, fp8_tflops=5000, tflops_at_mhz=2062,
        memory="HBM3e", mem_bw_gbs=8000, mem_gb=186, mem_total_mib=189471, l2_mb=126.5, tdp_w=1200, interconnect="nvlink", interconnect_gbs=900,
        source="NVIDIA GB200 NVL72 datasheet per GPU (FP16/BF16 360 PF* and FP8 720 PF* per 72 GPUs -> 2.5 / "
               "5 PF dense; 13.4 TB HBM3e and 576 TB/s per 72 GPUs -> 186 GB, 8 TB/s; NVLink5 1.8 TB/s = 900 "
               "per direction); the B200's die (148 SMs, 126.5 MiB L2, base clock: assumed); 2062 MHz max SM "
               "clock and 189471 MiB as nvidia-smi reports them on a public GB200 node (the 2.5 PF = 148 x 8192 "
               "x 2062 MHz, so the TF are quoted at that clock); 1200 W GPU power limit, the rated power public "
               "benchmark set-ups use for GB200",
        aliases=("gb200", "gb200-nvl72", "gb200-nvl4", "gb200-sxm"),
    ),
    GpuSpec(
        name="NVIDIA GB300", arch="blackwell", compute_capability=(10, 3), sms=148,
        base_mhz=1665, boost_mhz=2070, bf16_tflops=2500, fp16_tflops=2500, fp8_tflops=5000, tflops_at_mhz=2062,
        memory="HBM3e", mem_bw_gbs=8000, mem_gb=288, mem_total_mib=275040, l2_mb=126.5, tdp_w=1400, interconnect="nvlink", interconnect_gbs=900,
        source="NVIDIA GB300 NVL72 datasheet (FP8 360 PF dense per 72 GPUs -> 5 PF, BF16 half of it: 2.5 PF "
               "dense; 288 GB HBM3e 8 TB/s per GPU; NVLink5 1.8 TB/s = 900 per direction); 1400 W default and "
               "maximum power limit and 2070 MHz max SM clock as a public benchmark set-up reads them on GB300 "
               "(2026); SMs, L2, base clock and nvidia-smi's memory total assumed = HGX B300 (148 SMs, sm_103); "
               "tflops_at_mhz derived 2500 TF / (148 x 8192) = 2062 MHz",
        aliases=("gb300", "gb300-nvl72", "gb300-sxm"),
    ),
    GpuSpec(
        name="NVIDIA RTX PRO 6000 Blackwell Server Edition", arch="blackwell", compute_capability=(12, 0),
        sms=188, base_mhz=1590, boost_mhz=2617, bf16_tflops=503.8, fp16_tflops=503.8, fp8_tflops=1007.6,
        tflops_at_mhz=2617,
        memory="GDDR7", mem_bw_gbs=1597, mem_gb=96, mem_total_mib=97887, l2_mb=128, tdp_w=600, interconnect="pcie", interconnect_gbs=64,
        source="NVIDIA RTX PRO 6000 Blackwell Server Edition product page (FP16/BF16 1 PF*, FP8 2 PF*, "
               "96 GB GDDR7 1,597 GB/s, up to 600 W, PCIe Gen5 x16 128 GB/s, no NVLink) + RTX Blackwell "
               "whitepaper (GB202, 188 SMs, 128 MB L2; FP16/BF16 with FP32 accumulate 503.8 | 1,007.6* TF, "
               "FP8 1,007.6 dense = 188 x 1024/2048 x 2617 MHz); base/boost 1590/2617 MHz per the "
               "Workstation board (server clocks not published separately)",
        aliases=("rtxpro6000", "rtxpro6000-server", "pro6000-server", "rtx6000pro", "rtx6000pro-server",
                 "rtxpro6000-96gb"),
    ),
    GpuSpec(
        name="NVIDIA RTX PRO 6000 Blackwell Workstation Edition", arch="blackwell", compute_capability=(12, 0),
        sms=188, base_mhz=1590, boost_mhz=2617, bf16_tflops=503.8, fp16_tflops=503.8, fp8_tflops=1007.6,
        tflops_at_mhz=2617,
        memory="GDDR7", mem_bw_gbs=1792, mem_gb=96, mem_total_mib=97887, l2_mb=128, tdp_w=600, interconnect="pcie", interconnect_gbs=64,
        source="NVIDIA RTX PRO 6000 Blackwell Workstation Edition datasheet (24,064 CUDA cores = 188 SMs, "
               "125 TF FP32 and 4000 AI TOPS* at boost, 96 GB GDDR7 512-bit 1,792 GB/s, 600 W, PCIe Gen5 x16, "
               "no NVLink) + RTX Blackwell whitepaper (FP16/BF16 with FP32 accumulate 503.8 | 1,007.6* TF, "
               "FP8 1,007.6 dense; 1590/2617 MHz; 128 MB L2)",
        aliases=("rtxpro6000-ws", "pro6000-ws", "rtx6000pro-ws"),
    ),
    GpuSpec(
        name="NVIDIA GeForce RTX 5090", arch="blackwell", compute_capability=(12, 0), sms=170,
        base_mhz=2017, boost_mhz=2407, bf16_tflops=209.5, fp16_tflops=209.5, fp8_tflops=419,
        tflops_at_mhz=2407,
        memory="GDDR7", mem_bw_gbs=1792, mem_gb=32, mem_total_mib=32607, l2_mb=96, tdp_w=575, interconnect="pcie", interconnect_gbs=64,
        source="NVIDIA RTX Blackwell GPU architecture whitepaper, RTX 5090 column (170 SMs, 2017/2407 MHz, "
               "96 MB L2, 32 GB GDDR7 1,792 GB/s, 575 W, PCIe Gen5, no NVLink): FP16/BF16 tensor with FP32 "
               "accumulate 209.5 | 419* TF, FP8 with FP32 accumulate 419 | 838* TF (fp16-accumulate rates 2x; "
               "209.5 = 170 x 512 x 2407 MHz)",
        aliases=("rtx5090", "5090", "geforce-rtx-5090"),
    ),
)
# fmt: on


def norm_name(s: str) -> str:
    """A name compared case- and punctuation-insensitively (GPU names and aliases, model presets)."""
    return "".join(ch for ch in s.lower() if ch.isalnum())


def _gpu_key(name: str) -> str:
    """A GPU name as the catalog looks it up: ``norm_name`` without the vendor or the board's system name in front,
    so that a name or alias is found with or without them ("NVIDIA H100-SXM5-80GB", "b300", "NVIDIA B300", "HGX
    B200", "NVIDIA DGX H100": an HGX / DGX system's GPU)."""
    key = norm_name(name).removeprefix("nvidia")
    for system in ("hgx", "dgx"):
        key = key.removeprefix(system)
    return key


def _index() -> dict[str, GpuSpec]:
    idx: dict[str, GpuSpec] = {}
    for g in CATALOG:
        for key in (g.name, *g.nvml_names, *g.aliases):
            if idx.setdefault(_gpu_key(key), g) is not g:
                raise ImportError(f"GPU name {key!r} of {g.name} is also {idx[_gpu_key(key)].name}'s")
    return idx


_INDEX = _index()
_CUSTOM: dict[str, GpuSpec] = {}
# where a description of a GPU outside the catalog came from, weakest first (adopt decides between two by it)
DESCRIPTION_ORIGINS = ("calibration", "file", "device")
DESCRIPTION_ORIGINS_SAID = ("a calibration's copy", "another description", "the device's reading")
_ORIGIN: dict[str, int] = {}  # name key -> the origin index of the description registered under it


def _lookup(key: str) -> GpuSpec | None:
    """The GPU a name key (``_gpu_key``) names: a description registered in this process, else the catalog's."""
    return _CUSTOM.get(key) or _INDEX.get(key)


# what spec sheets and cloud catalogues write after a GPU's name: its memory's size and technology, "B300 288GB
# HBM3e". A name not found as written is looked up without them, and taken when they are that GPU's own: the
# technology its memory's, the size its memory's in GB
_MEMORY_WORDS = frozenset({"hbm3e", "hbm3", "hbm2e", "hbm2", "gddr7", "gddr6x", "gddr6"})
_MEMORY_SIZE = re.compile(r"(\d{1,4})g(?:b|ib)?")


def _by_memory_words(name: str) -> GpuSpec | None:
    """The GPU ``name`` means with its last words taken off when they are its memory's technology and size: the
    technology first (the size may tell two boards apart, "A100 40GB HBM2"), then the size."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    tech = words.pop() if len(words) > 1 and words[-1] in _MEMORY_WORDS else None
    size = _MEMORY_SIZE.fullmatch(words[-1]) if len(words) > 1 else None
    tries = ([(words, None)] if tech is not None else []) + ([(words[:-1], size)] if size else [])
    for rest, gb in tries:
        found = _lookup(_gpu_key(" ".join(rest)))
        if found is None:
            continue
        if (tech is not None and norm_name(found.memory) != tech) or (gb and int(gb.group(1)) != round(found.mem_gb)):
            return None  # the GPU that name is, with another memory: no GPU
        return found
    return None


def register(spec: GpuSpec) -> GpuSpec:
    """Add a device at run time (e.g. the CPU device measured by a microbenchmark)."""
    for key in (spec.name, *spec.aliases, *spec.nvml_names):
        _CUSTOM[_gpu_key(key)] = spec
    return spec


def get_gpu(name: str | GpuSpec) -> GpuSpec:
    """Resolve an exact NVML name (``NVIDIA H100 80GB HBM3``) or a short alias (``h100-sxm``), the vendor in front
    or not — or a JSON file describing a GPU the catalog lacks (``*.json``: ``load_spec_file``)."""
    if isinstance(name, GpuSpec):
        return name
    if not isinstance(name, str) or not name.strip():
        raise UnknownGpuError(f"GPU name must be a non-empty string, got {name!r}")
    if name.strip().lower().endswith(".json"):
        return load_spec_file(name.strip())
    spec = _lookup(_gpu_key(name)) or _by_memory_words(name)
    if spec is not None:
        return spec
    close = close_matches(name)
    hint = f"; close matches: {', '.join(close)}" if close else "; see `m2live gpus` for the catalog"
    raise UnknownGpuError(f"unknown GPU {name!r}{hint}")


def arch_of(cc: tuple[int, int]) -> str:
    """The catalog's architecture name for a compute capability; ValueError outside Ampere .. Blackwell."""
    if cc in ((8, 0), (8, 6), (8, 7)):
        return "ampere"
    if cc == (8, 9):
        return "ada"
    if cc == (9, 0):
        return "hopper"
    if cc[0] in (10, 12):
        return "blackwell"
    raise ValueError(f"compute capability {cc[0]}.{cc[1]} is outside what m2live models (Ampere 8.0 to "
                     "Blackwell 12.x)")


# A GPU described in a JSON file: the fields of a row of `m2live gpus --json` (which adds the three display-only
# keys below), the derived ones optional, every number within its limits.py bound
SPEC_REQUIRED = ("name", "compute_capability", "sms", "boost_mhz", "bf16_tflops", "memory", "mem_bw_gbs",
                 "mem_gb", "l2_mb", "tdp_w", "interconnect", "interconnect_gbs", "source")
SPEC_DISPLAY = ("cuda_total_gib", "inline_ecc", "data_bw_gbs")
MEMORY_TECHNOLOGIES = ("HBM2", "HBM2e", "HBM3", "HBM3e", "GDDR6", "GDDR6X", "GDDR7")
INTERCONNECTS = ("nvlink", "pcie", "c2c", "none")
SPEC_BOUNDS = {"sms": limits.GPU_SMS, "boost_mhz": limits.CLOCK_MHZ, "base_mhz": limits.CLOCK_MHZ,
               "tflops_at_mhz": limits.CLOCK_MHZ, "bf16_tflops": limits.GPU_TFLOPS, "fp16_tflops": limits.GPU_TFLOPS,
               "fp8_tflops": limits.GPU_TFLOPS, "mem_bw_gbs": limits.MEM_BW_GBS, "mem_gb": limits.MEM_GB,
               "mem_total_mib": limits.MEM_TOTAL_MIB, "l2_mb": limits.L2_MB, "tdp_w": limits.TDP_W,
               "interconnect_gbs": limits.LINK_GBS}


def spec_from_dict(doc: object, where: str = "GPU spec") -> GpuSpec:
    """A GpuSpec from a JSON object in the form `m2live gpus --json` writes; UnknownGpuError (one line) naming the
    field that is missing, unknown, of the wrong type or out of range."""
    def bad(msg: str) -> UnknownGpuError:
        return UnknownGpuError(f"{where}: {msg}")

    if not isinstance(doc, dict):
        raise bad("a GPU spec is a JSON object (a row of `m2live gpus --json`)")
    fields = {f.name for f in dataclasses.fields(GpuSpec)}
    unknown = sorted(set(doc) - fields - set(SPEC_DISPLAY))
    if unknown:
        raise bad(f"unknown field {unknown[0]!r} (fields: {', '.join(sorted(fields))})")
    missing = [k for k in SPEC_REQUIRED if doc.get(k) is None]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    for k in ("name", "source", "memory", "interconnect"):
        if not isinstance(doc[k], str) or not doc[k].strip():
            raise bad(f"{k} must be a non-empty string, got {doc[k]!r}")
    check_spec_name(doc["name"], "name", bad)
    cc = doc["compute_capability"]
    if not (isinstance(cc, list | tuple) and len(cc) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in cc)):
        raise bad(f"compute_capability must be [major, minor], got {cc!r}")
    cc = (int(cc[0]), int(cc[1]))
    try:
        arch = arch_of(cc)
    except ValueError as e:
        raise bad(str(e)) from None
    if doc.get("arch") not in (None, arch):
        raise bad(f"arch {doc['arch']!r} is not compute capability {cc[0]}.{cc[1]}'s ({arch})")
    if doc["memory"] not in MEMORY_TECHNOLOGIES:
        raise bad(f"memory {doc['memory']!r} is not one of {', '.join(MEMORY_TECHNOLOGIES)}")
    if doc["interconnect"] not in INTERCONNECTS:
        raise bad(f"interconnect {doc['interconnect']!r} is not one of {', '.join(INTERCONNECTS)}")
    num: dict[str, float] = {}
    for k, bound in SPEC_BOUNDS.items():
        if doc.get(k) is not None:
            try:
                num[k] = bound.check(doc[k], k)
            except ValueError as e:
                raise bad(str(e)) from None
    boost = num["boost_mhz"]
    base = num.get("base_mhz", boost)
    if base > boost:
        raise bad(f"base_mhz {base:g} is above boost_mhz {boost:g}")
    fp8 = num.get("fp8_tflops")
    if fp8 is None and "fp8_tflops" not in doc and cc >= (8, 9):
        fp8 = 2 * num["bf16_tflops"]  # Ada and later: twice the bf16 rate
    if fp8 is not None and cc < (8, 9):
        raise bad(f"fp8_tflops given for compute capability {cc[0]}.{cc[1]}, whose tensor cores have no fp8")
    names: list[str] = []
    for k in ("aliases", "nvml_names"):
        v = doc.get(k) or []
        if not (isinstance(v, list) and all(isinstance(a, str) and a.strip() for a in v)):
            raise bad(f"{k} must be a list of names, got {v!r}")
        for a in v:
            check_spec_name(a, k, bad)
        names.append(v)
    total = num.get("mem_total_mib")
    if total is not None and not (max(2 * CUDA_RESERVED_MIB, 0.85 * num["mem_gb"] * 1024) <= total
                                  <= 1.1 * num["mem_gb"] * 1024):
        raise bad(f"mem_total_mib {total:g} does not fit mem_gb {num['mem_gb']:g} (the driver reports 0.85-1.1 "
                  f"of the marketed capacity, and at least {2 * CUDA_RESERVED_MIB} MiB)")
    return GpuSpec(
        name=doc["name"].strip(), arch=arch, compute_capability=cc, sms=int(num["sms"]), base_mhz=base,
        boost_mhz=boost, bf16_tflops=num["bf16_tflops"], fp16_tflops=num.get("fp16_tflops", num["bf16_tflops"]),
        fp8_tflops=fp8, tflops_at_mhz=num.get("tflops_at_mhz", boost), mem_bw_gbs=num["mem_bw_gbs"],
        mem_gb=num["mem_gb"], l2_mb=num["l2_mb"], tdp_w=num["tdp_w"], interconnect=doc["interconnect"],
        interconnect_gbs=num["interconnect_gbs"], source=doc["source"].strip(), memory=doc["memory"],
        aliases=tuple(a.strip().lower() for a in names[0]), nvml_names=tuple(names[1]),
        mem_total_mib=num.get("mem_total_mib"),
    )


def spec_to_dict(spec: GpuSpec) -> dict:
    """``spec`` as plain JSON values, the form ``spec_from_dict`` reads (a GPU spec file, a calibration's
    ``gpu_spec``, a row of `m2live gpus --json` less its display-only keys)."""
    return json.loads(json.dumps(dataclasses.asdict(spec)))


SPEC_NAME_MAX_CHARS = 120  # NVML names are under 64 characters


def check_spec_name(name: str, what: str, bad: Callable[[str], Exception]) -> None:
    """A name a described GPU may take: printable, of a sensible length, that a lookup finds as itself (not empty
    once the vendor and system words are dropped, not a file name, not the CPU device's)."""
    if len(name) > SPEC_NAME_MAX_CHARS or not name.isprintable():
        raise bad(f"{what} {name[:40]!r}: a name is printable and at most {SPEC_NAME_MAX_CHARS} characters")
    key = _gpu_key(name)
    if not key or name.strip().lower().endswith(".json") or key in ("cpu", "cpudevice"):
        raise bad(f"{what} {name!r} cannot name a GPU (it would not look itself up)")


def load_spec_file(path: str) -> GpuSpec:
    """The GPU a JSON file describes (``spec_from_dict``: one object, or a list holding one), registered under
    its names for this process. A name the catalog or another file already gives a different GPU is refused: a
    calibration, a trace and a ranking name the GPU, so one name is one GPU. UnknownGpuError, one line."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open, a device read forever
            raise UnknownGpuError(f"GPU spec {path}: not a regular file")
        with open(path, "rb") as f:  # (nor a stray multi-GB file: a spec is ~1 KB)
            raw = f.read(limits.SPEC_FILE_MAX_BYTES + 1)
        if len(raw) > limits.SPEC_FILE_MAX_BYTES:
            raise UnknownGpuError(f"GPU spec {path}: larger than {limits.SPEC_FILE_MAX_BYTES} bytes; a GPU spec "
                                  "is one row of `m2live gpus --json`")
        text = raw.decode()
    except (OSError, UnicodeDecodeError, ValueError) as e:  # (ValueError: a NUL in the path)
        why = e.strerror.lower() if isinstance(e, OSError) and e.strerror else str(e)
        raise UnknownGpuError(f"GPU spec {path!r}: {why}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise UnknownGpuError(f"GPU spec {path}: not JSON ({e.msg}, line {e.lineno})") from None
    except (ValueError, RecursionError) as e:  # a 5,000-digit number; arrays nested past Python's recursion limit
        raise UnknownGpuError(f"GPU spec {path}: not a GPU spec ({e.__class__.__name__}: "
                              f"{str(e).splitlines()[0][:80] if str(e) else 'nested too deep'})") from None
    if isinstance(doc, list):
        if len(doc) != 1:
            raise UnknownGpuError(f"GPU spec {path}: a list of {len(doc)} GPUs; a spec file describes one")
        doc = doc[0]
    return adopt(spec_from_dict(doc, f"GPU spec {path}"), f"GPU spec {path}")


def adopt(spec: GpuSpec, where: str, origin: str = "file") -> GpuSpec:
    """The GPU a description outside the catalog names, registered under its names (one name is one GPU: a
    calibration, a trace and a ranking name it). ``origin`` (DESCRIPTION_ORIGINS, weakest first) decides between
    two descriptions of one name: a stronger one replaces a weaker one and a weaker one yields (the description in
    use is returned) — a calibration's copy yields to the run's own (a spec file, the device's reading), so a
    calibration taken in another PCIe slot or at another power limit still applies — each with a warning naming
    what differs; two files describing one name differently are refused, the device's re-reading replaces its
    own. A name the catalog gives another GPU is refused. UnknownGpuError, one line."""
    rank = DESCRIPTION_ORIGINS.index(origin)
    for key in (spec.name, *spec.aliases, *spec.nvml_names):
        k = _gpu_key(key)
        taken = _lookup(k)
        if taken is None or taken == spec:
            continue
        if _INDEX.get(k) is taken:
            raise UnknownGpuError(f"{where}: the name {key!r} is the catalog's {taken.name}; give this GPU a name "
                                  "of its own (a calibration, a trace and a ranking name the GPU)")
        held = _ORIGIN.get(k, DESCRIPTION_ORIGINS.index("file"))
        differs = "; ".join(differing_fields(spec, taken) if rank < held else differing_fields(taken, spec))
        if rank < held:
            log.warning("%s: its description of %s differs from the one in use (%s); the calibration's constants "
                        "apply to the one in use", where, key, differs)
            return taken
        if rank == held and origin != "device":
            raise UnknownGpuError(f"{where}: the name {key!r} already describes another GPU here ({taken.source}); "
                                  "one name is one GPU")
        log.warning("%s: %s is described otherwise than before (%s; before: %s); this description is used",
                    where, key, differs, DESCRIPTION_ORIGINS_SAID[held])
    register(spec)
    for key in (spec.name, *spec.aliases, *spec.nvml_names):
        _ORIGIN[_gpu_key(key)] = rank
    return spec


def differing_fields(a: GpuSpec, b: GpuSpec) -> list[str]:
    """The datasheet fields in which two descriptions of a GPU differ ("tdp_w 700 -> 1000"), its source aside."""
    out = []
    for f in dataclasses.fields(GpuSpec):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if f.name != "source" and va != vb:
            out.append(f"{f.name} {va!r} -> {vb!r}" if not isinstance(va, tuple) else f.name)
    return out


def in_catalog(spec: GpuSpec) -> bool:
    """Whether ``spec`` is a catalog row (not a GPU described by a file or read from a device)."""
    return _INDEX.get(_gpu_key(spec.name)) == spec


def close_matches(name: str, n: int = 4) -> list[str]:
    """Catalog names and aliases closest to ``name``, compared case- and punctuation-insensitively."""
    by_key: dict[str, str] = {}
    for g in CATALOG:
        for c in (g.name, *g.aliases):
            by_key.setdefault(norm_name(c), c)
    key = norm_name(name)
    # the NVML names share the "nvidia" prefix, which would dominate the similarity of short inputs
    strip = key.removeprefix("nvidia")
    scored = {c: max(difflib.SequenceMatcher(None, key, k).ratio(),
                     difflib.SequenceMatcher(None, strip, k.removeprefix("nvidia")).ratio())
              for k, c in by_key.items()}
    best = sorted((c for c, r in scored.items() if r >= 0.6), key=lambda c: -scored[c])[:n]
    if not best and len(strip) >= 3:
        best = [c for k, c in by_key.items() if strip[:4] in k][:n]
    return best


def all_gpus() -> list[GpuSpec]:
    return list(CATALOG)
