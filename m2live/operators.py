"""Per-operator rooflines on one GPU: GEMM, attention (prefill and decode), light memory-bound ops, the
tensor-parallel all-reduce.

Every GEMM is a roofline of a compute and a memory branch plus one fixed kernel latency:

    t_gemm = t_kernel + softmax_p( FLOPs / (P_boost * f_clk * eta_wave * eta_active * eta_duty),
                                    bytes / (BW * eta_mem(bytes)) )

with softmax_p(a, b) = (a^p + b^p)^(1/p) the roofline max under imperfect overlap of the two near the ridge
(p -> infinity is the hard max; p is fitted per kernel family). An attention call is its body's larger branch
plus a fixed part, never below the call's floor, plus the serial passes around the kernel (KV-cache write,
split-KV combine):

    t_attn = max(t_attn_floor, t_attn_over + max(t_compute, t_memory)) + t_after

``OpModel`` is what ``m2live ops`` / ``validate`` score against measured tables; ``Predictor`` (predictor.py)
composes its operators into whole steps.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Hashable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from .efficiency import (
    GEMM_BENCH_WINDOW,
    ArchConstants,
    GemmEfficiency,
    attention_wave,
    clock_ratio,
    constants_for,
    decode_splits,
    fa2_splits,
    fa3_splits,
    gemm_efficiency,
    grid_ctas,
    pick_rows,
    repad,
    tma_oob_share,
)
from .hardware import GpuSpec, get_gpu

DECODE_KEY_BLOCK = 128  # keys per block of the split-KV decode kernel at head_dim 128 (FlashAttention)
# FlashInfer's TRT-LLM generation kernels give each KV split at least two of their KV steps (fmhaKernels.cuh,
# computeCtaAndClusterConfig: maxNumCtasPerSeqKv = ceil(seqLenKv / (2 x stepKv)), "so that the reduction overhead
# does not outweigh the benefits of a shorter mainloop"), a step being two 128-key tile instances (stepKv =
# numInstsKv x tileSizeKv) in the bf16 head_dim-128 kernels: 512 keys. The step is read off the B300 table, not
# fitted: one sequence on one KV head runs 8.8 us at 511 keys as at 1-255, and 10.7-11.1 us at 1023-8191 (2-16
# splits merged in the kernel) — a 256-key minimum would split at 511 already, the 128-key blocks of FlashAttention's
# rule (priced until 2026-12-06) split 4 ways there and 64 at 8191, 0.09 us of merging each. Refitted with it
# (B300 decode 4.49 -> 3.91 %; 3.82 % with the whole steps below, ARCH["blackwell"]); refitted with 256-key pieces
# instead 4.24 %, 1024 3.98 %.
# A CTA's main loop runs whole steps, so a split of 257-512 keys takes two steps' time (the plateau of 1023-8191
# keys above is 2 steps a CTA at every split count): the CTAs' own stream rate (cta_bw) is priced on whole steps
TRTLLM_KV_STEP = 256
TRTLLM_SPLIT_MIN_KEYS = 2 * TRTLLM_KV_STEP
# FlashAttention-3 takes its dynamic-split path (a prepare kernel sizes each sequence's splits; the persistent varlen
# tile scheduler reads them) for varlen batches of at most 992 = 32 x 31 sequences, the prepare kernel's limit
# (hopper/flash_api.cpp); its scheduler's warp scans the sequences 31 at a time (tile_scheduler.hpp)
FA3_DYNAMIC_SPLIT_MAX_BATCH = 992
FA3_SCHEDULER_SEQS_PER_ROUND = 31
# How the prefill kernel's tensor-core and exponential (SFU) times add: (t_tc^p + t_exp^p)^(1/p). p = 2 makes
# the public GB200 -> GB300 figure come out: NVIDIA measured ~35 % faster fp8 attention forward (DeepSeek-V3's
# 192/128 head dims) from doubling the SFUs alone; the model gives 1.39 at p = 2 (1.38 at 2.4, 1.17 with a hard
# max). Not fitted: the calibration GPUs' exponential load is 0.15-0.4 of their tensor time, too little to pin p.
SFU_OVERLAP = 2.0
# The head dim at which ArchConstants.k0_attn states an attention kernel's per-row prologue/epilogue (the calibration
# region's, where every table has its rows)
ATTN_K0_HEAD_DIM = 128
# FlashAttention-2's softmax, per score, on the FP32 pipe (read off flash_fwd_kernel.h / softmax.h): one FFMA
# (scale and subtract the row max), one FADD (row sum), half a bf16 pack (two P values per F2FP), plus the
# output's rescale, head_dim FMULs per row per key block (fa2_key_block) — and one MUFU.EX2 on the SFUs. FA2 runs
# them in the warps that issue its MMAs, between the two GEMMs of a tile, so they add to the tensor time rather
# than hide under it (FA3 and the Blackwell kernels ping-pong warpgroups for that). Not fitted: with the SFU and
# FP32 rates of the CUDA guide this is what makes the same kernel ~1.4 x more efficient on an RTX 4090 (half-rate
# fp32-accumulate tensor cores, 128 FP32 lanes) than on an A100 (64 lanes), as FlashAttention-2's public
# benchmarks show (A100 ~0.63 of peak, RTX 4090 ~0.85-0.9, causal, head_dim 128, 2 K tokens: ~1.4 x; the model
# gives 1.25 x for vLLM's paged kernel with its per-row prologue, 1.33 x for the official kernel's 64-key blocks).
FA2_SOFTMAX_FP32_OPS = 2.5


def fa2_key_block(head_dim: int) -> int:
    """Keys per block of FA2's split-KV kernel, the one vLLM's paged calls run (run_mha_fwd_splitkv_dispatch:
    256 at head_dim <= 64, 128 at <= 128, else 64)."""
    return 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64


def tile_entry(table: tuple[tuple[int, float], ...], rows: int) -> float:
    """A query-tile table's entry for ``rows`` query rows: the smallest listed tile that holds them (the largest
    where none does); 1.0 for an empty table."""
    if not table:
        return 1.0
    return next((cost for tile, cost in table if tile >= rows), table[-1][1])


# FA2's varlen grouped-query decode (flash_api.cpp, seqlenq_ngroups_swapped): q in, the output and q back
RELAYOUT_COPIES = 3
PRECISIONS = ("bf16", "fp16", "fp8")  # weights of the four projections; attention, KV cache, LM head stay 16-bit
KBLOCK_BYTES = 128  # a GEMM main loop's K block: one 128-byte swizzled row of each operand (ArchConstants.t_kiter)
# One all-reduce's fixed cost, small messages: ~8 us over NVLink / NVLink-C2C (vLLM's own one-shot kernel: 7 us at
# 16 KiB on a B300, 7-10 us at 0.5 MB on H100 at TP 2-4 in the communicator benchmarks cited below), ~20 us over
# PCIe (host bridges, no NVLink SHARP)
ALLREDUCE_LATENCY_S = {"nvlink": 8e-6, "c2c": 8e-6, "pcie": 20e-6, "none": 20e-6}
# Over NVLink vLLM picks the faster of two kinds of all-reduce by message size. Its own kernels (custom one- and
# two-shot, symmetric-memory multimem) run in a fixed set of CTAs that load the peers' buffers over NVLink, so
# their rate is what those CTAs keep in flight (Little's law), not the link's: vLLM's communicator benchmarks
# (kernels/benchmark_device_communicators.py, in PRs #24111, #24532, #42324 on H100, #37756 on B300) rise by
# 320-460 GB/s of bus traffic between 1 and 4 MiB on NVLink4 (450 GB/s a direction) and NVLink5 (900) alike.
# NCCL's ring or NVLS takes over for large messages (16-64 MiB up): ~20 us to start (pynccl at 0.5 MiB: 21-25 us),
# then the links at about 0.8 of their rate (128 MiB: H100 0.96, B300 0.70). Read off those public tables, not
# fitted; across their 33 points (16 KiB-128 MiB, TP 2-8) the two paths score 13.6 % where the link-rate ring scored
# 23.3 % (bias -10 / -11 % against -15 / -31 % on H100 / B300). (The B300 table lists multi-node NVLink kernels
# too, so it may come from a GB300 NVL72 rack rather than an HGX board; the H100 points alone: bias -15 -> -10 %.)
# The all-reduce that vLLM fuses with the next RMSNorm on small steps is priced the same; the norm it absorbs is
# the predictor's (predictor.allreduce_fusion_max_bytes).
ALLREDUCE_SM_BUS_BPS = 400e9
ALLREDUCE_NCCL_LATENCY_S = 20e-6
ALLREDUCE_NCCL_LINK_SHARE = 0.8


def branch(t_compute: float, t_memory: float, t_fixed: float) -> str:
    """Which term bounds an operator: its fixed latency, the compute branch or the memory branch."""
    if t_fixed > t_compute and t_fixed > t_memory:
        return "latency"
    return "compute" if t_compute >= t_memory else "memory"


# Grids of at most this many query tiles per SM have their makespan list-scheduled (OpModel._list_makespan), those
# of up to twice as many a blend of that and the closed-form bound (_tile_makespan_fill), larger ones the bound: it
# is within 2 % of the list schedule from 6 tiles per SM up on the A100's table, and costs nothing (a step
# predictor's hot path: the list schedule of 12 tiles per SM takes ~0.1-0.3 ms, once per step shape). 12 was
# chosen on the A100's and B300's prefill tables among 6 / 8 / 12 (A100 4.48 / 4.45 / 4.43 %, B300 5.47 / 5.44 /
# 5.39 %, refitted constants)
LIST_SCHEDULE_TILES_PER_SM = 12
CACHE_ENTRIES = 65536  # a per-shape cache is emptied when it holds more (a long run's shapes never pile up)


def remember(cache: dict, key: Hashable, value: Any) -> Any:
    """Store ``value`` under ``key`` in a per-shape cache (emptied first when full) and return it."""
    if len(cache) > CACHE_ENTRIES:
        cache.clear()
    cache[key] = value
    return value


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__,
class OpTime:  # ~1 us of the ~20 us a whole step's prediction takes; nothing mutates one
    t: float
    bound: str  # "compute" | "memory" | "latency"
    t_compute: float
    t_memory: float
    factors: dict[str, float] = field(default_factory=dict)


class OpModel:
    """Single-operator times on one GPU (bf16 unless told otherwise).

    ``dtype="fp8"`` prices vLLM's W8A8 fp8 GEMMs (CUTLASS scaled-mm: e4m3 weights and activations with
    per-tensor scales, fp32 accumulation, bf16 output) at the fp8 tensor peak with the fp8 GEMM constants;
    attention stays bf16 (vLLM keeps attention and the KV cache in bf16), so it is priced as bf16 either way.
    At fp8, ``gemm`` is the whole linear layer as vLLM applies it to a bf16 input, quantisation included (what
    opbench_fp8 measures); the step predictor takes the scaled-mm alone and prices the quantisation as it runs
    when served (a light op, fused into the neighbouring kernels by torch.compile).
    """

    def __init__(self, gpu: GpuSpec | str, dtype: str = "bf16", constants: ArchConstants | None = None,
                 kv_elt: int = 2):
        self.gpu = get_gpu(gpu)
        if dtype not in PRECISIONS:
            raise ValueError(f"unknown precision {dtype!r}: one of {', '.join(PRECISIONS)}")
        if dtype == "fp8":
            self.gpu.require_fp8()
        self.c = constants or constants_for(self.gpu, dtype)
        self.dtype = dtype
        self.elt = 1 if dtype == "fp8" else 2  # bytes per GEMM input element (weights and activations)
        self.out_elt = 2  # GEMM outputs are bf16 (fp8 scaled-mm dequantises in its epilogue)
        self.peak = self.gpu.peak_flops(dtype)  # at boost: the GEMMs' tensor peak
        self.attn_elt = 2  # attention's q and output: bf16 at either precision
        # the KV cache's element: bf16 (vLLM's kv_cache_dtype "auto"), or 1 byte for an fp8 cache — priced by its
        # bytes alone (streamed and written at half the bytes; the kernels' efficiencies and tensor rate stay the
        # bf16 kernels': no table measured an fp8-KV attention kernel)
        self.kv_elt = kv_elt
        self.attn_peak = self.gpu.peak_flops("bf16") if dtype == "fp8" else self.peak
        self.bw = self.gpu.data_bw  # the peak less inline ECC's check bits (GpuSpec.data_bw)
        g = self.gpu  # the datasheet facts every call reads, looked up once (the step predictor's hot path)
        self._sms = g.sms
        self._sm_limits = g.sm_limits
        self._exp_rate = g.sms * g.exp_per_clk * g.boost_mhz * 1e6  # exponentials / s at boost (0: not priced)
        self._fp32_rate = g.sms * g.fp32_per_clk * g.boost_mhz * 1e6  # FP32 adds / multiplies / FMAs per s at boost
        self._softmax_costs: dict[int, float] = {}  # _softmax_cost per head dim
        self._fixed_work: dict[int, tuple[float, float]] = {}  # _fixed_work_at per head dim
        self._write_cache: dict[tuple[int, int, int], float] = {}  # _cache_write per (KV heads, head_dim, tokens)
        self._gemm_cache: dict[tuple[int, int, int], tuple[float, float, float, float, float, float, float]] = {}
        self._makespan_cache: dict[tuple, float] = {}  # _list_makespan per (chunks, heads)
        # gemm_pick per (tile rows of each candidate tile height, N, K), where the pick reads M through those
        # alone (efficiency.pick_rows)
        self._pick_rows = pick_rows(self.c)
        self._pick_cache: dict[tuple, GemmEfficiency] = {}

    # ---- GEMM -----------------------------------------------------------------------------------
    def _gemm_base(self, m: int, n: int, k: int) -> tuple[float, float, float, float, float, float, float]:
        """(compute time at boost, DRAM time, eta_wave, eta_active, eta_duty, eta_mem, fixed time), cached per
        shape. The fixed time is one kernel latency; when K is split, plus the partial sums' reduction: a second
        kernel, or (``split_reduce`` "serial") the in-kernel fix-up's wait and its fp32 partials' L2 traffic."""
        key = (m, n, k)
        hit = self._gemm_cache.get(key)
        if hit is not None:
            return hit
        e = self.gemm_pick(m, n, k)
        duty = e.eta_duty
        nbytes = self.elt * (m * k + n * k) + self.out_elt * m * n
        eta_mem = self._eta_mem(nbytes)
        if self.c.tma_oob:
            # the last row of activation tiles reaches past M: the main loop, compute and DRAM stream alike, slows
            # by that row's out-of-bounds share, where the SMs are busy (its boundary-checked loads cost a resource
            # the SMs share: a grid whose tiles — counted before the clusters round them up, as fitted — leave most
            # SMs idle hides it; efficiency.FP8_GEMM_FIT). A benchmark loop's L2 re-reads (gemm's l2_warm, which
            # serving never has) keep their rate: the fit priced the table's rows so.
            busy = min(1.0, grid_ctas(m, n, e.tile) / self._sms)
            slow = 1.0 + self.c.tma_oob * tma_oob_share(m, e.tile[0]) * busy
            duty /= slow
            eta_mem /= slow
        tc = 2.0 * m * n * k / (self.peak * e.eta_wave * e.eta_active * duty)
        fixed = self.c.t_kernel + (self._split_reduce(m, n, e.split_k) if e.split_k > 1 else 0.0)
        out = (tc, nbytes / (self.bw * eta_mem), e.eta_wave, e.eta_active, duty, eta_mem, fixed)
        return remember(self._gemm_cache, key, out)

    def gemm_pick(self, m: int, n: int, k: int) -> GemmEfficiency:
        """The tile and K split the library runs for this GEMM on this GPU (``efficiency.gemm_efficiency``),
        reductions priced in one SM's MACs at peak.

        Where the pick reads M only through its candidates' tile rows (``efficiency.pick_rows``), it is cached per
        those counts and N, K: a new M in the same tile rows — a serving engine's token counts step after step —
        takes it with its own padding (``efficiency.repad``, bit-identical to a fresh pick)."""
        sig = None
        if self._pick_rows:
            sig = (tuple(-(-m // bm) for bm in self._pick_rows), n, k)
            e = self._pick_cache.get(sig)
            if e is not None:
                return repad(e, m, n, k, self._sms)
        sm_macs = self.peak / (2.0 * self.gpu.sms)
        e = gemm_efficiency(m, n, k, self.gpu.sms, self.c, lambda split: self._split_reduce(m, n, split) * sm_macs,
                            self.c.t_kiter * sm_macs * self.elt / KBLOCK_BYTES)
        return e if sig is None else remember(self._pick_cache, sig, e)

    def _split_reduce(self, m: int, n: int, split: int) -> float:
        """Reducing ``split`` K slices' fp32 partial sums of an M x N output (s): in the GEMM kernel (``split_reduce``
        "serial": the last CTA of a tile waits, t_fixup, for the other slices to write their partials and reads
        them back through L2) or in a second kernel (one more t_kernel and every slice's partials read back
        through L2; the GEMM's stores of them retire under its main loop, as its output stores do)."""
        if self.c.split_reduce == "serial":
            return self.c.t_fixup + self.l2_time(8.0 * m * n * (split - 1))
        return self.c.t_kernel + self.l2_time(4.0 * m * n * split)

    def gemm(self, m: int, n: int, k: int, f_clk: float = 1.0, l2_warm: bool = False,
             quantize: bool = True) -> OpTime:
        """One linear layer Y = X W^T. At fp8 this is vLLM's fp8 linear layer applied to a bf16 input, as the
        opbench_fp8 collector times it: the input quantisation (``quantize_fp8``) and then the scaled-mm
        (``quantize=False``: the scaled-mm alone)."""
        tc, tm, wave, active, duty, eta_mem, fixed = self._gemm_base(m, n, k)
        tc /= f_clk
        if l2_warm and self.l2_resident(self.elt * n * k, self.elt * m * k + self.out_elt * m * n):
            tm = min(tm, self.l2_time(self.elt * (m * k + n * k) + self.out_elt * m * n))
        factors = {"f_clk": f_clk, "eta_wave": wave, "eta_active": active, "eta_duty": duty, "eta_mem": eta_mem}
        p = self.c.overlap
        body = (tc**p + tm**p) ** (1.0 / p)
        if self.dtype == "fp8" and quantize:
            fixed += self.quantize_fp8(m, k)
        return OpTime(fixed + body, branch(tc, tm, fixed), tc, tm, factors)

    def quantize_fp8(self, m: int, k: int) -> float:
        """vLLM's CUDA input quantisation with a dynamic per-tensor scale (``scaled_fp8_quant`` without a scale):
        a max-reduction kernel, then the quantising kernel, each a grid of one CTA per token row; they read the
        bf16 input twice (2 + 2 B per element) and write e4m3 (1 B). Each kernel's body is the larger of
        streaming those bytes and its rows' fixed SM-time (q_row per row over the SMs). One CTA per row keeps few
        bytes in flight, so the stream is capped per SM (q_sm_bw, Little's law) below the DRAM's own ceiling."""
        c = self.c
        bw = min(self.bw * c.eta_mem, self.gpu.sms * c.q_sm_bw) if c.q_sm_bw > 0 else self.bw * c.eta_mem
        t_stream = 5.0 * m * k / bw
        t_rows = 2.0 * m * c.q_row / self.gpu.sms
        p = c.overlap
        return 2 * c.t_kernel + (t_stream**p + t_rows**p) ** (1.0 / p)

    def clock_ratio(self, flops: float, t_at_boost: float, nbytes: float = 0.0,
                    duration_s: float = math.inf) -> float:
        """f_clk the power model gives work of ``flops`` and ``nbytes`` that takes ``t_at_boost`` at the boost
        clock, kept up for ``duration_s`` (infinity: steady load). The one clock forecast of m2live: operators,
        steps, the probe, validation and admission all use it."""
        if t_at_boost <= 0:
            return 1.0
        # activity is relative to this dtype's peak; the power of a full-activity op is the bf16 peak's (an fp8
        # MMA does twice the FLOPs of a bf16 one for about the same energy)
        return clock_ratio(self.gpu.tdp_w, self.attn_peak, self.gpu.kernel_family, flops / (t_at_boost * self.peak),
                           nbytes / (t_at_boost * self.bw), duration_s, self.c.limiter_headroom)

    def burst_clock(self, flops: float, t_at_boost: float,
                    window: tuple[int, int] = GEMM_BENCH_WINDOW) -> float:
        """f_clk of a benchmark measurement: the op run back to back from an idle board, timed from call
        ``window[0]`` to call ``window[1]`` (opbench: GEMM_BENCH_WINDOW, ATTN_BENCH_WINDOW) — the mean clock over
        that part of the burst."""
        first, last = window
        f_last = self.clock_ratio(flops, t_at_boost, 0.0, last * t_at_boost)
        if first <= 0:
            return f_last
        f_first = self.clock_ratio(flops, t_at_boost, 0.0, first * t_at_boost)
        return (last * f_last - first * f_first) / (last - first)

    # ---- attention ------------------------------------------------------------------------------
    def prefill_attention(
        self, seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, f_clk: float = 1.0,
        call_seqs: int = 0,
    ) -> OpTime:
        """Causal FlashAttention over chunks ``(new, ctx)``: each query attends to ctx + its causal prefix.

        CTAs are (sequence, head, block of BM queries); a CTA's main loop runs over its keys, against a fixed
        prologue/epilogue worth k0_attn keys at head_dim 128 for each of its query rows (eta_duty; a share of it,
        k0_attn_fixed, costs the same at every head_dim) — rows padded to the kernel's
        row block where it does not pack query heads into one tile (FlashAttention-2). Short chunks are
        latency- and duty-bound. Where the kernel splits the KV of a grid too small for the SMs (FA3,
        ``prefill_split``, ``fa3_splits``) the tiles are that many times more and shorter, and the split's fp32
        partial outputs are stored and merged by a combine kernel (``_split_partials``). FA3 decides the split
        for the whole varlen call — its sequences x KV heads x the longest query's packed blocks — so
        ``call_seqs`` counts the sequences sharing the call (a mixed step's decodes too; 0: these alone). Where
        the kernel streams a plain multi-head call's KV in series with its MMAs (``prefill_mha_kv_serial``) that
        stream is added to the compute branch (its time, not its FLOPs: the branch label then says compute).
        """
        c = self.c
        if seqs and all(new == 1 for new, _ in seqs):  # max_seqlen_q == 1: the kernel takes its decode path
            return self.decode_attention([ctx for _, ctx in seqs], len(seqs), heads, kv_heads, head_dim, f_clk)
        pairs = 0.0
        q_tokens = 0
        kv_tokens = 0
        ctas = 0
        bm = c.attn_block_m
        pad = c.attn_row_pad
        rows = 0  # query rows that pay the per-CTA prologue/epilogue: padded to the kernel's row block
        u_max = 0.0  # the longest query tile (one CTA's work) in key positions x rows
        k0 = self._fixed_work_at(head_dim)[0]
        k0_full = k0 * (-(-bm // pad) * pad if pad else bm)  # a full tile's prologue/epilogue
        group = heads // kv_heads
        packed = 0  # query tiles with a KV head's query heads packed as rows (prefill_pack_gqa)
        kv_max = 0
        new_max = 0
        pack = c.prefill_pack_gqa
        lone = 0.0  # work the lone query tiles of ping-pong CTAs add (_lone_tile), in key-row units
        u_lone = 0.0  # the longest last tile with it (the grid's longest: the larger of this and u_max)
        for new, ctx in seqs:
            pairs += new * ctx + new * (new + 1) / 2.0
            q_tokens += new
            kv_tokens += ctx + new
            nq = -(-new // bm)
            ctas += nq
            npk = -(-new * group // bm)
            packed += npk
            kv_max = max(kv_max, ctx + new)
            new_max = max(new_max, new)
            padded = pad and new > 1
            rows += -(-new // pad) * pad if padded else new
            # the longest tile is one of the last two (the last one may be short); packed (prefill_pack_gqa),
            # a tile is bm (position, query head) rows, bm / group positions
            if pack:
                rp = new * group - (npk - 1) * bm  # rows of the last packed tile
                last = ctx + new - rp / group  # keys before its first position
                u = rp * (last + (rp / group + 1) / 2.0) + k0 * rp
                if npk > 1:
                    u = max(u, bm * (last - bm / group + (bm / group + 1) / 2.0) + k0 * bm)
            else:
                p0 = (nq - 1) * bm
                r = new - p0
                u = r * (ctx + p0 + (r + 1) / 2.0) + k0 * (-(-r // pad) * pad if padded else r)
                extra = self._lone_tile(new, ctx, head_dim)
                lone += extra
                u_lone = max(u_lone, u + extra)
                if nq > 1:
                    u = max(u, bm * (ctx + p0 - bm + (bm + 1) / 2.0) + k0_full)
            if u > u_max:
                u_max = u
        flops = 4.0 * heads * head_dim * pairs
        ovh = 4.0 * heads * head_dim * k0 * rows
        duty = flops / (flops + ovh) if flops > 0 else 1.0
        # FA3 splits the KV when the query tiles (query heads packed per KV head) are few: counted as it counts
        # them for a varlen call, every sequence in the call at the longest query's packed blocks
        split = 1
        if c.prefill_split:
            mblocks = max(len(seqs), call_seqs) * kv_heads * -(-new_max * group // bm)
            split = fa3_splits(mblocks, -(-kv_max // DECODE_KEY_BLOCK), self._sms)
        tiles = packed * kv_heads if pack else ctas * heads
        work = (flops + ovh) / (4.0 * head_dim)
        grid = (seqs, kv_heads if pack else heads, group if pack else 1, k0, tiles, split, head_dim)
        span = self._prefill_span(*grid, work, u_max, False)
        wave = work / (self._sms * span)
        tc = flops / (self.attn_peak * f_clk * c.eta_attn * wave * duty)
        # every score is exponentiated on the SFUs while the tensor cores run the next tile: the two pipes
        # overlap, imperfectly (SFU_OVERLAP), and the exponentials bind where the tensor cores retire as many
        # query-key pairs per clock as the SFUs retire exponentials (B200 at head_dim 128; B300 has twice the SFUs).
        # Where the kernel's overlap is known (softmax_overlap: FA3), the score's whole softmax — its exponential and
        # its FP32 ops — overlaps the MMAs at that exponent: per score it grows little with head_dim, the MMAs in
        # proportion, so a small head_dim runs further from the tensor peak and a large one closer
        tc = self._with_softmax(tc, flops / (4.0 * head_dim), head_dim, f_clk, wave, exp_alone=True)
        if lone:  # what the lone tiles' softmax in series adds to the grid's makespan, at the tensor rate
            longer = self._prefill_span(*grid, work + heads * lone, max(u_max, u_lone), True) - span
            tc += max(0.0, longer) * 4.0 * head_dim * self._sms / (self.attn_peak * f_clk * c.eta_attn)
        # q read, the output written (by the kernel; under a split by the combine, in _split_partials), the KV read
        # (the decode stream's ramp, _kv_stream_time, here: H100 prefill 6.54 -> 6.61 %, A100 4.65 -> 4.64 %; not
        # taken — a prefill's memory branch hides under its MMAs where the ramp would matter)
        rate = self.bw * c.eta_attn_mem
        t_kv = 2.0 * head_dim * kv_heads * kv_tokens * self.kv_elt / rate
        tm = head_dim * heads * q_tokens * self.attn_elt * (2 if split == 1 else 1) / rate + t_kv
        t_after = self._cache_write(kv_heads, head_dim, q_tokens)
        if split > 1:  # the split's partial outputs, stored and merged (t_split: the combine kernel's launch)
            t_after += c.t_split + self._split_partials(split, q_tokens, heads, head_dim)
        t_items = ctas * kv_heads * c.block_cost / self._sms
        tc += t_items
        tm += t_items
        if c.prefill_mha_kv_serial and heads == kv_heads:  # the KV stream in series with the MMAs
            tc += t_kv
        return self._attn(tc, tm, {"f_clk": f_clk, "eta_wave": wave, "eta_active": c.eta_attn, "eta_duty": duty,
                                   "eta_mem": c.eta_attn_mem}, t_after)

    def decode_attention(self, contexts: list[int] | int, n_seqs: int, heads: int, kv_heads: int,
                         head_dim: int, f_clk: float = 1.0, l2_warm: bool = False, call_seqs: int = 0) -> OpTime:
        """Decode: each sequence reads its whole KV cache (ctx + the new token) once per layer.

        ``contexts`` is the list of contexts or their sum. Work is split into CTAs of (sequence, KV head[, KV
        split]); when the items cannot fill the SMs, the KV is split (flash-decoding, ``decode_splits``) and a
        combine kernel merges the parts (t_split; on FA2 also the fp32 partial outputs it writes and reads back) —
        except where the kernel splits only grouped-query heads (FlashAttention-2: plain multi-head decode runs one
        CTA per sequence x head over its whole cache), and where it has a rule of its own (``decode_split_rule``
        "trtllm", FlashInfer's TRT-LLM kernels: SMs // items splits, at least TRTLLM_SPLIT_MIN_KEYS keys each,
        merged in the kernel at t_merge per split; a larger query tile slows each CTA's pass, ``decode_tile_cost``). The
        body is the largest of DRAM streaming, the streaming rate the CTAs can keep in flight (one CTA streams at
        most cta_bw) and the items' fixed costs (block table, softmax, write-out), which hide behind the other
        resident CTAs' streaming. FA2's grouped-query path also copies q and the output between layouts. FA3's tile
        scheduler adds t_sched per 31 sequences of a call of at most FA3_DYNAMIC_SPLIT_MAX_BATCH (``call_seqs``: the
        call's sequences where prefills share it, else ``n_seqs``).
        """
        c = self.c
        summed = isinstance(contexts, numbers.Integral)
        kv_read = (int(contexts) if summed else sum(contexts)) + n_seqs
        kv_bytes = 2 * head_dim * kv_heads * kv_read * self.kv_elt
        nbytes = kv_bytes + 2 * head_dim * heads * n_seqs * self.attn_elt  # KV, q, out
        flops = 4.0 * heads * head_dim * kv_read
        items = n_seqs * kv_heads
        sms = self._sms
        grouped = heads > kv_heads
        group = heads // kv_heads if grouped else 1  # query heads per CTA (plain multi-head: one)
        fa2 = c.decode_split_rule == "fa2"  # FlashAttention-2: its own split rule, one CTA per item
        fa3 = c.decode_split_rule == "flash"  # FlashAttention-3: its scheduler and packed query rows
        split = 1
        step_pad = 1.0  # keys a CTA's whole main-loop steps cover, over the keys it reads (TRT-LLM)
        if c.decode_split_rule == "trtllm":
            # its splits follow the longest sequence's keys (mMaxSeqLenKv; the mean where only the sum is known)
            longest = max(1, int(kv_read / n_seqs) if summed or not contexts else max(contexts) + 1)
            split = max(1, min(-(-longest // TRTLLM_SPLIT_MIN_KEYS), sms // items))
            step_pad = -(-longest // (split * TRTLLM_KV_STEP)) * TRTLLM_KV_STEP * split / longest
        elif grouped or not c.split_needs_gqa:  # FA2 splits KV only for grouped-query heads
            kv_blocks = -(-int(kv_read / n_seqs) // DECODE_KEY_BLOCK)
            split = fa2_splits(items, kv_blocks, sms) if fa2 else decode_splits(items, kv_blocks, sms,
                                                                                 c.decode_max_splits)
        ctas = items * split
        # the query tile that holds one KV head's query heads sets a CTA's pace: its KV stream and its fixed work
        # (softmax, rescaling, the output) alike, or the fixed work by a table of its own
        tile_cost = tile_entry(c.decode_tile_cost, group)
        item_tile = tile_entry(c.decode_item_tile_cost or c.decode_tile_cost, group)
        # FA2 launches one CTA per item and the SM given the most items finishes last (whole waves of items: 128
        # items on 108 SMs take two items' time); FA3's and TRT-LLM's schedulers show no such steps (the H100 table
        # refitted with them: 12.1 % against 6.5 %), their items priced as the mean over the SMs
        waves = math.ceil(items / sms) if fa2 else items / sms
        t_items = waves * self._fixed_work_at(head_dim)[1] * item_tile
        if fa3 and c.t_qrow:
            # FA3's PackGQA: the tile's query rows gathered in and written out row by row, t_qrow each
            t_items += waves * c.t_qrow * group
        batch = max(call_seqs, n_seqs)  # the call's sequences: prefills sharing it count (attn_mixed_one_call)
        if fa3 and c.t_sched and batch <= FA3_DYNAMIC_SPLIT_MAX_BATCH:
            # FA3's tile lookups: over a call each SM's CTAs step through the whole batch's tile counts, a round
            # of loads per 31 sequences, with the items' other fixed work (t_sched)
            t_items += c.t_sched * batch / FA3_SCHEDULER_SEQS_PER_ROUND
        t_after = self._cache_write(kv_heads, head_dim, n_seqs) + (c.t_split + c.t_merge * split if split > 1 else 0.0)
        extra = 0.0  # bytes the split adds to the main kernel: q per split, fp32 partial outputs
        if split > 1 and c.combine_rows:
            # each split CTA loads q and writes its fp32 partial output; the combine kernel reads them back in CTAs
            # of combine_rows query rows (few rows: few CTAs, each streaming at most cta_bw) and writes the output
            partial = 4.0 * split * n_seqs * heads * head_dim
            extra = partial + self.attn_elt * head_dim * heads * n_seqs * (split - 1)
            comb = partial + self.attn_elt * head_dim * heads * n_seqs
            comb_ctas = -(-n_seqs * heads // c.combine_rows)
            t_after += max(comb / (self.bw * c.eta_attn_mem), comb / (min(comb_ctas, sms * c.cta_slots) * c.cta_bw))
        t_dram = self._kv_stream_time(nbytes)
        # the collector re-reads one KV cache: from L2 if it fits — not under a priced split, whose partial outputs
        # (written by the split CTAs, read back by the combine) pass through the same L2 (A100 decode 8.5 % this
        # way, 9.2 % with the KV kept L2-resident, FA2 split rule)
        if l2_warm and not extra and self.l2_resident(0.0, nbytes):
            t_dram = min(t_dram, self.l2_time(nbytes, c.l2_kv_bytes_per_clk))
        nbytes += extra
        t_dram += extra / (self.bw * c.eta_attn_mem)
        # a larger query tile slows the stream too (TRT-LLM); FA2's tile is always decode_row_block rows
        cta_bw = c.cta_bw / (1.0 if c.decode_row_block else tile_cost)
        padded = nbytes + (step_pad - 1.0) * kv_bytes  # the KV over whole steps
        t_stream = max(t_dram, padded / (min(ctas, sms * c.cta_slots) * cta_bw))
        # an item's fixed latency hides behind the other resident CTAs' streaming — wholly (item_overlap 0: the
        # larger of the two) or in part, (t_items^p + t_stream^p)^(1/p) as the GEMMs' soft roofline
        p = c.item_overlap
        tm = (t_items ** p + t_stream ** p) ** (1.0 / p) if p and t_items > 0 else max(t_items, t_stream)
        if c.decode_row_block:  # every CTA computes a whole block of query rows, the rest masked
            rows = -(-group // c.decode_row_block) * c.decode_row_block
            flops = 4.0 * head_dim * kv_read * (kv_heads if grouped else heads) * rows
        # a grid smaller than the SMs computes on as many SMs as it has CTAs
        wave = attention_wave(ctas, sms)
        tc = flops / (self.attn_peak * f_clk * c.eta_attn * wave)
        # the softmax as in prefill, where the kernel's is known (FA2's in series, FA3's overlapped); the
        # exponentials alone are not priced here (a decode's MMAs are far from binding)
        tc = self._with_softmax(tc, flops / (4.0 * head_dim), head_dim, f_clk, wave, exp_alone=False)
        if c.split_needs_gqa and grouped and n_seqs > 1 and kv_heads > 1:
            # FA2's grouped-query layout (seqlenq_ngroups_swapped) copies q before the kernel and the output and q
            # back after it, batch x heads x head_dim elements each, read and written (views only with one
            # sequence or one KV head): their launches are t_relayout, their traffic three memory-bound kernels'
            copied = 2.0 * self.attn_elt * n_seqs * heads * head_dim * RELAYOUT_COPIES
            t_after += c.t_relayout + self.elementwise(copied, RELAYOUT_COPIES).t_memory
        return self._attn(tc, tm, {"f_clk": f_clk, "eta_mem": nbytes / tm / self.bw if tm > 0 else 0.0}, t_after)

    def _prefill_span(self, seqs: list[tuple[int, int]], heads: int, group: int, k0: float, tiles: int, split: int,
                      head_dim: int, work: float, u_max: float, lone: bool) -> float:
        """A prefill grid's makespan in work units (key-rows on one SM): a small grid's tail list-scheduled
        (``_list_makespan``; blended into the closed form up to twice LIST_SCHEDULE_TILES_PER_SM tiles per SM, so
        that no step shows at the limit), a large one's the closed form (``_tile_makespan_fill``); ``lone``: with
        the lone query tiles' serial softmax (``_lone_tile``) in their tiles."""
        lim = LIST_SCHEDULE_TILES_PER_SM * self._sms
        if split == 1 and tiles < 2 * lim:
            span = self._list_makespan(seqs, heads, group, k0, work, head_dim, lone)
            if tiles > lim:
                w = (tiles - lim) / lim
                span = (1.0 - w) * span + w * work / (self._sms * self._tile_makespan_fill(tiles, work, u_max))
            return span
        return work / (self._sms * self._tile_makespan_fill(tiles * split, work, u_max / split))

    def _lone_tile(self, new: int, ctx: int, head_dim: int) -> float:
        """Work, in key-row units, that a chunk's last CTA adds where the kernel's CTAs ping-pong two query tiles
        (``prefill_pingpong``: one tile's softmax hidden under the other's MMAs). A chunk of an odd number of row
        tiles leaves its last CTA one tile with no partner: its softmax (``_softmax_cost``: exponentials on the
        SFUs, the rest on the FP32 pipe) runs in series with its MMAs over every key its rows read, which costs it
        min(softmax, MMA) a score more than the paired tiles' rate the grid is priced at (eta_attn, fitted on
        paired tiles, and the SFU term of ``prefill_attention``). A partner of fewer rows hides that much of it,
        so one more token never makes the chunk cheaper. No constant of its own: the softmax's cost against the
        MMAs' is the datasheet's SFU and FP32 rates against the tensor peak."""
        if not self.c.prefill_pingpong:
            return 0.0
        pad = self.c.attn_row_pad
        tiles = -(-new // pad)
        last = new - (tiles - 1) * pad  # rows of the last tile
        rows, partner = (last, 0) if tiles % 2 else (pad, last)  # the tile that waits, and its partner's rows
        serial = min(1.0, self._softmax_cost(head_dim) * self.attn_peak * self.c.eta_attn / (4.0 * head_dim))
        return max(0.0, serial * rows - partner) * (ctx + new)

    def _with_softmax(self, tc: float, scores: float, head_dim: int, f_clk: float, wave: float,
                      exp_alone: bool) -> float:
        """An attention kernel's compute time: its MMAs' ``tc`` over ``scores`` query-key scores, with the scores'
        softmax (``_softmax_cost``) in series where the kernel runs it between its MMAs (``softmax_serial``: FA2),
        overlapped at ``softmax_overlap`` where that is known (FA3), else — ``exp_alone`` — the exponentials alone
        at SFU_OVERLAP (the SFUs run them while the tensor cores run the next tile); ``tc`` on the CPU device."""
        if not self._exp_rate:
            return tc
        c = self.c
        if c.softmax_serial:
            return tc + scores * self._softmax_cost(head_dim) / (f_clk * wave)
        if c.softmax_overlap:
            q = c.softmax_overlap
            t_soft = scores * self._softmax_cost(head_dim) / (f_clk * wave)
            return (tc ** q + t_soft ** q) ** (1.0 / q)
        if exp_alone:
            t_exp = scores / (self._exp_rate * f_clk * wave)
            return (tc ** SFU_OVERLAP + t_exp ** SFU_OVERLAP) ** (1.0 / SFU_OVERLAP)
        return tc

    def _fixed_work_at(self, head_dim: int) -> tuple[float, float]:
        """The attention kernels' fixed work at ``head_dim``: the prefill prologue/epilogue a query row in key
        positions (k0_attn) and a decode item's SM-time (item_cost). Both are stated at ATTN_K0_HEAD_DIM; of each,
        a share costs the same at every head_dim (pipeline start, barriers, scheduling: k0_attn_fixed,
        item_cost_fixed) and the rest (the query's load, the output's normalisation and store) grows with it. A key
        position costs head_dim / ATTN_K0_HEAD_DIM times its time there. Exactly the stated values at
        ATTN_K0_HEAD_DIM; cached per head dim (the hot path looks it up)."""
        got = self._fixed_work.get(head_dim)
        if got is None:
            c = self.c
            r = head_dim / ATTN_K0_HEAD_DIM

            def grown(fixed: float) -> float:  # time at head_dim over time at ATTN_K0_HEAD_DIM
                return 1.0 + (1.0 - fixed) * (r - 1.0)

            got = self._fixed_work[head_dim] = (c.k0_attn * grown(c.k0_attn_fixed) / r,
                                                c.item_cost * grown(c.item_cost_fixed))
        return got

    def _softmax_cost(self, head_dim: int) -> float:
        """Seconds per query-key score of FlashAttention-2's softmax at boost on every SM, in series with its
        MMAs: one exponential on the SFUs, FA2_SOFTMAX_FP32_OPS plus the output's rescale on the FP32 pipe (also
        the softmax a ``softmax_overlap`` kernel overlaps with its MMAs). Cached per head dim (a model has one: the
        step predictor's hot path looks it up)."""
        cost = self._softmax_costs.get(head_dim)
        if cost is None:
            fp32_ops = FA2_SOFTMAX_FP32_OPS + head_dim / fa2_key_block(head_dim)
            cost = self._softmax_costs[head_dim] = 1.0 / self._exp_rate + fp32_ops / self._fp32_rate
        return cost

    def _tile_makespan_fill(self, n: int, work: float, u_max: float) -> float:
        """Share of SM time a prefill grid keeps busy: ``n`` query-tile CTAs of ``work`` units in all, the
        longest ``u_max``. Causal tiles are unequal (a sequence's last tile reads all its keys, its first one
        tile's worth), so the kernel takes the longest of: whole waves of the mean tile (wave quantisation of
        equal tiles), the longest tile alone (a grid smaller than the SMs waits on it) and — where CTAs are
        dispatched in grid order, each sequence's tiles shortest first (``attn_tile_order`` "grid") — Graham's
        list-scheduling bound: the last-dispatched long tile starts when the rest has drained, W/S + u_max - mean
        (within 3 % mean / 22 % worst of a simulated greedy dispatch over 108-148 SMs). A longest-first scheduler
        ("lpt") has no such tail; the grid-order bound scored better on all three calibration tables."""
        sms = self._sms
        if n <= 0 or work <= 0:
            return 1.0
        mean = work / n
        t = max(math.ceil(n / sms) * mean, u_max)
        if self.c.attn_tile_order == "grid":
            t = max(t, work / sms + u_max - mean)
        return work / (sms * t)

    def _list_makespan(self, seqs: list[tuple[int, int]], heads: int, group: int, k0: float, work: float,
                       head_dim: int, lone: bool = False) -> float:
        """Makespan, in the work units of ``_tile_makespan_fill``, of a small prefill grid (``heads`` grid heads,
        ``group`` query heads packed into each tile's rows) dispatched in its kernel's order (``attn_tile_order``:
        FlashAttention-2's grid, or FA3's longest-first persistent scheduler), each tile to the SM that frees
        first (greedy list scheduling, one tile per SM at a time). The closed-form bound is tight on large grids
        but short on small ones, whose last long tiles start late: on the A100's table, at 1-2 / 2-6 / 6-20 tiles
        per SM the list schedule is 11 / 7 / 2 % longer, and those rows (prompts of 1 K tokens or more) were
        predicted 8.3 / 8.1 / 1.8 % short. Up to LIST_SCHEDULE_TILES_PER_SM tiles per SM every tile is scheduled; past it,
        the last that many after the others' ``work`` spread evenly (the caller blends that into the closed form
        by twice as many, so that one more head or sequence never shortens the time). Cached per (chunks, heads)."""
        key = (tuple(seqs), heads, group, head_dim, lone)
        hit = self._makespan_cache.get(key)
        if hit is not None:
            return hit
        bm, pad = self.c.attn_block_m, self.c.attn_row_pad
        lpt = self.c.attn_tile_order == "lpt"
        per_seq = []  # each sequence's tiles (keys each query row reads, plus the prologue's), in dispatch order
        for new, ctx in seqs:
            rows = new * group  # (position, query head) rows: a KV head's query heads packed (prefill_pack_gqa)
            full = bm * (ctx + (bm / group + 1) / 2.0) + k0 * bm  # a full tile at s0 = 0; each next one reads
            step = bm * bm / group  # bm / group more keys a row
            n_full = rows // bm
            tiles = [full + i * step for i in range(n_full)]
            if rows > n_full * bm:  # the last, partial tile (its rows' prologue padded to the kernel's row block)
                s0, r = n_full * bm, rows - n_full * bm
                tiles.append(r * (ctx + s0 / group + (r / group + 1) / 2.0)
                             + k0 * (-(-r // pad) * pad if pad and new > 1 else r)
                             + (self._lone_tile(new, ctx, head_dim) if lone else 0.0))
            per_seq.append(tiles[::-1] if lpt else tiles)
        # FlashAttention-2's grid (blockIdx.x the query block, then the sequence, then the head): head by head, each
        # sequence's tiles in turn; FA3's varlen scheduler: sequence by sequence, each head's tiles longest first
        # ("lpt"), taken by whichever SM frees first
        order = (list(chain.from_iterable(s * heads for s in per_seq)) if lpt
                 else list(chain.from_iterable(per_seq)) * heads)
        sms = self._sms
        tail = order[-LIST_SCHEDULE_TILES_PER_SM * sms:]
        bulk = max(0.0, work - sum(tail)) / sms  # the tiles before the tail, spread evenly
        free = [bulk + u for u in tail[:sms]]  # when each SM frees: the first tiles one to an SM (a heap)
        free += [bulk] * (sms - len(free))
        heapq.heapify(free)
        replace_min = heapq.heapreplace
        for u in tail[sms:]:
            replace_min(free, free[0] + u)
        return remember(self._makespan_cache, key, max(free))

    def _split_partials(self, split: int, q_tokens: int, heads: int, head_dim: int) -> float:
        """The serial passes of a prefill split over the KV (FA3, ``prefill_split``): each of the ``split`` CTAs of
        a query tile stores its fp32 partial output and log-sum-exp (the grid is under a wave — that is when FA3
        splits — so no other tile hides the stores; streamed at the DRAM rate), and the combine kernel reads them
        back, out of L2 where they fit (written just before), and writes the output. On the H100's table the 93
        split rows (b = 1-2, 1-2 K tokens, few heads: 96 query tiles of 12 heads at 1 K split 4 ways, 40.5 us
        measured against 29.9 for 16 heads unsplit) came out 28 % fast without them, 4.7 % with them; the
        other forms tried: writes and reads both at the DRAM rate 6.8 %, both out of L2 5.3 %, the combine's read
        alone 8.3 %."""
        partial = 4.0 * split * q_tokens * heads * (head_dim + 1)  # fp32 partial outputs and their LSE
        rate = self.bw * self.c.eta_attn_mem
        read = min(self.l2_time(partial), partial / rate) if self.l2_resident(0.0, partial) else partial / rate
        return partial / rate + read + self.attn_elt * q_tokens * heads * head_dim / rate

    def _attn(self, tc: float, tm: float, factors: dict[str, float], t_after: float = 0.0) -> OpTime:
        """An attention call: its body plus a fixed part, never below the call's floor, plus the serial
        passes around the kernel (``t_after``: the KV-cache write, the split-KV combine)."""
        c = self.c
        t = max(c.t_attn, c.t_attn_over + max(tc, tm)) + t_after
        return OpTime(t, branch(tc, tm, c.t_attn - c.t_attn_over), tc, tm, factors)

    def _cache_write(self, kv_heads: int, head_dim: int, tokens: int) -> float:
        """vLLM writes the new tokens' K and V into the paged cache in its own kernel before attention
        (``reshape_and_cache_flash``): read and write 2 x kv_heads x head_dim per token. The kernel runs one CTA
        per token of min(kv_heads x head_dim, 512) threads, each CTA a few dependent loads and stores: it is
        latency-bound, and how many CTAs are in flight is set by how many the SMs hold (``GpuSpec.sm_limits``:
        2048 resident threads on an A100 hold 16 CTAs of one KV head's 128 threads but only 4 of 4 KV heads'
        512). So the time is the larger of streaming the bytes and the waves of CTAs after the first (the
        launch and first wave are in t_attn_over) at t_cache_cta each. Cached per shape: a serving engine writes
        the same token counts step after step (its decode batch sizes, its chunk budget)."""
        key = (kv_heads, head_dim, tokens)
        hit = self._write_cache.get(key)
        if hit is not None:
            return hit
        # K and V read in bf16, written in the cache's element
        t = self.elementwise(2.0 * (self.attn_elt + self.kv_elt) * kv_heads * head_dim * tokens).t_memory
        if self.c.t_cache_cta > 0:  # (no tokens: zero waves, the stream's 0 stands)
            max_threads, max_ctas = self._sm_limits
            resident = min(max_ctas, max_threads // min(kv_heads * head_dim, 512))  # >= 3: 512-thread CTAs fit
            waves = -(-tokens // (self._sms * resident))
            t = max(t, (waves - 1) * self.c.t_cache_cta)
        return remember(self._write_cache, key, t)

    def elementwise(self, nbytes: float, kernels: int = 1) -> OpTime:
        """``kernels`` memory-bound kernels moving ``nbytes`` in all (norms, RoPE, activation, KV writes)."""
        eta = self._eta_mem(nbytes / max(1, kernels))
        tm = nbytes / (self.bw * eta)
        fixed = kernels * self.c.t_kernel
        return OpTime(fixed + tm, branch(0.0, tm, fixed), 0.0, tm, {"eta_mem": eta})

    def _kv_stream_time(self, nbytes: float) -> float:
        """A decode kernel streaming ``nbytes`` of KV cache (and q, output) from DRAM: (W + sqrt(W * W0)) /
        (BW * eta_attn_mem), W0 = BW * t_ramp_kv the bytes it must keep in flight (Little's law, as _eta_mem)."""
        c = self.c
        t = nbytes / (self.bw * c.eta_attn_mem)
        if c.t_ramp_kv > 0:
            t *= 1.0 + math.sqrt(self.bw * c.t_ramp_kv / max(nbytes, 1.0))
        return t

    def _eta_mem(self, nbytes: float) -> float:
        """Achieved / datasheet DRAM bandwidth of one kernel streaming ``nbytes``: eta_mem / (1 + sqrt(W0 / W)),
        where W0 = BW * t_ramp are the bytes the memory system must have in flight to stream at its ceiling
        (Little's law: bandwidth x latency), so a faster memory needs a longer stream. Long streams follow the
        seed's law eta_mem * (1 - sqrt(W0/W)); the time (W + sqrt(W * W0)) / (BW * eta_mem) never falls as W
        grows, and short transfers stay cheap (their latency is in the kernel's fixed time)."""
        return self.c.eta_mem / (1.0 + math.sqrt(self.bw * self.c.t_ramp / max(nbytes, 1.0)))

    # ---- L2 residency (benchmark loops only: serving streams each layer's weights from DRAM once a step) ----
    BENCH_COPIES = 6  # the opbench collector cycles six copies of each operand through its timed loop

    def l2_resident(self, reread_bytes: float, other_bytes: float = 0.0) -> bool:
        """True when a benchmark loop re-reads its operands from L2: the collector's six copies of the re-read
        operand (a GEMM's weight, a decode row's KV cache) and the rest of the working set fit in the L2."""
        return self.BENCH_COPIES * reread_bytes + other_bytes <= self.gpu.l2_bytes

    def l2_time(self, nbytes: float, bytes_per_clk: float = 0.0) -> float:
        """Streaming ``nbytes`` out of L2 at the rate the kernels reach (bytes per SM per clock x SMs x boost
        clock; ``bytes_per_clk`` 0: the GEMV rate, l2_bytes_per_clk); a re-read operand takes whichever of L2 and
        DRAM is faster."""
        return nbytes / ((bytes_per_clk or self.c.l2_bytes_per_clk) * self.gpu.sms * self.gpu.boost_mhz * 1e6)

    # ---- tensor-parallel all-reduce ----------------------------------------------------------------------
    def allreduce(self, nbytes: float, tp: int) -> float:
        """One all-reduce of ``nbytes`` over ``tp`` GPUs: a fixed cost plus 2(tp-1)/tp of the data on the bus. Over
        NVLink the faster of vLLM's own kernels (their CTAs' rate, ALLREDUCE_SM_BUS_BPS, or the link's if lower)
        and NCCL (a longer start, then ALLREDUCE_NCCL_LINK_SHARE of the link); elsewhere a ring at the link's rate."""
        if tp <= 1:
            return 0.0
        wire = 2 * (tp - 1) / tp * nbytes
        nccl = self._nccl(wire)
        if self.gpu.interconnect not in ("nvlink", "c2c"):
            return nccl
        own = ALLREDUCE_LATENCY_S[self.gpu.interconnect] + wire / min(self.gpu.link_bw, ALLREDUCE_SM_BUS_BPS)
        return min(own, nccl)

    def allgather(self, nbytes_per_rank: float, tp: int) -> float:
        """One all-gather of ``nbytes_per_rank`` from each of ``tp`` GPUs (vLLM's CudaCommunicator.all_gather runs
        pynccl): each GPU receives the other (tp - 1) shards, priced as NCCL's all-reduce traffic is."""
        return self._nccl((tp - 1) * nbytes_per_rank) if tp > 1 else 0.0

    def _nccl(self, wire: float) -> float:
        """NCCL moving ``wire`` bytes through each GPU: over NVLink its ~20 us start, then
        ALLREDUCE_NCCL_LINK_SHARE of the link; elsewhere a ring at the link's rate after the link's latency."""
        if self.gpu.interconnect not in ("nvlink", "c2c"):
            lat = ALLREDUCE_LATENCY_S.get(self.gpu.interconnect, ALLREDUCE_LATENCY_S["pcie"])
            return lat + wire / self.gpu.link_bw
        return ALLREDUCE_NCCL_LATENCY_S + wire / (ALLREDUCE_NCCL_LINK_SHARE * self.gpu.link_bw)
