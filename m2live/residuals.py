"""Online correction of the mechanistic prediction: the seed's "calibrated mode", done while serving.

The mechanistic model prices the device body from datasheet numbers; what it cannot know is this engine's host
floor (scheduler, input preparation, sampling, Python), its per-sequence host cost, and how far the real kernels
sit from the modelled efficiencies on this device. ``ResidualTracker`` fits those few terms online:

    measured ≈ a + b_mm · t_mm + b_attn · t_attn + c · num_seqs

with ``t_mm`` the predicted projection/light/LM-head body and ``t_attn`` the predicted attention body (both from
the mechanistic Prediction, so clock, shapes and batch composition stay mechanistic). The fit is weighted least
squares on relative error (weight 1/measured²), with exponential forgetting (recent steps count more), a Huber
down-weighting of outliers, and a ridge pull toward the prior (a = 0, b = 1, c = 0) so that it is sane from
the first few steps. Until ``min_fit`` steps are seen, the correction is the rolling median ratio.

Every correction is scored out of sample: ``update`` first records the error of the correction it would have
made, then learns from the step. ``upper(q)`` adds the q-quantile of those relative errors (admission control
uses it as a safety margin).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from .predictor import Prediction
from .step import Step

_ATTN_OPS = ("attn_prefill", "attn_decode")
_HOST_OPS = ("launch", "host", "sampling")


def features(prediction: Prediction, step: Step) -> tuple[float, float, float, float]:
    """(1, t_mm ms, t_attn ms, num_seqs) for the host-term fit."""
    ops = prediction.ops
    t_attn = ops.get("attn_prefill", 0.0) + ops.get("attn_decode", 0.0)
    t_mm = max(0.0, prediction.t_blocks - t_attn)
    return (1.0, 1e3 * t_mm, 1e3 * t_attn, float(step.num_seqs))


class ResidualTracker:
    def __init__(self, window: int = 256, forget: float = 0.995, min_fit: int = 8, ridge: float = 0.05):
        if window < 8:
            raise ValueError(f"residual window must be >= 8, got {window}")
        if not (0.5 < forget <= 1.0):
            raise ValueError(f"forgetting factor must be in (0.5, 1], got {forget}")
        self.window = window
        self.forget = forget
        self.min_fit = min_fit
        self.ridge = ridge
        self.n = 0
        self._prior = np.array([0.0, 1.0, 1.0, 0.0])
        self._A = np.zeros((4, 4))
        self._b = np.zeros(4)
        self._wsum = 0.0
        self._theta: tuple[float, float, float, float] | None = None
        # out-of-sample relative errors (measured − estimate) / measured
        self._raw: deque[float] = deque(maxlen=window)
        self._cor: deque[float] = deque(maxlen=window)
        self._ratio: deque[float] = deque(maxlen=window)  # measured / raw predicted
        self._ratio_median = 1.0
        self._upper_cache: dict[float, float] = {}
        self._mad = 0.1

    # --- estimates --------------------------------------------------------------------------------
    def correct(self, prediction: Prediction, step: Step) -> float:
        """Corrected expected step time in seconds (the raw prediction stays in ``prediction.total_s``)."""
        th = self._theta
        if th is not None:
            x = features(prediction, step)
            est = (th[0] + th[1] * x[1] + th[2] * x[2] + th[3] * x[3]) * 1e-3
            if est > 0.2 * prediction.total_s * self._ratio_median and est > 0:
                return est
        return prediction.total_s * self._ratio_median

    def upper(self, prediction: Prediction, step: Step, q: float = 0.95) -> float:
        """Corrected upper q-quantile: the correction times (1 + q-quantile of its recent relative error)."""
        est = self.correct(prediction, step)
        m = self._upper_cache.get(q)
        if m is None:
            if len(self._cor) >= 4:
                # relative error r = (measured − est)/measured → measured = est / (1 − r)
                r = float(np.quantile(np.fromiter(self._cor, float), q))
                m = 1.0 / max(0.2, 1.0 - r) if r > 0 else 1.0
            else:
                m = 1.5  # no evidence yet: a wide margin
            self._upper_cache[q] = m
        return est * m

    # --- learning ---------------------------------------------------------------------------------
    def update(self, step: Step, prediction: Prediction, measured_s: float) -> None:
        if not (measured_s > 0 and math.isfinite(measured_s)) or not (prediction.total_s > 0):
            return
        est = self.correct(prediction, step)
        r_cor = (measured_s - est) / measured_s
        self._raw.append((measured_s - prediction.total_s) / measured_s)
        self._cor.append(r_cor)
        self._ratio.append(measured_s / prediction.total_s)
        self._upper_cache.clear()
        self.n += 1
        if self.n <= 16 or self.n % 8 == 0:
            self._ratio_median = float(np.median(np.fromiter(self._ratio, float)))
            self._mad = max(0.02, float(np.median(np.abs(np.fromiter(self._cor, float)))))

        # weighted least squares on relative error with forgetting and a Huber weight
        x = np.array(features(prediction, step))
        y = 1e3 * measured_s
        w = 1.0 / (y * y)
        k = 3.0 * self._mad
        if self.n > self.min_fit and abs(r_cor) > k:
            w *= k / abs(r_cor)
        self._A *= self.forget
        self._b *= self.forget
        self._wsum = self._wsum * self.forget + 1.0
        self._A += w * np.outer(x, x)
        self._b += w * y * x
        if self.n >= self.min_fit:
            self._solve()

    def _solve(self) -> None:
        # ridge toward the prior, scaled like one step's worth of evidence per unit of `ridge`
        scale = np.maximum(np.diag(self._A) / max(self._wsum, 1.0), 1e-12)
        lam = self.ridge * scale
        A = self._A + np.diag(lam)
        b = self._b + lam * self._prior
        try:
            th = np.linalg.solve(A, b)
        except np.linalg.LinAlgError:
            return
        if not np.all(np.isfinite(th)):
            return
        # physical sanity: no negative time per unit of work or per sequence
        th[1:] = np.maximum(th[1:], 0.0)
        self._theta = (float(th[0]), float(th[1]), float(th[2]), float(th[3]))

    # --- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict:
        def med_abs(d: deque[float]) -> float | None:
            return float(np.median(np.abs(np.fromiter(d, float)))) if d else None

        th = self._theta
        return {
            "n": self.n,
            "window": len(self._cor),
            "median_abs_ratio_raw": med_abs(self._raw),
            "median_abs_ratio_corrected": med_abs(self._cor),
            "median_measured_over_predicted": self._ratio_median,
            "host_floor_s": None if th is None else th[0] * 1e-3,
            "scale_mm": None if th is None else th[1],
            "scale_attn": None if th is None else th[2],
            "per_seq_s": None if th is None else th[3] * 1e-3,
            "fitted": th is not None,
        }
