"""GPU probe: measure on a real GPU what the model assumes, and score m2live against it.

Two measurements, one sampler thread (``m2live.telemetry.ClockSampler`` over NVML) recording the SM clock,
board power and clock-event (throttle) reasons all along:

1. **Projection GEMMs** of Llama-3.1-8B (qkv, o, gate_up, down; bf16) over token counts M, in a randomised
   order with a cool-down before each cell. Each cell is a CUDA graph of back-to-back ``F.linear`` calls that
   cycle through enough copies of the weight that it never stays in L2 (serving reads weights cold), replayed
   for a sustained phase long enough for the clock to settle. Per cell: time, median SM clock, power and event
   reasons over the settled half, and m2live's ``OpModel.gemm`` prediction with (a) the measured clock,
   (b) the clock forecast from the power cap, (c) boost — and the MAPE of each.
2. **Whole engine steps** without vLLM: a Llama-3.1-8B-shaped decoder in plain torch (random bf16 weights,
   contiguous KV cache, ``scaled_dot_product_attention``, RMSNorm, RoPE, SiLU MLP, LM head on the sampled
   tokens) running decode and mixed prefill+decode steps, replayed as a CUDA graph (GPU body only, as vLLM's
   graphs) and eagerly (with torch's own launch overhead); m2live's step prediction for the same layer count.
   The torch model has no vLLM host work, so predictions use ``HostConstants(alpha=0, t_samp=0)``.

``probe.json`` is rewritten after every cell, so a run that is killed still leaves its data; ``probe.png`` is
drawn after each phase. ``dry_run=True`` runs the same pipeline on the CPU with tiny shapes, a replayed clock
and ``time.perf_counter`` timing, so the code is exercised in CI.

torch, pynvml and matplotlib are imported inside functions: importing this module costs nothing.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .hardware import GpuSpec, get_gpu
from .predictor import HostConstants, OpModel, Predictor
from .shapes import ModelShape, get_model
from .step import Step

SCHEMA = "m2live.probe/1"
LLAMA_8B = "meta-llama/Llama-3.1-8B"

M_FULL = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
M_QUICK = (1, 16, 64, 256, 1024, 4096, 16384)
M_DRY = (1, 16, 64)

# NVML clock-event (formerly "throttle") reason bits, nvml.h nvmlClocksEventReason*.
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}

# The dry run's stand-in model: Llama-shaped (GQA 2:1, gated MLP), small enough for a CPU in seconds.
DRY_MODEL = ModelShape("probe-dry-run-tiny", hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2,
                       head_dim=64, vocab=512)
DRY_GPU = "NVIDIA H100 80GB HBM3"  # predictions in a dry run are for this catalog GPU unless --gpu says otherwise


class ProbeError(ValueError):
    """A probe that cannot run here (no CUDA, no NVML, unknown GPU, bad output path): one line, exit 2."""


class _Interrupted(BaseException):
    """SIGTERM during a run: stop measuring, write what we have."""


# ----------------------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepSpec:
    """One representative engine step: prefill chunks ``(new, ctx)`` plus ``decode_batch`` decodes at one
    context (a uniform context keeps the torch decode attention one batched call)."""

    name: str
    prefills: tuple[tuple[int, int], ...] = ()
    decode_batch: int = 0
    decode_ctx: int = 0

    def step(self) -> Step:
        return Step.build(list(self.prefills), [self.decode_ctx] * self.decode_batch)

    @property
    def kind(self) -> str:
        if self.prefills and self.decode_batch:
            return "mixed"
        return "prefill" if self.prefills else "decode"

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV cache the step needs (all sequences, after the step)."""
        return sum(n + c for n, c in self.prefills) + self.decode_batch * (self.decode_ctx + 1)

    @property
    def max_position(self) -> int:
        return max([n + c for n, c in self.prefills] + [self.decode_ctx + 1])


STEPS_GPU: tuple[StepSpec, ...] = (
    StepSpec("decode 1x1024", (), 1, 1024),
    StepSpec("decode 16x1024", (), 16, 1024),
    StepSpec("decode 64x2048", (), 64, 2048),
    StepSpec("decode 128x1024", (), 128, 1024),
    StepSpec("decode 256x512", (), 256, 512),
    StepSpec("prefill 512 + decode 32x1024", ((512, 0),), 32, 1024),
    StepSpec("prefill 2048 + decode 64x1024", ((2048, 0),), 64, 1024),
    StepSpec("chunk 1024@2048 + decode 16x2048", ((1024, 2048),), 16, 2048),
    StepSpec("prefill 4096", ((4096, 0),)),
    StepSpec("prefill 2x2048", ((2048, 0), (2048, 0))),
)
STEPS_DRY: tuple[StepSpec, ...] = (
    StepSpec("decode 4x32", (), 4, 32),
    StepSpec("prefill 16 + decode 2x32", ((16, 0),), 2, 32),
    StepSpec("chunk 8@16 + decode 1x16", ((8, 16),), 1, 16),
    StepSpec("prefill 32", ((32, 0),)),
)


@dataclass(frozen=True)
class ProbePlan:
    mode: str  # "full" | "quick" | "dry-run"
    model: ModelShape  # the model whose GEMMs and steps are measured (full layer count)
    ms: tuple[int, ...]
    repeats: int  # times each GEMM cell is measured (each repeat in its own random position)
    warmup_s: float
    sustain_s: float  # back-to-back replays per cell; the clock/time are read over the second half
    cooldown_s: float  # idle before each cell, so each starts from a similar power/thermal state
    target_rep_s: float  # GPU time of one timed repetition (a graph of calls)
    max_calls: int  # calls per repetition at most
    step_layers: int
    steps: tuple[StepSpec, ...]
    step_modes: tuple[str, ...]  # "graph" and/or "eager"
    step_min_s: float
    step_min_reps: int
    step_cooldown_s: float
    sampler_period_s: float
    time_limit_s: float | None
    seed: int = 0
    l2_ring_factor: float = 4.0  # weight copies per op span at least this many L2 sizes
    memory_cap_gb: float = 40.0
    # rough per-item overheads for the duration estimate (graph capture, allocation, first-call heuristics)
    cell_overhead_s: float = 0.2
    step_overhead_s: float = 0.8

    @property
    def gemm_ops(self) -> dict[str, tuple[int, int]]:
        return self.model.gemms()

    def estimate_s(self) -> float:
        """Wall-clock estimate of the measuring (start-up excluded), from the plan's own timings."""
        cells = len(self.gemm_ops) * len(self.ms) * self.repeats
        gemm = cells * (self.cell_overhead_s + self.cooldown_s + self.warmup_s + self.sustain_s)
        steps = len(self.steps) * (self.step_cooldown_s + len(self.step_modes)
                                   * (self.step_overhead_s + self.step_min_s))
        return gemm + steps


