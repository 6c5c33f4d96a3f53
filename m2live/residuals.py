"""Online correction of the mechanistic prediction: the seed's "calibrated mode", done while serving.

The mechanistic model prices the device body from datasheet numbers; what it cannot know is this engine's host
floor (scheduler, input preparation, sampling, Python), its host cost per sequence, and how far the real kernels
sit from the modelled efficiencies on this device. ``ResidualTracker`` fits those few terms online:

    measured ≈ a + b_mm · t_mm + b_attn · t_attn + c_dec · decode_seqs + c_pf · prefill_chunks

(a prefill chunk costs the host more than a decoding sequence: block allocation, the request's first sampling and
detokenisation; one shared per-sequence term made the floor absorb it and over-correct decode-only steps)

with ``t_mm`` the predicted projection/light/LM-head body and ``t_attn`` the predicted attention body (both from
the mechanistic Prediction, so clock, shapes and batch composition stay mechanistic). The fit is weighted least
squares on relative error (weight 1/measured) over a rolling window (recent steps only), robust (Huber then Tukey
weights: outliers such as a preempted CPU get no weight), and a ridge pull toward the prior (a = 0, b = 1, c = 0)
worth one step of evidence per term, so that the first fits are sane and a full window is hardly biased. Until
``min_fit`` steps are seen, the correction is the rolling median ratio.

Every correction is scored out of sample: ``update`` first records the error of the correction it would have
made, then learns from the step. ``upper(q)`` adds the q-quantile of those relative errors (admission control
uses it as a safety margin).

The plugin calls ``update`` on its record thread, off the engine's critical path; admission control reads
``upper`` on the engine's thread.
"""

from __future__ import annotations

import math
import threading
from collections import deque

import numpy as np

from .predictor import Prediction
from .step import Step

NF = 5  # features of the host-term fit


def features(prediction: Prediction, step: Step) -> tuple[float, float, float, float, float]:
    """(1, t_mm ms, t_attn ms, decoding sequences, prefill chunks) for the host-term fit."""
    ops = prediction.ops
    t_attn = ops.get("attn_prefill", 0.0) + ops.get("attn_decode", 0.0)
    t_mm = max(0.0, prediction.t_blocks - t_attn)
    return (1.0, 1e3 * t_mm, 1e3 * t_attn, float(len(step.decode_contexts)), float(len(step.prefill_seqs)))


