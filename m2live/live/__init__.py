"""The live plugin's engine side, split by concern (none of it imports vLLM, Prometheus or MQTT code):

- ``monitor`` — ``LiveMonitor``: the three per-step hooks, counters, status, shutdown; ``active_monitors``.
- ``device`` — ``EngineInfo``; which device and clock to predict with, the predictor and its calibration.
- ``control`` — live SLO control: the admission controller and the changes that reach it while serving.
- ``recorder`` — the record thread and its bounded queue: predict, correct, record, hand to the sinks.
- ``logs`` — the plugin's log handler (installed when a monitor starts), secret masking, hook error counts.

The sinks (Prometheus, MQTT, the JSONL trace) are built in ``vllm_hooks.sinks`` and handed to the monitor.
"""

from .device import EngineInfo
from .monitor import InjectedFault, LiveMonitor, active_monitors

__all__ = ["EngineInfo", "InjectedFault", "LiveMonitor", "active_monitors"]
