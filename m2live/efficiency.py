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
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .hardware import GpuSpec


def _cutlass_sm90_fp8(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """vLLM's CUTLASS fp8 scaled-mm on sm90 (csrc/quantization/w8a8/cutlass/c3x/scaled_mm_sm90_fp8_dispatch.cuh):
    M <= 16 swaps A and B into a 64 (N) x 16 (M) tile; M in (16, 64] the same for N <= 1280, else 64 x 64; M in
    (64, 128] 64 x 128; larger M 128 x 128. Thread-block clusters (the configs' ClusterShape): 2 x 1 above M = 64;
    2 and 4 along M for the swapped M <= 16 and (16, 64] tiles at N <= 1280; else none. No split-K (persistent
    scheduler)."""
    if m <= 16:
        return (16, 64, 2, 1) if n <= 1280 else (16, 64, 1, 1)
    if m <= 64:
        return (16, 64, 4, 1) if n <= 1280 else (64, 64, 1, 1)
    return (64, 128, 2, 1) if m <= 128 else (128, 128, 2, 1)


def _cutlass_sm100_fp8(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """The same on sm100 (B200, B300: scaled_mm_sm100_fp8_dispatch.cuh). Its configs' tile shapes are MMA tiles,
    and a cluster even along the MMA's M mode runs each on a pair of SMs (2-SM UMMA), half the tile per SM: M <= 16
    swapped, 128 (N) x 32 (M) on 4 x 1 clusters -> 64 x 32 per SM, four along N; M in (16, 64] swapped, 128 (N)
    x 64 (M) likewise -> 64 x 64 per SM, four along N (but M = 64 at K < 4096 unswapped 64 x 64 on one SM); M in
    (64, 256] 128 x 128 on 2 x 1 -> 64 x 128 per SM, pairs along M; above, 256 x 128 on 2 x 2 -> 128 x 128 per
    SM, pairs along M and N. No split-K."""
    if m <= 16:
        return 32, 64, 1, 4
    if m <= 64:
        return (64, 64, 1, 1) if m == 64 and k < 4096 else (64, 64, 1, 4)
    return (64, 128, 2, 1) if m <= 256 else (128, 128, 2, 2)


# Fixed tile dispatch by shape (ArchConstants.tile_rule), kernel facts read off the library's source:
# (BM, BN, CM, CN) = rows of M and columns of N one SM's tile covers, and the tiles along M and N of one cluster. The persistent
# scheduler hands out whole clusters, so a grid is rounded up to them: M = 257 on sm90 runs four 128-row tile rows,
# the fourth idle but holding its SMs (opbench_fp8 h100_sxm: M = 128 j + 1 with j odd 11-19 % slower than its
# tiles alone would take, 74.5 against 35.4 us at M = 256 for N = 16384, K = 4096).
TILE_RULES: dict[str, Callable[[int, int, int], tuple[int, int, int, int]]] = {
    "cutlass_sm90_fp8": _cutlass_sm90_fp8, "cutlass_sm100_fp8": _cutlass_sm100_fp8}


# the values each string-valued kernel fact of ArchConstants may take
KERNEL_FACT_VALUES: dict[str, frozenset[str]] = {
    "split_reduce": frozenset({"kernel", "serial"}),
    "decode_split_rule": frozenset({"flash", "fa2", "trtllm"}),
    "attn_tile_order": frozenset({"grid", "lpt"}),
    "tile_rule": frozenset({"", *TILE_RULES}),  # "": the tile_policy's pick
    "tile_policy": frozenset({"least_time", "largest_filling"}),
}


@dataclass(frozen=True)
class ArchConstants:
    """Per-architecture constants. Units: seconds, bytes, elements; efficiencies are ratios."""

    # --- GEMMs (cuBLAS / CUTLASS) ---
    eta_tc: float  # tensor-core ceiling of eta_active for an intense tile
    i_crit: float  # tile intensity BM*BN/(BM+BN) [elements] from which operand movement stops stalling MMAs
    k0: float  # prologue+epilogue cost of one output tile, in K elements of main-loop work (eta_duty)
    t_kernel: float  # fixed latency of one kernel (s): dispatch inside a CUDA graph, pipeline fill, tail
    eta_mem: float  # streaming DRAM efficiency (achieved / datasheet bandwidth) on the memory it was fitted on
    t_ramp: float  # Little's law: a kernel needs BW * t_ramp bytes in flight to stream at eta_mem (s)
    overlap: float  # p of the soft roofline (tc^p + tm^p)^(1/p): imperfect compute/memory overlap near the ridge
    # --- attention (vLLM's FlashAttention call: metadata, KV-cache write, the kernel) ---
    t_attn: float  # floor of one attention call (s): no call is faster (launches, metadata, KV write)
    t_attn_over: float  # fixed part of an attention call that does not overlap its body (s)
    eta_attn: float  # tensor-core ceiling of the fused attention kernel
    k0_attn: float  # per-CTA prologue/epilogue a query row, in key positions at head_dim 128 (eta_duty of attention)
    eta_attn_mem: float  # KV streaming efficiency of decode attention
    item_cost: float  # SM-time of one decode work item (one sequence x KV head) at head_dim 128: block table, softmax, write
    block_cost: float  # SM-time of one prefill work item (sequence x KV head x query block): setup, epilogue
    cta_bw: float  # bytes/s a single decode CTA can stream (outstanding loads / latency)
    k_split: float = 512.0  # shortest K slice the library's split-K kernels hand one CTA (split <= K / k_split)
    # shortest K slice when split-K evens out the last wave of a grid that already fills the SMs (tile_policy
    # "largest_filling"; 0: k_split): such a split must pay back a reduction over every output element
    k_balance: float = 0.0
    # how the GEMM library reduces split-K partial sums (a kernel fact): "kernel" — in a second kernel after the
    # GEMM (cuBLAS's splitKreduce_kernel on Ampere and data-centre Blackwell), one more t_kernel and the slices'
    # fp32 partials read back through L2; "serial" — inside the GEMM kernel (cuBLAS's sm90 "execute_segment_k"
    # kernels): the last CTA of each output tile waits for the other K slices (t_fixup) and adds their fp32
    # partial tiles, read back through L2 (both: OpModel._split_reduce)
    split_reduce: str = "kernel"
    t_fixup: float = 0.0  # that wait (s): a semaphore hand-off and an L2 round trip; 0 where split_reduce is "kernel"
    t_split: float = 0.0  # split-KV decode: the extra combine kernel that merges the partial softmaxes (s)
    # split-KV decode merged inside the kernel (decode_split_rule "trtllm"): the sequence's last CTA folds in the
    # splits' partial results one after another, t_merge each (s)
    t_merge: float = 0.0
    # FlashAttention-3's varlen tile scheduler on its dynamic-split path (batches of at most FA3_DYNAMIC_SPLIT_
    # MAX_BATCH sequences, operators): a CTA finds its next tile by a warp's prefix sum over the tile counts of the
    # next 31 sequences, one dependent round of loads each, so every SM's lookups over a call pass the whole batch:
    # t_sched per 31 sequences (s). 0: no such cost (other kernels; FA3 over larger batches)
    t_sched: float = 0.0
    # FA3's packed query rows in decode (PackGQA: a KV head's query heads are the rows of its tile, gathered in and
    # written out row by row, not by TMA): t_qrow per query row of an item, with the item's fixed work (s). 0: a
    # cost per item whatever its rows (or a query tile's cost, decode_tile_cost). Both are calibrated decode
    # constants, linear (calibration_params.LINEAR): a prior from a family without FA3 holds 0 and a fit moves it
    t_qrow: float = 0.0
    t_relayout: float = 0.0  # FA2 grouped-query decode: copying q into (group x KV head) rows and out back (s)
    # vLLM's KV-cache write (reshape_and_cache_flash) runs one CTA per token of min(KV heads x head_dim, 512)
    # threads: a latency-bound kernel whose CTAs in flight are capped by the SM's resident threads and CTAs
    # (GpuSpec.sm_limits). Each wave of them beyond the first (which t_attn_over holds) costs t_cache_cta (s)
    t_cache_cta: float = 0.0
    # GEMM main loop: the shortest time one CTA spends on a 128-byte-deep K block (64 bf16 / 128 fp8 elements;
    # s). A CTA keeps a few stages of operand loads in flight, so each block costs at least the load latency over
    # the stages (Little's law for one CTA). An SM's other tiles hide that wait, so it binds where the SM's MMAs
    # over all its tiles are faster — a wave or so of small tiles on fast tensor cores. 0: never binds
    t_kiter: float = 0.0
    # the share a GEMM's main loop slows by per unit of the out-of-bounds share of its last row of activation
    # tiles (M not a multiple of the tile's rows: a tile whose activation box reaches past M loads it through
    # the tensor memory accelerator's boundary-checked path); 0: no such cost (a kernel fact fitted once, on the
    # one table that shows it: opbench_fp8 h100_sxm; never transferred — FP8_KERNEL_FITTED)
    tma_oob: float = 0.0
    # decode attention's KV stream: Little's law for the whole kernel, as the GEMMs' t_ramp — a stream of W bytes
    # reaches eta_attn_mem only with BW * t_ramp_kv bytes in flight, so it takes (W + sqrt(W * BW * t_ramp_kv)) /
    # (BW * eta_attn_mem) (OpModel._kv_stream_time). 0: every KV stream at its ceiling at once
    t_ramp_kv: float = 0.0
    # bytes per SM per SM clock a decode kernel streams a benchmark loop's L2-resident KV cache at (0: the GEMV
    # rate, l2_bytes_per_clk)
    l2_kv_bytes_per_clk: float = 0.0
    # board power over TDP the power limiter's fast loop allows once it engages, LIMITER_ENGAGE_S into a burst,
    # until the one-second average takes over (clock_ratio). 2.0 = BURST_HEADROOM: no second stage
    limiter_headroom: float = 2.0
    # kernel facts (not fitted): the decode kernel splits the KV only when query heads share KV heads
    split_needs_gqa: bool = False
    # FA2's split-KV combine kernel (flash_fwd_splitkv_combine_kernel) reads the splits' fp32 partial outputs back,
    # combine_rows query rows per CTA (kBlockM = 4 at head_dim 128): few rows -> few CTAs, each streaming at most
    # cta_bw. 0: the combine is priced by t_split alone
    combine_rows: int = 0
    attn_row_pad: int = 0  # prefill query rows are padded to this block (0: the kernel packs heads, no padding)
    attn_block_m: int = 128  # query rows per prefill attention CTA
    # query rows every decode CTA computes, the group's query heads packed as rows (or the one row of plain
    # multi-head decode) and the rest masked (0: only the useful rows)
    decode_row_block: int = 0
    cta_slots: int = 4  # decode CTAs resident per SM
    # p of the soft maximum of a decode kernel's items' fixed work and its KV stream (0: the hard maximum, the
    # items' work wholly hidden behind the other resident CTAs' streaming). How much of it hides is the kernel's
    # (its warps' schedule), so it is fitted per kernel family and a GPU's calibration keeps it. The calibration
    # tables show it where items and stream are of a size: H100 decode rows of 128-512 keys at 256-4096 items ran
    # 10-27 % slower than the larger of the two
    item_overlap: float = 0.0
    # how the decode kernel splits the KV: "flash" (FlashAttention-3's rule, decode_splits), "fa2" (FlashAttention-2's,
    # fa2_splits) or "trtllm" (FlashInfer's TRT-LLM generation kernels, computeCtaAndClusterConfig: as many splits
    # as leave one CTA per SM, each of at least operators.TRTLLM_SPLIT_MIN_KEYS keys, merged in the kernel: t_merge
    # per split)
    decode_split_rule: str = "flash"
    # most KV splits the decode kernel may take: FlashAttention-3's own cap is 128, but vLLM caps it under a full
    # CUDA graph (its decode path) so the split buffers can be sized at capture: AttentionConfig.
    # flash_attn_max_num_splits_for_cuda_graph, 32 by default
    decode_max_splits: int = 128
    prefill_split: bool = False  # the prefill kernel splits the KV when its query tiles leave SMs idle (FA3)
    # the prefill kernel runs each tile's softmax in the warps that issue its MMAs, in series with them
    # (FlashAttention-2: operators.FA2_SOFTMAX_FP32_OPS); otherwise the exponentials overlap the MMAs (SFU_OVERLAP)
    softmax_serial: bool = False
    # How a kernel that overlaps its softmax with its MMAs (not softmax_serial) hides it: > 0, the whole softmax of
    # a score (its exponential on the SFUs and its FP32 ops, operators.FA2_SOFTMAX_FP32_OPS plus the output's
    # rescale, as OpModel._softmax_cost prices FA2's) is added to the tensor time as (t_tc^p + t_soft^p)^(1/p) with
    # p this exponent (1: in series, large: wholly hidden), in prefill and decode; 0, the exponential alone at
    # operators.SFU_OVERLAP in prefill. A fact of the kernel's pipelining, read off a table's head dims (per score
    # the softmax grows little with head_dim — only its output rescale does, head_dim / key block FMULs — and the
    # MMAs in proportion), so it stays with its kernel family in a leave-one-out check and a calibration
    softmax_overlap: float = 0.0
    # Share of the attention prefill kernel's per-row prologue/epilogue (k0_attn, stated at operators.ATTN_K0_HEAD_DIM)
    # that costs the same at every head_dim: the pipeline's first loads and barriers, the tile scheduler — against
    # the query tile's load and the output's normalisation and store, which grow with it. Fitted alone on a
    # table's head dims (short prompts, where the prologue is most of the time); 0: all of it in proportion to
    # head_dim, as the MMAs
    k0_attn_fixed: float = 0.0
    # ...and of the decode kernel's fixed work an item (item_cost, stated at operators.ATTN_K0_HEAD_DIM): 1, all of
    # it the same at every head_dim; the rest (the query's load, the output's normalisation and store) grows with it.
    # FA3's per-row gather (t_qrow), its scheduler's rounds (t_sched) and the prefill items (block_cost) keep their
    # head_dim-128 values at every head_dim: the share fitted on item_cost stands for what of them grows
    item_cost_fixed: float = 1.0
    # the prefill kernel packs a KV head's query heads into its query tiles as rows (FA3's PackGQA, which its
    # varlen calls always take): the grid is ceil(new x group / attn_block_m) tiles per sequence and KV head
    prefill_pack_gqa: bool = False
    # a prefill CTA works on two query tiles of attn_row_pad rows, one tile's softmax hidden under the other's MMAs
    # (ping-pong): a chunk of an odd number of tiles leaves one of them alone, slower (OpModel._lone_tile)
    prefill_pingpong: bool = False
    # plain multi-head prefill (one query head per KV head) streams its KV in series with its MMAs, not under them
    # (FlashInfer's TRT-LLM context kernels on the B300: see ARCH["blackwell"])
    prefill_mha_kv_serial: bool = False
    # a step holding both prefill chunks and decodes runs them in one attention call per layer (vLLM's FlashAttention
    # backends: one varlen kernel over every sequence, one KV-cache write), so the call's fixed part (t_attn_over)
    # is paid once; FlashInfer's backend runs its prefill and decode kernels one after the other
    attn_mixed_one_call: bool = False
    # ((query tile, relative cost of the main loop per KV token), ...): the decode kernel packs a KV head's query
    # heads into a tile of the smallest listed size that holds them, and a larger tile slows each CTA's pass over
    # its KV (its stream rate is cta_bw / cost). Empty: one rate for every group size
    decode_tile_cost: tuple[tuple[int, float], ...] = ()
    # ((query tile, relative cost of an item's fixed work), ...) where the kernels that run each tile differ in it
    # from their main loops' ratio above (TRT-LLM: tiles of 8-32 rows run its SwapsMmaAb kernels, 64 its
    # KeepsMmaAb): a decode item's fixed work scales by its tile's entry. Empty: by decode_tile_cost
    decode_item_tile_cost: tuple[tuple[int, float], ...] = ()
    # order in which prefill query tiles reach the SMs: "grid" (a plain grid, FA2's: head by head, each sequence's
    # tiles shortest first — a long tile can be dispatched last) or "lpt" (a persistent scheduler, FA3's: sequence
    # by sequence, each head's tiles longest first, to whichever SM frees first)
    attn_tile_order: str = "grid"
    # bytes per SM per SM clock the kernels stream out of L2 when a benchmark loop re-reads an operand that fits:
    # 19.0 fitted on the B300 GEMM table (126.5 MB of L2 holds six copies of weights up to 21 MB; it fits
    # 7.4 on the H100 and ~0 gain on the A100, where L2 re-reads are not faster than DRAM: the min() keeps them
    # at DRAM speed). Far below the A100 whitepaper's raw 47 B/clk/SM: a GEMV's loads, not the L2, set the rate.
    l2_bytes_per_clk: float = 19.0
    tiles: tuple[tuple[int, int], ...] = (
        (64, 64), (64, 128), (128, 64), (64, 256), (128, 128), (128, 256), (256, 128),
    )
    # a library that dispatches a fixed tile by shape instead of a heuristic over ``tiles`` (TILE_RULES): "" = the
    # tile_policy's pick
    tile_rule: str = ""
    # how the library's heuristic picks among ``tiles`` (gemm_efficiency): "least_time" — the tile whose waves
    # finish first; "largest_filling" — the largest tile whenever its grid fills every SM at least once, the
    # last wave evened out by split-K rather than by a smaller tile (cuBLAS on Ampere; see ARCH["ampere"])
    tile_policy: str = "least_time"
    memory: str = ""  # DRAM technology of the calibration GPU the DRAM efficiencies were fitted on
    # fp8 only (ARCH_FP8): vLLM's CUDA input quantisation (scaled_fp8_quant) runs one CTA per token row
    q_row: float = 0.0  # SM-time one token row costs each quantisation kernel (s)
    q_sm_bw: float = 0.0  # bytes/s one SM's quantisation CTAs stream (one row each: few bytes in flight)
    fitted_on: str = ""
    borrowed_from: str | None = None

    def __post_init__(self) -> None:
        if self.prefill_pingpong and (self.prefill_pack_gqa or self.attn_block_m != 2 * self.attn_row_pad):
            # OpModel._lone_tile reads the CTA as two unpacked tiles of attn_row_pad rows
            raise ValueError("ArchConstants.prefill_pingpong needs unpacked tiles (prefill_pack_gqa False) and "
                             "attn_block_m = 2 x attn_row_pad")
        if self.tma_oob < 0:  # a negative slowdown could price a GEMM at zero or negative time
            raise ValueError(f"ArchConstants.tma_oob must be >= 0, got {self.tma_oob!r}")
        # the kernel facts named by a string: a misspelt one would silently take the default branch
        for name, allowed in KERNEL_FACT_VALUES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"ArchConstants.{name} must be one of {sorted(allowed)}, got {getattr(self, name)!r}")


# Fitted by bench/fit_constants.py (`make fit`) on ../shared/data/opbench ONLY: ampere on the A100-SXM4-80GB
# tables, hopper on the H100 80GB HBM3 tables, blackwell on the B300 SXM6 AC tables (GEMMs with N,K in
# [1024, 16384], every M; prefill and decode attention with head_dim 128), every row predicted as `m2live validate`
# does it: the burst clock of the power model (TAU_CLOCK, BLACKWELL_SUSTAINED) and L2 re-reads of the loop.
# results/constants.json holds the fit and its leave-one-architecture-out check. Reading:
# - eta_tc 1.00 (A100), 0.96 (H100), 0.88 (B300; 1.00 before the voltage floor) of the dense peak at the NVML
#   max clock, with the burst clock in f_clk (BURST_HEADROOM; before it, 1.00 / 0.88 / 0.77 absorbed each GPU's
#   own burst droop, and 0.82 on the H100 with the clock held at boost).
# - eta_mem 0.76 (HBM2e, A100), 0.91 (HBM3, H100), 0.91 (HBM3e, B300): the streaming ceiling of each memory
#   technology (MEMORY_FITTED_ON); t_ramp, the Little's-law latency whose bandwidth-times-latency bytes a stream
#   needs in flight, fits 0 on the A100 and H100 (their kernels' fixed time carries the short streams) and
#   103 ns on the B300 (W0 = 0.8 MB at 8 TB/s).
# - i_crit 34 / 18 / 18 elements: the tile intensity from which operand feed stops limiting the MMAs (soft
#   minimum, ACTIVE_SOFTNESS): Ampere's mma.sync needs 128-wide tiles, Hopper's wgmma reads shared memory
#   asynchronously, Blackwell's tcgen05 keeps its accumulators in TMEM and its operands in shared memory.
# - k0 312 / 276 / 64 K-elements: per-tile prologue/epilogue (the B300's is mostly hidden: TMEM accumulators
#   drain while the next tile's main loop runs; 2-5 before its K-block floor).
# - k_split 768 / 1792 / 2048 K-elements (chosen on a grid): the shortest K slice cuBLAS's split-K hands a CTA.
# - t_kernel 2.6 / 3.2 / 1.9 us: a kernel's fixed time inside a CUDA graph (a split-K GEMM pays it twice on the
#   A100 and B300, whose cuBLAS reduces in a second kernel that reads the slices' fp32 partials back; the H100's
#   reduces in the GEMM kernel: t_fixup 1.4 us and the partials' L2 traffic); overlap p 2.6 / 3.4 / 1.7: how hard
#   the roofline max is near the ridge. The A100's GEMM group was refitted with its cuBLAS tile policy
#   (tile_policy "largest_filling") and the B300's with the reduction's reads (A100 GEMM 6.55 -> 5.39 %, B300
#   6.70 -> 6.88 %; results/constants.json "ampere_tile_policy"). k_balance 3072 (A100 only): see tile_policy.
# - t_kiter 65 ns (B300 only): the shortest time a CTA spends on one 128-byte K block, its loads' latency over
#   the stages it keeps in flight, hidden where its SM has other tiles to work on. On the B300 table a small-M
#   GEMM whose grid is a few 64-wide tiles grows by ~2 us per 1024 K (N = 1024, M <= 16: 3.6 / 4.9 / 5.6 us at
#   K = 1024 / 1536 / 2048) where its tcgen05 MMAs alone take 0.5 us: ~125 ns per block against 32 ns of MMA.
#   Fitted with eta_tc, i_crit, k0, t_kernel (k_split on its grid; eta_mem, t_ramp and overlap kept, as HBM3e's
#   eta_mem is every HBM3e GPU's): `bench/fit_constants.py --groups gemm --gpus b300_sxm --only
#   t_kiter,t_kernel,eta_tc,i_crit,k0 --maxiter 300 --max-rows 5000`: B300 GEMM 6.88 -> 6.32 % (paid by every
#   wave of tiles instead: 6.60 %; results/constants.json "blackwell_k_block_floor"). On the A100 it never binds
#   (a 64 x 64 tile's mma.sync takes 180 ns per block); the H100's fit takes 88 ns (5.58 -> 5.45 %) but costs the
#   leave-one-out from Hopper 1-2 points (B300 <- H100 9.0 -> 10.9 %): not taken, the H100 keeps none.
# - attention: a 12 us floor per vLLM attention call on A100/H100 (FlashAttention), 9 us on the B300
#   (FlashInfer's TRT-LLM kernels); tensor ceilings 0.61 (FA2) / 0.73 (FA3) / 0.89 (TRT-LLM) with a per-CTA
#   prologue/epilogue of 169 / 447 / 646 keys per query row, the scores' exponentials on the SFUs added in
#   quadrature (OpModel.prefill_attention, SFU_OVERLAP; before them 0.60 / 0.69 / 0.83 absorbed that cost);
#   each wave of KV-cache-write CTAs beyond the first (vLLM's reshape_and_cache_flash: one CTA per token,
#   min(KV heads x head_dim, 512) threads, as many resident as GpuSpec.sm_limits allow) holds its SM slots
#   4.5 / 2.3 / 1.7 us (t_cache_cta) — the dependent slot -> K/V load -> store chain of a latency-bound kernel,
#   shorter on the faster-clocked, newer memory systems. These four and block_cost were refitted together, `--only t_cache_cta,eta_attn,k0_attn,block_cost`,
#   on the query blocks of vLLM's kernels (attn_block_m 64 / 128 / 256), the burst-headroom clock and the causal
#   tile makespan (OpModel._tile_makespan_fill): prefill 8.09 / 7.87 / 8.37 -> 4.84 / 6.56 / 5.71 %, decode
#   8.33 / 6.44 / 6.06 -> 8.37 / 6.46 / 6.11 % (eta_attn is shared). Refitted the same way with the SFU term
#   (`--only t_cache_cta,eta_attn,k0_attn,block_cost --maxiter 300`): prefill 4.68 / 6.56 / 5.71 -> 4.68 / 6.54 /
#   5.74 %, and every other head dim of the H100 and B300 tables (never fitted) closer: hd64 17.1 -> 14.1 and
#   23.9 -> 21.2 %, hd256 15.9 -> 14.7 and 21.3 -> 20.2 %. A decode kernel's KV stream ramps to its ceiling
#   by Little's law, as a GEMM's weight stream does (OpModel._kv_stream_time): it needs BW x t_ramp_kv bytes in
#   flight, t_ramp_kv 0.81 / 1.29 / 1.09 us (W0 = 1.7 / 4.3 / 8.7 MB) — a loaded DRAM latency of about a
#   microsecond on all three memory systems — towards ceilings of 0.81 / 0.99 / 0.96 of DRAM peak (a 1 GB
#   cache streams at 0.78 / 0.93 / 0.93). The decode tables show the ramp as a bias by KV size: before it, KV
#   caches of one to four times the L2 came out 5-9 % fast and those over eight times 3-5 % slow on all three
#   GPUs (one ceiling for every size, 0.73 / 0.88 / 0.86, balanced the two). And the B300's decode re-reads a KV cache that
#   fits its L2 at l2_kv_bytes_per_clk = 41 bytes per SM per clock (a GEMV's loads reach 19): at batch 4-64,
#   a 64 MB cache takes 12-13 us and the model had ~17 us, at DRAM speed; the A100's and H100's fits gain
#   nothing from a rate of their own (they keep 0 = the GEMV rate). Refitted (`bench/fit_constants.py --groups
#   attention --gpus <one> --only eta_attn_mem,item_cost,cta_bw,t_merge,t_split,t_relayout,t_ramp_kv,
#   l2_kv_bytes_per_clk --maxiter 300`, each GPU on its own table): decode 5.23 / 6.46 / 6.11 -> 5.00 / 5.93 /
#   4.71 %, prefill within 0.02 point; leave-one-out decode A100 <- H100 18.1 -> 17.6, A100 <- B300 35.5 ->
#   34.8, H100 <- A100 14.8 -> 13.9, H100 <- B300 27.9 -> 28.2, B300 <- A100 68.3 -> 67.3, B300 <- H100 44.6 ->
#   45.8 %. Each (sequence x KV head) decode item costs ~3.5 / 3.7 / 1.6 us of SM time; split-KV combine 5.5 /
#   2.2 us (A100 / H100; the B300 merges in the kernel, 0.08 us per split);
#   FA2's grouped-query relayout 6.6 us of launches (A100 only) plus its three copies' DRAM traffic
#   (OpModel.decode_attention, as three memory-bound kernels); one decode CTA streams at most 22 GB/s on the
#   A100 (FA2 runs one CTA per head over plain multi-head caches), 86 GB/s on the B300 and without a visible limit on the H100. The A100's decode
#   constants (item_cost, cta_bw, t_split, t_relayout) were refitted with the relayout copies priced as bytes and
#   FA2's per-item cost by query rows (decode_tile_cost below), `--gpus a100_sxm --only
#   item_cost,t_relayout,cta_bw,t_split`: A100 decode 8.37 -> 6.58 %; then again with FA2's own split rule
#   (decode_split_rule "fa2"): 5.96 %, and with FA2's items in whole waves over the SMs: 5.24 % (item_cost
#   3.7 -> 3.5 us).
ARCH: dict[str, ArchConstants] = {
    "ampere": ArchConstants(
        eta_tc=0.999877, i_crit=33.6511, k0=311.773, t_kernel=2.65569e-06, eta_mem=0.76065, overlap=2.65677,
        t_ramp=0.0, k_split=768, k_balance=3072,  # the fit takes no ramp on the A100: its kernels reach eta_mem at once
        # (item_overlap with item_cost and eta_attn_mem refitted on every head_dim-128 row, 2026-12-05,
        # bench/fit_constants.py --gpus a100_sxm --groups attention --only those three: decode 5.00 -> 4.96 %,
        # prefill 4.65 -> 4.62 %)
        # eta_attn is FA2's tensor efficiency apart from its softmax, which runs in series with the MMAs
        # (softmax_serial, operators.FA2_SOFTMAX_FP32_OPS: priced from the SFU and FP32 rates of the GPU, so it
        # weighs less on an SM with more FP32 lanes or slower tensor cores — Ada, GB202). Refitted with it
        # (2026-12-05, --gpus a100_sxm --groups attention --only eta_attn,k0_attn,block_cost, every row):
        # eta_attn 0.609 -> 0.834, k0_attn 169 -> 232; A100 prefill 4.62 -> 4.64 %, decode 4.96 -> 4.95 %.
        # Refitted (2026-12-06, --gpus a100_sxm,b300_sxm --groups attention --only eta_attn,k0_attn) once small
        # grids were list-scheduled (OpModel._list_makespan): eta_attn 0.834 -> 0.833, k0_attn 232 -> 227; A100
        # prefill 4.64 -> 4.43 % (the list schedule alone: 4.44), decode 4.95 % unchanged
        t_attn=1.224e-05, t_attn_over=8.568e-06, eta_attn=0.833227, k0_attn=226.987, eta_attn_mem=0.810652,
        item_cost=3.4771e-06, block_cost=3.14942e-07, cta_bw=2.214e+10, t_split=5.541e-06, t_relayout=6.264e-06,
        t_cache_cta=4.54008e-06, t_ramp_kv=8.114e-07, item_overlap=3.97535,
        split_needs_gqa=True,  # FlashAttention-2 varlen decode: split-KV only when heads > KV heads
        # FA2's own split rule (set_params_splitkv): FlashAttention's over twice the SMs ("128 threads per block")
        # and only split counts that change the key blocks per split (A100 decode 6.59 -> 5.96 %, refitted)
        decode_split_rule="fa2",
        combine_rows=4,  # FA2's combine kernel: 4 query rows per CTA at head_dim 128
        attn_row_pad=64,  # FlashAttention-2 prefill: one head per CTA, query rows in blocks of 64 (FA3 packs)
        softmax_serial=True,  # FA2's softmax between its tile's two MMAs, in the same warps
        attn_mixed_one_call=True,  # vLLM's FLASH_ATTN backend: one flash_attn_varlen_func call for the whole batch
        # vLLM's prefill reads a paged KV cache, and FA2's varlen API sends paged-KV calls to its split-KV kernel,
        # whose query block is 64 rows at every head dim (run_mha_fwd_splitkv_dispatch: kBlockM = 64, kBlockN =
        # 128 at head_dim <= 128), not the 128 of its plain forward kernel (A100 prefill 8.9 -> 8.1 % refitted)
        attn_block_m=64,
        # FA2 decodes with the same split-KV kernel: 64 query rows per CTA, so one query head or 48 on a KV head
        # cost alike, as the A100 table shows (batch 64, 256 keys: 21.9 us at 2 heads, 26.9 us at 48); A100
        # decode 8.56 -> 8.33 % with the constants as fitted (refitted 8.31 %)
        decode_row_block=64,
        # ... but each real row of that block still costs the CTA its pass: the q rows it loads and the output
        # and log-sum-exp rows it writes are predicated on the rows that exist. The A100's SM time per decode item
        # at short contexts (<= 7 keys, >= 4 x SMs items, one KV head so no relayout copies: the items' fixed cost
        # alone) is flat to 8 query heads per KV head and then grows: 4.77 / 5.02 / 5.59 / 6.62 / 7.35 us at
        # 8 / 16 / 32 / 48 / 64 — these ratios, read off opbench a100_sxm (A100 decode 7.12 -> 6.59 %).
        # The KV stream is untouched: masked rows are computed all the same, so the tile is always 64 rows.
        decode_tile_cost=((8, 1.0), (16, 1.05), (32, 1.17), (48, 1.39), (64, 1.54)),
        # cuBLAS's Ampere heuristic keeps its largest tile (128 x 256) once that grid fills the 108 SMs, and evens
        # out the last wave with split-K instead of taking a smaller tile: on the A100 table every GEMM whose
        # 128 x 256 grid is 1.0-1.5 waves at K <= 4096 takes the two full waves of that tile (M x N from 3.7 M to
        # 6.3 M outputs all run 204 +- 3 us at K = 4096, where the least-time tile gives 152-165 us), and at
        # K >= 6144 the same tile split in 2-3 K slices (4096 x 1024 x 10240: 358 us measured, 356 us split 3,
        # 498 us unsplit, 358 us least-time tile): a K slice of at least k_balance = 3072 (chosen on a grid; the
        # table's splits: K 6144 in 2, 8192 in 2 not 3, 10240 and 12288 in 3), where the small-M splits that fill
        # the SMs go down to k_split = 768
        tile_policy="largest_filling",
        memory="HBM2e", fitted_on="opbench a100_sxm (NVIDIA A100-SXM4-80GB), bench/fit_constants.py",
    ),
    "hopper": ArchConstants(
        eta_tc=0.962938, i_crit=20.6673, k0=286.804, t_kernel=3.14346e-06, eta_mem=0.907861, overlap=3.16317,
        t_ramp=0.0, k_split=1792, t_fixup=1.42351e-06,
        # the limiter's fast loop (clock_ratio): after LIMITER_ENGAGE_S the H100 holds 1.41 x TDP (fitted on opbench
        # h100_sxm GEMMs with the compute side, eta_mem and the ramp kept: H100 GEMM 5.58 -> 5.41 %; refitted with
        # the Hopper energy anchor at the current activity, ENERGY_PER_FLOP: 5.42 %)
        limiter_headroom=1.4122,
        # cuBLAS's sm90 kernels reduce split-K in the GEMM kernel (split_reduce "serial"): on the H100 table at
        # M <= 16 the time steps up by ~1 us where the split starts (N <= 4096, K 3584 -> 4096), not by a kernel
        # launch (2.9 us) as on the A100, whose table shows no such step. Refitted with it (gemm group, --max-rows
        # 5000): H100 GEMM 6.15 -> 5.58 %
        split_reduce="serial",
        # the attention group refitted on every head_dim-128 row of the H100's tables with FA3's GQA packing
        # (prefill_pack_gqa) and the decode items' partial overlap (item_overlap) in place (2026-12-05,
        # bench/fit_constants.py --groups attention --max-rows 8000, then again with the decode constants and the
        # call's fixed parts only, the KV ramp held at its value before — free, it went to 1.85 us, 3.4 x the
        # A100's, for 0.1 point): H100 prefill 6.38 -> 5.36 %, decode 5.93 -> 5.79 % (5.64 %, below).
        # eta_attn_mem sits at its bound 1.0; with the KV ramp the table's longest streams (4.3 GB) come out at 0.97
        # of the datasheet bandwidth, measured 0.94-0.95. cta_bw now binds (49 GB/s a CTA; it had run off to
        # 3.6e13): one sequence over a long KV, split into at most 32 CTAs (decode_max_splits), streams at most
        # ~1.6 TB/s. eta_attn and k0_attn refitted (2026-12-06, bench/fit_constants.py --gpus h100_sxm --groups
        # attention --only eta_attn,k0_attn) once small grids were list-scheduled in FA3's order (attn_tile_order
        # "lpt", below): 0.734 -> 0.719, 448 -> 434; H100 prefill 5.35 -> 5.09 %, decode 5.64 % unchanged
        # FA3's tile scheduler priced over batches of at most 992 sequences (t_sched, operators.
        # FA3_DYNAMIC_SPLIT_MAX_BATCH; 2026-12-06), the decode constants refitted with it (--gpus h100_sxm --groups
        # attention --only item_cost,cta_bw,t_split,eta_attn_mem,item_overlap,t_sched --max-rows 8000, the KV ramp
        # held): decode 5.64 -> 4.57 %, prefill 4.80 -> 4.71 % (its single-token rows); t_sched 0.48 us a round
        # of 31 sequences, ~15 ns a sequence (the same term over every batch size: 5.09 %; none, refitted: 5.57 %)
        # FA3's packed query rows (t_qrow, 2026-12-07): a decode item's query heads are its tile's rows, gathered
        # in and written out row by row (PackGQA, not TMA), 25.5 ns a row — 512 bytes of q and output at ~20 GB/s,
        # below the CTA's KV stream (cta_bw 48 GB/s). The H100 table at one key and one KV head, past the
        # scheduler's batches: 1024 sequences of 8 / 32 / 64 query heads 41.5 / 41.9 / 45.9 us, 2048 73.7 / 82.9 /
        # 94.7 us. Refitted with it (--gpus h100_sxm --groups attention --only item_cost,cta_bw,t_split,
        # eta_attn_mem,item_overlap,t_sched,t_qrow --max-rows 8000, t_ramp_kv held): decode 4.57 -> 4.28 %,
        # prefill 4.71 %; a query-tile cost table as FA2's and TRT-LLM's (decode_tile_cost: 8 / 16 / 32 / 64 rows
        # 1.0 / 1.05 / 1.17 / 1.38, the KV stream slowed alike) 4.30 % with three constants to this one's
        # FA3 overlaps each score's softmax (exponential and FP32 ops, OpModel._softmax_cost) with the MMAs at
        # softmax_overlap = 1.255 — close to in series: its two ping-ponging warpgroups hide little of it. Fitted
        # (2026-12-07) with eta_attn and k0_attn on opbench h100_sxm's attention rows of head_dim 64 / 128 / 192 /
        # 256 (bench/fit_constants.py --gpus h100_sxm --groups attention --only eta_attn,k0_attn,softmax_overlap
        # --head-dims 64,128,192,256 --max-rows 5000 --maxiter 200; the prefill rows pin them, the decode rows'
        # compute never binds): per score the softmax grows little with head_dim (0.084 / 0.090 / 0.113 SM clocks
        # at 64 / 128 / 256) and the MMAs in proportion, so the head dims pin the overlap, and the MMAs come out at
        # the tensor peak
        # (eta_attn 0.719 -> 1.0, at its bound; k0_attn 434 -> 617): the kernel's distance from the peak is its
        # softmax and its fixed costs (a 16k-token causal prompt computes at 0.44 / 0.60 / 0.73 of the peak at
        # head_dim 64 / 128 / 256; FA3's published forward benchmarks rank the head dims alike). MAPE at head_dim 64 /
        # 192 / 256, every prefill row, 14.7 / 12.1 / 14.2 -> 10.3 / 11.0 / 11.3 %, head_dim 128 (the region)
        # 4.71 -> 4.66 %, head_dim 512 40.1 -> 42.8 % (results/constants.json hopper_softmax_overlap). On an H20
        # (the same kernel, a seventh of the tensor rate, the same SFU and FP32 rates an SM) the softmax hides under
        # the slow MMAs: a 16k-token head_dim-128 prefill computes at 0.85 of its peak (0.67 before; 21 % less time)
        softmax_overlap=1.25508,
        # The prologue/epilogue is about half fixed: prompts under 1 K tokens cost the H100 less at head_dim 256,
        # and more at 64, than in proportion (against head_dim 128: 1.25 x and 0.88 x measured, 1.40 x and 0.79 x
        # priced in proportion). So is a decode item's fixed work, priced the same at every head_dim until now:
        # decodes over <= 128 keys were priced 10-20 % too slow at head_dim 64 and 3-23 % too fast at 256 (medians
        # by batch; at 1-32 sequences head_dim 64 stays 11-15 % too slow: the call's floor, not the items). Each
        # fitted alone
        # (2026-12-07, bench/fit_constants.py --gpus h100_sxm --groups attention --only k0_attn_fixed, then
        # --only item_cost_fixed, --head-dims 64,128,192,256 --max-rows 6000; the rows of head_dim 128 do not move):
        # H100 prefill at head_dim 64 / 192 / 256 10.32 / 11.03 / 11.29 -> 6.89 / 7.39 / 6.65 %, decode 10.48 /
        # 7.92 / 7.74 -> 7.92 / 6.72 / 5.91 %. The prologue's share fitted with eta_attn, k0_attn and
        # softmax_overlap did no better (prefill 6.96 / 6.55 / 6.53 %, head_dim 128 4.66 -> 4.74 %)
        k0_attn_fixed=0.525826, item_cost_fixed=0.552985,
        t_attn=1.18773e-05, t_attn_over=9.52149e-06, eta_attn=1.0, k0_attn=616.864, eta_attn_mem=0.999845,
        item_cost=3.2558e-06, block_cost=2.76566e-06, cta_bw=4.84886e+10, t_split=2.596e-06,
        t_cache_cta=2.35962e-06, t_ramp_kv=1.291e-06, item_overlap=1.51632, t_sched=4.62669e-07, t_qrow=2.55153e-08,
        # vLLM decodes under a full CUDA graph, where it caps FA3's KV splits at 32 (decode_max_splits; the
        # collector's table agrees: one sequence over a 64-128 K-token KV ran ~1.35 x slower than two sequences
        # over the same bytes). item_overlap, item_cost, cta_bw, t_split refitted with it on all decode rows:
        # decode 5.79 -> 5.64 % (cap 16: 5.65 %, no cap: 5.79 %). (A step that mixes prefills into its decodes runs
        # outside the full graph, uncapped; the step predictor prices its decodes at the cap all the same.)
        decode_max_splits=32,
        # FA3's varlen calls always pack a KV head's query heads into the query tiles (hopper/flash_api.cpp
        # get_pack_gqa: PackGQA whenever cu_seqlens_q is given, as vLLM's prefill gives it)
        prefill_pack_gqa=True,
        # FA3 (kernel_source vllm_flash_attn_fa3) splits a prefill's KV too when its query tiles leave the SMs idle
        # (fa3_splits; query heads packed per KV head on a paged cache): H100 prefill 8.04 -> 7.87 % with the
        # constants as fitted (eta_attn, k0_attn, block_cost refitted: 7.87 %, not moved)
        prefill_split=True,
        # FA3's causal kernels run a persistent tile scheduler (hopper/tile_scheduler.hpp: each SM takes the next
        # tile when it frees, "longest-processing-time-first", a sequence's query blocks last to first): small
        # grids list-scheduled in that order (OpModel._list_makespan) price the H100's prefill 5.35 -> 5.13 %
        # with the constants as fitted, against 5.73 % in the FA2 grid's order
        attn_tile_order="lpt",
        attn_mixed_one_call=True,  # FA3 in vLLM's FLASH_ATTN backend, as FA2: one varlen call for the whole batch
        memory="HBM3", fitted_on="opbench h100_sxm (NVIDIA H100 80GB HBM3), bench/fit_constants.py",
    ),
    "blackwell": ArchConstants(
        eta_tc=0.878305, i_crit=18.1129, k0=62.3599, t_kernel=1.82635e-06, eta_mem=0.90688, overlap=2.00549,
        t_ramp=1.71604e-07, t_kiter=6.81944e-08,
        # cuBLAS's split-K slices on the B300 are at least k_split = 3072 deep: chosen on the fit's grid, which
        # stopped at 2048 until 2026-12-05 — the B300's pick sat on its edge (the A100's 768 and the H100's 1792
        # are inside it); 2048 / 2560 / 3072 / 4096 with the constants then fitted: 6.02 / 5.95 / 5.93 / 6.02 %
        k_split=3072,
        # the limiter's fast loop (clock_ratio): after LIMITER_ENGAGE_S the B300 holds ~its TDP (1.05 x). The GEMM
        # group (this, the compute side, eta_mem, the ramp, k_split) refitted on every one of opbench b300_sxm's
        # 14504 region rows (2026-12-05, bench/fit_constants.py --groups gemm --max-rows 15000, twice from the
        # constants before, k_split on the widened grid; it had been fitted on a 5000-row sample): B300 GEMM
        # 6.09 -> 5.88 %, prefill 5.72 -> 5.65 % (its burst clock and KV write move with these); the HBM3e
        # streaming ceiling it sets for other HBM3e GPUs (MEMORY_FITTED_ON: H200, B200) 0.919 -> 0.907
        limiter_headroom=1.05146,
        # the attention group refitted on every head_dim-128 row of the B300's tables (2026-12-05, bench/
        # fit_constants.py --groups attention --max-rows 8000; a 2500-row sample of each kind before): decode
        # 4.70 -> 4.53 %, prefill 5.65 -> 5.68 % (one objective over both kinds)
        # (then item_overlap with item_cost, eta_attn_mem, t_ramp_kv: --only those four, all rows: decode 4.53 ->
        # 4.48 %; prefill unchanged). eta_attn and k0_attn refitted (2026-12-06, with the A100's, above) once small
        # grids were list-scheduled: 0.837 -> 0.877, 588 -> 613; B300 prefill 5.68 -> 5.39 % (the list schedule
        # alone: 5.64), decode 4.48 % unchanged
        # The decode constants refitted (2026-12-06, --gpus b300_sxm --groups attention --only item_cost,cta_bw,
        # t_merge,eta_attn_mem,t_ramp_kv,item_overlap --max-rows 8000) once the kernel's splits took at least 512
        # keys each and its CTAs' own stream was priced on whole 256-key steps (operators.TRTLLM_SPLIT_MIN_KEYS,
        # TRTLLM_KV_STEP; 128-key blocks before): decode 4.49 -> 3.82 %, prefill 4.80 -> 4.78 %; cta_bw 93 -> 166
        # GB/s (fewer, longer splits), t_merge 0.090 -> 0.146 us a split
        t_attn=8.90871e-06, t_attn_over=8.0742e-06, eta_attn=0.876606, k0_attn=613.248, eta_attn_mem=0.955043,
        # ... and refitted again (2026-12-07, --only item_cost,cta_bw,t_merge,item_overlap --tiles
        # decode_item_tile_cost:8,16,32,64 --max-rows 8000) with the items' own tile costs (below): decode 3.82 ->
        # 3.38 %, prefill 4.78 -> 4.77 %
        item_cost=1.51186e-06, block_cost=8.48454e-07, cta_bw=1.67006e+11, t_split=0.0, t_merge=1.45981e-07,
        t_cache_cta=1.6876e-06, t_ramp_kv=9.20038e-07, l2_kv_bytes_per_clk=39.7028, item_overlap=6.25461,
        # decode is FlashInfer's TRT-LLM generation kernel (kernel_source vllm_flashinfer_trtllmdecode): its own
        # split rule, the splits merged in the kernel — no combine kernel (t_split 0: the fit drove it to 3e-10 s)
        decode_split_rule="trtllm",
        # TRT-LLM's own cost model of its generation kernels' main loop by query tile (kernelMainloopCost in
        # fmhaKernels.h's selectTileSizeQForGqaGeneration): 8 rows 1.0, 16 1.2, 32 1.48, 64 1.68, 128 2.2; it
        # scales a CTA's KV stream rate (and until 2026-12-07 its work item's fixed cost alike: below).
        # (eta_attn_mem, item_cost, cta_bw, t_merge refitted with both, bench/fit_constants.py --gpus b300_sxm
        # --groups attention --only item_cost,cta_bw,t_merge,eta_attn_mem: B300 decode 8.18 -> 6.06 %; the split
        # rule alone 7.35 %, the tile cost on the stream 7.15 %, on the item cost too 6.08 % before this refit)
        decode_tile_cost=((8, 1.0), (16, 1.2), (32, 1.48), (64, 1.68), (128, 2.2)),
        # A decode item's fixed work by query tile is not the main loop's ratio: for one new token FlashInfer runs
        # query groups of <= 8 / 16 / 32 rows in its SwapsMmaAb kernels and 33-64 in its KeepsMmaAb kernel
        # (fmhaKernels.cuh selectGqGenerationKernel; its cost-model search only for several new tokens). The B300
        # table at one key and one KV head, 1024 -> 2048 sequences (the call's floor cancels): 1.52 / 2.01 / 3.34 /
        # 2.98 us of SM time an item at 8 / 16 / 32 / 64 query heads — the 32-row swapped kernel slower an item
        # than the 64-row one, where the model had 1.0 / 1.2 / 1.48 / 1.68 and ran 15-25 % fast at 32 heads over
        # 512-2048 sequences. Fitted over every decode row with the decode constants (bench/fit_constants.py
        # --gpus b300_sxm --groups attention --only item_cost,cta_bw,t_merge,item_overlap --tiles
        # decode_item_tile_cost:8,16,32,64 --max-rows 8000): B300 decode 3.82 -> 3.38 %; the ratios as read off
        # those rows, the constants refitted: 3.53 %; the main loop's table refitted for both uses: 3.39 %. The
        # 128-row tile (groups of 65-128) is not in the table (its groups stop at 64): the 64-row entry scaled by
        # the main loop's 2.2 / 1.68, not fitted
        decode_item_tile_cost=((8, 1.0), (16, 1.22926), (32, 2.03358), (64, 1.87052), (128, 2.44949)),
        # FlashInfer's TRT-LLM context kernels (kernel_source vllm_flashinfer_trtllmprefill) run one head per CTA
        # over query tiles of 128 rows: a short chunk pays the per-CTA prologue for a full tile (fit: B300
        # prefill 13.8 % with no padding, 12.0 % with 128)
        attn_row_pad=128,
        # ...and a CTA works on two such 128-row query tiles (the kernels are named Q128Kv128; Blackwell attention
        # kernels ping-pong two query tiles between two softmax warpgroups so that one tile's softmax hides under
        # the other's MMAs, FlashAttention-4's layout): the unit of work, and of the grid's waves, is 256 rows.
        # Chosen on the B300 prefill table (refitted: 128 rows 9.9 %, 256 rows 8.5 %; a longest-first tile
        # order, as a persistent scheduler might hand out, 8.8 %)
        attn_block_m=256,
        # ...so a prompt of one 128-row tile (64-128 tokens) runs it alone: no partner, its softmax in series with
        # its MMAs (OpModel._lone_tile; no constant: the SFU and FP32 rates against the tensor peak, 0.82 of the
        # MMA time a score on the B300, capped at 1). On the B300 table a head costs more at 128 tokens than at
        # 256 for the same tokens (16 K tokens, 8 KV heads: 3.31 us a head against 2.82; the model had 2.57
        # against 2.79, now 2.98): grouped-query rows of 128 tokens -8.7 % bias, 9.8 % error -> -2.5 / 5.9 %, of
        # 64 tokens -3.7 / 4.9 -> -1.8 / 3.9 %; B300 prefill 5.08 -> 4.80 % (a refit of eta_attn, k0_attn: 4.79 %,
        # not taken). Also tried: the lone tile's diagonal block computed whole on top (4.76 %, but its term
        # vanishes at once when the tile gets a partner), its 128 padded rows computed (5.13 %)
        prefill_pingpong=True,
        # ...and with one query head per KV head they stream the KV in series with their MMAs: on the B300 table 32
        # heads at b = 16, 512 tokens take 163 us on 32 KV heads, 93 on 8, 72 on 1, the difference 0.6-0.75 us per
        # extra MB of KV; grouped-query shows none of it. Priced at bw x eta_attn_mem, no constant of its own
        # (a scanned rate did no better): B300 prefill 5.39 -> 5.08 % (docs/accuracy.md)
        prefill_mha_kv_serial=True,
        # ...and most of its per-tile prologue/epilogue costs the same at every head_dim: short prompts of head_dim
        # 256 were priced 10-30 % too slow in proportion, of 64 10-15 % too fast; a decode item's fixed work,
        # priced the same at every head_dim, is about half fixed (decodes over <= 128 keys of 512-2048 sequences
        # were priced 17-23 % too slow at 64, 22-37 % too fast at 256). Each fitted alone (2026-12-07, bench/fit_constants.py --gpus
        # b300_sxm --groups attention --only k0_attn_fixed, then --only item_cost_fixed, --head-dims 64,128,256
        # --max-rows 6000): B300 prefill at head_dim 64 / 256 19.52 / 21.74 -> 11.50 / 11.59 %, decode 6.36 / 9.41
        # -> 3.77 / 6.63 %, head_dim 128 unchanged. What stays at 64 is the long prompts' compute (-16 / -22 % at
        # 1-4 K / 4-16 K tokens): their softmax binds there, and the exponentials alone (SFU_OVERLAP) do not reach
        # it. Tried and not taken: the whole softmax overlapped at a fitted p (1.88, with 3.4 FP32 ops a score
        # fitted and the output's rescale in warps of its own, as the Blackwell kernels' correction warpgroup does):
        # head_dim 64 5.6 %, 256 11.6 %, but 128 4.77 -> 5.51 % with eta_attn at its bound — the region that carries
        # to a B200
        k0_attn_fixed=0.777994, item_cost_fixed=0.579347,
        # tcgen05 MMAs: a CTA pair shares one 256-wide tile (2-SM UMMA), so cuBLAS has 256x256 tiles too
        tiles=((64, 64), (64, 128), (128, 64), (64, 256), (128, 128), (128, 256), (256, 128), (256, 256)),
        memory="HBM3e", fitted_on="opbench b300_sxm (NVIDIA B300 SXM6 AC), bench/fit_constants.py",
    ),
}
# The A100 table has head_dim-128 rows only, which cannot pin how much of an attention kernel's fixed work grows
# with head_dim (k0_attn_fixed, item_cost_fixed: stated there). FA2 takes the H100's: its prefill tiles and decode
# items do the same per-row work as FA3's (load the query, normalise and store the output) against fixed set-up,
# and both families measured show a share of about half or more fixed (H100 prefill 0.53, decode 0.55; B300 0.78,
# 0.58), where the old pricing (the prologue wholly in proportion to head_dim, the decode item's work wholly fixed)
# is read off neither. No FA2 row outside head_dim 128 has checked it (an A100 or L40S decode of one short sequence
# at head_dim 256 now costs ~10 % more a call)
ARCH["ampere"] = replace(ARCH["ampere"], k0_attn_fixed=ARCH["hopper"].k0_attn_fixed,
                         item_cost_fixed=ARCH["hopper"].item_cost_fixed)
# Families no calibration table measured borrow the measured family whose kernels they run (GpuSpec.kernel_family):
# Ada (sm_89) and GB202 (sm_120, RTX Blackwell) issue mma.sync like Ampere and run FlashAttention-2 in vLLM —
# GB202 has neither Hopper's wgmma nor data-centre Blackwell's tcgen05/TMEM, so Hopper/B300 numbers would
# describe kernels it cannot run. Their own datasheets (SMs, clocks, peaks, memory, L2) do the rest.
# Their tile pick is the least-time one: the A100's cuBLAS tile policy is that chip's (TILE_POLICY_CHIPS, applied
# by constants_for).
ARCH["ada"] = replace(ARCH["ampere"], borrowed_from="ampere (Ada keeps Ampere's mma.sync tensor pipeline and FA2)")
# The power limiter's fast loop (limiter_headroom) is the board's firmware, not its kernels, so it is borrowed by
# generation: GB202 boards are Blackwell-generation boards and take the B300's (hold ~1.05 x TDP once the fast loop
# engages). The public square-GEMM figures of an RTX PRO 6000 Blackwell Server Edition (bench/accuracy_square.py,
# validation only, never fitted) show the droop only a fast loop gives: 417 -> 387 TF from 8192^3 to 10240^3
# calls (timed bursts of ~0.1 and ~0.2 s), where the one-second average alone keeps the clock at boost; with
# Ampere's value (no second stage) those rows come out +12 / +16 %, with the B300's +2 / +6 % (+1 / +5 % at its
# earlier 1.02). Ada keeps Ampere's
# (no fast loop): the one public L40S figure (269 TF) is already 5 % above the model, and Hopper's headroom (the
# contemporary boards) would put it 11 % under — no evidence for a second stage there.
ARCH["blackwell_rtx"] = replace(ARCH["ampere"], limiter_headroom=ARCH["blackwell"].limiter_headroom,
                                borrowed_from="ampere (GB202/sm_120 issues mma.sync and runs FA2: no wgmma, no "
                                "tcgen05/TMEM); the power limiter's fast loop from blackwell (the board generation)")
# A CPU "device" (the plugin on a machine with no GPU): no tiles or waves; the online correction does the rest.
# The CPU device (m2live/cpu_device.py) measures the engine's own kernels' *effective* FLOP/s and bandwidth, so
# the GEMM factors are 1 here (eta_tc = 1, no operand-feed limit, full streaming efficiency); the per-call costs
# and the attention efficiencies below are defaults that cpu_device.device_constants replaces with measured ones.
ARCH["cpu"] = ArchConstants(
    eta_tc=1.0, i_crit=0.0, k0=0.0, t_kernel=5e-6, eta_mem=1.0, t_ramp=0.0, overlap=8.0,
    t_attn=10e-6, t_attn_over=5e-6, eta_attn=0.3, k0_attn=0.0, eta_attn_mem=0.6, item_cost=0.0,
    block_cost=0.0, cta_bw=1e12,
    attn_block_m=1, cta_slots=1, tiles=((1, 1),),
    fitted_on="not fitted: measured at start-up by m2live/cpu_device.py (the engine's linear and attention kernels)",
)


# The numbers bench/fit_constants.py fits, by the tables they are fitted on (GEMM rows, attention rows); everything
# else in ArchConstants is a kernel fact (tile shapes, query block, resident CTAs, split rule) that belongs to the
# architecture's kernels and never transfers between them.
FITTED_GROUPS: dict[str, tuple[str, ...]] = {
    "gemm": ("eta_tc", "i_crit", "k0", "t_kernel", "eta_mem", "t_ramp", "overlap", "k_split", "t_fixup",
             "k_balance", "t_kiter", "limiter_headroom"),
    "attention": ("t_attn", "t_attn_over", "eta_attn", "k0_attn", "eta_attn_mem", "item_cost", "block_cost",
                  "cta_bw", "t_split", "t_merge", "t_relayout", "t_cache_cta", "t_ramp_kv", "l2_kv_bytes_per_clk",
                  "item_overlap", "t_sched", "t_qrow"),
}
FITTED = tuple(n for group in FITTED_GROUPS.values() for n in group)
# Fitted constants that only one kernel path prices: where a family's kernel facts never take that path, no
# prediction depends on the constant, and a fit (bench/fit_constants.py, m2live calibrate) leaves it alone.
ONLY_WHERE: dict[str, Callable[[ArchConstants], bool]] = {
    # the in-kernel split-K fix-up (a fixed tile dispatch never splits K: gemm_efficiency)
    "t_fixup": lambda c: c.split_reduce == "serial" and not c.tile_rule,
    "k_split": lambda c: not c.tile_rule,  # the split-K threshold likewise
    "t_relayout": lambda c: c.split_needs_gqa,  # FA2's grouped-query relayout (OpModel.decode_attention)
    "t_sched": lambda c: c.decode_split_rule == "flash",  # FA3's varlen tile scheduler (OpModel.decode_attention)
    "t_qrow": lambda c: c.decode_split_rule == "flash",  # FA3's packed query rows (OpModel.decode_attention)
    # the slices of a split that evens out a full grid's last wave (gemm_efficiency)
    "k_balance": lambda c: c.tile_policy == "largest_filling" and not c.tile_rule,
}


def in_use(c: ArchConstants, name: str) -> bool:
    """Whether any prediction under ``c`` depends on the constant ``name`` (``ONLY_WHERE``)."""
    rule = ONLY_WHERE.get(name)
    return rule is None or rule(c)


def transfer(target: ArchConstants, source: ArchConstants) -> ArchConstants:
    """``target``'s kernel facts with ``source``'s fitted numbers (the leave-one-GPU-out check)."""
    return replace(target, **{n: getattr(source, n) for n in FITTED}, fitted_on=source.fitted_on,
                   borrowed_from=None)


# DRAM streaming ceiling by memory technology (achieved / datasheet bandwidth of a long stream). Where a
# calibration GPU has that memory, it is that GPU's fitted GEMM eta_mem; for GDDR, which no calibration GPU has,
# it is the public figure: STREAM-type benchmarks of GDDR6/GDDR6X/GDDR7 cards reach ~0.95 of the datasheet
# bandwidth (GDDR's point-to-point channels have no HBM-style refresh and bank-group turnaround penalties at
# this scale). HBM2 (A30) is taken as HBM2e. A GPU whose memory differs from its kernel family's calibration
# GPU keeps the family's *share* of the ceiling: eta_mem and eta_attn_mem scale by the ratio of the ceilings.
MEMORY_FITTED_ON = {"HBM2e": "ampere", "HBM2": "ampere", "HBM3": "hopper", "HBM3e": "blackwell"}
MEMORY_PUBLIC_CEILING = {"GDDR6": 0.95, "GDDR6X": 0.95, "GDDR7": 0.95}


def memory_ceiling(memory: str) -> float | None:
    """Streaming ceiling of a memory technology, or None when neither measured nor published."""
    if memory in MEMORY_FITTED_ON:
        return ARCH[MEMORY_FITTED_ON[memory]].eta_mem
    return MEMORY_PUBLIC_CEILING.get(memory)


# cuBLAS tunes its tile heuristics per chip (and per release): a tile policy other than the least-time pick is
# applied only on the chips a table showed it on. "largest_filling" was seen on the A100 (sm_80, opbench a100_sxm,
# the cuBLAS of vLLM 0.14); the family's other chips (A10, A40: sm_86) and the families that borrow Ampere's
# kernels (Ada, GB202) keep the least-time pick.
TILE_POLICY_CHIPS: dict[str, tuple[tuple[int, int], ...]] = {"largest_filling": ((8, 0),)}


def fitted_on_this_gpu(c: ArchConstants, gpu: GpuSpec) -> bool:
    """True when ``c`` were fitted on ``gpu``'s own tables (its family's calibration GPU: ``fitted_on`` names it),
    not borrowed from another family nor carried over to a sibling GPU (an H200 or a B200 on its family's numbers)."""
    return c.borrowed_from is None and f"({gpu.name})" in c.fitted_on


def constants_for(gpu: GpuSpec, dtype: str = "bf16") -> ArchConstants:
    """The constants m2live uses on ``gpu``: its kernel family's, with the DRAM efficiencies moved to the GPU's
    own memory technology. A calibration (``m2live calibrate``) replaces fields of this on top."""
    if dtype == "fp8":
        gpu.require_fp8()
    c = arch_constants(gpu.kernel_family, dtype)
    if gpu.compute_capability not in TILE_POLICY_CHIPS.get(c.tile_policy, (gpu.compute_capability,)):
        c = replace(c, tile_policy="least_time")
    own, fitted = memory_ceiling(gpu.memory), memory_ceiling(c.memory)
    if own is None or fitted is None or own == fitted:
        return c
    r = own / fitted
    return replace(c, eta_mem=min(1.0, c.eta_mem * r), eta_attn_mem=min(1.0, c.eta_attn_mem * r),
                   memory=gpu.memory)


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


def grid_ctas(m: int, n: int, tile: tuple[int, int]) -> int:
    """CTAs of an M x N output in (BM, BN) tiles."""
    return -(-m // tile[0]) * -(-n // tile[1])


def _tile_time(m: int, n: int, k: int, sms: int, c: ArchConstants, bm: int, bn: int, split: int,
               iter_macs: float = 0.0, cluster_m: int = 1, cluster_n: int = 1) -> tuple[float, GemmEfficiency]:
    """One tile and K split: (time in units of one SM's MACs at peak, the factors). ``iter_macs``: the main
    loop's floor per K element (``t_kiter``) in the same units. An SM's other tiles hide it (their loads are in
    flight while one tile waits), so it binds where the SM's MMAs over all its waves of tiles take less than
    one floor — a grid of a wave or so of small tiles — and the tensor cores idle for the rest (a lower
    eta_duty)."""
    kk = k / split
    tile_rows = math.ceil(math.ceil(m / bm) / cluster_m) * cluster_m  # whole clusters of tiles (TILE_RULES)
    tile_cols = math.ceil(math.ceil(n / bn) / cluster_n) * cluster_n
    waves = -(-(tile_rows * tile_cols * split) // sms)
    intensity = bm * bn / (bm + bn)
    active = c.eta_tc * (1.0 + (c.i_crit / intensity) ** ACTIVE_SOFTNESS) ** (-1.0 / ACTIVE_SOFTNESS)
    duty = kk / (kk + c.k0) if c.k0 > 0 else 1.0
    if iter_macs * active > waves * bm * bn:
        duty *= waves * bm * bn / (active * iter_macs)
    return waves * bm * bn * kk / (active * duty), GemmEfficiency(
        _padding_wave(m, n, k, sms, bm, bn, waves, kk), active, duty, (bm, bn), split, waves)


def _padding_wave(m: int, n: int, k: int, sms: int, bm: int, bn: int, waves: int, kk: float) -> float:
    """eta_wave: the useful share of ``waves`` waves of BM x BN x KK tiles on ``sms`` SMs."""
    return min(1.0, (m * n * k) / (waves * sms * bm * bn * kk))


def pick_rows(c: ArchConstants) -> tuple[int, ...]:
    """The tile heights through whose row counts, ceil(M / BM), alone ``gemm_efficiency`` reads M — every
    candidate's time and so the pick, all but its padding (``repad``) — under the least-time pick; () where it
    reads M itself (a fixed dispatch's thresholds, the largest-filling policy's reduction of M x N partials)."""
    if c.tile_rule or c.tile_policy != "least_time":
        return ()
    return tuple(sorted({bm for bm, _ in c.tiles}))


def repad(e: GemmEfficiency, m: int, n: int, k: int, sms: int) -> GemmEfficiency:
    """The pick ``e`` made for another M in the same tile rows (``pick_rows``), with this M's padding: what
    ``gemm_efficiency`` itself returns for it, field by field."""
    bm, bn = e.tile
    return GemmEfficiency(_padding_wave(m, n, k, sms, bm, bn, e.waves, k / e.split_k), e.eta_active, e.eta_duty,
                          e.tile, e.split_k, e.waves)


def gemm_efficiency(m: int, n: int, k: int, sms: int, c: ArchConstants,
                    reduce_macs: Callable[[int], float] | None = None, iter_macs: float = 0.0) -> GemmEfficiency:
    """Pick the tile the library picks and return its factors: the fixed dispatch's (``tile_rule``), the
    least-time one of ``tiles``, or (``tile_policy`` "largest_filling") the largest tile once its grid fills the
    SMs.

    For each candidate tile (BM, BN): the grid is ceil(M/BM)*ceil(N/BN) CTAs; if that is less than one wave,
    K is split so the grid fills the SMs (as cuBLAS split-K does for small-M GEMMs; a fixed dispatch never
    splits). Time in units of "one SM at peak" is waves * BM*BN*(K/split) / (eta_active * eta_duty); the least
    time wins. Under "largest_filling", a largest tile whose grid is a wave or more runs alone, its K split into
    as many slices (each >= k_balance) as evens out its last wave best once the reduction is paid
    (``reduce_macs(split)``: reducing that many partial sums, in the same units; without it no such split).
    ``iter_macs``: the main loop's floor per K element (``t_kiter``, ``_tile_time``).
    """
    if c.tile_rule:  # a fixed dispatch (CUTLASS configs) never splits K
        bm, bn, cm, cn = TILE_RULES[c.tile_rule](m, n, k)
        return _tile_time(m, n, k, sms, c, bm, bn, 1, iter_macs, cm, cn)[1]
    tiles = c.tiles
    if c.tile_policy == "largest_filling":
        big = max(tiles, key=lambda t: (t[0] * t[1], -grid_ctas(m, n, t)))  # ties: fewer CTAs
        # only a GEMM that fills the tile's rows: under BM tokens its rows are mostly masked, and a wide N alone
        # (Llama-3-8B's gate_up, N = 28672: 112 CTAs of one token each) does not make the library keep it
        if m >= big[0] and grid_ctas(m, n, big) >= sms:
            most = int(k // (c.k_balance or c.k_split)) if reduce_macs is not None and k >= 1024 else 1
            splits = range(1, max(1, most) + 1)
            return min((_tile_time(m, n, k, sms, c, *big, s, iter_macs) for s in splits),
                       key=lambda t: t[0] + (reduce_macs(t[1].split_k) if t[1].split_k > 1 else 0.0))[1]
    best: tuple[float, GemmEfficiency] | None = None
    for bm, bn in tiles:
        ctas = grid_ctas(m, n, (bm, bn))
        split = max(1, min(sms // ctas, int(k // c.k_split))) if ctas < sms and k >= 1024 else 1
        cand = _tile_time(m, n, k, sms, c, bm, bn, split, iter_macs)
        if best is None or cand[0] < best[0]:
            best = cand
    assert best is not None
    return best[1]


def decode_splits(items: int, key_blocks: int, sms: int, max_splits: int = 128) -> int:
    """How many KV splits a flash-decoding kernel launches for ``items`` (sequence x KV head) work items.

    Kernel fact (FlashAttention's split-KV rule): no split once the items fill 80 % of the SMs; otherwise the
    fewest splits (at most one per key block, the SM count, 128) whose last wave is within 85 % of the best
    achievable wave fill.
    """
    if items <= 0 or items >= 0.8 * sms:
        return 1
    return _fewest_good_splits(items, max(1, min(sms, key_blocks, max_splits)), sms, 0)


def fa2_splits(items: int, key_blocks: int, sms: int, max_splits: int = 128) -> int:
    """FlashAttention-2's form of the rule (flash_api.cpp ``set_params_splitkv``): it counts twice the SMs (two
    128-thread CTAs fit one), and skips a split count that leaves the key blocks per split unchanged (64 blocks
    in 11 or 12 splits are 6 per split either way: 12 is not eligible)."""
    slots = 2 * sms
    if items <= 0 or items >= 0.8 * slots:
        return 1
    return _fewest_good_splits(items, max(1, min(slots, key_blocks, max_splits)), slots, key_blocks)


@lru_cache(maxsize=8192)
def _fewest_good_splits(items: int, hi: int, sms: int, key_blocks: int) -> int:
    """The fewest splits within 85 % of the best wave fill; with ``key_blocks``, only eligible split counts."""
    fills = []
    for s in range(1, hi + 1):
        waves = items * s / sms
        eligible = not key_blocks or s == 1 or -(-key_blocks // s) != -(-key_blocks // (s - 1))
        fills.append(waves / math.ceil(waves) if eligible else 0.0)
    best = max(fills)
    return next(s for s, fill in enumerate(fills, start=1) if fill >= 0.85 * best)


def fa3_splits(mblocks: int, n_blocks: int, sms: int, max_splits: int = 128) -> int:
    """FlashAttention-3's KV split for one forward call (hopper/heuristics.h num_splits_heuristic): the
    flash-decoding rule (``decode_splits``) over its query tiles (sequences x heads x query blocks, query heads
    packed per KV head), except that a KV of at most four blocks is never split."""
    return 1 if n_blocks <= 4 else decode_splits(mblocks, n_blocks, sms, max_splits)


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
# curve down to the curve's voltage floor (V_FLOOR), so P_dyn(f) = a * E * Peak(f_boost) * dyn_power(f/f_boost)
# where a is the op's tensor activity (0..1) and E the energy per tensor FLOP at boost voltage. Board power =
# P_idle + P_mem + P_dyn; the firmware lowers the clock until board power meets the cap (TDP). The f^3 law above
# the floor and a P_idle of 10 % of TDP are assumptions; E per
# architecture is fitted to the sustained clocks the seed measured at M=16384 under sustained GEMM load
# (A100-80GB 1125/1410 MHz, H100-SXM 1380/1980, L40S 1425/2520; H200 1455/1980 is a held-out check).
# --------------------------------------------------------------------------------------------------
IDLE_FRACTION = 0.10  # assumption: idle + uncore power as a share of TDP
MEM_POWER_FRACTION = 0.15  # assumption: DRAM + IO power at full streaming, share of TDP


# The DVFS curve's voltage floor, as a share of the boost voltage: below the clock where V reaches it the voltage
# stays put, so power falls only in proportion to f there (f * V_FLOOR^2, not f^3), and a card that sits deep in
# its droop gains more clock from a given power headroom than the f^3 law allows. Public figure: GPU core voltage
# runs from ~650 mV at the bottom of the curve to ~900-1050 mV at boost (0.62-0.72; Ada ~650 of ~1000 mV: 0.65).
# Not fitted. It moves the cards whose sustained clock sits deep below boost: the L40S (sustained 0.565 of boost,
# the seed's anchor unchanged): burst start 0.712 -> 0.781 of boost, the public square-GEMM L40S figure
# (bench/accuracy_square.py, 269 TF) -12.9 -> -5.0 %; and the B300, whose bursts then follow only from a sustained
# ratio at or above the floor: BLACKWELL_SUSTAINED refitted 0.60 -> 0.65 with Blackwell's GEMM and prefill
# constants (2026-12-05, results/constants.json "voltage_floor"): B300 GEMM 6.14 -> 6.09 %, prefill 6.07 ->
# 5.72 %, fp8 5.75 -> 5.68 % unrefitted. 0.60 (the largest floor that leaves the old B300 fit as it is) gave the
# L40S -9.7 %; 0.65 with the old B300 constants, unrefitted, 6.72 % on its GEMMs.
V_FLOOR = 0.65


def dyn_power(f: float) -> float:
    """Dynamic power at clock ratio ``f`` (of boost) over its value at boost: f * (V(f)/V_boost)^2, with V
    proportional to f down to V_FLOOR and flat below it."""
    return f * max(V_FLOOR, f) ** 2


def clock_for_power(p: float) -> float:
    """The clock ratio whose dynamic power is ``p`` (of its value at boost): the inverse of ``dyn_power``."""
    if p >= V_FLOOR**3:
        return p ** (1.0 / 3.0)
    return p / V_FLOOR**2


def clock_at_power(sustained: float, power_ratio: float) -> float:
    """The clock ratio a dynamic-power budget ``power_ratio`` x the sustained one allows (a burst's headroom,
    the limiter's fast loop), at most boost."""
    return min(1.0, clock_for_power(power_ratio * dyn_power(sustained)))


def _energy_from_anchor(tdp: float, peak_boost: float, sustained_ratio: float, activity: float = 1.0) -> float:
    """E [J/FLOP] that makes a full-activity GEMM settle at ``sustained_ratio`` of boost under ``tdp``."""
    budget = tdp * (1 - IDLE_FRACTION)
    return budget / (activity * peak_boost * dyn_power(sustained_ratio))


# Anchors (seed table 'Sustained @ M=16384'): datasheet TDP and dense bf16 peak at boost, at the tensor activity
# m2live itself computes for that load at boost (the gate_up GEMM of Llama-3.1-8B at M=16384: anchored at 0.90 /
# 0.8915 / 0.90 on the A100 / H100 / L40S; the constants below give 0.91 / 0.89 / 0.91;
# tests/test_transfer_physics.py checks that the forecast reproduces the three seed clocks within 3 %). The
# H100's was 0.81 until 2026-12-05, the activity under constants refitted since: the forecast had drifted to
# 1320 MHz and Hopper's tensor ceiling (0.998) absorbed the rest — the opbench bursts pin only eta_tc x clock —
# so a live NVML clock priced a loaded Hopper GPU ~7 % fast. Re-anchored
# at the current activity (and Hopper's GEMM and prefill ceilings refitted on the H100 bursts: eta_tc 0.963,
# eta_attn 0.739): the H100's and H200's forecast 1380 MHz (an H200 read 1440-1470 MHz on NVML under that load,
# results/probe/h200-20261204, validation only); on that probe's 28 sustained-load GEMMs, never fitted, the live
# clock's MAPE 6.7 -> 4.6 % and the forecast's 4.7 -> 4.2 %; H100 GEMM in-sample 5.41 -> 5.42 %, prefill
# 6.36 -> 6.38 %.
ENERGY_PER_FLOP: dict[str, float] = {
    "ampere": _energy_from_anchor(400.0, 312e12, 1125 / 1410, 0.90),  # A100-SXM4-80GB
    "hopper": _energy_from_anchor(700.0, 989.4e12 * 1980 / 1830, 1380 / 1980, 0.8915),  # H100-SXM (see above)
    "ada": _energy_from_anchor(350.0, 362.05e12 * 2520 / 2490, 1425 / 2520, 0.90),  # L40S
    # B300 SXM6 AC (1100 W, 2.25 PF at 1856 MHz, 2032 MHz max): no sustained measurement exists, so its
    # sustained ratio under a full-activity GEMM is fitted on the B300 opbench bursts through the burst model
    # below (BLACKWELL_SUSTAINED, bench/fit_constants.py --clock power)
    "blackwell": 0.0,
    # GB202 (RTX Blackwell): the seed's RTX 5090 cap sweep — power-capped at 400 W it holds 2452 MHz under
    # tensor load (209.5 TF at 2407 MHz, fp32 accumulate); the same energy per FLOP is assumed for the RTX PRO
    "blackwell_rtx": 400.0 * (1 - IDLE_FRACTION) / (209.5e12 * 2452 / 2407),
}
# (first fitted at 0.60 under the previous burst model, no headroom, tau 0.03 s; the B300's bursts pin eta_tc x f_s
# together. Refitted at 0.65 with the voltage floor, V_FLOOR — Blackwell's GEMM compute side refitted at 0.62 /
# 0.65 / 0.68 / 0.70: 6.45 / 6.09 / 6.28 / 6.37 % (0.65 and 0.70 started from eta_tc scaled to keep the burst
# start, 0.62 and 0.68 from the old constants) — eta_tc 0.88 at the NVML max clock)
BLACKWELL_SUSTAINED = 0.65  # fitted on opbench b300_sxm GEMM bursts (NVIDIA B300 SXM6 AC): see ENERGY_PER_FLOP
ENERGY_PER_FLOP["blackwell"] = _energy_from_anchor(1100.0, 2250e12 * 2032 / 1856, BLACKWELL_SUSTAINED)
ENERGY_PER_FLOP["cpu"] = 0.0

# One clock model for bursts and sustained load. The board's power limiter acts on power averaged over a window
# (nvidia-smi reports that average over one second, `power.draw.average`), so a load that starts on an idle
# board may draw up to BURST_HEADROOM x its TDP before the average catches up: it starts at the clock that
# budget allows (f_b = min(1, f_s * BURST_HEADROOM^(1/3)): power ~ f^3 at full activity) and then approaches
# the power-capped sustained clock f_s (forecast_clock_ratio) with time constant TAU_CLOCK. A kernel timed over
# a burst of D seconds sees the mean over the burst:
#   f(D) = f_s + (f_b - f_s) * (1 - exp(-D/tau)) / (D/tau)
# so short benchmark bursts (opbench: 3 warm-up + 6 x 5 back-to-back calls) run at f_b, a card whose TDP
# cannot feed its tensor peak even with the headroom (L40S) droops at once, and serving (D -> infinity) runs at
# f_s. Fitted jointly on the opbench GEMM bursts of A100, H100 and B300 (bench/fit_constants.py, GEMM groups
# refitted at each value; in-sample GEMM MAPE summed over the three / leave-one-GPU-out summed over six cells):
# headroom 1.5: 21.1 / 76.9, 2: 19.4 / 66.0, 3: 19.7 / 64.3; the old model (no headroom, tau 0.03 s) 20.1 /
# 69.2. The A100's bursts are the evidence: its largest GEMMs run at 0.95 of its boost peak for 0.4 s (297 of
# 312 TF), which no droop allows, while its sustained clock is 1125 MHz (the seed) — a headroom of at least
# (1410/1125)^3 = 1.97. With it the tensor ceilings read alike (eta_tc 1.00 / 0.98 / 0.96 then; 1.00 / 0.96 / 0.88 now) instead of absorbing
# each GPU's burst clock (1.00 / 0.88 / 0.77 before). tau: 0.3 s and 1 s fit the same (19.4 / 65.9 vs 66.0);
# the one-second window is kept.
BURST_HEADROOM = 2.0  # x TDP over a short burst, fitted jointly on opbench a100_sxm, h100_sxm, b300_sxm GEMMs
TAU_CLOCK = 1.0  # s: power-averaging window (see above); fits as well as 0.3 s on the same bursts
# The limiter's fast loop. On the H100's and B300's tables the clock of a compute-bound GEMM steps down once a
# burst has run ~20 ms: the same least-time tiles lose 9 % (H100) and 19 % (B300) of their throughput between
# calls of 0.3 ms (bursts of ~10 ms) and calls of 2 ms and more (bursts of 70-400 ms), at every M, N and K,
# where the one-second average above would still allow the start clock. A step fits the tables better than a
# second exponential (the constants then in place, no refit: H100 5.43 vs 5.49 %, B300 6.14 vs 6.21 %), and both
# tables put it at the same time (grid 15 / 20 / 25 / 30 ms before the refit: H100 5.53 / 5.45 / 5.44 / 5.45,
# B300 6.16 / 6.14 / 6.17 / 6.20 %; refitted at 20 / 25 ms: H100 5.41 / 5.42, B300 6.14 / 6.16 %). After it the board holds ArchConstants.limiter_headroom x TDP (per family: what the fast loop lets
# through is the board's firmware and cooling, not a datasheet number) until the slow average takes over.
LIMITER_ENGAGE_S = 0.02  # s: fitted jointly on opbench h100_sxm and b300_sxm GEMMs (a grid, see ARCH)
# The calls of one opbench measurement (the collector's benchmark_with_power, NOTICE.md): 3 eager warm-up calls,
# the CUDA graph's capture, 3 warm-up replays of the graph, then 6 timed replays; a GEMM graph holds 5 calls, an
# attention graph 1. The burst is counted from the first replay — the capture before it is a host pause in which
# the board idles (an assumption: with it the GEMM and attention tables agree on one LIMITER_ENGAGE_S; counted
# from the first eager call, (18, 48) and (6, 12), B300 prefill 6.66 % against 6.13 % unrefitted). As (calls
# before the timed replays, calls at their end): the mean clock over that window is the row's clock.
GEMM_BENCH_WINDOW = (15, 45)
ATTN_BENCH_WINDOW = (3, 9)


def clock_ratio(tdp_w: float, peak_flops_boost: float, arch: str, tensor_activity: float,
                mem_activity: float = 0.0, duration_s: float = math.inf,
                limiter_headroom: float = BURST_HEADROOM) -> float:
    """f_clk for work with the given tensor and DRAM activity at boost (0..1), sustained for ``duration_s``
    (the mean over the burst; infinity = steady serving load). ``limiter_headroom``: the board power over TDP
    the limiter's fast loop allows once it engages, LIMITER_ENGAGE_S into the burst (ArchConstants
    .limiter_headroom; BURST_HEADROOM: no second stage)."""
    sustained = forecast_clock_ratio(tdp_w, peak_flops_boost, arch, tensor_activity, mem_activity)
    if sustained >= 1.0 or math.isinf(duration_s):
        return sustained
    d = max(0.0, duration_s)
    start = clock_at_power(sustained, BURST_HEADROOM)
    held = min(start, clock_at_power(sustained, max(1.0, limiter_headroom)))
    if d < 1e-12:
        return start
    if d <= LIMITER_ENGAGE_S or held >= start:
        return sustained + (start - sustained) * _decay_integral(0.0, d) / d
    # f(t) = sustained + (start - sustained) exp(-t / tau), and from LIMITER_ENGAGE_S on at most ``held``:
    # held from then until the slow average brings the clock below it (t_cross), the slow decay after that
    t_cross = math.inf if held <= sustained else TAU_CLOCK * math.log((start - sustained) / (held - sustained))
    t_held_end = min(d, max(LIMITER_ENGAGE_S, t_cross))
    area = sustained * d + (start - sustained) * (_decay_integral(0.0, LIMITER_ENGAGE_S)
                                                  + _decay_integral(t_held_end, d))
    area += (held - sustained) * (t_held_end - LIMITER_ENGAGE_S)
    return area / d


def _decay_integral(a: float, b: float) -> float:
    """The integral of exp(-t / TAU_CLOCK) from a to b (0 when b <= a)."""
    if b <= a:
        return 0.0
    return TAU_CLOCK * (math.exp(-a / TAU_CLOCK) - math.exp(-b / TAU_CLOCK))


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
    return clock_for_power(budget / demand_at_boost)


# --------------------------------------------------------------------------------------------------
# fp8 (W8A8) GEMMs: vLLM's CutlassFP8ScaledMMLinearKernel — e4m3 weights and activations, per-tensor scales,
# fp32 accumulation, bf16 output. CUTLASS picks its own tiles and pipelines (not cuBLAS's), so its GEMM
# constants are fitted separately, by bench/fit_fp8.py on ../shared/data/opbench_fp8 ONLY (GEMMs with N,K in
# [1024, 16384], every M): hopper on h100_sxm (NVIDIA H100 80GB HBM3), blackwell on b300_sxm (NVIDIA B300 SXM6
# AC). Only the GEMM group and the input quantisation's two constants are fitted; everything else (attention,
# kernel facts) is the bf16 arch's, because vLLM keeps attention and the KV cache in bf16. ``results/fp8_constants.json`` holds the fit and its
# leave-one-GPU-out check.
# --------------------------------------------------------------------------------------------------
# Reading: every opbench_fp8 row is vLLM's fp8 linear layer on a bf16 input, so it includes the input
# quantisation — vLLM's CUDA scaled_fp8_quant with a dynamic per-tensor scale, two kernels of one CTA per token
# row: ~0.4 us of SM time per row and kernel (q_row: the tables' latency grows by ~7 ns per row at N = K = 32 on
# both GPUs), streaming at ~15 / 18 GB/s per SM (q_sm_bw, H100 / B300: one CTA per row keeps few bytes in
# flight — 0.58 / 0.33 of the DRAM peak; as a fraction of peak it did not transfer, LOO 14.4 / 10.8 %, per SM it
# does). Without it the bf16 constants priced the tables 42 % / 53 % too fast. CUTLASS's tensor-core ceiling
# eta_tc is 0.68 (H100) / 0.82 (B300, 0.75 before its 2-SM tiles, below) of the fp8 peak at the NVML max clock
# (cuBLAS bf16: 0.98 / 1.00). The
# H100's tiles are vLLM's own sm90 dispatch (TILE_RULES["cutlass_sm90_fp8"]: 128 x 128 above M = 128, no split-K),
# not a least-time pick: with the pick, M in (128, 512] came out 12-14 % fast (vLLM pads such M to 128-row tiles);
# with the dispatch, refitted, in-sample 9.3 -> 7.8 %, leave-one-GPU-out 11.7 -> 9.9 %. The B300 kept the
# least-time tile, unsplit (its k_split grid picks 65536), until its own dispatch was read (below). Both CUTLASS
# main loops have a K-block floor
# (t_kiter, refitted with the group, bench/fit_fp8.py): 106 ns per 128-byte block on the H100, whose M <= 64
# rows run vLLM's 64 x 16 and 64 x 64 tiles (16-65 ns of MMA a block; cuBLAS's bf16 kernels show none there),
# and 83 ns on the B300 (89 ns since; its bf16 kernels 65 ns). H100 fp8 7.81 -> 7.36 % (M <= 16 5.95 ->
# 4.7 %), B300 7.05 -> 5.70 %; leave-one-GPU-out H100 <- B300 9.92 -> 9.54, B300 <- H100 8.35 -> 7.43 %. With it the B300's fp8
# GEMMs stream at 0.79 of the catalog bandwidth (bf16 0.92: N = K = 16384 at M = 8 takes 50 us for 256 MB of
# e4m3 weights, the quantisation included, where cuBLAS bf16 moves 512 MB in 86 us), and their i_crit goes to
# 0 (no tile is operand-fed too slowly).
# In-sample MAPE 7.4 % (H100) / 5.7 % (B300), leave-one-GPU-out 9.5 % / 7.4 % (results/fp8_constants.json).
# Then (2026-12-05, seventh session) the configs' thread-block clusters (TILE_RULES): a grid runs in whole
# clusters. On the H100 (2 x 1 above M = 64) a grid with an odd number of 128-row tiles runs one more tile row:
# H100 fp8 7.36 -> 6.75 % with its constants unrefitted (M = 128 j + 1: 257 -14 -> -7 %, 513 -17 -> -9 %, 1281
# -19 -> -11 %; a refit reached 6.74 % and was not taken). The B300 now runs vLLM's sm100 dispatch too
# (_cutlass_sm100_fp8), read with its 2-SM MMA tiles and clusters — the earlier read without them (one SM per
# 256-row tile, no cluster rounding) had priced it worse than the least-time pick (8.9 %): with them, unrefitted
# 6.17 %, the blackwell group refitted (bench/fit_fp8.py --gpus b300_sxm, 2000-row sample, scored on all rows)
# 5.68 -> 5.20 % (M = 257 -13 -> +3 %, 513 -14 -> -2 %), leave-one-GPU-out B300 <- H100 7.33 -> 7.21 %,
# H100 <- B300 9.04 -> 9.22 %. Not modelled: the B300's M = 1 rows run 3x slower than its M = 2 rows (17.9 vs
# 5.6 us at N = K = 1024) and come out 56 % fast — a fixed ~13 us more (10-17 us at every N and K from 128 to
# 65536, whatever the size), at one token only and not on the H100; vLLM's sm100 dispatch runs M = 1-16 with
# one config, so the cost is outside the GEMM's tiles and its cause is not known.
# Then (2026-12-06) the H100's ragged M (tma_oob, a kernel fact fitted on opbench_fp8 h100_sxm, every region row,
# bench/fit_fp8.py --gpus h100_sxm --max-rows 15000): two GEMMs that run the same grid of tiles are not equally
# fast — M = 513 and 768 (six 128-row tile rows each) take 56.5 and 41.2 us at N = 2560, K = 8192, M = 129 and 256
# take 87.8 and 63.2 us at N = 16384, K = 8192 — the one whose last tile row is mostly past M is the slower, by
# more the emptier that row (M = 129 / 160 / 192 / 224 against 256: x1.39 / 1.29 / 1.16 / 1.10), and only where
# most SMs have a tile (M = 129 at N <= 4096, <= 64 tiles on 132 SMs: as fast as M = 256). DeepGEMM's maintainers
# say the same of Hopper's TMA: loads under its boundary check are slower than padded ones (deepseek-ai/DeepGEMM
# issue 35). Priced as a main loop 1 + tma_oob x (out-of-bounds share of the last tile row) x (share of SMs with a
# tile) times slower, compute and stream alike (OpModel._gemm_base): tma_oob 0.16; the rest of the group refitted
# with it: H100 fp8 6.75 -> 5.91 % (M = 256 / 512 / 768 +11.8 / +11.7 / +9.8 -> +7.8 / +7.8 / +5.9 %, 257 / 513 / 769
# -7.2 / -9.4 / -11.0 -> -3.1 / -4.0 / -5.2 %); leave-one-GPU-out H100 <- B300 9.22 -> 9.23 %, B300 <- H100 7.21 -> 7.11 %. The B300's
# sm100 kernel shows no such step (M = 129 runs faster than M = 256 there) and cuBLAS's bf16 kernels none on the
# H100: tma_oob stays 0 for both.
FP8_GEMM_FIT: dict[str, dict[str, float]] = {
    "hopper": dict(eta_tc=0.715655, i_crit=35.9333, k0=118.546, t_kernel=1.56793e-06, eta_mem=0.936745,
                   t_ramp=2.60532e-07, overlap=3.35663, k_split=65536, q_row=4.28365e-07, q_sm_bw=17180500000.0,
                   t_kiter=1.09793e-07, tma_oob=0.159964),
    "blackwell": dict(eta_tc=0.823407, i_crit=0.0847364, k0=429.871, t_kernel=1.45773e-06, eta_mem=0.79117,
                      t_ramp=1.84948e-07, overlap=1.9414, k_split=65536, q_row=4.12691e-07, q_sm_bw=16913500000.0,
                      t_kiter=8.9078e-08),
}
ARCH_FP8: dict[str, ArchConstants] = {
    arch: replace(ARCH[arch], **fit, tile_rule=rule,
                  fitted_on=f"opbench_fp8 {folder}, bench/fit_fp8.py (GEMM group only)")
    for arch, fit, rule, folder in (
        ("hopper", FP8_GEMM_FIT["hopper"], "cutlass_sm90_fp8", "h100_sxm (NVIDIA H100 80GB HBM3)"),
        ("blackwell", FP8_GEMM_FIT["blackwell"], "cutlass_sm100_fp8", "b300_sxm (NVIDIA B300 SXM6 AC)"))
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
# The power limiter's headroom is the board's, not the kernel's: the fp8 rows keep the bf16 fit's (a free one ran
# to 1.29 on the B300 fp8 table, a flat direction of its loss, where the bf16 GEMMs pin 1.05).
FITTED_GROUPS["fp8_gemm"] = (*(n for n in FITTED_GROUPS["gemm"] if n != "limiter_headroom"), "q_row", "q_sm_bw",
                             "tma_oob")
# Fitted, but a fact of one architecture's kernels, not a number that carries to another's: Hopper's fp8 scaled-mm
# slows where its activation tiles reach past M (tma_oob); the B300's does not (its table shows no such step), so
# a leave-one-GPU-out check keeps each GPU's own.
FP8_KERNEL_FITTED = ("tma_oob",)


def transfer_fp8(target: ArchConstants, source: ArchConstants) -> ArchConstants:
    """``target``'s fp8 kernel facts with ``source``'s fitted fp8 GEMM numbers (leave-one-GPU-out); the fitted
    kernel facts (FP8_KERNEL_FITTED) stay the target's."""
    return replace(target, **{n: getattr(source, n) for n in FITTED_GROUPS["fp8_gemm"] if n not in FP8_KERNEL_FITTED},
                   fitted_on=source.fitted_on, borrowed_from=None)


def tma_oob_share(m: int, bm: int) -> float:
    """Out-of-bounds share of the last row of BM-row activation tiles over M rows (0 when BM divides M)."""
    r = m % bm
    return (bm - r) / bm if r else 0.0
