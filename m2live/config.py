"""Plugin configuration: ``M2LIVE_*`` environment variables and/or a JSON or TOML file named by ``M2LIVE_CONFIG``.

The file uses the field names below (``slo_ms = 40``, ``prom_port = 9500``, ...) or the environment names
(``M2LIVE_SLO_MS``); environment variables win over the file. Every option, its variable and its default is
written once, as a field of ``M2liveConfig`` (its default, its variable and its doc); ``OPTIONS`` and the README
table (``python -m m2live.config``) are generated from the fields.
"""

from __future__ import annotations

import difflib
import json
import os
import socket
import tomllib
import urllib.parse
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from . import limits


class ConfigError(ValueError):
    """An invalid configuration value (one clear line)."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def option(default: object, env: str, doc: str, unset: str | None = None) -> Any:
    """A plugin option: its default (written once, here), its ``M2LIVE_*`` variable, its one-line doc (the README
    table's Meaning) and, for a default of None, what unset means (the README table's Default)."""
    return field(default=default, metadata={"env": env, "doc": doc, "unset": unset})


@dataclass
class M2liveConfig:
    """The plugin's options; each field's metadata names its variable and holds its doc (``OPTIONS``,
    ``readme_table``). Values are checked by ``validate`` against the bounds in ``m2live.limits``."""

    enable: bool = option(False, "M2LIVE_ENABLE", "turn the plugin on: the general plugin makes vLLM use the m2live "
                          "scheduler (same as `--scheduler-cls vllm_hooks.scheduler:auto`)")
    gpu: str | None = option(None, "M2LIVE_GPU", "device to predict for (NVML name or alias, e.g. `NVIDIA H100 80GB "
                             "HBM3`, `h100-sxm`, `cpu`)", unset="NVML name of GPU 0; `cpu` device without a GPU")
    gpu_index: int | None = option(None, "M2LIVE_GPU_INDEX", "NVML index of the GPU whose clock is sampled",
                                   unset="first of `CUDA_VISIBLE_DEVICES`, else local data-parallel rank × TP")
    model: str | None = option(None, "M2LIVE_MODEL", "model shape override: preset name or path to a HF config.json "
                               "/ model directory", unset="vLLM's own model config (hf_config)")
    slo_ms: float | None = option(None, "M2LIVE_SLO_MS", "step-latency SLO in ms; setting it turns admission "
                                  "control on", unset="unset (admission off)")
    slo_margin: float = option(0.1, "M2LIVE_SLO_MARGIN", "safety margin of the admission controller (fraction of "
                               "the SLO kept free)")
    admission: bool | None = option(None, "M2LIVE_ADMISSION", "admission control on/off (needs an SLO)",
                                    unset="1 when an SLO is set")
    prom_enable: bool = option(True, "M2LIVE_PROM", "serve Prometheus metrics")
    prom_host: str = option("127.0.0.1", "M2LIVE_PROM_HOST", "Prometheus exporter bind address")
    prom_port: int = option(9400, "M2LIVE_PROM_PORT", "Prometheus exporter port; data-parallel engine i uses "
                            "port + i")
    mqtt_url: str | None = option(None, "M2LIVE_MQTT_URL", "MQTT broker, e.g. `mqtt://127.0.0.1:1883` (`mqtts://` "
                                  "for TLS)", unset="unset (MQTT off)")
    mqtt_instance: str | None = option(None, "M2LIVE_MQTT_INSTANCE", "instance name in the topics "
                                       "`m2live/<instance>/...`", unset="<hostname>-<engine>")
    mqtt_username: str | None = option(None, "M2LIVE_MQTT_USERNAME", "MQTT user name")
    mqtt_password: str | None = option(None, "M2LIVE_MQTT_PASSWORD", "MQTT password")
    mqtt_tls_ca: str | None = option(None, "M2LIVE_MQTT_TLS_CA", "CA bundle for MQTT over TLS")
    mqtt_tls_cert: str | None = option(None, "M2LIVE_MQTT_TLS_CERT", "client certificate for MQTT over TLS")
    mqtt_tls_key: str | None = option(None, "M2LIVE_MQTT_TLS_KEY", "client key for MQTT over TLS")
    mqtt_control: bool = option(False, "M2LIVE_MQTT_CONTROL", "accept SLO / admission changes on "
                                "`m2live/<instance>/control` (off: the topic is not even subscribed; lock it with "
                                "broker ACLs when on)")
    mqtt_control_retained: bool = option(False, "M2LIVE_MQTT_CONTROL_RETAINED", "also apply a *retained* control "
                                         "message found at connect (off: only messages published while connected "
                                         "count)")
    trace: str | None = option(None, "M2LIVE_TRACE", "JSONL file with one record per step (data-parallel engine "
                               "i > 0 writes `<stem>.dp<i><suffix>`)", unset="unset (no trace)")
    calibration: str | None = option(None, "M2LIVE_CALIBRATION", "this GPU's calibration JSON (`m2live calibrate "
                                     "fit`): predictions, admission and exporters use its constants; refused, with "
                                     "a warning, for another GPU", unset="unset (the architecture's constants)")
    sample_ms: float = option(20.0, "M2LIVE_SAMPLE_MS", "clock sampling period in ms (10-50 recommended)")
    engine: str | None = option(None, "M2LIVE_ENGINE", "engine label on metrics and records",
                                unset="data-parallel rank (`0`)")
    residual_window: int = option(256, "M2LIVE_RESIDUAL_WINDOW", "steps in the rolling residual statistics")
    queue_size: int = option(4096, "M2LIVE_QUEUE_SIZE", "bounded queues of the record thread and the trace writer "
                             "(drops are counted)")
    mqtt_queue_size: int = option(1024, "M2LIVE_MQTT_QUEUE_SIZE", "records the MQTT publisher holds while the "
                                  "broker is away (the oldest dropped beyond it, counted)")
    fault: str | None = option(None, "M2LIVE_FAULT", "test only: `predict` or `predict:N` makes the predictor raise "
                               "(every N-th step) to prove hook errors are contained")
    device_scale: float = option(1.0, "M2LIVE_DEVICE_SCALE", "test only: multiplies the device's FLOP/s and "
                                 "bandwidth (the CPU device's fixed costs by its inverse) — a deliberately wrong "
                                 "prior that the online correction must rescue (e.g. 0.01 or 100)")
    # not options: where the values came from (file path, "env"), and e.g. unknown M2LIVE_* variables
    source: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

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
        names = set(OPTIONS)
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
        L.QUEUE_SIZE.check(self.mqtt_queue_size, "M2LIVE_MQTT_QUEUE_SIZE", ConfigError)
        if self.gpu_index is not None:
            L.GPU_INDEX.check(self.gpu_index, "M2LIVE_GPU_INDEX", ConfigError)
        if self.mqtt_url is not None and not self.mqtt_url.startswith(("mqtt://", "mqtts://", "tcp://")):
            raise ConfigError(f"M2LIVE_MQTT_URL must look like mqtt://HOST:PORT, got {mask_url(self.mqtt_url)!r}")
        if self.calibration:
            from .calibration_file import CalibrationError, load

            try:
                load(self.calibration, warn=False)  # read to check it; its users say what changed since
            except CalibrationError as e:
                raise ConfigError(f"M2LIVE_CALIBRATION: {e}") from None
        if not (1e-6 <= self.device_scale <= 1e6):
            raise ConfigError(f"M2LIVE_DEVICE_SCALE must be within [1e-06, 1e+06], got {self.device_scale}")
        if self.fault:
            kind, _, n = self.fault.partition(":")
            if kind != "predict" or (n and not (limits.digits(n) and len(n) < 10 and int(n) > 0)):
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


def _default_text(f: Field) -> str:
    """The README's Default cell: what unset means for a None default, else the default as a variable holds it."""
    if f.default is None:
        return f.metadata["unset"] or "unset"
    if isinstance(f.default, bool):
        return "1" if f.default else "0"
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def _kind(f: Field) -> str:
    """bool | int | float | str: how a value of this option is parsed (from the field's annotation)."""
    kind = str(f.type).removesuffix(" | None")
    if kind not in ("bool", "int", "float", "str"):
        raise TypeError(f"M2liveConfig.{f.name}: option of unsupported type {f.type!r}")
    return kind


# field -> (environment variable, type, default text for the README, one-line help): from the fields above
OPTIONS: dict[str, tuple[str, str, str, str]] = {
    f.name: (f.metadata["env"], _kind(f), _default_text(f), f.metadata["doc"])
    for f in fields(M2liveConfig) if "env" in f.metadata
}

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
    except (ValueError, tomllib.TOMLDecodeError) as e:  # ValueError: json's, and its 4300-digit integer limit
        raise ConfigError(f"M2LIVE_CONFIG: {path} is neither valid JSON nor TOML ({str(e)[:120]})") from None
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
    if not isinstance(value, str | int | float) or isinstance(value, bool):  # a file's list or table, not text
        raise ConfigError(f"{env} must be a string, got {str(value)[:40]!r}")
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
