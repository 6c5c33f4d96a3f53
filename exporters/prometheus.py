"""Prometheus exporter: every step's prediction, measurement, residual, per-operator times, per-factor
efficiencies, clock, power and admission state, as ``m2live_*`` metrics (names: DESIGN.md ★).

How it stays off the engine's hot path: ``publish`` only appends the record to a bounded queue
(``m2live.workqueue.DropOldestQueue``: drop oldest, counted in ``exporter_dropped_total``). A side thread folds queued records into the metric state every 100 ms, and a scrape folds whatever
is left before it answers, so a scrape always sees every submitted step. The metric families are produced by
one custom collector (``collect()``), which also calls the ``counters`` callable at scrape time for the
cumulative counters the exporter does not see itself (hook errors, MQTT drops, SLO violations).

Labels: ``engine``, ``gpu``, ``model`` on everything; ``op`` on per-operator metrics; ``factor`` and ``op`` on
``m2live_factor`` (f_clk is reported with ``op="step"``). Gauges hold the latest step's value.

Data-parallel engines: each engine runs its own exporter on its own port (``prom_port + engine index``, see
``m2live.config``); a Prometheus job lists all the ports. No multiprocess registry is needed.
"""

from __future__ import annotations

import bisect
import logging
import math
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample

from m2live import __version__ as M2LIVE_VERSION
from m2live.record import StepRecord
from m2live.workqueue import DropOldestQueue

from . import ExporterError

log = logging.getLogger("m2live.exporters.prometheus")

PREFIX = "m2live_"
LABELS = ("engine", "gpu", "model")

# Step times: 0.5 ms (a tiny decode step on a fast GPU) to 5 s (a long prefill on a slow device), ~1.5x apart
# so that histogram_quantile resolves a step time to about +-20 %.
STEP_BUCKETS = (0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)
# Residual ratio (measured - predicted) / measured: -1 (predicted twice the measurement) to +1 (measured far
# above the prediction), finest near 0 where a calibrated predictor lives.
RESIDUAL_BUCKETS = (-1.0, -0.75, -0.5, -0.4, -0.3, -0.2, -0.15, -0.1, -0.05, -0.025, 0.0, 0.025, 0.05, 0.1,
                    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
# Time spent in m2live code per step: 5 us to 50 ms.
OVERHEAD_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2)

# Cumulative counters the exporter reads from ``counters()`` at scrape time (always exported, 0 by default).
SCRAPE_COUNTERS = ("hook_errors_total", "mqtt_dropped_total", "slo_violations_total", "records_dropped_total",
                   "control_changes_total", "control_rejected_total", "trace_dropped_total", "trace_errors_total",
                   "admission_fallback_total")  # decisions that fell back to vLLM's own budget (admission.py)
_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

Key = tuple[str, str, str]  # (engine, gpu, model)


