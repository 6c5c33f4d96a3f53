"""LiveMonitor: the engine-side coordinator of the plugin.

It owns the config, the Predictor, the ClockSampler, the ResidualTracker, the AdmissionController (when an SLO
is set) and the sinks (Prometheus exporter, MQTT publisher, JSONL trace). The scheduler subclass in
``vllm_hooks`` calls three hooks per step:

    before_schedule(scheduler)          admission: set this step's token budget / admission cap
    on_schedule(scheduler, output)      convert the SchedulerOutput to a Step; note the live clock reading
    on_update(output)                   measure the step; queue it for the record thread

The record thread (``m2live-record``) does the rest off the engine's thread: predict the step with the clock
read when it was scheduled, correct it, update the residual tracker, build the record and hand it to the sinks.
Its queue is bounded; a step that finds it full displaces the oldest one, counted in ``records_dropped_total``.
On a GPU the engine thread waits for the device while the record thread runs; ``flush()`` waits for it.

Every hook is wrapped: an exception is counted in ``hook_errors_total``, logged (one line, rate-limited), and never
reaches vLLM. Nothing here blocks on a device or the network: the clock comes from the sampler's cached value and
sinks queue.

Measurement: a step lasts from the moment the engine could start it to the end of its ``update_from_output``:
``end_update(N) − max(start_schedule(N), end_update(N−1))`` — with synchronous scheduling that is schedule →
execute → update; with async scheduling (``schedule(N+1)`` runs before ``update(N)``) it is the interval between
consecutive updates while the engine is busy. Time spent in m2live's own hooks inside that window is subtracted
(it is reported separately as the hook overhead).

This module never imports vLLM: the two vLLM-specific functions (SchedulerOutput → Step, scheduler → QueueView)
are handed in by ``vllm_hooks``.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import limits
from .config import M2liveConfig
from .predictor import Prediction, Predictor
from .record import StepRecord
from .residuals import ResidualTracker
from .shapes import ModelShape, get_model
from .step import Step
from .telemetry import ClockSampler, ClockSource, CpufreqClockSource, NvmlClockSource, TelemetryError
from .workqueue import DropOldestQueue

log = logging.getLogger("m2live")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (not the stream of import time, which a
    test runner or a daemoniser may have closed or replaced since)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


if not log.handlers:
    _h = _StderrHandler()
    _h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [m2live] %(message)s", "%m-%d %H:%M:%S"))
    log.addHandler(_h)
    log.setLevel(logging.INFO)
    log.propagate = False

_MONITORS: list[weakref.ref] = []


def active_monitors() -> list[LiveMonitor]:
    """The monitors alive in this process (one per engine core)."""
    out = []
    for r in list(_MONITORS):
        m = r()
        if m is not None and not m.closed:
            out.append(m)
    return out


class InjectedFault(RuntimeError):
    """Raised on purpose by the predictor when ``M2LIVE_FAULT`` is set (tests prove containment)."""


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


class _Pending:
    __slots__ = ("index", "step", "ids", "reading", "age", "t_start", "ovh0", "hook_s", "decision", "slo_s",
                 "measured", "wall_end")

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


class LiveMonitor:
    def __init__(self, config: M2liveConfig, info: EngineInfo, *,
                 step_of: Callable[[Any, Any], Step | tuple[Step, list[str]]],
                 queue_view: Callable[[Any], Any] | None = None,
                 clock_source: ClockSource | None = None,
                 start_exporters: bool = True) -> None:
        self.cfg = config.for_engine(info.engine_index)
        self.info = info
        self.engine = str(self.cfg.engine)
        self._step_of = step_of
        self._queue_view = queue_view
        self.closed = False
        # counters
        self.hook_errors = 0
        self.steps = 0
        self.unmatched = 0
        self.sink_errors = 0
        self.exporter_errors = 0
        self.control_changes = 0  # remote control changes applied (MQTT)
        self.control_rejected = 0  # remote control changes refused here (the publisher counts its own)
        self._err_logged: dict[str, int] = {}
        self._lock = threading.Lock()  # set_slo_ms / set_admission come from the MQTT thread

        # --- device, clock ---------------------------------------------------------------------------------
        self.clock_why = ""
        self.gpu = self._resolve_device(clock_source)
        # --- model, predictor, residuals -------------------------------------------------------------------
        shape = get_model(self.cfg.model) if self.cfg.model else info.model_shape
        if shape is None:
            raise ValueError("no model shape: vLLM's model config was unusable and M2LIVE_MODEL is not set")
        self.calibration = self._load_calibration()  # "none", or which calibration the constants come from
        self.predictor = Predictor(self.gpu, shape, tp=max(1, info.tp), constants=self._calibrated or self._device_constants)
        self.model_label = info.model_name or shape.name
        self.residuals = ResidualTracker(window=self.cfg.residual_window)
        self._stale_s = max(1.0, 50 * self.cfg.sample_ms / 1000.0)
        self._fault_every = self.cfg.fault_every
        from .efficiency import ENERGY_PER_FLOP

        self._has_power_model = ENERGY_PER_FLOP.get(self.gpu.arch, 0.0) > 0.0
        # --- admission ---------------------------------------------------------------------------------------
        self.admission = None
        self._admission_on = self.cfg.admission_on
        self._slo_ms = self.cfg.slo_ms
        self._limits_touched = False
        if self._slo_ms is not None:
            self._make_admission()
        # --- step state ----------------------------------------------------------------------------------
        self._pending: dict[int, _Pending] = {}
        self._max_pending = 64
        self._n = 0
        self._ovh_total = 0.0
        self._last_end = 0.0
        self._ovh_last = 0.0
        self._t_start = 0.0
        self._ovh_start = 0.0
        self._pre_s = 0.0
        self._decision = None
        self.overheads: deque[float] = deque(maxlen=100_000)  # per-step hook time on the engine thread (s)
        self.record_times: deque[float] = deque(maxlen=100_000)  # per-step time on the record thread (s)
        self.step_times: deque[float] = deque(maxlen=100_000)  # per-step measured time (s)
        # --- the record thread ---------------------------------------------------------------------------
        self._work: DropOldestQueue[_Pending] = DropOldestQueue(max(64, self.cfg.queue_size))
        self._record_thread = threading.Thread(target=self._record_loop, name="m2live-record", daemon=True)
        # --- sinks ---------------------------------------------------------------------------------------
        self.sinks: list[Any] = []
        # observers get (record, step, request ids) on the record thread: tests and the demo, not exporters
        self.observers: list[Callable[[StepRecord, Step, list[str] | None], None]] = []
        self.trace = None
        self.prometheus = None
        self.mqtt = None
        if self.cfg.trace:
            try:
                from .trace import TraceWriter

                self.trace = TraceWriter(self.cfg.trace, queue_size=self.cfg.queue_size)
                self.sinks.append(self.trace)
            except OSError as e:
                self._count_exporter_error("trace", e)
        if start_exporters:
            self._start_exporters()
        self._record_thread.start()
        _MONITORS.append(weakref.ref(self))
        log.info("engine %s: predicting %s on %s (tp=%d); clock: %s; admission: %s; sinks: %s",
                 self.engine, self.model_label, self.gpu.name, self.predictor.tp, self.clock_why,
                 f"SLO {self._slo_ms} ms" if self.admission_active else "off",
                 ", ".join(type(s).__name__ for s in self.sinks) or "none")

    # ------------------------------------------------------------------------------------------------------
    def _resolve_device(self, clock_source: ClockSource | None):
        from .hardware import get_gpu

        cfg = self.cfg
        self._device_constants = None  # the CPU device's measured call costs and attention efficiencies
        self.prior_check = None  # the CPU device: re-measure when the first steps disagree with it by > 3x
        source: ClockSource | None = clock_source
        why = f"{clock_source.name} (given)" if clock_source is not None else ""
        want = (cfg.gpu or "").strip()
        cpu_wanted = want.lower() in ("cpu", "cpu-device")
        nvml_error = None
        if source is None and not cpu_wanted and (want or self.info.device == "cuda"):
            try:
                idx = cfg.gpu_index if cfg.gpu_index is not None else self._local_index()
                nv = NvmlClockSource(idx)
                source = nv
                why = f"nvml ({nv.device_name}, GPU {idx})"
                if not want:
                    want = nv.device_name
            except TelemetryError as e:
                nvml_error = str(e)
        if not want and self.info.device == "cuda":
            raise ValueError(f"cannot tell which GPU this is (NVML: {nvml_error}); set M2LIVE_GPU")
        if not want or cpu_wanted:
            from .cpu_device import PriorCheck, cpu_device_model

            shape = get_model(cfg.model) if cfg.model else self.info.model_shape  # measured on its shapes
            dtype = "fp32" if shape is not None and shape.dtype_bytes == 4 else "bf16"  # as vLLM resolved it
            spec, self._device_constants, key = cpu_device_model(shape, dtype, cfg.device_scale)
            if cfg.device_scale == 1.0:  # a prior scaled on purpose (test knob) must not drop the measurement
                self.prior_check = PriorCheck(key, shape, dtype)
            if source is None:
                try:
                    source = CpufreqClockSource()
                    why = "cpufreq"
                except TelemetryError as e:
                    why = f"forecast (no clock telemetry: cpufreq unavailable: {e})"
        else:
            from .cpu_device import scale_spec

            spec = scale_spec(get_gpu(want), cfg.device_scale)  # the test-only knob (1: the datasheet)
            if source is None:
                why = f"forecast (NVML unavailable: {nvml_error or 'not a CUDA engine'})"
        self.sampler = ClockSampler(source, period_s=cfg.sample_ms / 1000.0).start() if source else None
        self.clock_source_name = source.name if source is not None else "forecast"
        self.clock_why = why
        return spec

    def _load_calibration(self) -> str:
        """M2LIVE_CALIBRATION: this GPU's own constants for the predictor (and so admission and exporters). A
        calibration of another GPU, or a broken file, is refused with one warning: the architecture's constants
        are used and the info metric says ``none``."""
        self._calibrated = None
        if not self.cfg.calibration:
            return "none"
        from .calibrate import CalibrationError, load

        try:
            cal = load(self.cfg.calibration)
            cal.check_gpu(self.gpu)
        except CalibrationError as e:
            log.warning("engine %s: M2LIVE_CALIBRATION refused, predicting with the architecture's constants: %s",
                        self.engine, e)
            return "none"
        self._calibrated = cal.arch_constants()
        return cal.label()

    def _local_index(self) -> int:
        """NVML index of this engine's (first) GPU. NVML ignores CUDA_VISIBLE_DEVICES, so map through it;
        without it, local data-parallel engine i drives GPUs i*tp .. i*tp+tp-1."""
        import os

        cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        first = cvd.split(",")[0].strip() if cvd else ""
        if first.isdigit():
            return int(first)
        return max(0, self.info.local_rank) * max(1, self.info.tp)

    def _scrub(self, text: str) -> str:
        """``text`` with the MQTT password and any URL user:password part masked (every log line goes through)."""
        from .config import mask_url

        pw = self.cfg.mqtt_password
        if pw:
            text = text.replace(pw, "***")
        if self.cfg.mqtt_url and self.cfg.mqtt_url in text:
            text = text.replace(self.cfg.mqtt_url, mask_url(self.cfg.mqtt_url))
        return text

    def _count_exporter_error(self, what: str, e: BaseException) -> None:
        self.exporter_errors += 1
        log.warning("engine %s: %s unavailable, continuing without it: %s", self.engine, self._scrub(what),
                    self._scrub(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__))

    def _start_exporters(self) -> None:
        cfg = self.cfg
        if cfg.prom_enable:
            try:
                from exporters.prometheus import PrometheusExporter

                exp = PrometheusExporter(cfg.prom_host, cfg.prom_port, engine=self.engine, gpu=self.gpu.name,
                                         model=self.model_label, counters=self.counters)
                exp.start()
                try:
                    exp.set_clock_source(self.clock_source_name)
                    exp.set_calibration(self.calibration)
                except Exception as e:  # noqa: BLE001
                    self._count_exporter_error("prometheus clock source", e)
                self.prometheus = exp
                self.sinks.append(exp)
            except Exception as e:  # noqa: BLE001 - missing module, port in use, ...
                self._count_exporter_error(f"prometheus exporter on {cfg.prom_host}:{cfg.prom_port}", e)
        if cfg.mqtt_url:
            try:
                from exporters.mqtt import MqttPublisher

                pub = MqttPublisher(cfg.mqtt_url, cfg.mqtt_instance or f"m2live-{self.engine}",
                                    on_control=self.on_control if cfg.mqtt_control else None,
                                    control_retained=cfg.mqtt_control_retained, username=cfg.mqtt_username,
                                    password=cfg.mqtt_password, tls_ca=cfg.mqtt_tls_ca,
                                    tls_cert=cfg.mqtt_tls_cert, tls_key=cfg.mqtt_tls_key)
                pub.start()
                self.mqtt = pub
                self.sinks.append(pub)
            except Exception as e:  # noqa: BLE001
                self._count_exporter_error(f"MQTT publisher ({cfg.mqtt_url})", e)

    def add_sink(self, sink: Any) -> None:
        """Attach another sink (anything with ``submit(record)``; ``close()`` optional)."""
        self.sinks.append(sink)

    # --- admission control ------------------------------------------------------------------------------
    def _make_admission(self) -> None:
        try:
            from .admission import AdmissionController

            slo = self._slo_ms / 1000.0 if (self._slo_ms is not None and self._admission_on) else None
            self.admission = AdmissionController(self.predictor, self.residuals, slo, margin=self.cfg.slo_margin)
        except Exception as e:  # noqa: BLE001
            self.admission = None
            self._error("admission setup", e)

    @property
    def admission_active(self) -> bool:
        return self.admission is not None and self.admission.slo_s is not None

    def set_slo_ms(self, slo_ms: float | None) -> None:
        """Change the step SLO live (None: no SLO, admission off); the bounds of ``M2LIVE_SLO_MS``. Thread-safe."""
        if slo_ms is not None:
            try:
                limits.SLO_MS.check(slo_ms, "SLO")
            except ValueError:
                raise ValueError(f"SLO must be a positive number of ms within {limits.SLO_MS.describe()}, got "
                                 f"{slo_ms!r}") from None
        with self._lock:
            self._slo_ms = None if slo_ms is None else float(slo_ms)
            if self._slo_ms is not None and self.cfg.admission is None:
                self._admission_on = True
            if self.admission is None and self._slo_ms is not None:
                self._make_admission()
            if self.admission is not None:
                self.admission.set_slo(self._slo_ms / 1000.0 if self._slo_ms and self._admission_on else None)
        log.info("engine %s: SLO set to %s ms (admission %s)", self.engine, self._slo_ms,
                 "on" if self.admission_active else "off")

    def set_admission(self, on: bool) -> None:
        """Turn admission control on/off live (needs an SLO to do anything). Thread-safe."""
        with self._lock:
            self._admission_on = bool(on)
            if self.admission is None and self._slo_ms is not None and on:
                self._make_admission()
            if self.admission is not None:
                self.admission.set_slo(self._slo_ms / 1000.0 if (self._slo_ms and on) else None)
        log.info("engine %s: admission %s", self.engine, "on" if self.admission_active else "off")

    def on_control(self, msg: dict) -> None:
        """MQTT control message (already validated by the publisher), e.g. {"slo_ms": 40} / {"admission": false}.
        Values are checked again against the configuration's bounds; each applied change is logged with the
        old and the new value and counted in ``control_changes_total``, a refused one in
        ``control_rejected_total``."""
        try:
            before = (self._slo_ms, self.admission_active)
            if "slo_ms" in msg:
                self.set_slo_ms(msg["slo_ms"])
            if "admission" in msg:
                v = msg["admission"]
                if not isinstance(v, bool):
                    raise ValueError(f"admission must be true or false, got {v!r}")
                self.set_admission(v)
            self.control_changes += 1
            by = msg.get("by")
            log.warning("engine %s: remote control applied at %s by %s: SLO %s -> %s ms, admission %s -> %s",
                        self.engine, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        f"'{by}' (as the message says)" if by else "an unnamed MQTT publisher", before[0],
                        self._slo_ms, "on" if before[1] else "off", "on" if self.admission_active else "off")
        except Exception as e:  # noqa: BLE001
            self.control_rejected += 1
            self._error("control", e)

    # --- counters ---------------------------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        mq = self.mqtt
        return {
            "hook_errors_total": float(self.hook_errors),
            "mqtt_dropped_total": float(getattr(mq, "dropped", 0) if mq is not None else 0),
            "slo_violations_total": float(self.admission.violations if self.admission is not None else 0),
            "trace_dropped_total": float(self.trace.dropped if self.trace is not None else 0),
            "exporter_errors_total": float(self.exporter_errors + self.sink_errors
                                           + (self.trace.errors if self.trace is not None else 0)),
            "clock_errors_total": float(self.sampler.errors if self.sampler is not None else 0),
            "unmatched_steps_total": float(self.unmatched),
            "records_dropped_total": float(self.records_dropped),
            "admission_fallback_total": float(getattr(self.admission, "fallbacks", 0) if self.admission else 0),
            "control_changes_total": float(self.control_changes),
            "control_rejected_total": float(self.control_rejected + (getattr(mq, "control_rejected", 0)
                                                                     if mq is not None else 0)),
            "trace_errors_total": float(self.trace.errors if self.trace is not None else 0),
        }

    def _error(self, where: str, e: BaseException) -> None:
        self.hook_errors += 1
        n = self._err_logged.get(where, 0) + 1
        self._err_logged[where] = n
        if n == 1 or n % 1000 == 0:
            msg = self._scrub(str(e).strip().splitlines()[0] if str(e).strip() else "")
            log.warning("engine %s: hook error in %s (%d so far, engine continues): %s: %s", self.engine, where,
                        n, type(e).__name__, msg)

    # --- the hooks -------------------------------------------------------------------------------------
    def before_schedule(self, scheduler: Any, limits: tuple[int, int]) -> None:
        """Admission: set the scheduler's budget for this step. ``limits``: the configured (tokens, seqs)."""
        t0 = time.perf_counter()
        self._t_start = t0
        self._ovh_start = self._ovh_total
        self._decision = None
        try:
            ctrl = self.admission
            if ctrl is not None and ctrl.slo_s is not None and self._queue_view is not None:
                view = self._queue_view(scheduler)
                reading, f = self._clock()
                d = ctrl.decide(view, f)
                scheduler.max_num_scheduled_tokens = max(1, min(int(d.token_budget), limits[0]))
                scheduler.max_num_active_reqs = max(1, min(int(d.max_active), limits[1]))
                self._decision = (d, ctrl.slo_s)
                self._limits_touched = True
            elif self._limits_touched:
                scheduler.max_num_scheduled_tokens, scheduler.max_num_active_reqs = limits
                self._limits_touched = False
        except Exception as e:  # noqa: BLE001
            self._error("admission", e)
            try:  # never leave a stale budget behind
                scheduler.max_num_scheduled_tokens, scheduler.max_num_active_reqs = limits
            except Exception:  # noqa: BLE001
                pass
        dt = time.perf_counter() - t0
        self._pre_s = dt
        self._ovh_total += dt

    def _clock(self):
        """(reading or None, clock in MHz or None for the forecast)."""
        s = self.sampler
        if s is None:
            return None, None
        r, age = s.latest()
        if r is None or age > self._stale_s:
            return None, None
        return r, r.sm_mhz

    def on_schedule(self, scheduler: Any, output: Any) -> None:
        t0 = time.perf_counter()
        try:
            if getattr(output, "total_num_scheduled_tokens", 0) <= 0:
                return
            step = self._step_of(scheduler, output)
            ids = None
            if isinstance(step, tuple):
                step, ids = step
            if step is None or len(step) == 0:
                return
            self._n += 1
            s = self.sampler
            reading, age = s.latest() if s is not None else (None, math.inf)
            fresh = reading is not None and age <= self._stale_s
            if self._fault_every and self._n % self._fault_every == 0:
                raise InjectedFault(f"M2LIVE_FAULT: predictor failure injected on step {self._n}")
            dec = self._decision
            p = _Pending(index=self._n, step=step, ids=ids, reading=reading if fresh else None,
                         age=age if fresh else None, t_start=self._t_start, ovh0=self._ovh_start,
                         hook_s=self._pre_s, decision=dec, measured=0.0, wall_end=0.0,
                         slo_s=dec[1] if dec else (self.admission.slo_s if self.admission is not None else None))
            if len(self._pending) >= self._max_pending:  # outputs that never came back (aborted engine step)
                self._pending.pop(next(iter(self._pending)))
                self.unmatched += 1
            self._pending[id(output)] = p
        except Exception as e:  # noqa: BLE001
            self._error("predict", e)
        finally:
            dt = time.perf_counter() - t0
            self._ovh_total += dt
            p2 = self._pending.get(id(output))
            if p2 is not None:
                p2.hook_s += dt

    def on_update(self, output: Any) -> None:
        t_end = time.perf_counter()
        try:
            p = self._pending.pop(id(output), None)
            if p is not None:
                if p.t_start >= self._last_end:
                    start, ovh0 = p.t_start, p.ovh0
                else:  # async scheduling: this step was queued while the previous one ran
                    start, ovh0 = self._last_end, self._ovh_last
                measured = t_end - start - (self._ovh_total - ovh0)
                p.measured = measured if measured > 0 else t_end - start
                p.wall_end = time.time()
                p.hook_s += time.perf_counter() - t_end  # this hook's share, up to the hand-off
                self._work.put(p)
        except Exception as e:  # noqa: BLE001
            self._error("update", e)
        finally:
            now = time.perf_counter()
            self._ovh_total += now - t_end
            self._last_end = now
            self._ovh_last = self._ovh_total

    # --- the record thread --------------------------------------------------------------------------------
    @property
    def records_dropped(self) -> int:
        return self._work.dropped

    def _record_loop(self) -> None:
        while True:
            items = self._work.take(0.5, most=1)
            if not items:
                if self.prior_check is not None and self.prior_check.remeasure_pending:
                    self.prior_check.idle()  # no step for 0.5 s: the engine idles, measure the device again
                if self._work.closed:
                    return
                continue
            t0 = time.perf_counter()
            try:
                self._record(items[0])
            except Exception as e:  # noqa: BLE001
                self._error("record", e)
            finally:
                self.record_times.append(time.perf_counter() - t0)
                self._work.done(1)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every measured step has been recorded (True) or ``timeout`` seconds passed (False)."""
        return self._work.join(timeout)

    def _predict(self, p: _Pending) -> tuple[Prediction, str]:
        """The step's prediction with the clock read when it was scheduled (else the power-cap forecast)."""
        if p.reading is not None:
            return self.predictor.predict(p.step, clock_mhz=p.reading.sm_mhz), self.sampler.source.name
        # no live clock: the power-cap forecast (a device without a power model forecasts boost)
        return self.predictor.predict(p.step, f_clk=None if self._has_power_model else 1.0), "forecast"

    def _record(self, p: _Pending) -> None:
        step: Step = p.step
        pred, source = self._predict(p)
        corrected = self.residuals.correct(pred, step)  # scored before learning from this step
        measured = p.measured
        self.residuals.update(step, pred, measured)
        if self.prior_check is not None:
            self.prior_check.observe(pred.total_s, pred.t_blocks, measured)
        violation = None
        if self.admission is not None:
            violation = self.admission.observe(measured, p.slo_s) if p.slo_s is not None else None
        c = step.counts()
        r = p.reading
        d = p.decision[0] if p.decision else None
        self.steps += 1
        rec = StepRecord(
            step=p.index, time=p.wall_end, engine=self.engine, gpu=self.gpu.name, model=self.model_label,
            num_prefill_tokens=c["prefill_tokens"], num_decode_tokens=c["decode_reqs"],
            num_prefill_seqs=len(step.prefill_seqs), num_decode_seqs=c["decode_reqs"],
            prefill_kv_tokens=c["prefill_kv_tokens"], decode_kv_tokens=c["decode_kv_tokens"],
            predicted_s=pred.total_s, corrected_s=corrected, measured_s=measured, f_clk=pred.f_clk,
            clock_mhz=pred.clock_mhz, boost_mhz=self.gpu.boost_mhz, clock_source=source,
            ops=dict(pred.ops), factors=pred.factors, bound=pred.bound,
            power_w=r.power_w if r else None, power_limit_w=r.power_limit_w if r else None,
            clock_event_reasons=r.event_reasons if r else None, temperature_c=r.temperature_c if r else None,
            clock_age_s=p.age, token_budget=d.token_budget if d else None, max_active=d.max_active if d else None,
            slo_s=p.slo_s, slo_violation=violation, admission_flagged=d.flagged if d else None,
            hook_overhead_s=p.hook_s,
        )
        for sink in self.sinks:
            try:
                sink.submit(rec)
            except Exception as e:  # noqa: BLE001
                self.sink_errors += 1
                self._error(f"sink {type(sink).__name__}", e)
        self.overheads.append(p.hook_s)
        for obs in self.observers:
            try:
                obs(rec, step, p.ids)
            except Exception as e:  # noqa: BLE001
                self._error("observer", e)
        self.step_times.append(measured)

    # --- status / shutdown -------------------------------------------------------------------------------
    def status(self) -> dict:
        return {
            "engine": self.engine, "gpu": self.gpu.name, "model": self.model_label, "tp": self.predictor.tp,
            "clock_source": self.clock_source_name, "clock_why": self.clock_why, "steps": self.steps,
            "admission": self.admission_active, "slo_ms": self._slo_ms,
            "residuals": self.residuals.stats(), **self.counters(),
        }

    def close(self) -> None:
        if self.closed:
            return
        self.flush(timeout=5.0)  # the steps already measured reach the sinks before they close
        self.closed = True
        self._work.close()
        self._record_thread.join(timeout=2.0)
        if self.sampler is not None:
            try:
                self.sampler.stop()
                self.sampler.source.close()
            except Exception:  # noqa: BLE001
                pass
        for sink in self.sinks:
            try:
                close = getattr(sink, "close", None)
                if close:
                    close()
            except Exception:  # noqa: BLE001
                pass
