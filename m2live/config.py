"""Plugin configuration: ``M2LIVE_*`` environment variables and/or a JSON or TOML file named by ``M2LIVE_CONFIG``.

The file uses the field names below (``slo_ms = 40``, ``prom_port = 9500``, ...) or the environment names
(``M2LIVE_SLO_MS``); environment variables win over the file. Every option, its variable and its default is
listed in ``OPTIONS`` (the README table is generated from it: ``python -m m2live.config``).
"""

from __future__ import annotations

import difflib
import json
import os
import socket
import tomllib
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from . import limits


class ConfigError(ValueError):
    """An invalid configuration value (one clear line)."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

# field -> (environment variable, type, default text for the README, one-line help)
OPTIONS: dict[str, tuple[str, str, str, str]] = {
    "enable": ("M2LIVE_ENABLE", "bool", "0", "turn the plugin on: the general plugin makes vLLM use the m2live "
               "scheduler (same as `--scheduler-cls vllm_hooks.scheduler:auto`)"),
    "gpu": ("M2LIVE_GPU", "str", "NVML name of GPU 0; `cpu` device without a GPU",
            "device to predict for (NVML name or alias, e.g. `NVIDIA H100 80GB HBM3`, `h100-sxm`, `cpu`)"),
    "gpu_index": ("M2LIVE_GPU_INDEX", "int", "first of `CUDA_VISIBLE_DEVICES`, else local data-parallel "
                  "rank × TP", "NVML index of the GPU whose clock is sampled"),
    "model": ("M2LIVE_MODEL", "str", "vLLM's own model config (hf_config)",
              "model shape override: preset name or path to a HF config.json / model directory"),
    "slo_ms": ("M2LIVE_SLO_MS", "float", "unset (admission off)", "step-latency SLO in ms; setting it turns "
               "admission control on"),
    "slo_margin": ("M2LIVE_SLO_MARGIN", "float", "0.1", "safety margin of the admission controller "
                   "(fraction of the SLO kept free)"),
    "admission": ("M2LIVE_ADMISSION", "bool", "1 when an SLO is set", "admission control on/off (needs an SLO)"),
    "prom_enable": ("M2LIVE_PROM", "bool", "1", "serve Prometheus metrics"),
    "prom_host": ("M2LIVE_PROM_HOST", "str", "127.0.0.1", "Prometheus exporter bind address"),
    "prom_port": ("M2LIVE_PROM_PORT", "int", "9400", "Prometheus exporter port; data-parallel engine i uses "
                  "port + i"),
    "mqtt_url": ("M2LIVE_MQTT_URL", "str", "unset (MQTT off)", "MQTT broker, e.g. `mqtt://127.0.0.1:1883` "
                 "(`mqtts://` for TLS)"),
    "mqtt_instance": ("M2LIVE_MQTT_INSTANCE", "str", "<hostname>-<engine>", "instance name in the topics "
                      "`m2live/<instance>/...`"),
    "mqtt_username": ("M2LIVE_MQTT_USERNAME", "str", "unset", "MQTT user name"),
    "mqtt_password": ("M2LIVE_MQTT_PASSWORD", "str", "unset", "MQTT password"),
    "mqtt_tls_ca": ("M2LIVE_MQTT_TLS_CA", "str", "unset", "CA bundle for MQTT over TLS"),
    "mqtt_tls_cert": ("M2LIVE_MQTT_TLS_CERT", "str", "unset", "client certificate for MQTT over TLS"),
    "mqtt_tls_key": ("M2LIVE_MQTT_TLS_KEY", "str", "unset", "client key for MQTT over TLS"),
    "mqtt_control": ("M2LIVE_MQTT_CONTROL", "bool", "0", "accept SLO / admission changes on "
                     "`m2live/<instance>/control` (off: the topic is not even subscribed; lock it with broker "
                     "ACLs when on)"),
    "mqtt_control_retained": ("M2LIVE_MQTT_CONTROL_RETAINED", "bool", "0", "also apply a *retained* control "
                              "message found at connect (off: only messages published while connected count)"),
    "trace": ("M2LIVE_TRACE", "str", "unset (no trace)", "JSONL file with one record per step "
              "(data-parallel engine i > 0 writes `<stem>.dp<i><suffix>`)"),
    "calibration": ("M2LIVE_CALIBRATION", "str", "unset (the architecture's constants)",
                    "this GPU's calibration JSON (`m2live calibrate fit`): predictions, admission and exporters "
                    "use its constants; refused, with a warning, for another GPU"),
    "sample_ms": ("M2LIVE_SAMPLE_MS", "float", "20", "clock sampling period in ms (10-50 recommended)"),
    "engine": ("M2LIVE_ENGINE", "str", "data-parallel rank (`0`)", "engine label on metrics and records"),
    "residual_window": ("M2LIVE_RESIDUAL_WINDOW", "int", "256", "steps in the rolling residual statistics"),
    "queue_size": ("M2LIVE_QUEUE_SIZE", "int", "4096",
                   "bounded queues of the record thread and the trace writer (drops are counted)"),
    "fault": ("M2LIVE_FAULT", "str", "unset", "test only: `predict` or `predict:N` makes the predictor raise "
              "(every N-th step) to prove hook errors are contained"),
    "device_scale": ("M2LIVE_DEVICE_SCALE", "float", "1", "test only: multiplies the device's FLOP/s and bandwidth "
                     "(the CPU device's fixed costs by its inverse) — a deliberately wrong prior that the online "
                     "correction must rescue (e.g. 0.01 or 100)"),
}


@dataclass
class M2liveConfig:
    enable: bool = False
    gpu: str | None = None
    gpu_index: int | None = None
    model: str | None = None
    slo_ms: float | None = None
    slo_margin: float = 0.1
    admission: bool | None = None  # None: on iff an SLO is set
    prom_enable: bool = True
    prom_host: str = "127.0.0.1"
    prom_port: int = 9400
    mqtt_url: str | None = None
    mqtt_instance: str | None = None
    mqtt_username: str | None = None
    mqtt_password: str | None = None
    mqtt_tls_ca: str | None = None
    mqtt_tls_cert: str | None = None
    mqtt_tls_key: str | None = None
    mqtt_control: bool = False
    mqtt_control_retained: bool = False
    trace: str | None = None
    calibration: str | None = None  # path of a calibration JSON (m2live calibrate fit)
    sample_ms: float = 20.0
    engine: str | None = None  # None: the data-parallel rank
    residual_window: int = 256
    queue_size: int = 4096
    fault: str | None = None
    device_scale: float = 1.0  # test only: scales the device prior (see OPTIONS)
    source: list[str] = field(default_factory=list)  # where values came from (file path, "env")
    warnings: list[str] = field(default_factory=list)  # e.g. unknown M2LIVE_* variables (closest known named)

    # --- derived ----------------------------------------------------------------------------------
    @property
    def admission_on(self) -> bool:
        if self.slo_ms is None:
            return False
        return True if self.admission is None else self.admission

    @property
    def fault_every(self) -> int:
        """0: no fault injection; N: the predictor raises on every N-th step."""
        if not self.fault:
            return 0
        kind, _, n = self.fault.partition(":")
        return int(n) if n else 1

    def for_engine(self, index: int) -> M2liveConfig:
        """This config as data-parallel engine ``index`` sees it (label, port, trace path, instance)."""
        c = replace(self, source=list(self.source), warnings=list(self.warnings))
        if c.engine is None:
            c.engine = str(index)
        if index:
            c.prom_port = self.prom_port + index
            if c.trace:
                p = Path(c.trace)
                c.trace = str(p.with_name(f"{p.stem}.dp{index}{p.suffix}"))
        if c.mqtt_instance is None:
            c.mqtt_instance = f"{_hostname()}-{c.engine}"
        return c

    # --- construction -----------------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> M2liveConfig:
        env = os.environ if environ is None else environ
        raw: dict[str, object] = {}
        sources: list[str] = []
        path = env.get("M2LIVE_CONFIG")
        if path:
            raw.update(_read_file(path))
            sources.append(path)
        by_env = {v[0]: k for k, v in OPTIONS.items()}
        from_env = {by_env[k]: v for k, v in env.items() if k in by_env}
        if from_env:
            sources.append("env")
        raw.update(from_env)
        cfg = cls.from_dict(raw, sources)
        cfg.warnings.extend(unknown_env(env))
        return cfg

    @classmethod
    def from_dict(cls, raw: Mapping[str, object], sources: list[str] | None = None) -> M2liveConfig:
        kw: dict[str, object] = {}
        names = {f.name for f in fields(cls)} - {"source", "warnings"}
        by_env = {v[0]: k for k, v in OPTIONS.items()}
        for key, value in raw.items():
            name = by_env.get(key, key)
            if name not in names:
                near = _closest(str(key), [*names, *by_env])
                hint = f"did you mean {near!r}? " if near else ""
                raise ConfigError(f"unknown m2live option {key!r} ({hint}known: {', '.join(sorted(names))})")
            kw[name] = _convert(name, value)
        cfg = cls(**kw, source=list(sources or []))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Every number within its bound in ``m2live.limits`` (the MQTT control uses the same bounds)."""
        L = limits
        if self.slo_ms is not None:
            L.SLO_MS.check(self.slo_ms, "M2LIVE_SLO_MS", ConfigError)
        L.SLO_MARGIN.check(self.slo_margin, "M2LIVE_SLO_MARGIN", ConfigError)
        L.PORT.check(self.prom_port, "M2LIVE_PROM_PORT (a TCP port)", ConfigError)
        L.SAMPLE_MS.check(self.sample_ms, "M2LIVE_SAMPLE_MS", ConfigError)
        L.RESIDUAL_WINDOW.check(self.residual_window, "M2LIVE_RESIDUAL_WINDOW", ConfigError)
        L.QUEUE_SIZE.check(self.queue_size, "M2LIVE_QUEUE_SIZE", ConfigError)
        if self.gpu_index is not None:
            L.GPU_INDEX.check(self.gpu_index, "M2LIVE_GPU_INDEX", ConfigError)
        if self.mqtt_url is not None and not self.mqtt_url.startswith(("mqtt://", "mqtts://", "tcp://")):
            raise ConfigError(f"M2LIVE_MQTT_URL must look like mqtt://HOST:PORT, got {mask_url(self.mqtt_url)!r}")
        if self.calibration:
            from .calibrate import CalibrationError, load

            try:
                load(self.calibration)
            except CalibrationError as e:
                raise ConfigError(f"M2LIVE_CALIBRATION: {e}") from None
        if not (1e-6 <= self.device_scale <= 1e6):
            raise ConfigError(f"M2LIVE_DEVICE_SCALE must be within [1e-06, 1e+06], got {self.device_scale}")
        if self.fault:
            kind, _, n = self.fault.partition(":")
            if kind != "predict" or (n and not (n.isdigit() and len(n) < 10 and int(n) > 0)):
                raise ConfigError(f"M2LIVE_FAULT must be 'predict' or 'predict:N', got {self.fault!r}")

    def describe(self) -> dict[str, object]:
        """Every option with its effective value, secrets masked (``m2live config check``)."""
        out: dict[str, object] = {}
        for name in OPTIONS:
            v = getattr(self, name, None)
            if name in SECRET_OPTIONS and v:
                v = "***"
            elif name == "mqtt_url" and v:
                v = mask_url(str(v))
            out[name] = v
        return out