class _Hist:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot: above the largest bound (+Inf)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1  # bucket i holds bounds[i-1] < v <= bounds[i]
        self.sum += v

    def cumulative(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for b, c in zip((*self.bounds, math.inf), self.counts, strict=True):
            acc += c
            out.append(("+Inf" if b == math.inf else repr(float(b)), float(acc)))
        return out


# histogram name -> (help, buckets, value getter)
_HISTOGRAMS: dict[str, tuple[str, tuple[float, ...], Callable[[StepRecord], float | None]]] = {
    "step_predicted_seconds": ("Mechanistic (m2) prediction of the engine step time, made before the step ran.",
                               STEP_BUCKETS, lambda r: r.predicted_s),
    "step_corrected_seconds": ("Prediction after the online residual correction (what admission uses).",
                               STEP_BUCKETS, lambda r: r.corrected_s),
    "step_measured_seconds": ("Measured engine step time.", STEP_BUCKETS, lambda r: r.measured_s),
    "step_residual_ratio": ("(measured - predicted) / measured, mechanistic prediction.",
                            RESIDUAL_BUCKETS, lambda r: r.residual_ratio),
    "step_corrected_residual_ratio": ("(measured - corrected) / measured, corrected prediction.",
                                      RESIDUAL_BUCKETS,
                                      lambda r: (r.measured_s - r.corrected_s) / r.measured_s
                                      if r.measured_s else None),
    "hook_overhead_seconds": ("Time spent in m2live code for one engine step.", OVERHEAD_BUCKETS,
                              lambda r: r.hook_overhead_s),
}

# scalar gauge name -> (help, value getter); a None value removes the series (the quantity is unknown)
_GAUGES: dict[str, tuple[str, Callable[[StepRecord], float | None]]] = {
    "sm_clock_mhz": ("SM clock used for the latest prediction (MHz).", lambda r: r.clock_mhz),
    "sm_clock_boost_mhz": ("Maximum (boost) SM clock of the device (MHz).", lambda r: r.boost_mhz),
    "power_watts": ("Board power draw (W).", lambda r: r.power_w),
    "power_limit_watts": ("Enforced board power limit (W).", lambda r: r.power_limit_w),
    "clock_event_reasons": ("NVML clock event (throttle) reasons bitmask of the latest sample.",
                            lambda r: r.clock_event_reasons),
    "temperature_celsius": ("GPU temperature (C).", lambda r: r.temperature_c),
    "clock_age_seconds": ("Age of the clock sample used for the latest prediction (s).", lambda r: r.clock_age_s),
    "admission_token_budget": ("Token budget the admission controller gave the latest step.",
                               lambda r: r.token_budget),
    "admission_max_active": ("Running-request cap the admission controller gave the latest step.",
                             lambda r: r.max_active),
    "slo_seconds": ("Step-latency SLO in force (s); absent when admission is off.", lambda r: r.slo_s),
    "step_last_predicted_seconds": ("Mechanistic prediction of the latest step (s).", lambda r: r.predicted_s),
    "step_last_measured_seconds": ("Measured time of the latest step (s).", lambda r: r.measured_s),
    "step_last_seqs": ("Requests in the latest step (decoding and prefilling).",
                       lambda r: r.num_decode_seqs + r.num_prefill_seqs),
    "capacity_seqs": ("Requests that could decode together within the SLO at the latest decode context "
                      "(predicted, corrected, at most max_num_seqs: the admission controller's rule); absent without "
                      "an SLO.", lambda r: r.capacity_seqs),
}


@dataclass
class _EngineState:
    hists: dict[str, _Hist] = field(default_factory=lambda: {n: _Hist(b) for n, (_, b, _) in _HISTOGRAMS.items()})
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    flagged: int = 0
    violations: int = 0
    gauges: dict[str, float] = field(default_factory=dict)
    ops: dict[str, float] = field(default_factory=dict)
    factors: dict[tuple[str, str], float] = field(default_factory=dict)
    clock_source: str | None = None


class PrometheusExporter:
    """Sink that serves ``m2live_*`` metrics over HTTP (``port=None``: registry only, for tests)."""

    kind = "prometheus"

    def __init__(self, host: str = "127.0.0.1", port: int | None = 9400, *, engine: str = "0", gpu: str = "",
                 model: str = "", registry: CollectorRegistry | None = None,
                 counters: Callable[[], dict[str, float]] | None = None, queue_size: int = 65536):
        if port is not None and not (isinstance(port, int) and 0 <= port <= 65535):
            raise ExporterError(f"Prometheus port must be an integer in 0..65535, got {port!r}")
        self.host, self.port = host, port
        self.labels: Key = (str(engine), gpu, model)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.counters = counters
        self.errors = 0  # records (or counters() calls) that could not be processed
        self._q: DropOldestQueue[StepRecord] = DropOldestQueue(queue_size)
        self._lock = threading.Lock()
        self._state: dict[Key, _EngineState] = {}
        self._last_key: Key | None = None
        self._clock_source: str | None = None
        self._calibration: str | None = None
        self._weights: str | None = None
        self._vllm_version = "unknown"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._httpd = None
        self._registered = False

    # ---- life cycle ---------------------------------------------------------------------------------------
    def start(self) -> PrometheusExporter:
        """Register the collector, start the folding thread and (unless port is None) the HTTP endpoint."""
        if not self._registered:
            self.registry.register(_Collector(self))
            self._registered = True
        if self.port is not None and self._httpd is None:
            from prometheus_client import start_http_server
            try:
                self._httpd, _ = start_http_server(self.port, addr=self.host, registry=self.registry)
            except OSError as e:
                if e.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
                    raise ExporterError(f"port {self.port} on {self.host} is already in use "
                                        f"(set M2LIVE_PROM_PORT to a free port)") from None
                raise ExporterError(f"cannot serve metrics on {self.host}:{self.port}: {e.strerror or e}") from None
            if self.port == 0:
                self.port = self._httpd.server_address[1]
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="m2live-prometheus", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        self.flush()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    @property
    def url(self) -> str | None:
        return None if self.port is None else f"http://{self.host}:{self.port}/metrics"

    # ---- the sink -------------------------------------------------------------------------------------------
    @property
    def dropped(self) -> int:
        """Records dropped because the queue was full."""
        return self._q.dropped

    def publish(self, record: StepRecord) -> None:
        """Queue one record (O(1), never blocks, never raises; drops the oldest record when full)."""
        self._q.put(record)

    submit = publish  # the older name of the same thing

    def set_clock_source(self, name: str) -> None:
        """Which clock source feeds f_clk (``clock_source_info{source}``), e.g. after a fallback."""
        with self._lock:
            self._clock_source = str(name)

    def set_weights(self, label: str) -> None:
        """The linear layers' weights the predictions price (``weights_info{precision}``: ``bf16``, ``fp8 (static
        input scales)``, ...), read from the engine's quantization config."""
        with self._lock:
            self._weights = str(label)

    def set_vllm_version(self, version: str) -> None:
        """The vLLM release the plugin runs in (``build_info{vllm_version}``; ``unknown`` until set)."""
        with self._lock:
            self._vllm_version = str(version)

    def set_calibration(self, label: str) -> None:
        """Which GPU calibration the predictions use (``calibration_info{calibration}``; ``none``: the
        architecture's constants)."""
        with self._lock:
            self._calibration = str(label)

    def flush(self) -> None:
        """Fold every queued record into the metric state (the side thread and each scrape do this)."""
        with self._lock:
            records = self._q.take(0.0)
            try:
                for r in records:
                    try:
                        self._fold(r)
                    except Exception as e:  # a malformed record must not kill the exporter
                        self.errors += 1
                        if self.errors <= 3:
                            log.warning("m2live: Prometheus exporter skipped a record: %s", e)
            finally:
                self._q.done(len(records))

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.flush()

    def _key(self, r: StepRecord) -> Key:
        e, g, m = self.labels
        return (str(r.engine) if r.engine not in (None, "") else e, r.gpu or g, r.model or m)

    def _fold(self, r: StepRecord) -> None:
        key = self._key(r)
        st = self._state.get(key)
        if st is None:
            st = self._state[key] = _EngineState()
        self._last_key = key
        st.steps += 1
        st.prefill_tokens += int(r.num_prefill_tokens)
        st.decode_tokens += int(r.num_decode_tokens)
        if r.slo_violation:
            st.violations += 1
        if r.admission_flagged:
            st.flagged += 1
        for name, (_, _, get) in _HISTOGRAMS.items():
            v = get(r)
            if v is not None and math.isfinite(v):
                st.hists[name].observe(float(v))
        for name, (_, get) in _GAUGES.items():
            v = get(r)
            if v is None:
                st.gauges.pop(name, None)
            else:
                st.gauges[name] = float(v)
        st.ops = {op: float(t) for op, t in r.ops.items()}
        st.factors = {(f, op): float(v) for f, per_op in r.factors.items() for op, v in per_op.items()}
        if r.f_clk is not None:
            st.factors[("f_clk", "step")] = float(r.f_clk)
        st.clock_source = r.clock_source or st.clock_source

    # ---- scrape ------------------------------------------------------------------------------------------------
    def _scrape_counters(self) -> dict[str, float]:
        if self.counters is None:
            return {}
        try:
            raw = self.counters() or {}
            return {str(k): float(v) for k, v in raw.items()}
        except Exception as e:
            with self._lock:
                self.errors += 1
                n = self.errors
            if n <= 3:
                log.warning("m2live: counters() failed at scrape time: %s", e)
            return {}

    def collect(self) -> Iterator[Metric]:
        self.flush()
        extra = self._scrape_counters()
        with self._lock:
            families = list(self._families(extra))
        yield from families

    def _families(self, extra: dict[str, float]) -> Iterator[Metric]:
        states = self._state
        default = self._last_key or self.labels
        labels = list(LABELS)
        for name, (doc, _, _) in _HISTOGRAMS.items():
            fam = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
            for key, st in states.items():
                h = st.hists[name]
                cum = h.cumulative()
                fam.add_metric(list(key), cum, h.sum)
                if h.bounds[0] < 0:  # the client omits _count/_sum when buckets go negative; keep them
                    lab = dict(zip(labels, key, strict=True))
                    fam.samples.append(Sample(fam.name + "_count", lab, cum[-1][1]))
                    fam.samples.append(Sample(fam.name + "_sum", lab, h.sum))
            yield fam
        for cname, doc, attr in (("steps", "Engine steps recorded.", "steps"),
                                 ("admission_flagged", "Steps that no budget could keep under the SLO "
                                  "(decodes ran anyway).", "flagged")):
            fam = CounterMetricFamily(PREFIX + cname, doc, labels=labels)
            for key, st in states.items():
                fam.add_metric(list(key), getattr(st, attr))
            yield fam
        fam = CounterMetricFamily(PREFIX + "tokens", "Tokens scheduled, by kind.", labels=[*labels, "kind"])
        for key, st in states.items():
            fam.add_metric([*key, "prefill"], st.prefill_tokens)
            fam.add_metric([*key, "decode"], st.decode_tokens)
        yield fam
        for name, (doc, _) in _GAUGES.items():
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for key, st in states.items():
                if name in st.gauges:
                    fam.add_metric(list(key), st.gauges[name])
            yield fam
        fam = GaugeMetricFamily(PREFIX + "op_predicted_seconds", "Predicted time of each operator in the latest "
                                "step, all layers (s).", labels=[*labels, "op"])
        for key, st in states.items():
            for op, t in st.ops.items():
                fam.add_metric([*key, op], t)
        yield fam
        fam = GaugeMetricFamily(PREFIX + "factor", "Efficiency factors of the latest step's prediction "
                                "(f_clk, eta_wave, eta_active, eta_duty, eta_mem, ...), per operator.",
                                labels=[*labels, "factor", "op"])
        for key, st in states.items():
            for (f, op), v in st.factors.items():
                fam.add_metric([*key, f, op], v)
        yield fam
        fam = GaugeMetricFamily(PREFIX + "clock_source_info", "Clock source feeding f_clk (value 1).",
                                labels=[*labels, "source"])
        if self._clock_source is not None:
            fam.add_metric([*default, self._clock_source], 1.0)
            for key, st in states.items():
                if key != default and st.clock_source:
                    fam.add_metric([*key, st.clock_source], 1.0)
        else:
            for key, st in states.items():
                if st.clock_source:
                    fam.add_metric([*key, st.clock_source], 1.0)
        yield fam
        fam = GaugeMetricFamily(PREFIX + "calibration_info", "GPU calibration the predictions use (value 1; "
                                "'none': the architecture's constants).", labels=[*labels, "calibration"])
        if self._calibration is not None:
            fam.add_metric([*default, self._calibration], 1.0)
        yield fam
        fam = GaugeMetricFamily(PREFIX + "build_info", "m2live's version and the vLLM release it runs in (value 1).",
                                labels=[*labels, "version", "vllm_version"])
        fam.add_metric([*default, M2LIVE_VERSION, self._vllm_version], 1.0)
        yield fam
        fam = GaugeMetricFamily(PREFIX + "weights_info", "Weights format the predictions price (value 1; from the "
                                "engine's quantization config).", labels=[*labels, "precision"])
        if self._weights is not None:
            fam.add_metric([*default, self._weights], 1.0)
        yield fam
        # cumulative counters read at scrape time; slo violations fall back to the records' own flags
        own = {"slo_violations_total": float(sum(st.violations for st in states.values())),
               "exporter_dropped_total": float(self.dropped), "exporter_errors_total": float(self.errors)}
        values = {k: 0.0 for k in SCRAPE_COUNTERS} | own | extra
        for k in ("exporter_dropped_total", "exporter_errors_total"):  # the caller's and ours: both count
            if k in extra:
                values[k] = own[k] + extra[k]
        for k, v in values.items():
            base = k[:-len("_total")] if k.endswith("_total") else k
            if not _NAME_RE.match(base) or not math.isfinite(v) or v < 0:
                continue
            fam = CounterMetricFamily(PREFIX + base, f"m2live {base.replace('_', ' ')} (cumulative).",
                                      labels=labels)
            fam.add_metric(list(default), v)
            yield fam


class _Collector:
    """The registry-facing side (a collector is one method: ``collect``)."""

    def __init__(self, exporter: PrometheusExporter):
        self._exp = exporter

    def collect(self) -> Iterator[Metric]:
        return self._exp.collect()

    def describe(self) -> list[Metric]:
        return []  # families are dynamic; skip the registry's describe-time collect