def make_plan(quick: bool = False, dry_run: bool = False, seed: int = 0,
              time_limit_s: float | None = None) -> ProbePlan:
    """The measurement plan for a mode. ``time_limit_s`` None → the mode's default (quick: 330 s)."""
    if dry_run:
        return ProbePlan(
            mode="dry-run", model=DRY_MODEL, ms=M_DRY, repeats=1, warmup_s=0.005, sustain_s=0.03,
            cooldown_s=0.0, target_rep_s=0.002, max_calls=8, step_layers=DRY_MODEL.layers, steps=STEPS_DRY,
            step_modes=("eager",), step_min_s=0.02, step_min_reps=3, step_cooldown_s=0.0,
            sampler_period_s=0.005, time_limit_s=time_limit_s, seed=seed, cell_overhead_s=0.02,
            step_overhead_s=0.05,
        )
    model = get_model(LLAMA_8B)
    if quick:
        return ProbePlan(
            mode="quick", model=model, ms=M_QUICK, repeats=1, warmup_s=0.1, sustain_s=1.5, cooldown_s=0.5,
            target_rep_s=0.005, max_calls=512, step_layers=8, steps=STEPS_GPU, step_modes=("graph", "eager"),
            step_min_s=0.4, step_min_reps=5, step_cooldown_s=0.3, sampler_period_s=0.02,
            time_limit_s=330.0 if time_limit_s is None else time_limit_s, seed=seed,
        )
    return ProbePlan(
        mode="full", model=model, ms=M_FULL, repeats=2, warmup_s=0.2, sustain_s=2.0, cooldown_s=1.5,
        target_rep_s=0.005, max_calls=512, step_layers=model.layers, steps=STEPS_GPU,
        step_modes=("graph", "eager"), step_min_s=1.0, step_min_reps=5, step_cooldown_s=0.5,
        sampler_period_s=0.02, time_limit_s=time_limit_s, seed=seed,
    )


def gemm_order(plan: ProbePlan) -> list[tuple[str, int, int]]:
    """(op, M, repeat) in a random order (seeded): a clock that depends on history cannot fake a curve."""
    cells = [(op, m, r) for r in range(plan.repeats) for op in plan.gemm_ops for m in plan.ms]
    random.Random(plan.seed).shuffle(cells)
    return cells


def ring_copies(weight_bytes: int, l2_bytes: float, factor: float = 4.0) -> int:
    """Copies of a weight to cycle through so that a re-read always misses L2 (at least 2)."""
    if weight_bytes <= 0:
        return 2
    return max(2, math.ceil(factor * max(0.0, l2_bytes) / weight_bytes))


# ----------------------------------------------------------------------------------------------------------
# Scoring helpers (pure)
# ----------------------------------------------------------------------------------------------------------
def mape(pairs: Iterable[tuple[float, float]]) -> float | None:
    """Mean absolute percentage error of (predicted, measured) pairs, in %; None when there are none."""
    errs = [abs(p - m) / m for p, m in pairs if m > 0 and math.isfinite(p) and math.isfinite(m)]
    return 100.0 * sum(errs) / len(errs) if errs else None


def reason_names(mask: int | None) -> list[str]:
    if not mask:
        return []
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    rest = mask & ~sum(CLOCK_EVENT_REASONS)
    if rest:
        names.append(f"0x{rest:x}")
    return names


def gemm_predictions(om: OpModel, m: int, n: int, k: int, clock_mhz: float | None) -> dict[str, dict]:
    """OpModel.gemm (weights cold in L2) at the live clock, at the power-cap forecast (as Predictor derives it
    from the op's tensor and DRAM activity at boost), and at boost."""
    boost = om.gemm(m, n, k, 1.0, l2_warm=False)
    flops = 2.0 * m * n * k
    nbytes = om.elt * (m * k + n * k + m * n)
    f_fc = om.clock_ratio(flops, boost.t, nbytes)
    out = {"boost": (1.0, boost), "forecast": (f_fc, om.gemm(m, n, k, f_fc, l2_warm=False))}
    if clock_mhz is not None and clock_mhz > 0:
        f_live = clock_mhz / om.gpu.boost_mhz
        out["live"] = (f_live, om.gemm(m, n, k, f_live, l2_warm=False))
    return {src: {"f_clk": f, "time_s": t.t, "bound": t.bound} for src, (f, t) in out.items()}


def clock_stats(readings: Sequence[Any]) -> dict[str, Any]:
    """Median SM clock, power, temperature; OR of the event-reason masks; min/max clock; sample count."""
    if not readings:
        return {"samples": 0}
    mhz = [r.sm_mhz for r in readings]
    power = [r.power_w for r in readings if r.power_w is not None]
    temp = [r.temperature_c for r in readings if r.temperature_c is not None]
    mask = 0
    have_mask = False
    for r in readings:
        if r.event_reasons is not None:
            mask |= int(r.event_reasons)
            have_mask = True
    return {
        "samples": len(readings),
        "clock_mhz": statistics.median(mhz), "clock_min_mhz": min(mhz), "clock_max_mhz": max(mhz),
        "max_mhz": readings[-1].max_mhz,
        "power_w": statistics.median(power) if power else None,
        "power_limit_w": readings[-1].power_limit_w,
        "temperature_c": statistics.median(temp) if temp else None,
        "event_reasons": mask if have_mask else None,
        "event_reason_names": reason_names(mask) if have_mask else [],
    }


def _finite(x: Any) -> Any:
    """JSON-safe copy: non-finite floats become None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


# ----------------------------------------------------------------------------------------------------------
# Device back-ends: CUDA (events, graphs) and CPU (perf_counter) for the dry run
# ----------------------------------------------------------------------------------------------------------
class _Device:
    def __init__(self, torch: Any, cuda: bool):
        self.torch = torch
        self.cuda = cuda
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.dtype = torch.bfloat16
        self.timing = "cuda-events" if cuda else "perf_counter"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def time_once(self, launch: Callable[[], Any]) -> float:
        """Seconds of one ``launch()`` on the device (GPU time between two events; CPU wall time)."""
        if self.cuda:
            ev = self.torch.cuda.Event
            s, e = ev(enable_timing=True), ev(enable_timing=True)
            s.record()
            launch()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3
        t0 = time.perf_counter()
        launch()
        return time.perf_counter() - t0

    def repeat(self, launch: Callable[[], Any], min_s: float, min_reps: int, max_reps: int = 100000
               ) -> list[tuple[float, float, float]]:
        """Back-to-back timed repetitions for at least ``min_s`` and ``min_reps``: (t0, t1 monotonic, secs)."""
        out: list[tuple[float, float, float]] = []
        start = time.monotonic()
        while True:
            t0 = time.monotonic()
            dt = self.time_once(launch)
            t1 = time.monotonic()
            out.append((t0, t1, dt))
            if len(out) >= max_reps or (len(out) >= min_reps and t1 - start >= min_s):
                return out

    def graph(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Capture ``fn`` (already warmed up) into a CUDA graph and return its replay."""
        torch = self.torch
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return g.replay

    def empty_cache(self) -> None:
        if self.cuda:
            self.torch.cuda.empty_cache()

    def peak_memory_gb(self) -> float | None:
        if self.cuda:
            return self.torch.cuda.max_memory_allocated() / 1e9
        return None


