"""Check the plugin's effective configuration (M2LIVE_CONFIG file + M2LIVE_* environment) and print it.

    m2live config check [--json]

Prints every option with its value and where the values came from (secrets masked); exit 2 with one line on
stderr when the configuration would not start the plugin as written: a bad value, an unknown GPU or model name,
a missing TLS file, or an ``M2LIVE_*`` variable no option reads (named with the closest known one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.parse
from pathlib import Path

from ..config import M2liveConfig, mask_url


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("check",), help="check: validate and print the effective configuration")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def problems(cfg: M2liveConfig) -> list[str]:
    """What would stop (or silently change) the plugin beyond the per-field bounds ``validate`` checks."""
    out = list(cfg.warnings)
    if cfg.gpu and cfg.gpu.strip().lower() not in ("cpu", "cpu-device"):
        from ..hardware import UnknownGpuError, get_gpu

        try:
            get_gpu(cfg.gpu)
        except UnknownGpuError as e:
            out.append(f"M2LIVE_GPU: {str(e).splitlines()[0]}")
    if cfg.model:
        from ..shapes import ModelShapeError, get_model

        try:
            get_model(cfg.model)
        except (ModelShapeError, OSError, ValueError) as e:
            out.append(f"M2LIVE_MODEL: {str(e).splitlines()[0]}")
    if cfg.mqtt_url:
        try:
            u = urllib.parse.urlsplit(cfg.mqtt_url)  # raises on a broken IPv6 literal ('mqtt://[::1')
            u.port  # noqa: B018 - raises on a bad port
            ok = bool(u.hostname)
        except ValueError:
            ok = False
        if not ok:
            out.append(f"M2LIVE_MQTT_URL {mask_url(cfg.mqtt_url)!r}: expected mqtt://HOST[:PORT]")
    for env, path in (("M2LIVE_MQTT_TLS_CA", cfg.mqtt_tls_ca), ("M2LIVE_MQTT_TLS_CERT", cfg.mqtt_tls_cert),
                      ("M2LIVE_MQTT_TLS_KEY", cfg.mqtt_tls_key)):
        if path and not os.path.isfile(path):
            out.append(f"{env}: no such file {path}")
    if cfg.mqtt_control_retained and not cfg.mqtt_control:
        out.append("M2LIVE_MQTT_CONTROL_RETAINED has no effect without M2LIVE_MQTT_CONTROL=1")
    if cfg.admission and cfg.slo_ms is None:
        out.append("M2LIVE_ADMISSION=1 has no effect without M2LIVE_SLO_MS (the SLO admission keeps steps under)")
    if cfg.calibration and cfg.gpu and cfg.gpu.strip().lower() not in ("cpu", "cpu-device"):
        from ..calibration_file import CalibrationError, load
        from ..hardware import UnknownGpuError

        try:
            load(cfg.calibration).check_gpu(cfg.gpu)
        except (CalibrationError, UnknownGpuError) as e:
            out.append(f"M2LIVE_CALIBRATION: {str(e).splitlines()[0]}")
    if cfg.trace and (why := _unwritable(cfg.trace)):
        out.append(f"M2LIVE_TRACE {cfg.trace}: {why}")
    if not _HOST.fullmatch(cfg.prom_host or ""):
        out.append(f"M2LIVE_PROM_HOST {cfg.prom_host!r}: not an IP address or host name to bind to")
    return out


# an IPv4 / IPv6 literal or a DNS name (letters, digits, '-', '.', ':' and '%' of a scoped IPv6 address)
_HOST = re.compile(r"[A-Za-z0-9.:%\-]+|\[[0-9A-Fa-f:.%]+\]")


def _unwritable(path: str) -> str | None:
    """Why the trace file at ``path`` could not be opened for appending (None: it can): a directory there, or
    no writable directory to create it in (the plugin creates missing parent folders)."""
    p = Path(path)
    if p.is_dir():
        return "is a directory (give a file name)"
    if p.exists():
        return None if os.access(p, os.W_OK) else "not writable"
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot create it under {parent} (not writable)"


def device_here(cfg: M2liveConfig) -> tuple[str, str | None]:
    """The device the plugin would predict for on this machine and why — M2LIVE_GPU's, else what NVML names for
    the engine's first GPU (M2LIVE_GPU_INDEX, else the first of CUDA_VISIBLE_DEVICES, else 0; a data-parallel
    engine's rank moves it on), the catalog's row or a GPU the catalog lacks read from its driver, else — no
    NVIDIA driver — the CPU device of a CPU engine — and the problem that would switch the plugin off, if any
    (M2LIVE_GPU's own problems are ``problems``')."""
    from ..device_spec import catalog_or_device, is_derived
    from ..hardware import UnknownGpuError, get_gpu
    from ..live.device import EngineInfo, local_gpu_index
    from ..telemetry import TelemetryError, nvml_device_name

    if cfg.gpu:
        if cfg.gpu.strip().lower() in ("cpu", "cpu-device"):
            return "the CPU device (M2LIVE_GPU)", None
        try:
            return f"{get_gpu(cfg.gpu).name} (M2LIVE_GPU)", None
        except UnknownGpuError:
            return "none (M2LIVE_GPU names no GPU m2live knows: see the error below)", None
    index = cfg.gpu_index if cfg.gpu_index is not None else local_gpu_index(EngineInfo(model_shape=None))
    try:
        name = nvml_device_name(index)
    except TelemetryError as e:
        return f"the CPU device, for a CPU engine (NVML: {e}; a CUDA engine would need M2LIVE_GPU)", None
    try:
        spec = catalog_or_device(name, index)
    except ValueError as e:
        return "none", f"NVML GPU {index}: {e}; the plugin would switch itself off (set M2LIVE_GPU)"
    how = "read from its driver: not in the catalog" if is_derived(spec) else "the catalog's"
    problem = None
    if cfg.calibration:
        from ..calibration_file import CalibrationError, load

        try:
            load(cfg.calibration).check_gpu(spec)
        except (CalibrationError, UnknownGpuError) as e:
            problem = f"M2LIVE_CALIBRATION: {str(e).splitlines()[0]}"
    return f"{spec.name} (NVML GPU {index}; {how})", problem


def run(args: argparse.Namespace) -> int:
    cfg = M2liveConfig.from_env()  # a bad value raises ConfigError: one line, exit 2 (m2live.cli)
    issues = problems(cfg)
    shown = cfg.describe()
    device, trouble = device_here(cfg)
    if trouble:
        issues.append(trouble)
    if args.json:
        print(json.dumps({"config": shown, "source": cfg.source, "device": device, "problems": issues}, indent=2))
    else:
        print(f"m2live configuration from {', '.join(cfg.source) or 'defaults'}:")
        width = max(len(k) for k in shown)
        for k, v in shown.items():
            print(f"  {k:<{width}}  {'unset' if v is None else v}")
        print(f"device here: {device}")
    for line in issues:
        print(f"m2live config: error: {line}", file=sys.stderr)
    return 2 if issues else 0
