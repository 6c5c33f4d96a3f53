"""vLLM general plugin (entry point ``vllm.general_plugins: m2live = vllm_hooks.plugin:register``).

vLLM calls ``register()`` in every process (front end, engine core, workers) before the engine core resolves
its scheduler class (``EngineCore.__init__`` → ``load_general_plugins()`` → ``SchedulerConfig.get_scheduler_cls()``).
``register`` wraps ``SchedulerConfig.get_scheduler_cls`` once per process so that

* with ``M2LIVE_ENABLE=1`` and no scheduler chosen by the user, the engine uses ``vllm_hooks.scheduler.auto``
  (the m2live subclass of the Scheduler or AsyncScheduler vLLM would have used);
* ``--scheduler-cls pkg.module:attr`` (colon form) resolves like ``pkg.module.attr``.

A scheduler the user chose explicitly is never replaced. ``register`` never raises: any failure is one warning
line and vLLM runs unchanged; a configuration file that cannot be used is one ERROR line with the reason.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("m2live")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def enabled(environ=None) -> bool:
    env = os.environ if environ is None else environ
    flag = env.get("M2LIVE_ENABLE", "").strip().lower()
    if flag in _TRUE:
        return True
    if flag not in _FALSE:
        log.error("m2live is off for this engine: M2LIVE_ENABLE=%r is not one of 1/true/yes/on or "
                  "0/false/no/off", env.get("M2LIVE_ENABLE"))
        return False
    path = env.get("M2LIVE_CONFIG")
    if path:
        try:
            from m2live.config import M2liveConfig

            return M2liveConfig.from_env(env).enable
        except Exception as e:  # noqa: BLE001 - never raise into vLLM; but never switch off silently either
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.error("m2live is off for this engine: its configuration (M2LIVE_CONFIG=%s) is invalid: %s "
                      "(check it with `m2live config check`)", path, msg)
            return False
    return False


def register() -> None:
    try:
        _patch()
    except Exception as e:  # noqa: BLE001 - a plugin exception would abort vLLM start-up
        log.warning("m2live plugin not installed (vLLM runs unchanged): %s: %s", type(e).__name__, e)


def _patch() -> None:
    from vllm.config.scheduler import SchedulerConfig

    original = SchedulerConfig.get_scheduler_cls
    if getattr(original, "_m2live_wrapped", False):
        return

    def get_scheduler_cls(self):
        cls = getattr(self, "scheduler_cls", None)
        try:
            if cls is None and enabled():
                from .scheduler import auto

                return auto
            if isinstance(cls, str) and ":" in cls:
                import importlib

                module, _, attr = cls.partition(":")
                return getattr(importlib.import_module(module), attr)
        except Exception as e:  # noqa: BLE001
            log.warning("m2live scheduler unavailable, using vLLM's own: %s: %s", type(e).__name__, e)
        return original(self)

    get_scheduler_cls._m2live_wrapped = True  # type: ignore[attr-defined]
    get_scheduler_cls.__doc__ = original.__doc__
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls
