"""The per-step record that flows one way: plugin → residual tracker → sinks (Prometheus, MQTT, JSONL trace).

``build_record`` makes it from what the monitor knows about one step (a pure function). Sinks consume records;
they never compute predictions. ``publish`` must never block the record thread for long: a sink queues
(bounded, dropping and counting) and does its I/O on its own thread.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .predictor import Prediction
    from .step import Step
    from .telemetry import ClockReading


@dataclass
class StepRecord:
    step: int  # engine-local step index
    time: float  # wall clock (time.time()) when the step finished
    engine: str  # engine label (data-parallel index, or "0")
    gpu: str  # NVML name of the device predicted for ("cpu" on a CPU-only machine)
    model: str
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    prefill_kv_tokens: int  # context already cached under the prefill chunks
    decode_kv_tokens: int  # sum of decode contexts
    predicted_s: float  # mechanistic prediction
    corrected_s: float  # after the online residual correction
    measured_s: float | None  # None until the step's output arrived
    f_clk: float  # clock ratio used for the prediction
    clock_mhz: float
    boost_mhz: float
    clock_source: str  # "nvml" | "cpufreq" | "fixed" | "replay" | "forecast"
    ops: dict[str, float] = field(default_factory=dict)  # op -> predicted seconds
    factors: dict[str, dict[str, float]] = field(default_factory=dict)  # factor -> {op: value}
    bound: dict[str, str] = field(default_factory=dict)
    power_w: float | None = None
    power_limit_w: float | None = None
    clock_event_reasons: int | None = None  # NVML clock-event (throttle) reason bitmask
    temperature_c: float | None = None
    clock_age_s: float | None = None  # age of the clock sample used
    token_budget: int | None = None  # admission decision applied to this step
    max_active: int | None = None
    slo_s: float | None = None
    slo_violation: bool | None = None
    admission_flagged: bool | None = None  # no budget could meet the SLO (decodes ran anyway)
    hook_overhead_s: float | None = None  # time spent in m2live code for this step
    # requests that could decode together within the SLO at the latest decode context (the admission controller's
    # rule: AdmissionController.capacity, at most max_num_seqs); None with no SLO in force
    capacity_seqs: int | None = None

    @property
    def residual_ratio(self) -> float | None:
        """(measured − predicted) / measured, on the mechanistic prediction."""
        if not self.measured_s:
            return None
        return (self.measured_s - self.predicted_s) / self.measured_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["residual_ratio"] = self.residual_ratio
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def build_record(*, index: int, time: float, engine: str, gpu: str, model: str, boost_mhz: float, step: Step,
                 prediction: Prediction, corrected_s: float, measured_s: float, clock_source: str,
                 reading: ClockReading | None = None, clock_age_s: float | None = None, decision: Any = None,
                 slo_s: float | None = None, slo_violation: bool | None = None,
                 hook_overhead_s: float | None = None, capacity_seqs: int | None = None) -> StepRecord:
    """The record of one measured step: its shape (``step``), the prediction made for it with the clock read
    when it was scheduled (``reading``, None: the forecast), the correction, the measurement and the admission
    ``decision`` it ran under (``m2live.admission.Decision`` or None)."""
    c = step.counts()
    r, d, p = reading, decision, prediction
    return StepRecord(
        step=index, time=time, engine=engine, gpu=gpu, model=model,
        num_prefill_tokens=c["prefill_tokens"], num_decode_tokens=c["decode_reqs"],
        num_prefill_seqs=len(step.prefill_seqs), num_decode_seqs=c["decode_reqs"],
        prefill_kv_tokens=c["prefill_kv_tokens"], decode_kv_tokens=c["decode_kv_tokens"],
        predicted_s=p.total_s, corrected_s=corrected_s, measured_s=measured_s, f_clk=p.f_clk,
        clock_mhz=p.clock_mhz, boost_mhz=boost_mhz, clock_source=clock_source,
        ops=dict(p.ops), factors=p.factors, bound=p.bound,
        power_w=r.power_w if r else None, power_limit_w=r.power_limit_w if r else None,
        clock_event_reasons=r.event_reasons if r else None, temperature_c=r.temperature_c if r else None,
        clock_age_s=clock_age_s, token_budget=d.token_budget if d else None,
        max_active=d.max_active if d else None, slo_s=slo_s, slo_violation=slo_violation,
        admission_flagged=d.no_budget if d else None, hook_overhead_s=hook_overhead_s,
        capacity_seqs=capacity_seqs,
    )


@runtime_checkable
class Sink(Protocol):
    """Where records go (Prometheus, MQTT, the JSONL trace; built by ``vllm_hooks.sinks``).

    Optional, looked up with ``getattr``: ``kind`` (``"prometheus"``, ``"mqtt"``, ``"trace"``: how the monitor
    names it, e.g. ``monitor.mqtt``) and ``sink_counters()`` (cumulative counters the monitor adds to its own,
    e.g. ``{"mqtt_dropped_total": 3}``)."""

    def publish(self, record: StepRecord) -> None:
        """Hand over one record; never blocks on I/O, never raises."""

    def flush(self) -> None:
        """Hand on what is queued now (never waits on the network)."""

    def close(self) -> None:
        """Flush what can be flushed quickly and stop."""


class _SubmitSink:
    """An object with ``submit(record)`` or ``publish(record)`` (``flush``, ``close`` optional) as a ``Sink``."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.kind = getattr(obj, "kind", None)
        self.name = type(obj).__name__
        self.publish = getattr(obj, "publish", None) or obj.submit

    def flush(self) -> None:
        f = getattr(self.obj, "flush", None)
        if f is not None:
            f()

    def close(self) -> None:
        c = getattr(self.obj, "close", None)
        if c is not None:
            c()

    def sink_counters(self) -> dict[str, float]:
        f = getattr(self.obj, "sink_counters", None)
        return f() if f is not None else {}


def as_sink(obj: Any) -> Sink:
    """``obj`` itself when it has ``publish``, ``flush`` and ``close``; an object with only ``submit(record)``
    (the older sink interface, still what tests and observers pass) wrapped as one."""
    if all(callable(getattr(obj, m, None)) for m in ("publish", "flush", "close")):
        return obj
    return _SubmitSink(obj)
