"""The CPU device's kernel timings: the linear and attention kernels vLLM-CPU runs, timed the way the engine
calls them (see ``cpu_device`` for what is measured and why; this module only times).

Every figure is the fastest of several runs: another job on the machine can only make a run slower.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from itertools import accumulate
from typing import Any

from .shapes import ModelShape

STREAM_BYTES = 256 << 20  # weights streamed by the one-token pass: well beyond any last-level cache
MAX_WEIGHT_BYTES = 96 << 20  # one measured weight matrix at most (a 70B model's projections are cut to this)
# the shapes used when no model is known (the shipped bench-llama: hidden 1024, 16 / 8 heads of 64, MLP 2816)
DEFAULT_GEMMS = {"qkv": (2048, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816)}
DEFAULT_ATTN = (16, 8, 64)  # heads, KV heads, head_dim


# ---- timing ------------------------------------------------------------------------------------------------
def _best(fn: Callable[[], object], budget_s: float, min_reps: int = 3, max_reps: int = 200,
          deadline: float = math.inf) -> float:
    """Fastest of several runs of ``fn`` (s) after one warm-up: at least ``min_reps`` (one once the whole
    benchmark's ``deadline`` has passed), more while ``budget_s`` lasts. Another job on the machine can only
    make a run slower, so the fastest run is the measurement."""
    fn()
    best = math.inf
    t_end = min(time.perf_counter() + budget_s, deadline)
    if time.perf_counter() > deadline:
        min_reps = 1
    reps = 0
    while reps < min_reps or (time.perf_counter() < t_end and reps < max_reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best


def _torch_dtype(dtype: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(dtype, torch.bfloat16)


def _rand(*shape: int, dtype):
    import torch

    return torch.empty(*shape, dtype=dtype).uniform_(-1.0, 1.0)


def _linear_factory(tdt) -> tuple[Callable[[Any], Callable[[Any], Any]], str]:
    """make(weight) -> linear(x): the kernel vLLM-CPU would run for that weight, else torch's linear."""
    import torch

    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        class _Layer(torch.nn.Module):
            def __init__(self, w: torch.Tensor) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(w, requires_grad=False)
                self.bias = None

        def make_vllm(w):
            layer = _Layer(w)
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            fn = layer.cpu_linear
            return lambda x: fn(x, layer.weight, None)

        probe = make_vllm(torch.zeros(64, 64, dtype=tdt))
        probe(torch.zeros(1, 64, dtype=tdt))
        return make_vllm, "vLLM-CPU linear dispatch"
    except Exception:  # noqa: BLE001 - no vLLM (or not its CPU build): what torch runs
        return (lambda w: (lambda x: torch.nn.functional.linear(x, w))), "torch linear"


def _attention_factory(tdt, heads: int, kv_heads: int, head_dim: int
                       ) -> tuple[Callable[[list[tuple[int, int]]], Callable[[], None]], str]:
    """make(seqs) -> run(): one attention call over sequences (new tokens, cached context), as vLLM-CPU calls
    it (its paged-KV op, 128-token blocks), else torch's scaled_dot_product_attention."""
    import torch

    try:
        from vllm import _custom_ops as ops
        from vllm import envs
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        bs = 128
        isa = _get_attn_isa(tdt, bs, head_dim, "auto")

        def make_vllm(seqs: list[tuple[int, int]]) -> Callable[[], None]:
            q_lens = [n for n, _ in seqs]
            seq_lens = [n + c for n, c in seqs]
            blocks = [-(-s // bs) for s in seq_lens]
            kv = _rand(sum(blocks), kv_heads, bs, 2 * head_dim, dtype=tdt)
            kc, vc = kv.view(sum(blocks), kv_heads, 2 * bs, head_dim).chunk(2, dim=2)
            table = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
            start = 0
            for i, b in enumerate(blocks):
                table[i, :b] = torch.arange(start, start + b, dtype=torch.int32)
                start += b
            qsl = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32)
            sl = torch.tensor(seq_lens, dtype=torch.int32)
            q = _rand(sum(q_lens), heads, head_dim, dtype=tdt)
            out = torch.empty_like(q)
            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(seqs), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, seq_lens=sl,
                dtype=tdt, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype="auto")

            def run() -> None:
                ops.cpu_attention_with_kv_cache(
                    query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=sl,
                    scale=head_dim ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
                    softcap=0.0, scheduler_metadata=meta, s_aux=None)
            return run

        make_vllm([(1, 16)])()
        return make_vllm, f"vLLM-CPU attention ({isa})"
    except Exception:  # noqa: BLE001
        def make_torch(seqs: list[tuple[int, int]]) -> Callable[[], None]:
            g = heads // max(1, kv_heads)
            parts = []
            for n, c in seqs:
                q = _rand(1, heads, n, head_dim, dtype=tdt)
                k = _rand(1, kv_heads, n + c, head_dim, dtype=tdt).repeat_interleave(g, dim=1)
                parts.append((q, k))

            def run() -> None:
                for q, k in parts:
                    torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=q.shape[2] > 1)
            return run
        return make_torch, "torch sdpa"