def _settled(reps: list[tuple[float, float, float]], t_start: float, t_end: float
             ) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]], float]:
    """Split repetitions into (early, settled) halves by time; returns the settled window's start."""
    t_mid = t_start + (t_end - t_start) / 2.0
    settled = [r for r in reps if r[0] >= t_mid]
    if len(settled) < max(1, len(reps) // 2):
        settled = reps[len(reps) // 2:]
        t_mid = settled[0][0] if settled else t_start
    early = reps[: len(reps) - len(settled)]
    return early, settled, t_mid


# ----------------------------------------------------------------------------------------------------------
# The torch decoder (Llama-shaped, random weights)
# ----------------------------------------------------------------------------------------------------------
class TorchDecoder:
    """A Llama-style decoder in plain torch: RMSNorm, fused qkv, RoPE, GQA attention with SDPA over a contiguous
    KV cache, o, RMSNorm, fused gate_up, SiLU*up, down, residual adds; final norm + LM head on the sampled
    tokens. Weights are random bf16 (timing does not depend on their values)."""

    def __init__(self, dev: _Device, shape: ModelShape, layers: int, max_pos: int, seed: int = 0):
        torch = dev.torch
        self.dev, self.torch, self.shape, self.layers = dev, torch, shape, layers
        self.F = torch.nn.functional
        h, d = shape.hidden, shape.head_dim
        self.h, self.hq, self.kv, self.d = h, shape.heads, shape.kv_heads, d
        self.group = shape.heads // shape.kv_heads
        g = torch.Generator(device=dev.device).manual_seed(seed)

        def w(*size: int) -> Any:
            return (torch.randn(*size, generator=g, device=dev.device, dtype=dev.dtype) * 0.02)

        qkv_n, o_k = shape.gemms()["qkv"][0], shape.heads * d
        self.w = [
            {"ln1": torch.ones(h, device=dev.device, dtype=dev.dtype), "qkv": w(qkv_n, h), "o": w(h, o_k),
             "ln2": torch.ones(h, device=dev.device, dtype=dev.dtype),
             "gate_up": w(2 * shape.intermediate, h), "down": w(h, shape.intermediate)}
            for _ in range(layers)
        ]
        self.emb = w(shape.vocab, h)
        self.lm = self.emb if shape.tied_embeddings else w(shape.vocab, h)
        self.norm = torch.ones(h, device=dev.device, dtype=dev.dtype)
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev.device, dtype=torch.float32) / d))
        ang = torch.outer(torch.arange(max_pos, device=dev.device, dtype=torch.float32), inv)
        self.cos, self.sin = ang.cos().to(dev.dtype), ang.sin().to(dev.dtype)
        try:
            from torch.nn.attention.bias import causal_lower_right
            self.causal_lower_right = causal_lower_right
        except ImportError:  # older torch: an explicit boolean mask does the same
            self.causal_lower_right = None

    def rms(self, x: Any, weight: Any) -> Any:
        F = self.F
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), weight, 1e-5)
        xf = x.float()
        return (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * weight

    def rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = self.d // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    # ---- inputs for one step -------------------------------------------------------------------------
    def inputs(self, spec: StepSpec, seed: int = 0) -> dict[str, Any]:
        """Token ids, positions, KV caches (random past), sampled-token rows: fixed tensors, so the step can
        be captured in a CUDA graph."""
        torch, dev = self.torch, self.dev
        g = torch.Generator(device=dev.device).manual_seed(seed)
        pos: list[int] = []
        sample: list[int] = []
        for n, c in spec.prefills:
            pos += range(c, c + n)
            sample.append(len(pos) - 1)
        b, ctx = spec.decode_batch, spec.decode_ctx
        pos += [ctx] * b
        sample += range(len(pos) - b, len(pos))
        T = len(pos)

        def cache(batch: int, length: int) -> Any:
            return torch.randn(batch, self.kv, length, self.d, generator=g, device=dev.device, dtype=dev.dtype)

        layers = []
        for _ in range(self.layers):
            pre = [(cache(1, n + c), cache(1, n + c)) for n, c in spec.prefills]
            dec = (cache(b, ctx + 1), cache(b, ctx + 1)) if b else None
            layers.append({"pre": pre, "dec": dec})
        positions = torch.tensor(pos, device=dev.device, dtype=torch.long)
        return {
            "spec": spec, "T": T,
            "ids": torch.randint(0, self.shape.vocab, (T,), generator=g, device=dev.device),
            "cos": self.cos[positions].unsqueeze(1), "sin": self.sin[positions].unsqueeze(1),
            "sample": torch.tensor(sample, device=dev.device, dtype=torch.long),
            "layers": layers,
        }

    # ---- forward ---------------------------------------------------------------------------------------
    def _attention(self, q: Any, k: Any, v: Any, lay: dict, spec: StepSpec) -> Any:
        F, torch = self.F, self.torch
        hq, kvh, d, G = self.hq, self.kv, self.d, self.group
        outs = []
        off = 0
        for (n, c), (kc, vc) in zip(spec.prefills, lay["pre"], strict=True):
            kc[0, :, c:c + n].copy_(k[off:off + n].transpose(0, 1))  # KV-cache write
            vc[0, :, c:c + n].copy_(v[off:off + n].transpose(0, 1))
            qj = q[off:off + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            # KV heads repeated to the query heads (a copy of ~(n+c)*H*D*4 bytes, <1 % of the attention) so that
            # every torch version dispatches plain MHA FlashAttention; causal aligned bottom-right over the cache
            kx, vx = kc.repeat_interleave(G, dim=1), vc.repeat_interleave(G, dim=1)
            if c == 0:
                o = F.scaled_dot_product_attention(qj, kx, vx, is_causal=True)
            elif self.causal_lower_right is not None:
                o = F.scaled_dot_product_attention(qj, kx, vx, attn_mask=self.causal_lower_right(n, n + c))
            else:
                mask = torch.ones(n, n + c, device=q.device, dtype=torch.bool).tril(diagonal=c)
                o = F.scaled_dot_product_attention(qj, kx, vx, attn_mask=mask)
            outs.append(o[0].transpose(0, 1).reshape(n, hq * d))
            off += n
        b, ctx = spec.decode_batch, spec.decode_ctx
        if b:
            kd, vd = lay["dec"]
            kd[:, :, ctx].copy_(k[off:off + b])  # KV-cache write of the new token
            vd[:, :, ctx].copy_(v[off:off + b])
            # GQA for one query token: the G query heads of a KV head act as G query rows against its cache
            qd = q[off:off + b].reshape(b, kvh, G, d)
            o = F.scaled_dot_product_attention(qd, kd, vd)
            outs.append(o.reshape(b, hq * d))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def forward(self, inp: dict) -> Any:
        F = self.F
        spec: StepSpec = inp["spec"]
        T, hq, kvh, d = inp["T"], self.hq, self.kv, self.d
        x = F.embedding(inp["ids"], self.emb)
        for w, lay in zip(self.w, inp["layers"], strict=True):
            h = self.rms(x, w["ln1"])
            qkv = F.linear(h, w["qkv"])
            q = self.rope(qkv[:, : hq * d].view(T, hq, d), inp["cos"], inp["sin"])
            k = self.rope(qkv[:, hq * d:(hq + kvh) * d].view(T, kvh, d), inp["cos"], inp["sin"])
            v = qkv[:, (hq + kvh) * d:].view(T, kvh, d)
            x = x + F.linear(self._attention(q, k, v, lay, spec), w["o"])
            gate, up = F.linear(self.rms(x, w["ln2"]), w["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["down"])
        xs = self.rms(x.index_select(0, inp["sample"]), self.norm)
        return F.linear(xs, self.lm)


# ----------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------
@dataclass
class _Env:
    torch: Any
    dev: _Device
    spec: GpuSpec
    source: Any
    sampler: Any
    gpu_info: dict = field(default_factory=dict)
    l2_bytes: float = 0.0


def _load_torch(dry_run: bool) -> Any:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - ImportError or a broken install: say so in one line
        raise ProbeError(f"m2live probe needs PyTorch{'' if dry_run else ' with CUDA'}: cannot import torch "
                         f"({e.__class__.__name__}: {e})") from None
    if not dry_run:
        if not torch.cuda.is_available():
            raise ProbeError(f"m2live probe needs PyTorch with CUDA and an NVIDIA GPU: torch {torch.__version__}"
                             f" sees no CUDA device (use --dry-run to exercise the pipeline on the CPU)")
        if not torch.cuda.is_bf16_supported():
            raise ProbeError(f"{torch.cuda.get_device_name()} has no bf16 support; the probe measures bf16")
    return torch


def _nvml_info(torch: Any) -> dict:
    """NVML index matching torch's current CUDA device (by UUID; CUDA_VISIBLE_DEVICES reorders indices),
    name, driver, power limits, max clocks."""
    try:
        import pynvml
    except Exception as e:  # noqa: BLE001
        raise ProbeError(f"m2live probe needs nvidia-ml-py (pynvml): {e.__class__.__name__}: {e}") from None
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    uuid = str(getattr(props, "uuid", "") or "")
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001
        raise ProbeError(f"NVML init failed ({e}); the probe needs NVML for the clock") from None

    def s(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    def opt(fn: Callable, *a: Any) -> Any:
        try:
            return fn(*a)
        except Exception:  # noqa: BLE001 - optional on some boards
            return None

    try:
        index = None
        count = pynvml.nvmlDeviceGetCount()
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            if uuid and uuid in s(opt(pynvml.nvmlDeviceGetUUID, h) or ""):
                index = i
                break
        if index is None:
            vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
            index = int(vis) if vis.isdigit() and int(vis) < count else dev
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        pl = opt(pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
        pdl = opt(pynvml.nvmlDeviceGetPowerManagementDefaultLimit, h)
        return {
            "nvml_index": index,
            "name": s(pynvml.nvmlDeviceGetName(h)),
            "uuid": s(opt(pynvml.nvmlDeviceGetUUID, h) or ""),
            "driver": s(opt(pynvml.nvmlSystemGetDriverVersion) or ""),
            "max_sm_mhz": opt(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM),
            "max_mem_mhz": opt(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM),
            "power_limit_w": None if pl is None else pl / 1000.0,
            "default_power_limit_w": None if pdl is None else pdl / 1000.0,
        }
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def dry_run_readings(spec: GpuSpec, n: int = 40) -> list[Any]:
    """A synthetic clock recording for the dry run: a droop from boost to 75 % and back, power rising towards
    the TDP with the software power cap flagged near the bottom."""
    from .telemetry import ClockReading

    out = []
    for i in range(n):
        x = 0.5 - 0.5 * math.cos(2 * math.pi * i / n)  # 0 → 1 → 0
        out.append(ClockReading(t=0.0, sm_mhz=round(spec.boost_mhz * (1 - 0.25 * x)), max_mhz=spec.boost_mhz,
                                power_w=0.2 * spec.tdp_w + 0.78 * spec.tdp_w * x, power_limit_w=spec.tdp_w,
                                event_reasons=0x4 if x > 0.8 else 0, temperature_c=40 + 30 * x))
    return out


def _git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                           capture_output=True, text=True, timeout=3)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _slug(s: str) -> str:
    out = "".join(ch.lower() if ch.isalnum() else "-" for ch in s)
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-")


def default_out_dir(gpu_name: str, dry_run: bool, now: _dt.datetime | None = None) -> Path:
    now = now or _dt.datetime.now(_dt.UTC)
    base = "dry-run" if dry_run else _slug(gpu_name.replace("NVIDIA", ""))
    return Path("results") / "probe" / f"{base}-{now:%Y%m%d}"


def _prepare_out(out: str | os.PathLike) -> Path:
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ProbeError(f"--out {out}: exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".probe-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ProbeError(f"--out {out}: not writable ({e.strerror or e})") from None
    return p


class _Writer:
    """Keeps probe.json current on disk (atomic replace) after every cell."""

    def __init__(self, out: Path, doc: dict, sampler: Any, t0: float):
        self.out, self.doc, self.sampler, self.t0 = out, doc, sampler, t0
        self.path = out / "probe.json"

    def clock_trace(self, max_points: int = 4000) -> dict[str, list]:
        rs = self.sampler.between(self.t0, float("inf")) if self.sampler is not None else []
        stride = max(1, math.ceil(len(rs) / max_points))
        rs = rs[::stride]
        return {"t_s": [round(r.t - self.t0, 4) for r in rs], "sm_mhz": [r.sm_mhz for r in rs],
                "power_w": [r.power_w for r in rs], "event_reasons": [r.event_reasons for r in rs]}

    def flush(self) -> None:
        self.doc["duration_s"] = time.monotonic() - self.t0
        self.doc["clock_trace"] = self.clock_trace()
        if self.sampler is not None:
            self.doc["sampler"] = {"reads": self.sampler.reads, "errors": self.sampler.errors,
                                   "period_s": self.sampler.period_s}
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_finite(self.doc), indent=1))
        os.replace(tmp, self.path)


def _summarise_gemm(cells: list[dict]) -> dict:
    done = [c for c in cells if c.get("time_s")]
    out: dict[str, Any] = {}
    for src in ("live", "forecast", "boost"):
        out[src] = mape((c["pred"][src]["time_s"], c["time_s"]) for c in done if src in c["pred"])
    by_op: dict[str, dict] = {}
    for op in sorted({c["op"] for c in done}):
        by_op[op] = {src: mape((c["pred"][src]["time_s"], c["time_s"]) for c in done
                               if c["op"] == op and src in c["pred"]) for src in ("live", "forecast", "boost")}
    # the power-cap forecast of the clock itself, against the clock measured (the seed's open item)
    clk = mape((c["pred"]["forecast"]["f_clk"], c["pred"]["live"]["f_clk"]) for c in done if "live" in c["pred"])
    return {"mape": out, "mape_by_op": by_op, "clock_forecast_mape": clk, "cells_measured": len(done)}


def _clock_summary(cells: list[dict], max_mhz: float | None) -> dict:
    """Per op: settled clock at the largest M measured and the droop below the max (boost) clock."""
    out = {}
    for op in sorted({c["op"] for c in cells if c.get("clock_mhz")}):
        mine = sorted((c for c in cells if c["op"] == op and c.get("clock_mhz")), key=lambda c: c["m"])
        top = [c["clock_mhz"] for c in mine if c["m"] == mine[-1]["m"]]
        clk = statistics.median(top)
        ref = max_mhz or mine[-1].get("max_mhz")
        out[op] = {"m": mine[-1]["m"], "clock_mhz": clk, "droop": (1 - clk / ref) if ref else None,
                   "clock_at_min_m_mhz": mine[0]["clock_mhz"], "min_m": mine[0]["m"]}
    return out


def _summarise_steps(cells: list[dict]) -> dict:
    res: dict[str, Any] = {}
    for mode in sorted({c["mode"] for c in cells}):
        mine = [c for c in cells if c["mode"] == mode and c.get("time_s")]
        res[mode] = {src: mape((c["pred"][src]["time_s"], c["time_s"]) for c in mine if src in c["pred"])
                     for src in ("live", "forecast", "boost")}
    return res


def _step_clock_forecast_mape(cells: list[dict]) -> float | None:
    return mape((c["pred"]["forecast"]["f_clk"], c["pred"]["live"]["f_clk"]) for c in cells
                if c.get("time_s") and "live" in c["pred"])


def _open_env(dry_run: bool, gpu_override: str | None, plan: ProbePlan) -> _Env:
    from .telemetry import ClockSampler, NvmlClockSource, ReplayClockSource, TelemetryError

    torch = _load_torch(dry_run)
    if dry_run:
        spec = get_gpu(gpu_override or DRY_GPU)
        dev = _Device(torch, cuda=False)
        source = ReplayClockSource(dry_run_readings(spec))
        info = {"name": f"CPU dry run ({platform.machine()})",
                "driver": None, "max_sm_mhz": spec.boost_mhz, "power_limit_w": spec.tdp_w}
        l2 = 0.0
    else:
        info = _nvml_info(torch)
        try:
            spec = get_gpu(gpu_override or info["name"])
        except KeyError as e:
            raise ProbeError(f"{e}; pass --gpu with the catalog name to predict for") from None
        dev = _Device(torch, cuda=True)
        try:
            source = NvmlClockSource(info["nvml_index"])
        except TelemetryError as e:
            raise ProbeError(f"no NVML clock: {e}") from None
        props = torch.cuda.get_device_properties(dev.device)
        info.update({"torch_name": props.name, "sms": props.multi_processor_count,
                     "memory_gb": props.total_memory / 1e9, "l2_bytes": getattr(props, "L2_cache_size", None),
                     "compute_capability": f"{props.major}.{props.minor}"})
        l2 = max(spec.l2_bytes, float(info.get("l2_bytes") or 0))
    history = int(4 * (plan.time_limit_s or 3600) / plan.sampler_period_s) + 1000
    sampler = ClockSampler(source, period_s=plan.sampler_period_s, history=min(history, 2_000_000))
    return _Env(torch=torch, dev=dev, spec=spec, source=source, sampler=sampler, gpu_info=info, l2_bytes=l2)


def _run_gemms(env: _Env, plan: ProbePlan, doc: dict, writer: _Writer, say: Callable[[str], None],
               deadline: float | None) -> None:
    torch, dev, spec = env.torch, env.dev, env.spec
    F = torch.nn.functional
    om = OpModel(spec)
    torch.manual_seed(plan.seed)
    ops = plan.gemm_ops
    rings: dict[str, list[Any]] = {}
    for op, (n, k) in ops.items():
        copies = ring_copies(2 * n * k, env.l2_bytes, plan.l2_ring_factor)
        rings[op] = [torch.randn(n, k, device=dev.device, dtype=dev.dtype) * 0.02 for _ in range(copies)]
    doc["gemm"]["weight_copies"] = {op: len(r) for op, r in rings.items()}
    cells: list[dict] = doc["gemm"]["cells"]
    order = gemm_order(plan)
    per_cell = plan.cell_overhead_s + plan.cooldown_s + plan.warmup_s + plan.sustain_s
    for i, (op, m, rep) in enumerate(order):
        if deadline is not None and time.monotonic() + per_cell > deadline:
            doc["gemm"]["skipped"] = [{"op": o, "m": mm, "repeat": r} for o, mm, r in order[i:]]
            say(f"time limit: {len(order) - i} GEMM cells skipped")
            break
        n, k = ops[op]
        ring = rings[op]
        time.sleep(plan.cooldown_s)
        x = torch.randn(m, k, device=dev.device, dtype=dev.dtype)

        def body(count: int, x: Any = x, ring: list = ring) -> None:
            r = len(ring)
            for j in range(count):
                F.linear(x, ring[j % r])

        body(1)  # first call: library heuristics, workspace
        dev.sync()
        pilot = min(dev.time_once(lambda: body(1)) for _ in range(3))
        calls = max(1, min(plan.max_calls, math.ceil(plan.target_rep_s / max(pilot, 1e-7))))
        method = "eager"
        launch: Callable[[], Any] = lambda calls=calls: body(calls)  # noqa: E731
        capture_error = None
        if dev.cuda:
            try:
                launch = dev.graph(lambda calls=calls: body(calls))
                method = "cuda-graph"
            except Exception as e:  # noqa: BLE001 - fall back to eager back-to-back calls, and say so
                capture_error = f"{e.__class__.__name__}: {e}".splitlines()[0]
        dev.repeat(launch, plan.warmup_s, 1)
        t_start = time.monotonic()
        reps = dev.repeat(launch, plan.sustain_s, min_reps=4)
        t_end = time.monotonic()
        early, settled, t_mid = _settled(reps, t_start, t_end)
        readings = env.sampler.between(t_mid, t_end)
        if not readings:
            r, _ = env.sampler.latest()
            readings = [r] if r is not None else []
        stats = clock_stats(readings)
        early_stats = clock_stats(env.sampler.between(t_start, t_mid))
        t_cell = statistics.median(dt for _, _, dt in settled) / calls
        per_call = sorted(dt / calls for _, _, dt in settled)
        cell = {
            "op": op, "m": m, "n": n, "k": k, "repeat": rep, "order": i, "method": method,
            "calls_per_rep": calls, "reps": len(reps), "reps_settled": len(settled),
            "time_s": t_cell, "time_p10_s": per_call[len(per_call) // 10], "time_p90_s": per_call[-1 - len(per_call) // 10],
            "time_early_s": statistics.median(dt for _, _, dt in early) / calls if early else None,
            "clock_early_mhz": early_stats.get("clock_mhz"),
            "tflops": 2.0 * m * n * k / t_cell / 1e12,
            "t_start_s": t_start - writer.t0, "t_end_s": t_end - writer.t0,
            **stats,
            "pred": gemm_predictions(om, m, n, k, stats.get("clock_mhz")),
        }
        if capture_error:
            cell["graph_error"] = capture_error
        for src, p in cell["pred"].items():
            cell.setdefault("err", {})[src] = (p["time_s"] - t_cell) / t_cell
        cells.append(cell)
        del x, launch
        doc["gemm"].update(_summarise_gemm(cells))
        writer.flush()
        e = cell.get("err", {})
        say(f"[{i + 1}/{len(order)}] {op:8s} M={m:<6d} {t_cell * 1e6:10.1f} us  {cell['tflops']:6.1f} TF/s  "
            f"clock {stats.get('clock_mhz') or 0:6.0f} MHz  power {stats.get('power_w') or 0:5.0f} W  "
            f"err live {_pct(e.get('live'))} forecast {_pct(e.get('forecast'))} boost {_pct(e.get('boost'))}"
            f"{'  ' + ','.join(stats['event_reason_names']) if stats.get('event_reason_names') else ''}")
    del rings
    dev.empty_cache()
    doc["gemm"]["clock_summary"] = _clock_summary(cells, env.gpu_info.get("max_sm_mhz"))


def _pct(x: float | None) -> str:
    return "   n/a" if x is None else f"{100 * x:+6.1f}%"


def _run_steps(env: _Env, plan: ProbePlan, doc: dict, writer: _Writer, say: Callable[[str], None],
               deadline: float | None) -> None:
    dev, spec = env.dev, env.spec
    shape = replace(plan.model, layers=plan.step_layers,
                    name=f"{plan.model.name} ({plan.step_layers} of {plan.model.layers} layers)")
    hosts = {
        # the torch model has no vLLM host work: no per-sequence host term, no sampling tail
        "graph": HostConstants(alpha=0.0, t_samp=0.0, graph_max_tokens=1 << 40),
        "eager": HostConstants(alpha=0.0, t_samp=0.0, graph_max_tokens=0),
    }
    preds = {mode: Predictor(spec, shape, host=h) for mode, h in hosts.items()}
    sec = doc["steps"]
    sec.update({"model": shape.name, "layers": plan.step_layers, "modes": list(plan.step_modes),
                "host_constants": {mode: asdict(h) for mode, h in hosts.items() if mode in plan.step_modes},
                "note": ("torch decoder, not vLLM: random bf16 weights, contiguous KV cache, SDPA attention; "
                         "predictions use HostConstants(alpha=0, t_samp=0): no scheduler or sampler work. "
                         "'graph' replays the whole step as one CUDA graph (GPU body, launch term = graph "
                         "replays); 'eager' launches every torch kernel from Python (predicted with eager "
                         "launches at HostConstants.t_launch per kernel, 11 kernels per layer; this torch "
                         "model launches more, unfused kernels than vLLM).")})
    max_pos = max(s.max_position for s in plan.steps) + 1
    t_build = time.monotonic()
    model = TorchDecoder(dev, plan.model, plan.step_layers, max_pos, seed=plan.seed)
    dev.sync()
    sec["build_s"] = time.monotonic() - t_build
    sec["attention"] = ("SDPA: prefill as MHA with KV heads repeated (causal, bottom-right over the cache), decode "
                        "as the G query heads of each KV head against its cache")
    kv_per_token = 2 * plan.step_layers * plan.model.kv_heads * plan.model.head_dim * 2
    weights = plan.step_layers * plan.model.layer_weight_bytes() + 2 * plan.model.vocab * plan.model.hidden * 2
    order = list(plan.steps)
    random.Random(plan.seed + 1).shuffle(order)
    cells: list[dict] = sec["cells"]
    for i, sp in enumerate(order):
        est = plan.step_cooldown_s + len(plan.step_modes) * (plan.step_overhead_s + plan.step_min_s)
        if deadline is not None and time.monotonic() + est > deadline:
            sec["skipped"] = [s.name for s in order[i:]]
            say(f"time limit: {len(order) - i} steps skipped")
            break
        need_gb = (weights + sp.kv_tokens * kv_per_token) / 1e9
        if dev.cuda and need_gb > plan.memory_cap_gb * 0.9:
            sec.setdefault("skipped", []).append(sp.name)
            say(f"{sp.name}: skipped, needs ~{need_gb:.1f} GB")
            continue
        time.sleep(plan.step_cooldown_s)
        inp = model.inputs(sp, seed=plan.seed + i)
        step = sp.step()
        for mode in plan.step_modes:
            fn = lambda inp=inp, model=model: model.forward(inp)  # noqa: E731
            fn()
            fn()
            dev.sync()
            launch, err = fn, None
            if mode == "graph":
                try:
                    launch = dev.graph(fn)
                except Exception as e:  # noqa: BLE001 - keep going with the next mode; say why
                    err = f"{e.__class__.__name__}: {e}".splitlines()[0]
                    cells.append({"name": sp.name, "mode": mode, "error": err})
                    say(f"{sp.name} [{mode}]: capture failed: {err}")
                    continue
            dev.repeat(launch, 0.0, 2)
            t_start = time.monotonic()
            reps = dev.repeat(launch, plan.step_min_s, plan.step_min_reps)
            t_end = time.monotonic()
            _, settled, t_mid = _settled(reps, t_start, t_end)
            readings = env.sampler.between(t_mid, t_end) or [r for r in [env.sampler.latest()[0]] if r]
            stats = clock_stats(readings)
            t_meas = statistics.median(dt for _, _, dt in settled)
            p = preds[mode]
            pred: dict[str, dict] = {}
            runs = {"boost": {"f_clk": 1.0}, "forecast": {"f_clk": None}}
            if stats.get("clock_mhz"):
                runs["live"] = {"clock_mhz": stats["clock_mhz"]}
            for src, kw in runs.items():
                r = p.predict(step, **kw)
                pred[src] = {"time_s": r.total_s, "f_clk": r.f_clk, "t_blocks_s": r.t_blocks}
                if src == "live":
                    pred[src]["ops_s"] = {op: v for op, v in r.ops.items() if v > 0}
            cell = {
                "name": sp.name, "kind": sp.kind, "mode": mode,
                "prefills": [list(x) for x in sp.prefills], "decode_batch": sp.decode_batch,
                "decode_ctx": sp.decode_ctx, "num_tokens": step.num_tokens, "num_seqs": step.num_seqs,
                "time_s": t_meas, "time_min_s": min(dt for _, _, dt in settled), "reps": len(reps),
                "t_start_s": t_start - writer.t0, "t_end_s": t_end - writer.t0, **stats, "pred": pred,
                "err": {src: (v["time_s"] - t_meas) / t_meas for src, v in pred.items()},
            }
            cells.append(cell)
            del launch
            sec["mape"] = _summarise_steps(cells)
            sec["clock_forecast_mape"] = _step_clock_forecast_mape(cells)
            writer.flush()
            e = cell["err"]
            say(f"step {sp.name:34s} [{mode:5s}] {t_meas * 1e3:9.3f} ms  clock "
                f"{stats.get('clock_mhz') or 0:6.0f} MHz  err live {_pct(e.get('live'))} "
                f"forecast {_pct(e.get('forecast'))} boost {_pct(e.get('boost'))}")
        del inp
        dev.empty_cache()
    del model
    dev.empty_cache()


def run_probe(out: str | os.PathLike | None = None, *, quick: bool = False, dry_run: bool = False,
              gpu: str | None = None, seed: int = 0, time_limit_s: float | None = None,
              say: Callable[[str], None] = print, plot: bool = True) -> dict:
    """Run the probe and write ``probe.json`` and ``probe.png``; returns the JSON document."""
    t0 = time.monotonic()
    if time_limit_s is not None and not time_limit_s > 0:
        raise ProbeError(f"--time-limit must be positive, got {time_limit_s}")
    plan = make_plan(quick=quick, dry_run=dry_run, seed=seed, time_limit_s=time_limit_s)
    if out is not None:
        out_dir = _prepare_out(out)  # fail on a bad path before anything slow
    env = _open_env(dry_run, gpu, plan)
    if out is None:
        out_dir = _prepare_out(default_out_dir(env.gpu_info.get("name") or env.spec.name, dry_run))
    torch = env.torch
    now = _dt.datetime.now(_dt.UTC)
    doc: dict[str, Any] = {
        "schema": SCHEMA, "complete": False, "mode": plan.mode, "dry_run": dry_run, "quick": quick,
        "date": now.isoformat(timespec="seconds"),
        "gpu": {**env.gpu_info, "catalog_name": env.spec.name, "catalog_boost_mhz": env.spec.boost_mhz,
                "catalog_tdp_w": env.spec.tdp_w, "catalog_l2_bytes": env.spec.l2_bytes},
        "torch": torch.__version__, "cuda": getattr(torch.version, "cuda", None),
        "python": platform.python_version(), "m2live_commit": _git_commit(),
        "clock_source": env.source.name,
        "plan": {"ms": list(plan.ms), "ops": {op: list(nk) for op, nk in plan.gemm_ops.items()},
                 "repeats": plan.repeats, "warmup_s": plan.warmup_s, "sustain_s": plan.sustain_s,
                 "cooldown_s": plan.cooldown_s, "target_rep_s": plan.target_rep_s, "seed": plan.seed,
                 "step_layers": plan.step_layers, "time_limit_s": plan.time_limit_s,
                 "estimate_s": plan.estimate_s(), "timing": env.dev.timing,
                 "l2_bytes_for_weight_rings": env.l2_bytes, "l2_ring_factor": plan.l2_ring_factor},
        "model": plan.model.name,
        "gemm": {"cells": [], "mape": {}, "note": "OpModel.gemm with l2_warm=False; time = median per call over "
                 "the settled (second) half of the sustained phase; clock/power = median NVML samples there"},
        "steps": {"cells": [], "mape": {}},
        "mape": {}, "errors": [], "out_dir": str(out_dir),
    }
    writer = _Writer(out_dir, doc, env.sampler, t0)
    deadline = t0 + plan.time_limit_s if plan.time_limit_s else None
    say(f"m2live probe ({plan.mode}): {doc['gpu'].get('name')} → predicting for {env.spec.name}; "
        f"torch {torch.__version__}; writing {out_dir}; estimate ~{plan.estimate_s():.0f} s of measuring")

    in_main = _is_main_thread()
    old_term = signal.signal(signal.SIGTERM, _raise_interrupted) if in_main else None
    env.sampler.start()
    try:
        with torch.inference_mode():
            _phase(doc, "gemm", lambda: _run_gemms(env, plan, doc, writer, say, deadline), say)
            if plot:
                _plot_safe(out_dir, doc, say)
            _phase(doc, "steps", lambda: _run_steps(env, plan, doc, writer, say, deadline), say)
        doc["complete"] = not doc["errors"] and not doc["gemm"].get("skipped") and not doc["steps"].get("skipped")
    except _Interrupted:
        doc["errors"].append("interrupted by SIGTERM")
        say("interrupted: writing what was measured")
    finally:
        env.sampler.stop()
        try:
            env.source.close()
        except Exception:  # noqa: BLE001
            pass
        if in_main and old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        doc["peak_memory_gb"] = env.dev.peak_memory_gb()
        doc["mape"] = {"gemm": doc["gemm"].get("mape", {}), "steps": doc["steps"].get("mape", {}),
                       "clock_forecast": {"gemm": doc["gemm"].get("clock_forecast_mape"),
                                          "steps": doc["steps"].get("clock_forecast_mape")}}
        writer.flush()
        if plot:
            _plot_safe(out_dir, doc, say)
    return doc


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise _Interrupted()


def _phase(doc: dict, name: str, fn: Callable[[], None], say: Callable[[str], None]) -> None:
    """Run one phase; a failure inside it is recorded (one line) and the next phase still runs."""
    try:
        fn()
    except (_Interrupted, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - a GPU-side failure must not lose the other phase's data
        msg = f"{name}: {e.__class__.__name__}: {e}".splitlines()[0]
        doc["errors"].append(msg)
        say(f"error in {msg}")


def _plot_safe(out_dir: Path, doc: dict, say: Callable[[str], None]) -> None:
    try:
        plot_probe(doc, out_dir / "probe.png")
    except Exception as e:  # noqa: BLE001 - a plotting problem never loses probe.json
        msg = f"plot: {e.__class__.__name__}: {e}".splitlines()[0]
        if msg not in doc["errors"]:
            doc["errors"].append(msg)
        say(f"error in {msg}")


# ----------------------------------------------------------------------------------------------------------
# The picture
# ----------------------------------------------------------------------------------------------------------
SRC_STYLE = {"live": ("tab:green", "o"), "forecast": ("tab:orange", "s"), "boost": ("tab:red", "^")}


def _fmt_mape(m: dict | None) -> str:
    m = m or {}
    return ", ".join(f"{src} {m[src]:.1f}%" for src in ("live", "forecast", "boost") if m.get(src) is not None)


def plot_probe(doc: dict, path: str | os.PathLike) -> Path:
    """probe.png: SM clock and power vs M per op; GEMM and step predicted vs measured (live / forecast /
    boost clock); the clock over the whole run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = doc.get("gpu", {})
    cells = [c for c in doc.get("gemm", {}).get("cells", []) if c.get("time_s")]
    steps = [c for c in doc.get("steps", {}).get("cells", []) if c.get("time_s")]
    fig = plt.figure(figsize=(15, 13))
    gs = fig.add_gridspec(3, 2, height_ratios=[1, 1, 0.8], hspace=0.35, wspace=0.22)
    ax_clk, ax_pw = fig.add_subplot(gs[0, 0]), fig.add_subplot(gs[0, 1])
    ax_gemm, ax_step = fig.add_subplot(gs[1, 0]), fig.add_subplot(gs[1, 1])
    ax_t = fig.add_subplot(gs[2, :])
    ops = sorted({c["op"] for c in cells})
    for op in ops:
        mine = sorted((c for c in cells if c["op"] == op), key=lambda c: (c["m"], c.get("repeat", 0)))
        ms = [c["m"] for c in mine]
        ax_clk.plot(ms, [c.get("clock_mhz") or float("nan") for c in mine], "o-", label=op)
        ax_pw.plot(ms, [c.get("power_w") or float("nan") for c in mine], "o-", label=op)
    boost = gpu.get("max_sm_mhz") or gpu.get("catalog_boost_mhz")
    if boost:
        ax_clk.axhline(boost, color="gray", ls="--", lw=1, label=f"max clock {boost:.0f} MHz")
    if gpu.get("power_limit_w"):
        ax_pw.axhline(gpu["power_limit_w"], color="gray", ls="--", lw=1,
                      label=f"power limit {gpu['power_limit_w']:.0f} W")
    for ax, title, unit in ((ax_clk, "SM clock (settled median) vs M", "MHz"),
                            (ax_pw, "board power (settled median) vs M", "W")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens M")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ops:
            ax.legend(fontsize=8)

    def scatter(ax: Any, rows: list[dict], mape_: dict | None, title: str, unit: float, ulabel: str) -> None:
        lo, hi = float("inf"), 0.0
        for src, (color, marker) in SRC_STYLE.items():
            pts = [(c["time_s"] * unit, c["pred"][src]["time_s"] * unit) for c in rows if src in c.get("pred", {})]
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            m = (mape_ or {}).get(src)
            ax.scatter(xs, ys, s=18, c=color, marker=marker, alpha=0.75,
                       label=f"{src} clock" + (f" (MAPE {m:.1f}%)" if m is not None else ""))
            lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
        if hi > 0:
            ax.plot([lo, hi], [lo, hi], color="gray", lw=1)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.legend(fontsize=8)
        ax.set_xlabel(f"measured ({ulabel})")
        ax.set_ylabel(f"predicted ({ulabel})")
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")

    scatter(ax_gemm, cells, doc.get("gemm", {}).get("mape"), "projection GEMMs: predicted vs measured", 1e6, "us")
    step_mape = doc.get("steps", {}).get("mape", {})
    graph_rows = [c for c in steps if c["mode"] == "graph"] or steps
    mode = graph_rows[0]["mode"] if graph_rows else "graph"
    scatter(ax_step, graph_rows, step_mape.get(mode),
            f"decoder steps ({doc.get('steps', {}).get('layers', '?')} layers, {mode}): predicted vs measured",
            1e3, "ms")
    other = [c for c in steps if c["mode"] != mode and "live" in c.get("pred", {})]
    if other:
        ax_step.scatter([c["time_s"] * 1e3 for c in other], [c["pred"]["live"]["time_s"] * 1e3 for c in other],
                        s=26, facecolors="none", edgecolors="tab:blue",
                        label=f"{other[0]['mode']}: {_fmt_mape(step_mape.get(other[0]['mode']))}")
        ax_step.legend(fontsize=8)
    tr = doc.get("clock_trace", {})
    if tr.get("t_s"):
        ax_t.plot(tr["t_s"], tr["sm_mhz"], lw=0.8, color="tab:blue", label="SM clock")
        ax_t.set_ylabel("MHz")
        ax2 = ax_t.twinx()
        ax2.plot(tr["t_s"], [p if p is not None else float("nan") for p in tr["power_w"]], lw=0.8,
                 color="tab:red", alpha=0.6, label="power")
        ax2.set_ylabel("W")
        for c in steps[:1]:
            ax_t.axvline(c["t_start_s"], color="k", ls=":", lw=1)
            ax_t.text(c["t_start_s"], ax_t.get_ylim()[1], " steps", va="top", fontsize=8)
    ax_t.set_xlabel("time since start (s)")
    ax_t.set_title("NVML SM clock and power over the run" if not doc.get("dry_run")
                   else "replayed clock over the run (dry run: synthetic)")
    ax_t.grid(alpha=0.3)
    head = (f"m2live probe ({doc.get('mode')}) on {gpu.get('name')} — {doc.get('date', '')[:10]}, "
            f"torch {doc.get('torch')}, driver {gpu.get('driver') or 'n/a'}")
    sub = f"GEMM MAPE: {_fmt_mape(doc.get('gemm', {}).get('mape'))}"
    if step_mape:
        sub += "   |   steps MAPE " + "; ".join(f"{m}: {_fmt_mape(v)}" for m, v in step_mape.items())
    if not doc.get("complete", True):
        sub += "   [partial]"
    fig.suptitle(head + "\n" + sub, fontsize=11)
    out = Path(path)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
