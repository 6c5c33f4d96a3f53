"""Sinks that carry m2live's per-step records to the people who run the fleet.

- :mod:`exporters.prometheus` — ``PrometheusExporter``: histograms, gauges and counters on an HTTP endpoint.
- :mod:`exporters.mqtt` — ``MqttPublisher``: a compact per-step stream, a retained status, a control topic.

Both consume :class:`m2live.record.StepRecord`; neither computes predictions. ``submit`` never blocks the
engine step and never raises. The modules import their client libraries only when used.
"""

from __future__ import annotations


class ExporterError(ValueError):
    """A sink cannot start (port in use, bad URL, bad option): one clear line."""


__all__ = ["ExporterError"]
