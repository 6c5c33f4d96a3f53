"""The efficiency factors of the step equation, each a named physical behaviour.

Compute branch:  eta_c = f_clk * eta_wave * eta_active * eta_duty
  f_clk      sustained SM clock / boost clock (live from NVML, forecast from the power cap, or 1 = boost)
  eta_wave   how completely the GEMM's tile grid fills the SMs: tile padding of M and N and the idle SMs of a
             partial last wave (with split-K when the grid is smaller than one wave)
  eta_active fraction of cycles the tensor cores issue MMAs instead of waiting on operand movement; it grows
             with the tile's arithmetic intensity BM*BN/(BM+BN) up to a per-architecture ceiling (a soft minimum)
  eta_duty   steady-state share of the kernel spent in the main loop: K/BK main-loop iterations against a fixed
             prologue/epilogue cost of K0/BK iterations, i.e. K / (K + K0)
Memory branch:   eta_mem = achieved / peak DRAM bandwidth, a per-architecture streaming ceiling; a fixed
  per-kernel latency is paid on top of both branches (launch inside a graph, pipeline fill, tail), and the
  two branches combine as a soft maximum (compute and memory never overlap perfectly near the ridge).

Every fitted constant in ``ARCH`` says what it was fitted on. Architectures that were never measured borrow the
constants of the nearest measured one (named in ``borrowed_from``); their datasheets do the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache


@dataclass(frozen=True)
class ArchConstants:
    """Per-architecture constants. Units: seconds, bytes, elements; efficiencies are ratios."""

    # --- GEMMs (cuBLAS / CUTLASS) ---
    eta_tc: float  # tensor-core ceiling of eta_active for an intense tile
    i_crit: float  # tile intensity BM*BN/(BM+BN) [elements] from which operand movement stops stalling MMAs
    k0: float  # prologue+epilogue cost of one output tile, in K elements of main-loop work (eta_duty)
    t_kernel: float  # fixed latency of one kernel (s): dispatch inside a CUDA graph, pipeline fill, tail
    eta_mem: float  # streaming DRAM efficiency (achieved / datasheet bandwidth)
    mem_ramp: float  # achieved DRAM bandwidth ramps with the bytes streamed: eta_mem * (1 - mem_ramp/sqrt(MB))
    overlap: float  # p of the soft roofline (tc^p + tm^p)^(1/p): imperfect compute/memory overlap near the ridge
    l2_speedup: float  # weight re-read from L2 (benchmark loops without a flush) vs from DRAM; never in serving
    # --- attention (vLLM's FlashAttention call: metadata, KV-cache write, the kernel) ---
    t_attn: float  # floor of one attention call (s): no call is faster (launches, metadata, KV write)
    t_attn_over: float  # fixed part of an attention call that does not overlap its body (s)
    eta_attn: float  # tensor-core ceiling of the fused attention kernel
    k0_attn: float  # per-CTA prologue/epilogue in key positions (eta_duty of attention)
    eta_attn_mem: float  # KV streaming efficiency of decode attention
    item_cost: float  # SM-time of one decode work item (one sequence x KV head): block table, softmax, write
    block_cost: float  # SM-time of one prefill work item (sequence x KV head x query block): setup, epilogue
    cta_bw: float  # bytes/s a single decode CTA can stream (outstanding loads / latency)
    k_split: float = 512.0  # shortest K slice the library's split-K kernels hand one CTA (split <= K / k_split)
    t_split: float = 0.0  # split-KV decode: the extra combine kernel that merges the partial softmaxes (s)
    t_relayout: float = 0.0  # FA2 grouped-query decode: copying q into (group x KV head) rows and out back (s)
    # kernel facts (not fitted): the decode kernel splits the KV only when query heads share KV heads
    split_needs_gqa: bool = False
    attn_row_pad: int = 0  # prefill query rows are padded to this block (0: the kernel packs heads, no padding)
    attn_block_m: int = 128  # query rows per prefill attention CTA
    cta_slots: int = 4  # decode CTAs resident per SM
    tiles: tuple[tuple[int, int], ...] = (
        (64, 64), (64, 128), (128, 64), (64, 256), (128, 128), (128, 256), (256, 128),
    )
    # fp8 only (ARCH_FP8): vLLM's CUDA input quantisation (scaled_fp8_quant) runs one CTA per token row
    q_row: float = 0.0  # SM-time one token row costs each quantisation kernel (s)
    eta_q: float = 1.0  # DRAM streaming efficiency of those kernels
    fitted_on: str = ""
    borrowed_from: str | None = None


# Fitted by bench/fit_constants.py (`make fit`) on ../shared/data/opbench ONLY: ampere on the A100-SXM4-80GB
# tables, hopper on the H100 80GB HBM3 tables (GEMMs with N,K in [1024, 16384], every M; prefill and decode
# attention with head_dim 128). results/constants.json holds the fit and its leave-one-GPU-out check. Reading:
# - eta_tc 1.00 (A100) vs 0.82 (H100) of peak at the NVML max clock: the H100's tensor figure is quoted at
#   1830 MHz, not its 1980 MHz max, and it runs below max under tensor load even in short bursts — part of
#   "eta_tc" on Hopper is f_clk, which is why the live clock matters most there.
# - eta_mem 0.83 (HBM2e, A100) vs 0.97 (HBM3, H100): achieved/peak DRAM bandwidth of long weight streams. The
#   ramp with the bytes W one kernel moves, (1 - mem_ramp/sqrt(W MB)), is the seed's law with mem_ramp = 1 on
#   every architecture: fitted independently it came out 1.07 (A100) and 1.00 (H100), so it is fixed, not fitted.
# - i_crit 37 vs 15 elements: the tile intensity at which operand feed stops limiting the MMAs (soft minimum,
#   ACTIVE_SOFTNESS): Hopper's wgmma reads operands from shared memory asynchronously, so smaller tiles still keep
#   the tensor cores busy; Ampere's mma.sync needs 128-wide tiles.
# - k0 367 / 191 K-elements: per-tile prologue/epilogue (Hopper's TMA pipeline fills faster).
# - k_split 768 / 1792 K-elements (chosen on a grid): the shortest K slice the library's split-K kernels give
#   one CTA — cuBLAS on Hopper splits K less eagerly than on Ampere.
# - t_kernel 1.5 / 1.8 us: a kernel's fixed time inside a CUDA graph (a split-K GEMM pays it twice: the
#   reduction); overlap p 2.4 / 3.2: how hard the roofline max is near the ridge.
# - attention: ~12 us floor of one vLLM attention call on both GPUs; FlashAttention-2 (A100) at 0.58 and
#   FlashAttention-3 (H100) at 0.65 of peak with a per-CTA prologue/epilogue worth 170 / 430 keys per query row
#   (FA2 pads a chunk's rows to blocks of 64: one head per CTA; FA3 packs the heads of a group, no padding);
#   ~4 us of SM time per (sequence x KV head) decode item, hidden behind streaming once CTAs share the SMs;
#   prefill block cost ~3 us on H100 and ~0 on A100 (there the padded-row prologue already carries it);
#   decode KV streams at 0.71 (A100) / 0.88 (H100) of peak DRAM bandwidth, one decode CTA at <= 22 / 23 GB/s
#   (read off plain multi-head decode, where FA2 runs one CTA per head over the whole cache); the split-KV
#   combine kernel costs 7 us on A100 and 2 us on H100; FA2's grouped-query relayout (q into group-rows and
#   the output back, two copies) 7 us.
ARCH: dict[str, ArchConstants] = {
    "ampere": ArchConstants(
        eta_tc=1.0, i_crit=36.51, k0=366.5, t_kernel=1.472e-06, eta_mem=0.8345, overlap=2.449,
        mem_ramp=1.0,  # the seed's eta_mem(W) law with c = 1 (not fitted: see above)
        l2_speedup=1.0,  # no measurable L2 re-read gain in opbench (fit: 1.00)
        k_split=768,
        t_attn=1.179e-05, t_attn_over=8.155e-06, eta_attn=0.5822, k0_attn=170.9, eta_attn_mem=0.7109,
        item_cost=4.099e-06, block_cost=2.318e-07, cta_bw=2.211e+10, t_split=7.227e-06, t_relayout=7.294e-06,
        split_needs_gqa=True,  # FlashAttention-2 varlen decode: split-KV only when heads > KV heads
        attn_row_pad=64,  # FlashAttention-2 prefill: one head per CTA, query rows in blocks of 64 (FA3 packs)
        fitted_on="opbench a100_sxm (NVIDIA A100-SXM4-80GB), bench/fit_constants.py",
    ),
    "hopper": ArchConstants(
        eta_tc=0.8215, i_crit=14.9, k0=191, t_kernel=1.821e-06, eta_mem=0.9719, overlap=3.209,
        mem_ramp=1.0, l2_speedup=1.0, k_split=1792,
        t_attn=1.194e-05, t_attn_over=9.201e-06, eta_attn=0.6493, k0_attn=434, eta_attn_mem=0.8793,
        item_cost=3.95e-06, block_cost=2.961e-06, cta_bw=2.333e+10, t_split=1.758e-06,
        fitted_on="opbench h100_sxm (NVIDIA H100 80GB HBM3), bench/fit_constants.py",
    ),
}
# Unmeasured architectures: nearest measured generation of the tensor-core/memory pipeline.
ARCH["ada"] = replace(ARCH["ampere"], borrowed_from="ampere (Ada keeps Ampere's mma.sync tensor pipeline)")
ARCH["blackwell"] = replace(ARCH["hopper"], borrowed_from="hopper (TMA + async tensor-core pipeline)")
# A CPU "device" (the plugin on a machine with no GPU): no tiles or waves; the online correction does the rest.
# The CPU device (m2live/cpu_device.py) measures the engine's own kernels' *effective* FLOP/s and bandwidth, so
# the GEMM factors are 1 here (eta_tc = 1, no operand-feed limit, full streaming efficiency); the per-call costs
# and the attention efficiencies below are defaults that cpu_device.device_constants replaces with measured ones.
ARCH["cpu"] = ArchConstants(
    eta_tc=1.0, i_crit=0.0, k0=0.0, t_kernel=5e-6, eta_mem=1.0, mem_ramp=0.0, overlap=8.0, l2_speedup=1.0,
    t_attn=10e-6, t_attn_over=5e-6, eta_attn=0.3, k0_attn=0.0, eta_attn_mem=0.6, item_cost=0.0,
    block_cost=0.0, cta_bw=1e12,
    attn_block_m=1, cta_slots=1, tiles=((1, 1),),
    fitted_on="not fitted: measured at start-up by m2live/cpu_device.py (the engine's linear and attention kernels)",
)


# The numbers bench/fit_constants.py fits, by the tables they are fitted on (GEMM rows, attention rows); everything
# else in ArchConstants is a kernel fact (tile shapes, query block, resident CTAs, split rule) that belongs to the
# architecture's kernels and never transfers between them.
FITTED_GROUPS: dict[str, tuple[str, ...]] = {
    "gemm": ("eta_tc", "i_crit", "k0", "t_kernel", "eta_mem", "overlap", "k_split"),
    "attention": ("t_attn", "t_attn_over", "eta_attn", "k0_attn", "eta_attn_mem", "item_cost", "block_cost",
                  "cta_bw", "t_split", "t_relayout"),
}
FITTED = tuple(n for group in FITTED_GROUPS.values() for n in group)


def transfer(target: ArchConstants, source: ArchConstants) -> ArchConstants:
    """``target``'s kernel facts with ``source``'s fitted numbers (the leave-one-GPU-out check)."""
    return replace(target, **{n: getattr(source, n) for n in FITTED}, fitted_on=source.fitted_on,
                   borrowed_from=None)


def arch_constants(arch: str, dtype: str = "bf16") -> ArchConstants:
    """The constants of ``arch``'s kernels for ``dtype``: bf16/fp16 (cuBLAS) or fp8 (``ARCH_FP8``, vLLM's CUTLASS
    scaled-mm; attention and the other fields stay the bf16 ones)."""
    table = ARCH_FP8 if dtype == "fp8" else ARCH
    try:
        return table[arch]
    except KeyError:
        raise ValueError(f"no {dtype} efficiency constants for architecture {arch!r}") from None


# eta_active is the soft minimum of the tensor-core ceiling and the operand feed of the tile (intensity / i_crit):
# (1 + (i_crit/I)^q)^(-1/q). q = 3 was chosen jointly on both calibration GPUs (2.5-3.5 score alike; with the
# other constants refitted the hard minimum, q -> infinity, scored 7.35 % / 5.93 % on the GEMM region against
# 6.9 % / 5.9 %): the two limits overlap near i_crit, like compute and memory near the ridge.
ACTIVE_SOFTNESS = 3.0


@dataclass(frozen=True)
class GemmEfficiency:
    eta_wave: float
    eta_active: float
    eta_duty: float
    tile: tuple[int, int]
    split_k: int
    waves: int


def gemm_efficiency(m: int, n: int, k: int, sms: int, c: ArchConstants) -> GemmEfficiency:
    """Pick the tile a good GEMM heuristic would pick (least time), and return its factors.

    For each candidate tile (BM, BN): the grid is ceil(M/BM)*ceil(N/BN) CTAs; if that is less than one wave,
    K is split so the grid fills the SMs (as cuBLAS split-K does for small-M GEMMs). Time in units of
    "one SM at peak" is waves * BM*BN*(K/split) / (eta_active * eta_duty); the least time wins.
    """
    best: tuple[float, GemmEfficiency] | None = None
    for bm, bn in c.tiles:
        tm, tn = -(-m // bm), -(-n // bn)
        ctas = tm * tn
        split = 1
        if ctas < sms and k >= 1024:
            split = max(1, min(sms // ctas, int(k // c.k_split)))
        kk = k / split
        waves = -(-(ctas * split) // sms)
        intensity = bm * bn / (bm + bn)
        active = c.eta_tc * (1.0 + (c.i_crit / intensity) ** ACTIVE_SOFTNESS) ** (-1.0 / ACTIVE_SOFTNESS)
        duty = kk / (kk + c.k0) if c.k0 > 0 else 1.0
        cost = waves * bm * bn * kk / (active * duty)
        if best is None or cost < best[0]:
            wave = (m * n * k) / (waves * sms * bm * bn * kk)
            best = (cost, GemmEfficiency(min(1.0, wave), active, duty, (bm, bn), split, waves))
    assert best is not None
    return best[1]


def decode_splits(items: int, key_blocks: int, sms: int, max_splits: int = 128) -> int:
    """How many KV splits a flash-decoding kernel launches for ``items`` (sequence x KV head) work items.

    Kernel fact (FlashAttention's split-KV rule, FA2 and FA3 alike): no split once the items fill 80 % of the
    SMs; otherwise the fewest splits (at most one per key block, the SM count, 128) whose last wave is within
    85 % of the best achievable wave fill.
    """
    if items <= 0 or items >= 0.8 * sms:
        return 1
    return _fewest_good_splits(items, max(1, min(sms, key_blocks, max_splits)), sms)


@lru_cache(maxsize=8192)
def _fewest_good_splits(items: int, hi: int, sms: int) -> int:
    fills = []
    for s in range(1, hi + 1):
        waves = items * s / sms
        fills.append(waves / math.ceil(waves))
    best = max(fills)
    return next(s for s, fill in enumerate(fills, start=1) if fill >= 0.85 * best)


def attention_wave(ctas: int, sms: int) -> float:
    """Share of SM-slots busy when ``ctas`` equal CTAs run in ceil(ctas/sms) waves."""
    if ctas <= 0:
        return 1.0
    waves = math.ceil(ctas / sms)
    return ctas / (waves * sms)


# --------------------------------------------------------------------------------------------------
# The clock forecast: a power model from the datasheet (the seed's open item "forecast f_clk from the cap").
#
# Dynamic power of the SMs at clock f scales as f * V(f)^2 with V roughly proportional to f on the DVFS
# curve, so P_dyn(f) = a * E * Peak(f_boost) * (f/f_boost)^3 where a is the op's tensor activity (0..1) and E
# the energy per tensor FLOP at boost voltage. Board power = P_idle + P_mem + P_dyn; the firmware lowers the
# clock until board power meets the cap (TDP). The f^3 law and a P_idle of 10 % of TDP are assumptions; E per
# architecture is fitted to the sustained clocks the seed measured at M=16384 under sustained GEMM load
# (A100-80GB 1125/1410 MHz, H100-SXM 1380/1980, L40S 1425/2520; H200 1455/1980 is a held-out check).
# --------------------------------------------------------------------------------------------------
IDLE_FRACTION = 0.10  # assumption: idle + uncore power as a share of TDP
MEM_POWER_FRACTION = 0.15  # assumption: DRAM + IO power at full streaming, share of TDP


def _energy_from_anchor(tdp: float, peak_boost: float, sustained_ratio: float, activity: float = 1.0) -> float:
    """E [J/FLOP] that makes a full-activity GEMM settle at ``sustained_ratio`` of boost under ``tdp``."""
    budget = tdp * (1 - IDLE_FRACTION)
    return budget / (activity * peak_boost * sustained_ratio**3)


# Anchors (seed table 'Sustained @ M=16384'): datasheet TDP and dense bf16 peak at boost.
ENERGY_PER_FLOP: dict[str, float] = {
    "ampere": _energy_from_anchor(400.0, 312e12, 1125 / 1410),  # A100-SXM4-80GB
    "hopper": _energy_from_anchor(700.0, 989.4e12 * 1980 / 1830, 1380 / 1980),  # H100-SXM
    "ada": _energy_from_anchor(350.0, 362.05e12, 1425 / 2520),  # L40S
}
ENERGY_PER_FLOP["blackwell"] = ENERGY_PER_FLOP["hopper"]  # borrowed: no Blackwell anchor measured
ENERGY_PER_FLOP["cpu"] = 0.0


def forecast_clock_ratio(
    tdp_w: float, peak_flops_boost: float, arch: str, tensor_activity: float, mem_activity: float = 0.0
) -> float:
    """f_clk predicted from the power cap for an op mix with the given tensor and DRAM activity (0..1)."""
    e = ENERGY_PER_FLOP.get(arch, 0.0)
    if e <= 0 or tensor_activity <= 0:
        return 1.0
    budget = tdp_w * (1 - IDLE_FRACTION - MEM_POWER_FRACTION * min(1.0, max(0.0, mem_activity)))
    demand_at_boost = min(1.0, tensor_activity) * e * peak_flops_boost
    if demand_at_boost <= budget:
        return 1.0
    return (budget / demand_at_boost) ** (1.0 / 3.0)


# --------------------------------------------------------------------------------------------------
# fp8 (W8A8) GEMMs: vLLM's CutlassFP8ScaledMMLinearKernel — e4m3 weights and activations, per-tensor scales,
# fp32 accumulation, bf16 output. CUTLASS picks its own tiles and pipelines (not cuBLAS's), so its GEMM
# constants are fitted separately, by bench/fit_fp8.py on ../shared/data/opbench_fp8 ONLY (GEMMs with N,K in
# [1024, 16384], every M): hopper on h100_sxm (NVIDIA H100 80GB HBM3), blackwell on b300_sxm (NVIDIA B300 SXM6
# AC). Only the GEMM group is fitted; everything else (attention, kernel facts) is the bf16 arch's, because
# vLLM keeps attention and the KV cache in bf16. ``results/fp8_constants.json`` holds the fit and its
# leave-one-GPU-out check.
# --------------------------------------------------------------------------------------------------
# Reading: every opbench_fp8 row is vLLM's fp8 linear layer on a bf16 input, so it includes the input
# quantisation — vLLM's CUDA scaled_fp8_quant with a dynamic per-tensor scale, two kernels of one CTA per token
# row: ~0.4 us of SM time per row and kernel (q_row: the tables' latency grows by ~7 ns per row at N = K = 32 on
# both GPUs), streaming at 0.59 (H100) / 0.33 (B300) of peak DRAM bandwidth (eta_q: one CTA per row keeps few
# bytes in flight, and the B300's 8 TB/s needs 2.4x the H100's). Without it the bf16 constants priced the tables
# 42 % / 53 % too fast. CUTLASS's tensor-core ceiling eta_tc is 0.67 (H100) / 0.77 (B300) of the fp8 peak at
# the NVML max clock (cuBLAS bf16 on the H100: 0.82); on the H100 the k_split grid picks "never" (65536):
# vLLM's sm90 fp8 configs have no split-K. In-sample MAPE 9.3 % (H100) / 7.1 % (B300), leave-one-GPU-out
# 14.4 % / 10.8 % (results/fp8_constants.json).
FP8_GEMM_FIT: dict[str, dict[str, float]] = {
    "hopper": dict(eta_tc=0.6737, i_crit=34.54, k0=2.447, t_kernel=1.719e-06, eta_mem=0.8641,
                   t_ramp=3.586e-09, overlap=2.356, k_split=65536, q_row=4.495e-07, eta_q=0.5891),
    "blackwell": dict(eta_tc=0.7716, i_crit=8.738, k0=32.52, t_kernel=1.7e-06, eta_mem=0.9844,
                      t_ramp=3.852e-07, overlap=1.358, k_split=4096, q_row=3.494e-07, eta_q=0.3319),
}
ARCH_FP8: dict[str, ArchConstants] = {
    arch: replace(ARCH[arch], **fit, fitted_on=f"opbench_fp8 {folder}, bench/fit_fp8.py (GEMM group only)")
    for arch, fit, folder in (("hopper", FP8_GEMM_FIT["hopper"], "h100_sxm (NVIDIA H100 80GB HBM3)"),
                              ("blackwell", FP8_GEMM_FIT["blackwell"], "b300_sxm (NVIDIA B300 SXM6 AC)"))
}
# Ada's fp8 MMAs run on its mma.sync pipeline (CUTLASS sm89 kernels): no fp8 table measured one, so it keeps
# its bf16 constants (themselves borrowed from Ampere) with its own fp8 datasheet peak; GB202 (sm_120) likewise.
for _fam in ("ada", "blackwell_rtx"):
    if _fam in ARCH:
        ARCH_FP8[_fam] = replace(ARCH[_fam], borrowed_from=f"{_fam} bf16 constants ({ARCH[_fam].borrowed_from}): "
                                 "no fp8 table of an mma.sync GPU")
# What bench/fit_fp8.py fits (fit_constants' machinery, group "fp8_gemm"): the GEMM group plus the two constants
# of the input quantisation that every opbench_fp8 row includes (the collector times vLLM's fp8 linear layer on
# a bf16 input). Kept out of FITTED: the bf16 leave-one-GPU-out check has nothing to do with them.
FITTED_GROUPS["fp8_gemm"] = (*FITTED_GROUPS["gemm"], "q_row", "eta_q")


def transfer_fp8(target: ArchConstants, source: ArchConstants) -> ArchConstants:
    """``target``'s fp8 kernel facts with ``source``'s fitted fp8 GEMM numbers (leave-one-GPU-out)."""
    return replace(target, **{n: getattr(source, n) for n in FITTED_GROUPS["fp8_gemm"]},
                   fitted_on=source.fitted_on, borrowed_from=None)