SECRET_OPTIONS = ("mqtt_password",)


def mask_url(url: str) -> str:
    """``url`` with any user:password part replaced by ``***`` (for logs and error messages)."""
    try:
        u = urllib.parse.urlsplit(url)
        netloc = u.netloc
    except ValueError:
        netloc = ""
    if "@" in netloc:
        return url.replace(netloc, "***@" + netloc.rsplit("@", 1)[1], 1)
    if "@" in url:  # not parseable as a URL, but something before an @ may still be a secret
        return "***@" + url.rsplit("@", 1)[1]
    return url


# M2LIVE_* variables that are not plugin options but are read elsewhere (tests, tools)
OTHER_VARIABLES = ("M2LIVE_CONFIG", "M2LIVE_SNAPSHOT")


def _closest(name: str, known: list[str]) -> str | None:
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return near[0] if near else None


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """One line per ``M2LIVE_*`` variable that no option reads, naming the closest known variable."""
    known = [v[0] for v in OPTIONS.values()] + list(OTHER_VARIABLES)
    out = []
    for k in sorted(environ):
        if k.startswith("M2LIVE_") and k not in known:
            near = _closest(k, known)
            out.append(f"unknown variable {k} is ignored" + (f" (did you mean {near}?)" if near else ""))
    return out


