"""Sinks that carry m2live's per-step records to the people who run the fleet.

- :mod:`exporters.prometheus` — ``PrometheusExporter``: histograms, gauges and counters on an HTTP endpoint.
- :mod:`exporters.mqtt` — ``MqttPublisher``: a compact per-step stream, a retained status, a control topic.

Both consume :class:`m2live.record.StepRecord`; neither computes predictions. Both are sinks in the sense of
:class:`m2live.record.Sink` (``publish`` / ``flush`` / ``close``; ``submit`` is the older name of ``publish``):
``publish`` never blocks and never raises, and queues on :class:`m2live.workqueue.DropOldestQueue`. They are
built for the plugin by ``vllm_hooks.sinks`` (m2live itself never imports this package). The modules import
their client libraries only when used.
"""

from __future__ import annotations


class ExporterError(ValueError):
    """A sink cannot start (port in use, bad URL, bad option): one clear line."""


__all__ = ["ExporterError"]
