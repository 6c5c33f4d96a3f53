"""The step equation (the seed's boxed equation), term by term:

    T_step   = max(T_blocks, N_kern * T_launch) + alpha * S_n + T_samp
    T_blocks = N_L * (t_qkv + t_o + t_gate_up + t_down + t_attn_prefill + t_attn_decode + t_light + 2 t_allreduce)
               + t_allreduce (the embedding's, under TP) + t_lm_head(sampled tokens: GEMM, vocab gather, sampler)

``Predictor._predict`` computes exactly these terms, each by a named method: ``t_projections``,
``t_attention``, ``t_light``, ``t_allreduce``, ``t_lm_head`` (the GPU body, from the operator rooflines in
``operators.py``), ``t_launch`` (host launches, overlapping the body), ``t_host`` (per sampled sequence) and
``HostConstants.t_samp`` (the fixed tail).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

from .efficiency import ENERGY_PER_FLOP, ArchConstants
from .hardware import GpuSpec
from .operators import OpModel, OpTime, branch, remember
from .quantization import kv_cache_bytes, kv_cache_dtype_of
from .shapes import ModelShape, get_model
from .step import Step

GEMM_OPS = ("qkv", "o", "gate_up", "down")
OPS = (*GEMM_OPS, "attn_prefill", "attn_decode", "light", "allreduce", "lm_head", "launch", "host", "sampling")


def has_power_model(arch: str) -> bool:
    """Whether the clock forecast has a power model for this architecture (one without forecasts boost)."""
    return ENERGY_PER_FLOP.get(arch, 0.0) > 0.0


MHZ_ABOVE = 5.0  # an f_clk above this is a clock in MHz (as NVML reports it), at or below it a ratio to boost


def clock_as_ratio(f_clk: float, boost_mhz: float) -> float:
    """``f_clk`` as a ratio to boost: a clock in MHz (> ``MHZ_ABOVE``) divided by the boost clock, a ratio as
    it is. ValueError when it is not positive."""
    if not f_clk > 0:
        raise ValueError(f"f_clk must be positive, got {f_clk}")
    return f_clk / boost_mhz if f_clk > MHZ_ABOVE else float(f_clk)


@dataclass(frozen=True)
class HostConstants:
    """Host-side terms (CPU work around the GPU body). Priors for vLLM V1 on a GPU; the online residual
    tracker refits them per engine (the seed's calibrated mode), so they are starting points, not truths.
    Sources: vLLM V1's per-step CPU overhead is ~0.3-1 ms (scheduler, input preparation, output processing)
    plus ~5-20 us per sequence; an eager CUDA kernel launch costs ~4 us of CPU; a CUDA-graph replay ~7-10 us."""

    t_launch: float = 4e-6  # CPU cost of launching one kernel eagerly (s)
    graph_max_tokens: int = 512  # steps with at most this many tokens replay captured CUDA graphs
    t_graph_piece: float = 7.5e-6  # replaying one piece of vLLM's piecewise CUDA graph (one per layer, +1) (s)
    # host work per sampled sequence (s): scheduler, input prep, sampler, the outputs' hand-off. vLLM V1's scheduler
    # alone takes 9.3-11.0 us a running sequence per step on a 2.6 GHz Xeon, prefix caching on (bench/scheduler_cost.py)
    alpha: float = 12e-6
    t_samp: float = 0.5e-3  # fixed per-step tail: scheduler, output processing (s)
    kernels_per_step: int = 4  # eager kernels outside the layers: embedding, final norm, LM head, sampler


GEMM_KERNELS_PER_LAYER = 4  # qkv, o, gate_up, down
ATTN_KERNELS_PER_LAYER = 2  # KV-cache write, attention
# vLLM 0.32 compiles the layer with Inductor and its norms, RoPE and activation native (custom ops off;
# platforms/cuda.py get_default_ir_op_priority: "native" when compiling): a reduction kernel per residual add +
# RMSNorm, RoPE of q and of k, one kernel for SiLU*mul. On GPUs it also turns on Inductor's combo kernels
# (config/compilation.py, torch >= 2.9: "horizontal fusion, useful for fusing qk-norm and qk-rope when query and key
# have different shapes"), so q's and k's RoPE are one kernel; the CPU backend has no combo kernels (two).
LIGHT_KERNELS_PER_LAYER = 4
LIGHT_KERNELS_PER_LAYER_CPU = 5
NORM_KERNELS_PER_LAYER = 2  # of those, the add+RMSNorm after each tensor-parallel all-reduce
# vLLM's sampler over each sampled sequence's logits (v1/sample/sampler.py), as a served request runs it — random
# sampling at the temperature and top-p / top-k of the model's generation config, which is what the server applies
# when the request leaves them unset (vllm bench serve no longer sends temperature 0): the logits cast to fp32 (read
# 2 B, write 4 B a logit), the temperature divided in place (read and write 4 B), then FlashInfer's top-k/top-p
# sampler (ops/topk_topp_sampler.py forward_cuda): a softmax (read 4, write 4) and a sampling pass over the
# probabilities (read 4) — 26 B a logit in four memory-bound kernels. Under tensor parallelism the LM head's vocab
# shards are first all-gathered (LogitsProcessor._gather_logits, pynccl along the vocab dim, then a copy into place:
# read and write 2 B a logit).
SAMPLER_BYTES_PER_LOGIT = 26
SAMPLER_KERNELS = 4
GATHER_COPY_BYTES_PER_LOGIT = 4

# vLLM's all-reduce + RMSNorm fusion (PassConfig.fuse_allreduce_rms, FlashInfer's TRT-LLM fused all-reduce kernel):
# on by default at -O2 (the API server's level) for TP > 1 on compute capability 9.0 and the 10.x family
# (vllm/config/vllm.py enable_allreduce_rms_fusion; default since vLLM 0.16, PR #34299), where the all-reduce's
# message (tokens x hidden x 2 B) is at most this many MiB — FI_ALLREDUCE_FUSION_MAX_SIZE_MB of
# vllm/compilation/passes/fusion/allreduce_rms_fusion.py (vLLM 0.32), by capability and TP size; a larger step runs
# the unfused graph (vLLM compiles both ranges). The fused kernel adds the residual and normalises while the
# reduced rows are in registers: the layer's two add+RMSNorm kernels (and their reads of the all-reduced
# activation) go, the all-reduce is priced as before.
ALLREDUCE_RMS_FUSION_MAX_MIB: dict[tuple[int, int], dict[int, float]] = {
    (9, 0): {2: 64, 4: 2, 8: 0.5},
    (10, 0): {2: 64, 4: 32, 8: 1, 16: 64},
    (10, 3): {2: 64, 4: 64, 8: 4, 16: 64},
    (10, 7): {2: 64, 4: 64, 8: 2},
}


def allreduce_fusion_max_bytes(gpu: GpuSpec, tp: int, enabled: bool | None = None) -> float:
    """Largest all-reduce message (bytes) vLLM fuses with the RMSNorm after it on ``gpu`` at ``tp``; 0 where it
    does not fuse. ``enabled``: None (vLLM's default: on where the kernel is — capability 9.0 or 10.x over NVLink
    at a TP size the table lists), False (a server run with ``fuse_allreduce_rms`` off, or a vLLM before 0.16)
    or True (the same as None: the fusion exists only where its kernel and its size table do)."""
    if enabled is False or tp <= 1 or gpu.interconnect not in ("nvlink", "c2c"):
        return 0.0
    return ALLREDUCE_RMS_FUSION_MAX_MIB.get(tuple(gpu.compute_capability), {}).get(tp, 0.0) * 1024**2


@dataclass(slots=True)
class Prediction:
    total_s: float
    ops: dict[str, float]  # op -> seconds in this step (all layers)
    factors: dict[str, dict[str, float]]  # factor -> {op: value}; f_clk under op "step"
    bound: dict[str, str]  # op -> which branch bound it
    f_clk: float
    clock_mhz: float
    clock_source: str  # "live" | "forecast" | "boost"
    t_blocks: float
    gpu: str = ""
    model: str = ""
    tp: int = 1
    l2_resident: bool = False  # True only when weights were assumed warm in L2 (benchmark loops)

    def to_dict(self) -> dict:
        return asdict(self)


class Predictor:
    """Whole-step prediction for one model on one GPU (per-GPU shard under tensor parallelism)."""

    def __init__(self, gpu: GpuSpec | str, model: ModelShape | str | os.PathLike, tp: int = 1,
                 dtype: str = "bf16", host: HostConstants | None = None,
                 constants: ArchConstants | None = None, act_scale: str = "static",
                 allreduce_fusion: bool | None = None, sampler: bool = True,
                 fp8_constants: ArchConstants | None = None, kv_cache_dtype: str = "auto"):
        """``dtype``: precision of the four projections' weights ("bf16", or "fp8": vLLM's W8A8 linear layers;
        attention, the KV cache, the LM head and the embeddings stay bf16). ``act_scale`` (fp8 only): "static"
        (the checkpoint's calibrated per-tensor input scales) or "dynamic" (vLLM's default for on-the-fly fp8:
        a max reduction over each projection's input every step before quantising it). ``allreduce_fusion``:
        vLLM's all-reduce + RMSNorm fusion under TP (``allreduce_fusion_max_bytes``; None: vLLM's default).
        ``sampler``: the LM head's logits go through vLLM's sampler (and the vocab gather under TP); False for a
        model that stops at the logits (the probe's torch decoder). ``constants`` / ``fp8_constants``: the GPU's
        own (a calibration's ``predictor_constants``) for its bf16 kernels and its fp8 GEMMs; None: the family's.
        ``kv_cache_dtype``: vLLM's ("auto": the model's dtype; "fp8" / "fp8_e4m3" / "fp8_e5m2": one byte per element,
        ``KV_CACHE_BYTES``) — the cache's capacity and the bytes attention streams and writes."""
        if act_scale not in ("static", "dynamic"):
            raise ValueError(f"act_scale must be 'static' or 'dynamic', got {act_scale!r}")
        self.kv_cache_dtype = kv_cache_dtype_of(kv_cache_dtype)
        self.dtype = dtype
        self.act_scale = act_scale
        self.sampler = sampler
        self._sampling_s: dict[int, float] = {}  # sampler (+ vocab gather) seconds by sampled-sequence count
        base = get_model(model)
        kv_elt = kv_cache_bytes(self.kv_cache_dtype) or base.dtype_bytes  # "auto": the model's dtype
        self.ops = OpModel(gpu, dtype="bf16" if dtype == "fp8" else dtype, constants=constants, kv_elt=kv_elt)
        self.gemm_ops = (OpModel(self.ops.gpu, dtype="fp8", constants=fp8_constants) if dtype == "fp8"
                         else self.ops)  # the four projections
        self.gpu = self.ops.gpu
        if kv_elt != base.dtype_bytes:
            base = replace(base, kv_dtype_bytes=kv_elt)
        self.model = base.sharded(tp)
        self.tp = tp
        self.host = host or HostConstants()
        m = self.model
        self._gemm_nk = m.gemms()
        self._gemm_list = [(name, n, k) for name, (n, k) in self._gemm_nk.items()]
        self._lm_nk = m.lm_head
        self._attn_dims = (m.heads_per_gpu, m.kv_heads_per_gpu, m.head_dim)  # (query heads, KV heads, head_dim)
        d = m.dtype_bytes
        h, kv, hd = m.hidden, m.kv_heads_per_gpu, m.head_dim
        # light ops per token per layer (bytes): 2 fused add+RMSNorm (read x,res; write x,res), RoPE on q,k,
        # SiLU*mul (read 2I/tp, write I/tp), KV-cache write (read+write k,v)
        self._light_bytes_per_token = (d * (2 * 4 * h + 2 * (m.heads_per_gpu + kv) * hd + 3 * m.intermediate // tp)
                                       + 2 * kv * hd * (d + kv_elt))  # (K and V read in d, written in kv_elt)
        self._light_kernels = LIGHT_KERNELS_PER_LAYER_CPU if self.gpu.arch == "cpu" else LIGHT_KERNELS_PER_LAYER
        # Qwen3's per-head q and k RMSNorm before RoPE (q_norm, k_norm; ModelShape.qk_norm) costs no kernel and no
        # pass of its own as vLLM serves it: compiled with the norm native (platforms/cuda.py), Inductor makes each
        # head's mean square and scaling the prologue of the RoPE kernel that reads q (or k) anyway — a reduction
        # with its pointwise consumer, the pattern of every RMSNorm kernel; vLLM turns on combo kernels for just this
        # (LIGHT_KERNELS_PER_LAYER). --enforce-eager would run them apart.
        if dtype == "fp8":
            # vLLM quantises each projection's input to e4m3 (QuantFP8) before its scaled-mm. Served, the model runs
            # under torch.compile with custom ops off (vllm/config/vllm.py: "otherwise Inductor handles fusion"):
            # with a static scale the quantisation of the qkv, gate_up and down inputs fuses into the RMSNorm and
            # SiLU*mul that produce them (they write 1 B per element instead of 2), and only the o input, the
            # attention op's output, is quantised by a kernel of its own (read 2 B, write 1 B). A dynamic
            # per-tensor scale needs each input's max before quantising it: a reduction pass and a quantising
            # pass per projection (read 2 + 2 B, write 1 B), two kernels each.
            fused = 2 * h + m.intermediate // tp  # inputs of qkv and gate_up (hidden each), of down (I/tp)
            o_in = m.heads_per_gpu * hd
            if act_scale == "dynamic":
                self._light_bytes_per_token += 5 * (fused + o_in)
                quant_kernels = 8
            else:
                self._light_bytes_per_token += 3 * o_in - fused
                quant_kernels = 1
            self._light_kernels += quant_kernels
        # a step whose all-reduces fuse with the norms after them: those two kernels go, and of their traffic the
        # read of the all-reduced activation (the fused kernel holds it in registers); the residual's read and
        # write and the normalised output (e4m3 under a static scale) it still moves
        self._fusion_max_tokens = int(allreduce_fusion_max_bytes(self.gpu, tp, allreduce_fusion)
                                      // (h * m.dtype_bytes))
        self._light_fused = (self._light_bytes_per_token - NORM_KERNELS_PER_LAYER * h * d,
                             self._light_kernels - NORM_KERNELS_PER_LAYER)

    @classmethod
    def for_gpu(cls, gpu: GpuSpec | str, model: ModelShape | str | os.PathLike = "meta-llama/Llama-3.1-8B",
                tp: int = 1, **kw) -> Predictor:
        return cls(gpu, model, tp=tp, **kw)

    # ---- clock --------------------------------------------------------------------------------------
    def _resolve_clock(self, f_clk: float | None, clock_mhz: float | None) -> tuple[float | None, str]:
        boost = self.gpu.boost_mhz
        if clock_mhz is not None:
            if clock_mhz <= 0:
                raise ValueError(f"clock must be positive, got {clock_mhz} MHz")
            return clock_mhz / boost, "live"
        if f_clk is None:
            return None, "forecast"
        ratio = clock_as_ratio(f_clk, boost)
        return ratio, "boost" if f_clk == 1.0 else "live"

    def forecast_f_clk(self, step: Step) -> float:
        """f_clk the power cap allows for this step's op mix (board power vs clock and op activity)."""
        p = self._predict(step, 1.0, "boost", breakdown=False)
        t = p.t_blocks
        if t <= 0:
            return 1.0
        flops, nbytes = self.work(step)
        if self.gemm_ops is not self.ops:  # fp8 projections: count their FLOPs at the bf16 peak's energy per FLOP
            g = 2.0 * step.num_tokens * sum(n * k for n, k in self._gemm_nk.values()) * self.model.layers
            flops += g * (self.ops.peak / self.gemm_ops.peak - 1.0)
        return self.ops.clock_ratio(flops, t, nbytes)

    @property
    def sawtooth(self) -> bool:
        """Whether the step time is a sawtooth in the tokens (the projection GEMMs slow as their last row of
        activation tiles empties: ``ArchConstants.tma_oob``, fp8 on Hopper) rather than growing with them; the
        searches over a step's size then also try ``tile_row_end``."""
        return self.gemm_ops.c.tma_oob > 0

    def tile_row_end(self, tokens: int) -> int:
        """The smallest step size (tokens) from ``tokens`` up that fills the last row of activation tiles of every
        projection GEMM, where the GEMMs slow as that row empties (``ArchConstants.tma_oob``: fp8 on Hopper) — so
        the step time is a sawtooth in the tokens and a step of this size can be faster than one of ``tokens``;
        ``tokens`` itself where the time grows with the tokens. The rows are the picks' at ``tokens`` (16 for the
        swapped small-M tiles, 64 or 128 above): the largest of them, which the others divide."""
        if not self.sawtooth or tokens <= 0:
            return tokens
        bm = max(self.gemm_ops.gemm_pick(tokens, n, k).tile[0] for _, n, k in self._gemm_list)
        return -(-tokens // bm) * bm

    # ---- the step equation ------------------------------------------------------------------------------
    def predict(self, step: Step, f_clk: float | None = None, clock_mhz: float | None = None) -> Prediction:
        """``f_clk``: None → forecast from the power cap; a ratio (1.0 = boost); or a clock in MHz (> 5)."""
        if not isinstance(step, Step):
            step = Step(step)
        f, source = self._resolve_clock(f_clk, clock_mhz)
        if f is None:
            f = self.forecast_f_clk(step)
        return self._predict(step, f, source, breakdown=True)

    def predict_fast(self, step: Step, f_clk: float = 1.0) -> Prediction:
        """Fast path (admission control): per-op times and total, no factors or bounds; f_clk as a ratio."""
        return self._predict(step, f_clk, "live", breakdown=False)

    def predict_total(self, step: Step, f_clk: float = 1.0) -> float:
        """Fast path: total seconds only, f_clk as a ratio."""
        return self._predict(step, f_clk, "live", breakdown=False).total_s

    def _predict(self, step: Step, f: float, source: str, breakdown: bool) -> Prediction:
        """T_step = max(T_blocks, N_kern * T_launch) + alpha * S_n + T_samp, term by term."""
        L = self.model.layers
        ops: dict[str, float] = {}
        factors: dict[str, dict[str, float]] = {"f_clk": {"step": f}}
        bound: dict[str, str] = {}
        rec = _Recorder(ops, factors, bound, breakdown)
        self.t_projections(step.num_tokens, f, L, rec)  # four GEMMs per layer over every token of the step
        self.t_attention(step, f, L, rec)  # prefill chunks over their context; decodes over their KV cache
        rec.op("light", self.t_light(step.num_tokens), L)  # norms, RoPE, SiLU*mul, residual adds
        # two per layer under tensor parallelism, and one after the vocab-parallel embedding lookup
        # (VocabParallelEmbedding.forward sums the shards' rows)
        ops["allreduce"] = (2 * L + 1) * self.t_allreduce(step.num_tokens)
        if breakdown and self.tp > 1:
            bound["allreduce"] = "communication"
        rec.op("lm_head", self.t_lm_head(step.num_seqs, f), 1)  # on the sampled tokens only
        t_blocks = sum(ops.values())
        t_launch = self.t_launch(step.num_tokens)  # host launches overlap the GPU body ...
        ops["launch"] = max(0.0, t_launch - t_blocks)
        ops["host"] = self.t_host(step)  # ... per-sequence host work and the fixed tail do not
        ops["sampling"] = self.host.t_samp
        total = max(t_blocks, t_launch) + ops["host"] + ops["sampling"]
        if breakdown:
            bound["launch"] = bound["host"] = bound["sampling"] = "host"
        return Prediction(
            total_s=total, ops=ops, factors=factors, bound=bound, f_clk=f, clock_mhz=f * self.gpu.boost_mhz,
            clock_source=source, t_blocks=t_blocks, gpu=self.gpu.name, model=self.model.name, tp=self.tp,
        )

    # ---- the terms -------------------------------------------------------------------------------------
    def t_projections(self, tokens: int, f: float, layers: int, rec: _Recorder) -> None:
        """qkv, o, gate_up, down: one GEMM each per layer over all tokens (inlined roofline: the hot path)."""
        g = self.gemm_ops
        ov = g.c.overlap
        inv_ov = 1.0 / ov
        ops, breakdown = rec.ops, rec.breakdown
        if breakdown:
            fs = rec.factors
            wave_d, active_d, duty_d, mem_d = (fs.setdefault(k, {}) for k in
                                               ("eta_wave", "eta_active", "eta_duty", "eta_mem"))
        for name, n, k in self._gemm_list:
            tc, tm, wave, active, duty, eta_mem, fixed = g._gemm_base(tokens, n, k)
            tc /= f
            ops[name] = (fixed + (tc**ov + tm**ov) ** inv_ov) * layers
            if breakdown:
                rec.bound[name] = branch(tc, tm, fixed)
                wave_d[name], active_d[name], duty_d[name], mem_d[name] = wave, active, duty, eta_mem

    def t_attention(self, step: Step, f: float, layers: int, rec: _Recorder) -> None:
        """Prefill attention (causal chunks over their cached context) and decode attention (KV-cache reads)."""
        o = self.ops
        heads, kv_heads, head_dim = self._attn_dims
        pre, dec = step.prefill_seqs, step.decode_contexts
        # on the one-call backends (FA3) the decodes share the prefill's call, and its split decision
        call = len(pre) + len(dec) if o.c.attn_mixed_one_call else 0
        t_pre = o.prefill_attention(pre, heads, kv_heads, head_dim, f, call) if pre else None
        if t_pre is not None:
            rec.op("attn_prefill", t_pre, layers)
        else:
            rec.ops["attn_prefill"] = 0.0
        if dec:
            t_dec = o.decode_attention(dec, len(dec), heads, kv_heads, head_dim, f, call_seqs=call)
            rec.op("attn_decode", t_dec, layers)
            if t_pre is not None and o.c.attn_mixed_one_call:
                # one call for the mixed batch: its fixed part once (each call's time holds it, so the sum never
                # falls below the longer of the two)
                rec.ops["attn_decode"] = (t_dec.t - min(o.c.t_attn_over, t_pre.t)) * layers
        else:
            rec.ops["attn_decode"] = 0.0

    def t_light(self, tokens: int) -> OpTime:
        """One layer's memory-bound kernels (norms, RoPE, activation, residual adds; fp8 input quantisation);
        without the norms where the all-reduces before them fuse them (``allreduce_fusion_max_bytes``)."""
        per_token, kernels = self._light_per_layer(tokens)
        return self.ops.elementwise(tokens * per_token, kernels)

    def _light_per_layer(self, tokens: int) -> tuple[int, int]:
        """(bytes per token, kernels) of one layer's light ops at a step of ``tokens``."""
        if tokens <= self._fusion_max_tokens:
            return self._light_fused
        return self._light_bytes_per_token, self._light_kernels

    @property
    def fusion_max_tokens(self) -> int:
        """The largest step (tokens) whose all-reduces vLLM fuses with the RMSNorms after them; 0: none does."""
        return self._fusion_max_tokens

    def t_allreduce(self, tokens: int) -> float:
        """One tensor-parallel all-reduce of the layer's tokens x hidden activations."""
        return self.ops.allreduce(tokens * self.model.hidden * self.model.dtype_bytes, self.tp)

    def t_lm_head(self, sampled: int, f: float) -> OpTime:
        """The LM head on the sampled tokens (one per sequence), then its logits to a token: the vocab shards'
        all-gather under TP and the sampler's passes over the fp32 logits (SAMPLER_BYTES_PER_LOGIT)."""
        n_v, k_v = self._lm_nk
        g = self.ops.gemm(sampled, n_v, k_v, f)
        if sampled <= 0 or not self.sampler:
            return g
        extra = self._sampling_s.get(sampled)
        if extra is None:  # clock-independent (memory-bound kernels, the gather): once per sequence count
            logits = sampled * self.model.vocab
            extra = self.ops.elementwise(logits * SAMPLER_BYTES_PER_LOGIT, SAMPLER_KERNELS).t
            if self.tp > 1:
                extra += self.ops.allgather(sampled * n_v * self.model.dtype_bytes, self.tp)
                extra += self.ops.elementwise(logits * GATHER_COPY_BYTES_PER_LOGIT).t
            remember(self._sampling_s, sampled, extra)
        return OpTime(g.t + extra, g.bound, g.t_compute, g.t_memory, g.factors)

    def t_launch(self, tokens: int) -> float:
        """N_kern * T_launch: steps up to graph_max_tokens replay vLLM's piecewise CUDA graph (a piece per layer,
        plus one); larger steps launch every kernel eagerly."""
        h, L = self.host, self.model.layers
        if tokens <= h.graph_max_tokens:
            return (L + 1) * h.t_graph_piece
        per_layer = GEMM_KERNELS_PER_LAYER + ATTN_KERNELS_PER_LAYER + self._light_per_layer(tokens)[1]
        return (L * per_layer + h.kernels_per_step) * h.t_launch

    def t_host(self, step: Step) -> float:
        """alpha * S_n: host work per sampled sequence."""
        return self.host.alpha * step.num_seqs

    # ---- work accounting (for the clock forecast, the planner and MFU-style metrics) --------------------
    def work(self, step: Step) -> tuple[float, float]:
        """(FLOPs, DRAM bytes) of one step on one GPU."""
        m = self.model
        T = step.num_tokens
        d = m.dtype_bytes
        flops = 0.0
        nbytes = 0.0
        e = self.gemm_ops.elt  # projection weights and inputs: 1 B in fp8; outputs bf16
        for n, k in self._gemm_nk.values():
            flops += 2.0 * T * n * k
            nbytes += e * (T * k + n * k) + d * T * n
        pairs = sum(new * ctx + new * (new + 1) / 2.0 for new, ctx in step.prefill_seqs)
        dec = step.decode_contexts
        pairs += sum(dec) + len(dec)
        flops += 4.0 * m.heads_per_gpu * m.head_dim * pairs
        kv_tok = sum(c + n for n, c in step.prefill_seqs) + sum(dec) + len(dec)
        nbytes += d * 2 * m.kv_heads_per_gpu * m.head_dim * kv_tok
        nbytes += T * self._light_per_layer(T)[0]
        flops, nbytes = flops * m.layers, nbytes * m.layers
        n_v, k_v = self._lm_nk
        flops += 2.0 * step.num_seqs * n_v * k_v
        nbytes += d * n_v * k_v
        return flops, nbytes


class _Recorder:
    """Collects one prediction's per-op times and, when asked for the breakdown, bounds and factors."""

    __slots__ = ("ops", "factors", "bound", "breakdown")

    def __init__(self, ops: dict[str, float], factors: dict[str, dict[str, float]], bound: dict[str, str],
                 breakdown: bool):
        self.ops, self.factors, self.bound, self.breakdown = ops, factors, bound, breakdown

    def op(self, name: str, t: OpTime, scale: float) -> None:
        self.ops[name] = t.t * scale
        if self.breakdown:
            self.bound[name] = t.bound
            for k, v in t.factors.items():
                if k != "f_clk":
                    self.factors.setdefault(k, {})[name] = v
