"""LiveMonitor: the engine-side coordinator of the plugin.

It ties together the device and its clock (``device``), the predictor and the residual tracker, live SLO
control (``control``), the record thread (``recorder``) and the sinks it is handed. The scheduler subclass in
``vllm_hooks`` calls three hooks per step:

    before_schedule(scheduler, limits)  admission: returns this step's (token budget, running cap), or None
    on_schedule(scheduler, output)      convert the SchedulerOutput to a Step; note the live clock reading
    on_update(output)                   measure the step; queue it for the record thread

Every hook is wrapped: an exception is counted in ``hook_errors_total``, logged (one line, rate-limited), and never
reaches vLLM. Nothing here blocks on a device or the network: the clock comes from the sampler's cached value and
sinks queue.

Measurement: a step lasts from the moment the engine could start it to the end of its ``update_from_output``:
``end_update(N) − max(start_schedule(N), end_update(N−1))`` — with synchronous scheduling that is schedule →
execute → update; with async scheduling (``schedule(N+1)`` runs before ``update(N)``) it is the interval between
consecutive updates while the engine is busy. Time spent in m2live's own hooks inside that window is subtracted
(it is reported separately as the hook overhead).

This package imports neither vLLM nor the Prometheus/MQTT code: the two vLLM-specific functions (SchedulerOutput →
Step, scheduler → QueueView) and the sinks are handed in by ``vllm_hooks``, which also applies the budget to vLLM.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from ..config import M2liveConfig
from ..device_spec import is_derived
from ..quantization import WeightFormat
from ..record import Sink, as_sink
from ..residuals import ResidualTracker
from ..step import Step
from ..telemetry import ClockSource
from .control import SloControl
from .device import EngineInfo, build_predictor, choose_device, model_shape
from .logs import HookErrors, first_line, install_log_handler, log, scrub
from .recorder import Pending, Recorder

_MONITORS: list[weakref.ref] = []


def active_monitors() -> list[LiveMonitor]:
    """The monitors alive in this process (one per engine core)."""
    return [m for m in (r() for r in list(_MONITORS)) if m is not None and not m.closed]


class InjectedFault(RuntimeError):
    """Raised on purpose by the predictor when ``M2LIVE_FAULT`` is set (tests prove containment)."""


class LiveMonitor:
    def __init__(self, config: M2liveConfig, info: EngineInfo, *,
                 step_of: Callable[[Any, Any], Step | tuple[Step, list[str]]],
                 queue_view: Callable[[Any], Any] | None = None, clock_source: ClockSource | None = None,
                 sinks: Callable[[LiveMonitor], Iterable[Any]] | Iterable[Any] = ()) -> None:
        """``sinks``: the sinks, or a function of this monitor that builds them (it may read the labels,
        ``counters``, ``on_control`` and report a sink that cannot start with ``sink_failed``)."""
        install_log_handler()
        self.cfg = config.for_engine(info.engine_index)
        self.info = info
        self.engine = str(self.cfg.engine)
        self._step_of, self._queue_view = step_of, queue_view
        self.closed = False
        self.unmatched = 0
        self.exporter_errors = 0  # sinks that could not start
        self._errors = HookErrors(self.cfg, self.engine)
        shape = model_shape(self.cfg, info)
        self.device = choose_device(self.cfg, info, shape, clock_source)
        self.gpu, self.sampler = self.device.spec, self.device.sampler
        self.clock_source_name, self.clock_why = self.device.clock_source_name, self.device.clock_why
        self.prior_check = self.device.prior_check
        self.predictor, self.calibration = build_predictor(self.cfg, info, shape, self.device, self.engine)
        self.weights = WeightFormat(self.predictor.dtype, self.predictor.act_scale).label  # weights_info
        self.model_label = info.model_name or shape.name
        self.residuals = ResidualTracker(window=self.cfg.residual_window)
        self.control = SloControl(self.cfg, self.predictor, self.residuals, self.engine, self._errors)
        self.recorder = Recorder(predictor=self.predictor, residuals=self.residuals, device=self.device,
                                 control=self.control, labels=(self.engine, self.gpu.name, self.model_label),
                                 queue_size=self.cfg.queue_size, on_error=self._errors)
        self._stale_s = max(1.0, 50 * self.cfg.sample_ms / 1000.0)
        self._fault_every = self.cfg.fault_every
        # step state (the engine thread only)
        self._pending: dict[int, Pending] = {}
        self._max_pending = 64
        self._n = 0
        self._ovh_total = self._ovh_last = self._ovh_start = 0.0  # time in our hooks: total, at marks
        self._last_end = self._t_start = self._pre_s = 0.0
        self._decision = None
        for sink in (sinks(self) if callable(sinks) else sinks):
            self.add_sink(sink)
        self.recorder.start()
        _MONITORS.append(weakref.ref(self))
        log.info("engine %s: predicting %s (%s weights) on %s (tp=%d); clock: %s; admission: %s; sinks: %s",
                 self.engine, self.model_label, self.weights,
                 f"{self.gpu.name}, {self.gpu.source}" if self.gpu.arch == "cpu" or is_derived(self.gpu)
                 else self.gpu.name,
                 self.predictor.tp, self.clock_why,
                 f"SLO {self.control.slo_ms} ms" if self.admission_active else "off",
                 ", ".join(getattr(s, "name", type(s).__name__) for s in self.sinks) or "none")

    @property
    def scheduled_steps(self) -> int:
        """Steps taken up when scheduled so far (the index the latest one's record will carry)."""
        return self._n

    # --- sinks ------------------------------------------------------------------------------------------
    @property
    def sinks(self) -> list[Sink]:
        return self.recorder.sinks

    @property
    def observers(self) -> list:
        return self.recorder.observers

    def add_sink(self, sink: Any) -> None:
        """Attach another sink (``publish``/``flush``/``close``, or just ``submit(record)``)."""
        self.sinks.append(as_sink(sink))

    def sink(self, kind: str) -> Any:
        """The sink of that ``kind`` ("prometheus", "mqtt", "trace"), or None."""
        for s in self.sinks:
            if getattr(s, "kind", None) == kind:
                return getattr(s, "obj", s)
        return None

    prometheus = property(lambda self: self.sink("prometheus"))
    mqtt = property(lambda self: self.sink("mqtt"))
    trace = property(lambda self: self.sink("trace"))

    def sink_failed(self, what: str, e: BaseException) -> None:
        """A sink that could not start: counted in ``exporter_errors_total``, one warning; the engine goes on."""
        self.exporter_errors += 1
        log.warning("engine %s: %s unavailable, continuing without it: %s", self.engine, scrub(self.cfg, what),
                    scrub(self.cfg, first_line(e) or type(e).__name__))

    # --- live SLO control --------------------------------------------------------------------------------
    admission = property(lambda self: self.control.admission)
    admission_active = property(lambda self: self.control.active)

    def set_slo_ms(self, slo_ms: float | None) -> None:
        self.control.set_slo_ms(slo_ms)

    def set_admission(self, on: bool) -> None:
        self.control.set_admission(on)

    def on_control(self, msg: dict) -> None:
        self.control.on_control(msg)

    # --- counters ---------------------------------------------------------------------------------------
    hook_errors = property(lambda self: self._errors.total)
    steps = property(lambda self: self.recorder.steps)
    records_dropped = property(lambda self: self.recorder.dropped)
    overheads = property(lambda self: self.recorder.overheads)
    record_times = property(lambda self: self.recorder.record_times)
    step_times = property(lambda self: self.recorder.step_times)

    def counters(self) -> dict[str, float]:
        adm = self.admission
        out = {
            "hook_errors_total": float(self.hook_errors), "mqtt_dropped_total": 0.0,
            "slo_violations_total": float(adm.violations if adm is not None else 0), "trace_dropped_total": 0.0,
            "exporter_errors_total": float(self.exporter_errors + self.recorder.sink_errors),
            "clock_errors_total": float(self.sampler.errors if self.sampler is not None else 0),
            "unmatched_steps_total": float(self.unmatched), "records_dropped_total": float(self.records_dropped),
            "admission_fallback_total": float(getattr(adm, "fallbacks", 0) if adm is not None else 0),
            "control_changes_total": float(self.control.changes),
            "control_rejected_total": float(self.control.rejected), "trace_errors_total": 0.0,
        }
        for s in self.sinks:  # what each sink counts itself (MQTT drops, trace write errors, ...)
            for k, v in (s.sink_counters() if hasattr(s, "sink_counters") else {}).items():
                out[k] = out.get(k, 0.0) + float(v)
        return out

    # --- the hooks (the engine thread) ---------------------------------------------------------------------
    def _fresh_reading(self) -> tuple[Any, float | None]:
        """The sampler's latest reading and its age if fresh, else (None, None): the forecast is used."""
        r, age = self.sampler.latest() if self.sampler is not None else (None, math.inf)
        return (r, age) if r is not None and age <= self._stale_s else (None, None)

    def before_schedule(self, scheduler: Any, limits: tuple[int, int]) -> tuple[int, int] | None:
        """Admission: the (token budget, running-request cap) for this step within ``limits`` (the configured
        ones), or None: vLLM's configured limits (admission off, or it failed)."""
        t0 = time.perf_counter()
        self._t_start, self._ovh_start, self._decision = t0, self._ovh_total, None
        budget = None
        try:
            self.recorder.max_seqs = int(limits[1])  # the SLO capacity's ceiling (the record thread reads it)
            if self._queue_view is not None and self.control.active:
                reading = self._fresh_reading()[0]
                budget, d, slo_s = self.control.decide(self._queue_view(scheduler),
                                                       reading.sm_mhz if reading is not None else None, limits)
                self._decision = (d, slo_s)
        except Exception as e:  # noqa: BLE001
            budget = None
            self._errors("admission", e)
        self._pre_s = dt = time.perf_counter() - t0
        self._ovh_total += dt
        return budget

    def hook_error(self, where: str, e: BaseException) -> None:
        """An error in m2live code outside the monitor (e.g. applying the budget), counted like a hook's."""
        self._errors(where, e)

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
            reading, age = self._fresh_reading()
            if self._fault_every and self._n % self._fault_every == 0:
                raise InjectedFault(f"M2LIVE_FAULT: predictor failure injected on step {self._n}")
            dec, adm = self._decision, self.admission
            p = Pending(index=self._n, step=step, ids=ids, reading=reading, age=age, t_start=self._t_start, ovh0=self._ovh_start,
                        hook_s=self._pre_s, decision=dec, measured=0.0, wall_end=0.0,
                        slo_s=dec[1] if dec else (adm.slo_s if adm is not None else None))
            if len(self._pending) >= self._max_pending:  # outputs that never came back (aborted engine step)
                self._pending.pop(next(iter(self._pending)))
                self.unmatched += 1
            self._pending[id(output)] = p
        except Exception as e:  # noqa: BLE001
            self._errors("predict", e)
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
                self.recorder.put(p)
        except Exception as e:  # noqa: BLE001
            self._errors("update", e)
        finally:
            now = time.perf_counter()
            self._ovh_total += now - t_end
            self._last_end = now
            self._ovh_last = self._ovh_total

    # --- status / shutdown -------------------------------------------------------------------------------
    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every measured step has been handed to the sinks (True) or ``timeout`` seconds passed
        (False); then ask each sink to pass on what it queued."""
        done = self.recorder.flush(timeout)
        for sink in self.sinks:
            try:
                sink.flush()
            except Exception as e:  # noqa: BLE001
                self._errors(f"sink {getattr(sink, 'name', type(sink).__name__)} flush", e)
        return done

    def status(self) -> dict:
        return {
            "engine": self.engine, "gpu": self.gpu.name, "model": self.model_label, "tp": self.predictor.tp,
            "clock_source": self.clock_source_name, "clock_why": self.clock_why, "steps": self.steps,
            "admission": self.admission_active, "slo_ms": self.control.slo_ms,
            "residuals": self.residuals.stats(), **self.counters(),
        }

    def close(self) -> None:
        if self.closed:
            return
        self.flush(timeout=5.0)  # the steps already measured reach the sinks before they close
        self.closed = True
        self.recorder.close()
        if self.sampler is not None:
            try:
                self.sampler.stop()
                self.sampler.source.close()
            except Exception:  # noqa: BLE001
                pass
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:  # noqa: BLE001
                pass
