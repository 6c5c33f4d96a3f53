"""The sinks the configuration asks for, built for one monitor: the JSONL trace (``M2LIVE_TRACE``), the Prometheus
exporter (``M2LIVE_PROM*``) and the MQTT publisher (``M2LIVE_MQTT_*``), in that order.

``start_monitor`` is how anything outside the scheduler subclass (tests, tools) gets a ``LiveMonitor`` with the
sinks its environment asks for. A sink that cannot start (port in use, bad TLS file, unwritable trace) is one
warning and ``exporter_errors_total``; the engine runs without it. Importing this module imports neither vLLM
nor the exporters' client libraries.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from m2live.config import M2liveConfig
from m2live.live import EngineInfo, LiveMonitor
from m2live.step import Step
from m2live.telemetry import ClockSource
from m2live.trace import TraceWriter


def vllm_version() -> str:
    """The release of the vLLM loaded in this process (``unknown`` when none is): never imports it."""
    return str(getattr(sys.modules.get("vllm"), "__version__", "unknown"))


class TraceSink(TraceWriter):
    """The JSONL trace as a sink: ``publish`` queues, the writer thread writes whole lines."""

    kind = "trace"

    def publish(self, record) -> None:
        self.submit(record)

    def flush(self) -> None:
        pass  # the writer thread writes every ``flush_s``; close() drains

    def sink_counters(self) -> dict[str, float]:
        return {"trace_dropped_total": float(self.dropped), "trace_errors_total": float(self.errors)}


def env_sinks(mon: LiveMonitor, exporters: bool = True) -> list[Any]:
    """The sinks ``mon``'s configuration asks for (``exporters=False``: the trace only)."""
    cfg = mon.cfg
    out: list[Any] = []
    if cfg.trace:
        try:
            out.append(TraceSink(cfg.trace, queue_size=cfg.queue_size))
        except OSError as e:
            mon.sink_failed("trace", e)
    if not exporters:
        return out
    if cfg.prom_enable:
        try:
            from exporters.prometheus import PrometheusExporter

            exp = PrometheusExporter(cfg.prom_host, cfg.prom_port, engine=mon.engine, gpu=mon.gpu.name,
                                     model=mon.model_label, counters=mon.counters)
            exp.start()
            try:
                exp.set_clock_source(mon.clock_source_name)
                exp.set_calibration(mon.calibration)
                exp.set_weights(mon.weights)
                exp.set_vllm_version(vllm_version())
            except Exception as e:  # noqa: BLE001
                mon.sink_failed("prometheus clock source", e)
            out.append(exp)
        except Exception as e:  # noqa: BLE001 - missing module, port in use, ...
            mon.sink_failed(f"prometheus exporter on {cfg.prom_host}:{cfg.prom_port}", e)
    if cfg.mqtt_url:
        try:
            from exporters.mqtt import MqttPublisher

            pub = MqttPublisher(cfg.mqtt_url, cfg.mqtt_instance or f"m2live-{mon.engine}",
                                queue_size=cfg.mqtt_queue_size,
                                on_control=mon.on_control if cfg.mqtt_control else None,
                                control_retained=cfg.mqtt_control_retained, username=cfg.mqtt_username,
                                password=cfg.mqtt_password, tls_ca=cfg.mqtt_tls_ca, tls_cert=cfg.mqtt_tls_cert,
                                tls_key=cfg.mqtt_tls_key)
            pub.start()
            out.append(pub)
        except Exception as e:  # noqa: BLE001
            mon.sink_failed(f"MQTT publisher ({cfg.mqtt_url})", e)
    return out


def start_monitor(config: M2liveConfig, info: EngineInfo, *,
                  step_of: Callable[[Any, Any], Step | tuple[Step, list[str]]],
                  queue_view: Callable[[Any], Any] | None = None, clock_source: ClockSource | None = None,
                  start_exporters: bool = True) -> LiveMonitor:
    """A running ``LiveMonitor`` with the sinks ``config`` asks for (``start_exporters=False``: no Prometheus,
    no MQTT; the trace still)."""
    return LiveMonitor(config, info, step_of=step_of, queue_view=queue_view, clock_source=clock_source,
                       sinks=lambda mon: env_sinks(mon, exporters=start_exporters))
