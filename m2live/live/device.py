"""What the monitor predicts for: the device (a GPU of the catalog, or the CPU device measured here), the clock
that feeds f_clk, the model, and the predictor with this GPU's calibration when one is configured.

Which device: ``M2LIVE_GPU`` when set (``cpu`` / ``cpu-device``: the CPU device), else the name NVML gives for a
CUDA engine's GPU, else the CPU device. Which clock: a source handed in (tests), else the first that opens of
NVML (a GPU) or cpufreq (the CPU device) — ``m2live.telemetry.choose_clock_source`` decides — else the
power-cap forecast, and ``clock_why`` says which and why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ..config import M2liveConfig
from ..device_spec import catalog_or_device, is_derived
from ..efficiency import ArchConstants
from ..hardware import GpuSpec, get_gpu
from ..limits import digits
from ..predictor import Predictor, has_power_model
from ..quantization import WeightFormat, kv_cache_bytes, kv_cache_dtype_of
from ..shapes import ModelShape, get_model
from ..telemetry import ClockSampler, ClockSource, choose_clock_source

log = logging.getLogger("m2live")


@dataclass
class EngineInfo:
    """What the plugin learns from vLLM's own config."""

    model_shape: ModelShape | None
    model_name: str = ""
    tp: int = 1
    engine_index: int = 0
    device: str = "cpu"  # vLLM platform device type: "cuda", "cpu", ...
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    local_rank: int = 0  # data-parallel rank on this node (picks the GPU whose clock is sampled)
    # the engine's compilation_config.pass_config.fuse_allreduce_rms (None: not reported, m2live's default)
    allreduce_fusion: bool | None = None
    # the linear layers' weights as the engine runs them (its quantization config; bf16 when unquantised)
    weights: WeightFormat = WeightFormat()
    kv_cache_dtype: str = "auto"  # the engine's cache_config.cache_dtype ("auto": the model's dtype)


@dataclass
class Device:
    """The device predicted for and its live clock (``sampler`` None: the forecast)."""

    spec: GpuSpec
    sampler: ClockSampler | None
    clock_source_name: str  # "nvml", "cpufreq", ..., or "forecast"
    clock_why: str  # one line: which clock and why
    constants: ArchConstants | None = None  # the CPU device's measured call costs and attention efficiencies
    prior_check: Any = None  # the CPU device: re-measure when the first steps disagree with it by > 3x

    @property
    def has_power_model(self) -> bool:
        """Whether the clock forecast has a power model here (a device without one forecasts boost)."""
        return has_power_model(self.spec.arch)


def model_shape(cfg: M2liveConfig, info: EngineInfo) -> ModelShape:
    """``M2LIVE_MODEL`` when set, else the shape vLLM's model config gave."""
    shape = get_model(cfg.model) if cfg.model else info.model_shape
    if shape is None:
        raise ValueError("no model shape: vLLM's model config was unusable and M2LIVE_MODEL is not set")
    return shape


