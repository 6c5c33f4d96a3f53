"""The plugin's log: one stderr handler (installed when the first monitor starts, never at import), secrets
masked in every line, and hook errors counted and logged at most once per thousand of a kind."""

from __future__ import annotations

import logging
import sys
import threading

from ..config import M2liveConfig, mask_url

log = logging.getLogger("m2live")

_install_lock = threading.Lock()


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (not the stream of install time, which a
    test runner or a daemoniser may have closed or replaced since)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def install_log_handler() -> None:
    """Give the ``m2live`` logger its stderr handler (INFO, one line per record, not propagated), once per
    process; a second call does nothing. Handlers someone else added stay as they are."""
    with _install_lock:
        if any(isinstance(h, _StderrHandler) for h in log.handlers):
            return
        h = _StderrHandler()
        h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [m2live] %(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def scrub(cfg: M2liveConfig, text: str) -> str:
    """``text`` with the MQTT password and any URL user:password part masked (every log line goes through)."""
    pw = cfg.mqtt_password
    if pw:
        text = text.replace(pw, "***")
    if cfg.mqtt_url and cfg.mqtt_url in text:
        text = text.replace(cfg.mqtt_url, mask_url(cfg.mqtt_url))
    return text


def first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else ""


class HookErrors:
    """Counts the errors m2live caught in its own code (``hook_errors_total``); logs the first of each kind and
    then every thousandth, one line each, so a failure on every step never floods the engine's log."""

    def __init__(self, cfg: M2liveConfig, engine: str) -> None:
        self.cfg = cfg
        self.engine = engine
        self.total = 0
        self._per_kind: dict[str, int] = {}

    def __call__(self, where: str, e: BaseException) -> None:
        self.total += 1
        n = self._per_kind.get(where, 0) + 1
        self._per_kind[where] = n
        if n == 1 or n % 1000 == 0:
            log.warning("engine %s: hook error in %s (%d so far, engine continues): %s: %s", self.engine, where,
                        n, type(e).__name__, scrub(self.cfg, first_line(e)))
