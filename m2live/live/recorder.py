"""The record thread (``m2live-record``): everything per step that need not run on the engine's thread.

The engine thread ``put``s a measured step (``Pending``) on a bounded queue; a step that finds it full
displaces the oldest one, counted in ``records_dropped_total``. The thread predicts the step with the clock read
when it was scheduled, corrects it, updates the residual tracker (and the CPU device's prior check and the
SLO count), builds the record (``m2live.record.build_record``) and hands it to the sinks, then to the
observers. On a GPU the engine thread waits for the device meanwhile; ``flush()`` waits for the thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..predictor import Prediction, Predictor
from ..record import Sink, StepRecord, build_record
from ..residuals import ResidualTracker
from ..step import Step
from ..workqueue import DropOldestQueue
from .control import SloControl
from .device import Device

CAPACITY_EVERY_S = 1.0  # how often the record thread re-prices the SLO capacity


class Pending:
    """One scheduled step, from ``on_schedule`` (what ran, the clock) to the record thread (measured)."""

    __slots__ = ("index", "step", "ids", "reading", "age", "t_start", "ovh0", "hook_s", "decision", "slo_s",
                 "measured", "wall_end")

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


Observer = Callable[[StepRecord, Step, "list[str] | None"], None]


class Recorder:
    def __init__(self, *, predictor: Predictor, residuals: ResidualTracker, device: Device, control: SloControl,
                 labels: tuple[str, str, str], queue_size: int,
                 on_error: Callable[[str, BaseException], None]) -> None:
        self.predictor = predictor
        self.residuals = residuals
        self.device = device
        self.control = control
        self.engine, self.gpu, self.model = labels
        self._on_error = on_error
        self.sinks: list[Sink] = []
        # observers get (record, step, request ids) on the record thread: tests and the demo, not the sinks
        self.observers: list[Observer] = []
        self.steps = 0
        self.sink_errors = 0
        self.overheads: deque[float] = deque(maxlen=100_000)  # per-step hook time on the engine thread (s)
        self.record_times: deque[float] = deque(maxlen=100_000)  # per-step time on the record thread (s)
        self.step_times: deque[float] = deque(maxlen=100_000)  # per-step measured time (s)
        self._work: DropOldestQueue[Pending] = DropOldestQueue(max(64, queue_size))
        # the SLO capacity (AdmissionController.capacity), recomputed at most every CAPACITY_EVERY_S on this thread
        self.max_seqs = 0  # vLLM's max_num_seqs, as the scheduler hook last passed it
        self._context: int | None = None  # mean cached tokens of the latest step's decoding requests
        self._capacity: tuple[float, float | None, int | None] = (-CAPACITY_EVERY_S, None, None)  # (when, SLO, value)
        self._thread = threading.Thread(target=self._loop, name="m2live-record", daemon=True)

    @property
    def dropped(self) -> int:
        return self._work.dropped

    def start(self) -> None:
        self._thread.start()

    def put(self, p: Pending) -> None:
        self._work.put(p)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every measured step has been recorded (True) or ``timeout`` seconds passed (False)."""
        return self._work.join(timeout)

    def close(self) -> None:
        self._work.close()
        self._thread.join(timeout=2.0)
        if self.device.prior_check is not None:
            self.device.prior_check.close()

    def _loop(self) -> None:
        prior = self.device.prior_check
        while True:
            items = self._work.take(0.5, most=1)
            if not items:
                if prior is not None:
                    prior.idle()  # no step for 0.5 s: the engine idles; a pending re-measurement starts (a child)
                if self._work.closed:
                    return
                continue
            t0 = time.perf_counter()
            try:
                self._record(items[0])
            except Exception as e:  # noqa: BLE001
                self._on_error("record", e)
            finally:
                self.record_times.append(time.perf_counter() - t0)
                self._work.done(1)

    def _slo_capacity(self, p: Pending, step: Step) -> int | None:
        """The requests that could decode together within the step's SLO at the latest decode context, recomputed
        when the SLO changes or CAPACITY_EVERY_S has passed (a bisection of predictions: ~0.2-5 ms at max_num_seqs
        256-4096), else the last value; None with no SLO, or before the first decode."""
        if step.decode_contexts:
            self._context = round(sum(step.decode_contexts) / len(step.decode_contexts))
        admission = self.control.admission
        if admission is None or p.slo_s is None or self._context is None or self.max_seqs < 1:
            return None
        when, slo, value = self._capacity
        now = time.monotonic()
        if slo != p.slo_s or now - when >= CAPACITY_EVERY_S:
            value = None
            try:  # priced at the step's own SLO, whatever is in force by now
                value = admission.capacity(self._context, self.max_seqs,
                                           p.reading.sm_mhz if p.reading is not None else None, slo_s=p.slo_s)
            except Exception as e:  # noqa: BLE001 - the record goes out without it; retried in a second
                self._on_error("capacity", e)
            self._capacity = (now, p.slo_s, value)
        return value

    def _predict(self, p: Pending) -> tuple[Prediction, str]:
        """The step's prediction with the clock read when it was scheduled (else the power-cap forecast)."""
        if p.reading is not None:
            return (self.predictor.predict(p.step, clock_mhz=p.reading.sm_mhz),
                    self.device.clock_source_name)
        # no live clock: the power-cap forecast (a device without a power model forecasts boost)
        return self.predictor.predict(p.step, f_clk=None if self.device.has_power_model else 1.0), "forecast"

    def _record(self, p: Pending) -> None:
        step: Step = p.step
        pred, source = self._predict(p)
        measured = p.measured
        corrected = self.residuals.update(step, pred, measured)  # the correction scored before learning from it
        if self.device.prior_check is not None:
            self.device.prior_check.observe(pred.total_s, pred.t_blocks, measured)
        admission = self.control.admission
        violation = None
        if admission is not None and p.slo_s is not None:
            violation = admission.observe(measured, p.slo_s)
        self.steps += 1
        capacity = self._slo_capacity(p, step)
        rec = build_record(
            index=p.index, time=p.wall_end, engine=self.engine, gpu=self.gpu, model=self.model,
            boost_mhz=self.device.spec.boost_mhz, step=step, prediction=pred, corrected_s=corrected,
            measured_s=measured, clock_source=source, reading=p.reading, clock_age_s=p.age,
            decision=p.decision[0] if p.decision else None, slo_s=p.slo_s, slo_violation=violation,
            hook_overhead_s=p.hook_s, capacity_seqs=capacity)
        for sink in self.sinks:
            try:
                sink.publish(rec)
            except Exception as e:  # noqa: BLE001
                self.sink_errors += 1
                self._on_error(f"sink {getattr(sink, 'name', type(sink).__name__)}", e)
        self.overheads.append(p.hook_s)
        for obs in self.observers:
            try:
                obs(rec, step, p.ids)
            except Exception as e:  # noqa: BLE001
                self._on_error("observer", e)
        self.step_times.append(measured)