def _body(t: float, fixed: float) -> float:
    """A timed pass less its calls' fixed cost, never below a fifth of the pass (a noisy fixed-cost reading
    cannot make a rate run away)."""
    return max(t - fixed, 0.2 * t)


def microbenchmark(budget_s: float = 1.6, model: ModelShape | None = None, dtype: str = "bf16") -> dict:
    """Time the engine's own linear and attention kernels (see the module docstring); numpy when no torch."""
    try:
        import torch  # noqa: F401
    except Exception:  # noqa: BLE001
        return _numpy_benchmark(budget_s)
    import torch

    tdt = _torch_dtype(dtype)
    elt = torch.empty(0, dtype=tdt).element_size()
    gemms = dict(model.gemms()) if model is not None else dict(DEFAULT_GEMMS)
    # cut very large projections to MAX_WEIGHT_BYTES (their speed per byte / per FLOP is what is measured)
    gemms = {n: (min(nn, max(64, MAX_WEIGHT_BYTES // (k * elt))), k) for n, (nn, k) in gemms.items()}
    layer_bytes = sum(n * k * elt for n, k in gemms.values())
    copies = max(1, math.ceil(STREAM_BYTES / layer_bytes))
    if model is not None:
        copies = min(copies, max(1, model.layers))  # a model that fits in cache runs from cache in the engine too
    make_linear, gemm_kind = _linear_factory(tdt)
    deadline = time.perf_counter() + budget_s  # (vLLM's import, paid above outside the engine, is not counted)
    with torch.no_grad():
        stack = [[(make_linear(_rand(n, k, dtype=tdt)), k) for n, k in gemms.values()] for _ in range(copies)]
        xs = {k: _rand(1, k, dtype=tdt) for _, k in gemms.values()}
        tiny = make_linear(_rand(64, 64, dtype=tdt))
        x64 = _rand(1, 64, dtype=tdt)

        def calls(n: int = 32) -> None:
            for _ in range(n):
                tiny(x64)

        t_call = _best(calls, 0.08 * budget_s, deadline=deadline) / 32

        def stream() -> None:
            for layer in stack:
                for f, k in layer:
                    f(xs[k])

        n_calls = copies * len(gemms)
        t1 = _best(stream, 0.25 * budget_s, deadline=deadline)
        t_stream = _body(t1, n_calls * t_call)  # the one-token pass less its calls' fixed cost
        bw = copies * layer_bytes / t_stream
        # compute: a few hundred tokens through one layer, sized to ~50 ms a pass on this machine
        layer0 = stack[0]
        flops_per_token = 2.0 * sum(n * k for n, k in gemms.values())
        x_probe = {k: _rand(32, k, dtype=tdt) for _, k in gemms.values()}
        t_probe = _best(lambda: [f(x_probe[k]) for f, k in layer0], 0.02 * budget_s, min_reps=1, max_reps=2,
                        deadline=deadline)
        per_token = max(t_probe - len(gemms) * t_call, 1e-9) / 32
        m_c = int(min(512, max(32, 0.05 / per_token)))
        xc = {k: _rand(m_c, k, dtype=tdt) for _, k in gemms.values()}
        tc = _best(lambda: [f(xc[k]) for f, k in layer0], 0.25 * budget_s, deadline=deadline)
        flops = flops_per_token * m_c / _body(tc, len(gemms) * t_call)
        # overlap: the stack again, at the token count whose FLOPs take as long as its weights' stream (a
        # decode batch of a few to a few tens of tokens); how much longer than the slower of the two it takes
        # says how far the kernel overlaps its weight stream with its FMAs
        m_mid = int(min(256, max(2, round(flops * elt / (2.0 * bw)))))
        xm = {k: _rand(m_mid, k, dtype=tdt) for _, k in gemms.values()}
        t_mid = _best(lambda: [f(xm[k]) for layer in stack for f, k in layer], 0.1 * budget_s, deadline=deadline)
        overlap = overlap_exponent(copies * flops_per_token * m_mid / flops, t_stream,
                                   _body(t_mid, n_calls * t_call))
        stack.clear()  # free the weights before the attention buffers

        heads, kvh, hd = ((model.heads, model.kv_heads, model.head_dim) if model is not None else DEFAULT_ATTN)
        make_attn, attn_kind = _attention_factory(tdt, heads, kvh, hd)
        t_attn = _best(make_attn([(1, 16)]), 0.04 * budget_s, deadline=deadline)
        dec = [(1, 1024)] * 16
        t_dec = _best(make_attn(dec), 0.12 * budget_s, deadline=deadline)
        dec_bytes = elt * hd * (2 * kvh * sum(c + 1 for _, c in dec) + 2 * heads * len(dec))
        attn_bw = dec_bytes / _body(t_dec, t_attn)
        n_pf = 256
        t_pf = _best(make_attn([(n_pf, 0)]), 0.12 * budget_s, deadline=deadline)
        attn_flops = 4.0 * heads * hd * (n_pf * (n_pf + 1) / 2) / _body(t_pf, t_attn)
    return {"flops": flops, "bw": bw, "t_call": t_call, "attn_flops": attn_flops, "attn_bw": attn_bw,
            "t_attn": t_attn, "gemm_tokens": m_c, "stream_mb": copies * layer_bytes / 1e6,
            "overlap": overlap, "overlap_tokens": m_mid,
            "kind": f"{gemm_kind}, {attn_kind}, {dtype}"}


OVERLAP_RANGE = (1.0, 8.0)  # the p of (t_c^p + t_m^p)^(1/p): 1 = compute and stream add up, 8 = the slower only


def overlap_exponent(t_compute: float, t_stream: float, t_both: float) -> float:
    """The p for which (t_compute^p + t_stream^p)^(1/p) = t_both: how a linear kernel's FMAs and weight
    stream combine on this machine (OpModel.gemm's ``overlap``). Clamped to OVERLAP_RANGE: a pass slower than
    the sum (another job cut in) reads as 1, one at the slower of the two as 8."""
    lo, hi = OVERLAP_RANGE

    def both(p: float) -> float:  # decreasing in p
        return (t_compute**p + t_stream**p) ** (1.0 / p)

    if not (t_compute > 0 and t_stream > 0 and t_both > 0) or t_both >= both(lo):
        return lo
    if t_both <= both(hi):
        return hi
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if both(mid) > t_both else (lo, mid)
    return round(0.5 * (lo + hi), 3)


def _numpy_benchmark(budget_s: float) -> dict:
    import numpy as np

    n = 512
    a = np.random.rand(n, n).astype(np.float32)
    t_mm = _best(lambda: a @ a, budget_s / 2)
    src = np.ones(16 * 1024 * 1024, dtype=np.float32)
    dst = np.empty_like(src)
    t_cp = _best(lambda: np.copyto(dst, src), budget_s / 2)
    flops = 2.0 * n**3 / t_mm
    return {"flops": flops, "bw": 2.0 * src.nbytes / t_cp, "t_call": 5e-6, "attn_flops": 0.3 * flops,
            "attn_bw": 0.6 * 2.0 * src.nbytes / t_cp, "t_attn": 10e-6, "kind": "numpy fp32 matmul, copy"}
