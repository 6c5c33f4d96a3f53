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
and ``time.perf_counter`` timing, so the code is exercised in CI. ``--calibrate`` (``calibrate.py``) measures
the GPU's calibration plan instead and fits its calibration.

One concern per module: ``plan`` (what to measure), ``score`` (predictions, clock statistics, MAPE summaries),
``device`` (timing: CUDA events and graphs, or perf_counter), ``decoder`` (the torch Llama decoder), ``env``
(torch, the GPU, the clock sampler), ``output`` (the output directory, probe.json), ``gemms`` and ``steps``
(the two phases), ``kernels`` (each step's per-operator device times under torch.profiler), ``run`` (the
orchestration), ``plot`` (probe.png), ``calibrate`` (``--calibrate``).

torch, pynvml and matplotlib are imported inside functions: importing this package costs nothing.
"""

from ..validate import mape
from .calibrate import run_calibrate
from .decoder import TorchDecoder
from .device import ProbeError, _Device, load_torch
from .env import dry_run_readings
from .output import default_out_dir
from .plan import (
    DRY_GPU,
    DRY_MODEL,
    LLAMA_8B,
    M_DRY,
    M_FULL,
    M_QUICK,
    SCHEMA,
    STEPS_DRY,
    STEPS_GPU,
    ProbePlan,
    StepSpec,
    gemm_order,
    make_plan,
    ring_copies,
)
from .plot import SRC_STYLE, plot_probe
from .run import run_probe
from .score import CLOCK_EVENT_REASONS, clock_stats, gemm_predictions, reason_names

__all__ = [
    "CLOCK_EVENT_REASONS", "DRY_GPU", "DRY_MODEL", "LLAMA_8B", "M_DRY", "M_FULL", "M_QUICK", "SCHEMA",
    "SRC_STYLE", "STEPS_DRY", "STEPS_GPU", "ProbeError", "ProbePlan", "StepSpec", "TorchDecoder", "_Device",
    "clock_stats", "default_out_dir", "dry_run_readings", "gemm_order", "gemm_predictions", "load_torch",
    "make_plan", "mape", "plot_probe", "reason_names", "ring_copies", "run_calibrate", "run_probe",
]