def _hostname() -> str:
    try:
        return socket.gethostname().split(".")[0] or "m2live"
    except OSError:
        return "m2live"


def _read_file(path: str) -> dict[str, object]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"M2LIVE_CONFIG: cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"M2LIVE_CONFIG: {path} is not a UTF-8 text file (JSON or TOML expected)") from None
    if "\x00" in text:
        raise ConfigError(f"M2LIVE_CONFIG: {path} is a binary file (JSON or TOML expected)")
    try:
        if p.suffix.lower() == ".toml":
            data = tomllib.loads(text)
        elif p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                data = tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"M2LIVE_CONFIG: {path} is neither valid JSON nor TOML ({e})") from None
    except RecursionError:
        raise ConfigError(f"M2LIVE_CONFIG: {path} is nested too deeply to be a table of options") from None
    if isinstance(data, dict) and isinstance(data.get("m2live"), dict):
        data = data["m2live"]  # allow a [m2live] table
    if not isinstance(data, dict):
        raise ConfigError(f"M2LIVE_CONFIG: {path} must hold a table/object of options")
    return data


def _convert(name: str, value: object) -> object:
    env, kind, _, _ = OPTIONS[name]
    if value is None:
        return None
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
        s = str(value).strip().lower()
        if s in _TRUE:
            return True
        if s in _FALSE:
            return False
        raise ConfigError(f"{env} must be 0/1/true/false, got {value!r}")
    if kind == "int":
        if isinstance(value, bool):
            raise ConfigError(f"{env} must be an integer, got {value!r}")
        try:
            f = float(str(value).strip())
            if not f.is_integer():
                raise ValueError
            return int(f)
        except ValueError:
            raise ConfigError(f"{env} must be an integer, got {value!r}") from None
    if kind == "float":
        if isinstance(value, bool):
            raise ConfigError(f"{env} must be a number, got {value!r}")
        s = str(value).strip()
        if name == "slo_ms" and s.lower() in ("", "none", "off"):
            return None
        try:
            f = float(s)
        except ValueError:
            raise ConfigError(f"{env} must be a number, got {value!r}") from None
        if f != f or f in (float("inf"), float("-inf")):
            raise ConfigError(f"{env} must be finite, got {value!r}")
        return f
    s = str(value).strip()
    return s or None


def readme_table() -> str:
    """The README's option table (markdown)."""
    lines = ["| Variable | Default | Meaning |", "|---|---|---|"]
    lines.append("| `M2LIVE_CONFIG` | unset | JSON or TOML file with the options below (field names or "
                 "variable names); environment variables win |")
    for _, (env, _, default, help_text) in OPTIONS.items():
        lines.append(f"| `{env}` | {default} | {help_text} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(readme_table())