class ResidualTracker:
    def __init__(self, window: int = 256, min_fit: int = 8, ridge: float = 1.0, refit_every: int = 32):
        if window < 8:
            raise ValueError(f"residual window must be >= 8, got {window}")
        self.window = window
        self.min_fit = min_fit
        self.ridge = ridge
        self.refit_every = max(1, refit_every)
        self.n = 0
        self._prior = np.array([0.0, 1.0, 1.0, 0.0, 0.0])
        # ring buffer over the last `window` steps, one plain tuple per step (turned into arrays only when
        # fitting or reporting):
        # (*features, measured ms, raw predicted ms, raw rel. error, corrected rel. error)
        self._rows: deque[tuple[float, ...]] = deque(maxlen=window)
        self._theta: tuple[float, ...] | None = None
        self._ratio_median = 1.0
        self._upper_cache: dict[float, float] = {}
        self._lock = threading.Lock()  # guards the ring buffer between update() and readers on other threads

    # --- estimates --------------------------------------------------------------------------------
    def correct(self, prediction: Prediction, step: Step) -> float:
        """Corrected expected step time in seconds (the raw prediction stays in ``prediction.total_s``)."""
        th = self._theta
        if th is not None:
            est = 1e-3 * sum(t * x for t, x in zip(th, features(prediction, step), strict=True))
            if est > 0.0:
                return est
        return prediction.total_s * self._ratio_median

    def upper(self, prediction: Prediction, step: Step, q: float = 0.95) -> float:
        """Corrected upper q-quantile: the correction times (1 + q-quantile of its recent relative error)."""
        est = self.correct(prediction, step)
        m = self._upper_cache.get(q)
        if m is None:
            k = len(self._rows)
            if k >= 4:
                # relative error r = (measured − est)/measured → measured = est / (1 − r)
                with self._lock:  # update() appends on the record thread
                    cor = [row[-1] for row in self._rows]
                r = float(np.quantile(cor, q))
                m = 1.0 / max(0.2, 1.0 - r) if r > 0 else 1.0
            else:
                m = 1.5  # no evidence yet: a wide margin
            self._upper_cache[q] = m
        return est * m

    # --- learning ---------------------------------------------------------------------------------
    def update(self, step: Step, prediction: Prediction, measured_s: float) -> None:
        if not (measured_s > 0 and math.isfinite(measured_s)) or not (prediction.total_s > 0):
            return
        est = self.correct(prediction, step)  # scored before learning from this step
        row = (*features(prediction, step), 1e3 * measured_s, 1e3 * prediction.total_s,
               (measured_s - prediction.total_s) / measured_s, (measured_s - est) / measured_s)
        with self._lock:
            self._rows.append(row)
            self.n += 1
            # the error quantile over a window of steps moves slowly: recompute it every 8 steps once warm
            if self.n <= 64 or self.n % 8 == 0:
                self._upper_cache.clear()
        every = 1 if self.n <= 2 * self.min_fit else 4 if self.n <= 64 else 8 if self.n <= 256 else self.refit_every
        if self.n % every == 0:
            self._refit()

    def _refit(self) -> None:
        with self._lock:  # a consistent snapshot
            a = np.array(self._rows, dtype=float).reshape(-1, NF + 4)
        k = len(a)
        X, y, p = a[:, :NF], a[:, NF], a[:, NF + 1]
        self._ratio_median = float(np.median(y / p)) if k else 1.0
        if k < self.min_fit:
            return
        # IRLS on relative error: Huber, then Tukey's biweight (gross outliers -- a preempted CPU, a GC pause --
        # get zero weight); ridge toward the prior keeps the 4 terms sane on narrow data.
        base = 1.0 / y
        w = np.ones(k)
        th = self._prior.copy()
        for it in range(3):
            sw = base * w
            A = X * sw[:, None]
            b = y * sw
            G = A.T @ A
            lam = self.ridge * np.maximum(np.diag(G) / k, 1e-12)  # the prior counts as `ridge` average steps
            try:
                th = np.linalg.solve(G + np.diag(lam), A.T @ b + lam * self._prior)
            except np.linalg.LinAlgError:
                return
            th = np.maximum(th, 0.0)  # no negative floor, time per unit of work or per sequence
            r = (y - X @ th) / y
            s = 1.4826 * float(np.median(np.abs(r))) + 1e-3
            u = np.abs(r) / s
            if it == 0:
                w = np.minimum(1.0, 1.345 / np.maximum(u, 1e-12))
            else:
                w = np.where(u < 4.685, (1 - (u / 4.685) ** 2) ** 2, 0.0)
        if np.all(np.isfinite(th)):
            self._theta = tuple(float(t) for t in th)

    # --- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            a = np.array(self._rows, dtype=float).reshape(-1, NF + 4)
        k = len(a)

        def med_abs(col: int) -> float | None:
            return float(np.median(np.abs(a[:, col]))) if k else None

        th = self._theta
        return {
            "n": self.n,
            "window": k,
            "median_abs_ratio_raw": med_abs(NF + 2),
            "median_abs_ratio_corrected": med_abs(NF + 3),
            "median_measured_over_predicted": self._ratio_median,
            "host_floor_s": None if th is None else th[0] * 1e-3,
            "scale_mm": None if th is None else th[1],
            "scale_attn": None if th is None else th[2],
            "per_decode_seq_s": None if th is None else th[3] * 1e-3,
            "per_prefill_chunk_s": None if th is None else th[4] * 1e-3,
            "fitted": th is not None,
        }
