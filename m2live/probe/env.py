"""Where the probe runs: torch and the device, the catalog GPU it predicts for, and the clock (NVML through
``m2live.telemetry``, or a replayed synthetic droop in the dry run) sampled on its own thread."""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..device_spec import catalog_or_device
from ..hardware import GpuSpec, get_gpu
from ..telemetry import (
    ClockReading,
    ClockSampler,
    ClockSource,
    NvmlClockSource,
    ReplayClockSource,
    TelemetryError,
    nvml_device_info,
)
from .device import ProbeError, Rep, _Device, load_torch, settled
from .plan import DRY_GPU, ProbePlan
from .score import clock_stats


@dataclass
class Window:
    """A sustained run of back-to-back timed repetitions, split in half by time: the early half (clock still
    moving) and the settled half the results are read from."""

    reps: list[Rep]
    early: list[Rep]
    settled: list[Rep]
    t_start: float
    t_end: float
    stats: dict  # clock_stats over the settled half (the latest reading when the sampler had none there)
    early_stats: dict  # clock_stats over the early half

    def per_rep_s(self) -> list[float]:
        """Device seconds of each settled repetition."""
        return [dt for _, _, dt in self.settled]


@dataclass
class _Env:
    torch: Any
    dev: _Device
    spec: GpuSpec
    source: ClockSource
    sampler: ClockSampler
    gpu_info: dict = field(default_factory=dict)
    l2_bytes: float = 0.0

    def sustain(self, launch: Callable[[], Any], min_s: float, min_reps: int) -> Window:
        """Repeat ``launch`` for at least ``min_s`` and ``min_reps``, and read the clock over the settled half."""
        t_start = time.monotonic()
        reps = self.dev.repeat(launch, min_s, min_reps)
        t_end = time.monotonic()
        early, late, t_mid = settled(reps, t_start, t_end)
        readings = self.sampler.between(t_mid, t_end)
        if not readings:
            r, _ = self.sampler.latest()
            readings = [r] if r is not None else []
        return Window(reps, early, late, t_start, t_end, clock_stats(readings),
                      clock_stats(self.sampler.between(t_start, t_mid)))


def dry_run_readings(spec: GpuSpec, n: int = 40) -> list[ClockReading]:
    """A synthetic clock recording for the dry run: a droop from boost to 75 % and back, power rising towards
    the TDP with the software power cap flagged near the bottom."""
    out = []
    for i in range(n):
        x = 0.5 - 0.5 * math.cos(2 * math.pi * i / n)  # 0 → 1 → 0
        out.append(ClockReading(t=0.0, sm_mhz=round(spec.boost_mhz * (1 - 0.25 * x)), max_mhz=spec.boost_mhz,
                                power_w=0.2 * spec.tdp_w + 0.78 * spec.tdp_w * x, power_limit_w=spec.tdp_w,
                                event_reasons=0x4 if x > 0.8 else 0, temperature_c=40 + 30 * x))
    return out


def _nvml_info(torch: Any) -> dict:
    """NVML's view of torch's current CUDA device (matched by UUID), or ProbeError in one line."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        return nvml_device_info(str(getattr(props, "uuid", "") or ""), torch.cuda.current_device())
    except TelemetryError as e:
        raise ProbeError(f"{e}; the probe needs NVML (nvidia-ml-py) for the clock") from None


def _dry_env(torch: Any, gpu_override: str | None) -> tuple[_Device, GpuSpec, ClockSource, dict, float]:
    spec = get_gpu(gpu_override or DRY_GPU)
    info = {"name": f"CPU dry run ({platform.machine()})",
            "driver": None, "max_sm_mhz": spec.boost_mhz, "power_limit_w": spec.tdp_w}
    return _Device(torch, cuda=False), spec, ReplayClockSource(dry_run_readings(spec)), info, 0.0


def _gpu_env(torch: Any, gpu_override: str | None) -> tuple[_Device, GpuSpec, ClockSource, dict, float]:
    info = _nvml_info(torch)
    dev = _Device(torch, cuda=True)
    props = torch.cuda.get_device_properties(dev.device)
    try:  # a GPU outside the catalog: its terms read from the device (device_spec)
        spec = get_gpu(gpu_override) if gpu_override else catalog_or_device(info["name"], info["nvml_index"])
    except (KeyError, ValueError) as e:
        raise ProbeError(f"{e}; pass --gpu with the catalog name to predict for") from None
    try:
        source = NvmlClockSource(info["nvml_index"])
    except TelemetryError as e:
        raise ProbeError(f"no NVML clock: {e}") from None
    info.update({"spec_source": spec.source, "torch_name": props.name, "sms": props.multi_processor_count,
                 "memory_gb": props.total_memory / 1e9, "l2_bytes": getattr(props, "L2_cache_size", None),
                 "compute_capability": f"{props.major}.{props.minor}"})
    return dev, spec, source, info, max(spec.l2_bytes, float(info.get("l2_bytes") or 0))


def open_env(dry_run: bool, gpu_override: str | None, plan: ProbePlan) -> _Env:
    """torch, the device, the GPU to predict for, and a (not yet started) clock sampler sized for the plan."""
    torch = load_torch(dry_run)
    dev, spec, source, info, l2 = (_dry_env if dry_run else _gpu_env)(torch, gpu_override)
    history = int(4 * (plan.time_limit_s or 3600) / plan.sampler_period_s) + 1000
    sampler = ClockSampler(source, period_s=plan.sampler_period_s, history=min(history, 2_000_000))
    return _Env(torch=torch, dev=dev, spec=spec, source=source, sampler=sampler, gpu_info=info, l2_bytes=l2)
