"""Live SLO control: the admission controller, the SLO in force, and the changes that reach it while the
engine runs (``set_slo_ms`` / ``set_admission`` from Python, ``on_control`` from the MQTT control topic).

Each step ``decide`` turns the controller's decision into the (token budget, running-request cap) the
scheduler should use, within the engine's configured limits; applying it to vLLM is ``vllm_hooks``' job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import limits as bounds
from ..config import M2liveConfig
from ..predictor import Predictor
from ..residuals import ResidualTracker

log = logging.getLogger("m2live")


class SloControl:
    """Owns the ``AdmissionController`` (made when an SLO first appears) and the live changes to it."""

    def __init__(self, cfg: M2liveConfig, predictor: Predictor, residuals: ResidualTracker, engine: str,
                 on_error: Callable[[str, BaseException], None]) -> None:
        self.cfg = cfg
        self.engine = engine
        self._predictor = predictor
        self._residuals = residuals
        self._on_error = on_error
        self.admission: Any = None  # m2live.admission.AdmissionController, or None (no SLO ever set)
        self.slo_ms = cfg.slo_ms
        self._on = cfg.admission_on
        self.changes = 0  # remote control changes applied (MQTT)
        self.rejected = 0  # remote control changes refused here (the publisher counts its own)
        self._lock = threading.Lock()  # set_slo_ms / set_admission come from the MQTT thread
        if self.slo_ms is not None:
            self._make_admission()

    def _make_admission(self) -> None:
        try:
            from ..admission import AdmissionController

            slo = self.slo_ms / 1000.0 if (self.slo_ms is not None and self._on) else None
            self.admission = AdmissionController(self._predictor, self._residuals, slo, margin=self.cfg.slo_margin)
        except Exception as e:  # noqa: BLE001
            self.admission = None
            self._on_error("admission setup", e)

    @property
    def active(self) -> bool:
        return self.admission is not None and self.admission.slo_s is not None

    def _apply(self) -> None:
        if self.admission is not None:
            self.admission.set_slo(self.slo_ms / 1000.0 if self.slo_ms and self._on else None)

    # --- each step (the engine thread) -------------------------------------------------------------------
    def decide(self, view: Any, clock_mhz: float | None, limits: tuple[int, int]) -> tuple[tuple[int, int], Any, float]:
        """((token budget, running-request cap) within ``limits``, the decision, the SLO it was made under)."""
        ctrl = self.admission
        d = ctrl.decide(view, clock_mhz)
        budget = (max(1, min(int(d.token_budget), limits[0])), max(1, min(int(d.max_active), limits[1])))
        return budget, d, ctrl.slo_s

    # --- live changes (any thread) ------------------------------------------------------------------------
    def set_slo_ms(self, slo_ms: float | None) -> None:
        """Change the step SLO live (None: no SLO, admission off); the bounds of ``M2LIVE_SLO_MS``. Thread-safe."""
        if slo_ms is not None:
            try:
                bounds.SLO_MS.check(slo_ms, "SLO")
            except ValueError:
                raise ValueError(f"SLO must be a positive number of ms within {bounds.SLO_MS.describe()}, got "
                                 f"{slo_ms!r}") from None
        with self._lock:
            self.slo_ms = None if slo_ms is None else float(slo_ms)
            if self.slo_ms is not None and self.cfg.admission is None:
                self._on = True
            if self.admission is None and self.slo_ms is not None:
                self._make_admission()
            self._apply()
        log.info("engine %s: SLO set to %s ms (admission %s)", self.engine, self.slo_ms,
                 "on" if self.active else "off")

    def set_admission(self, on: bool) -> None:
        """Turn admission control on/off live (needs an SLO to do anything). Thread-safe."""
        with self._lock:
            self._on = bool(on)
            if self.admission is None and self.slo_ms is not None and on:
                self._make_admission()
            self._apply()
        log.info("engine %s: admission %s", self.engine, "on" if self.active else "off")

    def on_control(self, msg: dict) -> None:
        """MQTT control message (already validated by the publisher), e.g. {"slo_ms": 40} / {"admission": false}.
        Values are checked again against the configuration's bounds; each applied change is logged with the
        old and the new value and counted in ``control_changes_total``, a refused one in
        ``control_rejected_total``."""
        try:
            before = (self.slo_ms, self.active)
            if "slo_ms" in msg:
                self.set_slo_ms(msg["slo_ms"])
            if "admission" in msg:
                v = msg["admission"]
                if not isinstance(v, bool):
                    raise ValueError(f"admission must be true or false, got {v!r}")
                self.set_admission(v)
            self.changes += 1
            by = msg.get("by")
            log.warning("engine %s: remote control applied at %s by %s: SLO %s -> %s ms, admission %s -> %s",
                        self.engine, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        f"'{by}' (as the message says)" if by else "an unnamed MQTT publisher", before[0],
                        self.slo_ms, "on" if before[1] else "off", "on" if self.active else "off")
        except Exception as e:  # noqa: BLE001
            self.rejected += 1
            self._on_error("control", e)
