"""The per-step record that flows one way: plugin → residual tracker → sinks (Prometheus, MQTT, JSONL trace).

Sinks consume records; they never compute predictions. ``submit`` must never block the engine step: a sink
queues (bounded, dropping and counting) and does its I/O on its own thread.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Protocol


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


class Sink(Protocol):
    def submit(self, record: StepRecord) -> None:
        """Hand over one record; never blocks, never raises."""

    def close(self) -> None:
        """Flush what can be flushed quickly and stop."""