def local_gpu_index(info: EngineInfo) -> int:
    """NVML index of this engine's (first) GPU. NVML ignores CUDA_VISIBLE_DEVICES, so map through it;
    without it, local data-parallel engine i drives GPUs i*tp .. i*tp+tp-1."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    first = cvd.split(",")[0].strip() if cvd else ""
    if digits(first):
        return int(first)
    return max(0, info.local_rank) * max(1, info.tp)


def choose_device(cfg: M2liveConfig, info: EngineInfo, shape: ModelShape,
                  clock_source: ClockSource | None = None) -> Device:
    """The device and its clock sampler (started); see the module docstring for the order of choices."""
    from .. import cpu_device

    want = (cfg.gpu or "").strip()
    cpu_wanted = want.lower() in ("cpu", "cpu-device")
    nvml = None
    idx: int | None = None  # the NVML device that named the GPU, when NVML did
    if clock_source is None and not cpu_wanted and (want or info.device == "cuda"):
        idx = cfg.gpu_index if cfg.gpu_index is not None else local_gpu_index(info)
        nvml = choose_clock_source(("nvml",), idx)
        if nvml.source is not None and not want:
            want = nvml.source.device_name  # type: ignore[attr-defined]
    nvml_error = nvml.failed.get("nvml") if nvml is not None else None
    if not want and info.device == "cuda":
        raise ValueError(f"cannot tell which GPU this is (NVML: {nvml_error}); set M2LIVE_GPU")
    constants = prior = None
    choice = nvml
    if not want or cpu_wanted:
        dtype = "fp32" if shape.dtype_bytes == 4 else "bf16"  # measured on its shapes, as vLLM resolved them
        spec, constants, key = cpu_device.cpu_device_model(shape, dtype, cfg.device_scale)
        if cfg.device_scale == 1.0:  # a prior scaled on purpose (test knob) must not drop the measurement
            prior = cpu_device.PriorCheck(key, shape, dtype)
        choice = choose_clock_source(("cpufreq",)) if clock_source is None else None
        forecast = f"forecast (no clock telemetry: cpufreq unavailable: {choice.failed.get('cpufreq')})" \
            if choice is not None else ""
    else:
        named = bool((cfg.gpu or "").strip())  # M2LIVE_GPU: the catalog's, never read from the device
        spec = cpu_device.scale_spec(_catalog_or_device(want, None if named else idx), cfg.device_scale)
        forecast = f"forecast (NVML unavailable: {nvml_error or 'not a CUDA engine'})"
    if clock_source is not None:
        source, why = clock_source, f"{clock_source.name} (given)"
    elif choice is not None and choice.source is not None:
        source, why = choice.source, choice.why
    else:
        source, why = None, forecast
    sampler = ClockSampler(source, period_s=cfg.sample_ms / 1000.0).start() if source is not None else None
    return Device(spec, sampler, source.name if source is not None else "forecast", why, constants, prior)


def _catalog_or_device(name: str, nvml_index: int | None) -> GpuSpec:
    """The catalog's row for ``name``; for a GPU NVML named that the catalog does not list (``nvml_index`` given),
    its spec read from the device (``device_spec``), with a warning that says so. A name the user set
    (M2LIVE_GPU: a catalog name or a GPU spec file) is looked up as given: a typo is an error, not a device to
    read."""
    if nvml_index is None:
        return get_gpu(name)
    spec = catalog_or_device(name, nvml_index)
    if is_derived(spec):
        log.warning("%s is not in m2live's GPU catalog: its datasheet terms were read from the device by NVML (%s); "
                    "predictions borrow the %s kernel family's constants — set M2LIVE_GPU to a catalog GPU to use "
                    "its datasheet instead", name, spec.source.split(": ", 1)[-1], spec.kernel_family)
    return spec


def load_calibration(cfg: M2liveConfig, gpu: GpuSpec, engine: str) -> tuple[str, dict[str, ArchConstants] | None]:
    """M2LIVE_CALIBRATION: this GPU's own constants for the predictor (and so admission and the metrics) — its
    keyword arguments, bf16 and fp8 (``Calibration.predictor_constants``) — with the label that says which;
    ``("none", None)`` without one. A calibration of another GPU, or a broken file,
    is refused with one warning: the architecture's constants are used and the info metric says ``none``."""
    if not cfg.calibration:
        return "none", None
    from ..calibrate import CalibrationError, load

    try:
        cal = load(cfg.calibration)
        cal.check_gpu(gpu)
    except CalibrationError as e:
        log.warning("engine %s: M2LIVE_CALIBRATION refused, predicting with the architecture's constants: %s",
                    engine, e)
        return "none", None
    return cal.label(), cal.predictor_constants()


def predicted_weights(info: EngineInfo, gpu: GpuSpec, engine: str) -> WeightFormat:
    """The weights' format the predictor prices: the engine's, unless fp8 on a device without fp8 tensor cores
    (the CPU device measures the engine's own kernels as they run, on bf16 shapes) — then bf16, said once."""
    w = info.weights
    if w.precision == "fp8" and not gpu.has_fp8:
        log.warning("engine %s: %s, but %s has no fp8 tensor cores: its linear layers are priced as bf16",
                    engine, w.why, gpu.name)
        return WeightFormat("bf16", "static", f"{w.why}; priced as bf16 on {gpu.name}")
    return w


def build_predictor(cfg: M2liveConfig, info: EngineInfo, shape: ModelShape, device: Device,
                    engine: str) -> tuple[Predictor, str]:
    """The predictor (a calibration's constants first, then the CPU device's measured ones, then the
    architecture's; the engine's weights format) and the calibration label."""
    label, calibrated = load_calibration(cfg, device.spec, engine)
    w = predicted_weights(info, device.spec, engine)
    return Predictor(device.spec, shape, tp=max(1, info.tp), **(calibrated or {"constants": device.constants}),
                     dtype=w.precision, act_scale=w.act_scale, allreduce_fusion=info.allreduce_fusion,
                     kv_cache_dtype=predicted_kv_cache(info, engine)), label


def predicted_kv_cache(info: EngineInfo, engine: str) -> str:
    """The engine's KV-cache dtype as the predictor prices it: fp8 by its bytes (one per element; the fp8-KV
    attention kernels' own efficiencies were never measured, the start-up log says so), a value m2live does not
    know as the model's dtype, with a warning."""
    try:
        kv = kv_cache_dtype_of(info.kv_cache_dtype)
    except ValueError:
        log.warning("engine %s: KV cache dtype %r is not one m2live knows: priced as the model's dtype", engine,
                    info.kv_cache_dtype)
        return "auto"
    if kv_cache_bytes(kv) == 1:
        log.info("engine %s: fp8 KV cache (%s): attention priced at one byte per cached element, with the 16-bit "
                 "kernels' efficiencies (no fp8-KV kernel was measured)", engine, kv)
    return kv
