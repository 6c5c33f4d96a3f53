"""Online correction of the mechanistic prediction: the seed's "calibrated mode", done while serving.

The mechanistic model prices the device body from datasheet (or, on the CPU device, start-up) numbers; what it
cannot know is how far this engine's kernels sit from them and the host work around them (scheduler, input
preparation, sampling, Python). A prior can be off by orders of magnitude — an unseen GPU, a wrong clock, a CPU
measured while busy — so the correction is built to converge from *any* prior:

1. **Scales first, in log space.** Each prediction is split into four op classes: GEMMs (projections and LM head),
   attention, the rest of the device body (norms, activations, all-reduce, launch gaps) and the host prior
   (per-sequence host work and the fixed tail). The fit finds one multiplicative scale per class,

       measured ≈ s_gemm·t_gemm + s_attn·t_attn + s_other·t_other + s_host·t_host,

   by minimising a Huber loss of ``log(measured) − log(fit)`` (gross outliers, beyond 6 robust sigmas, get no
   weight) with Gauss-Newton steps, starting from the median measured/predicted ratio. In log space a prior off
   by 100× is an offset of 4.6, not a leverage point: the first fit already removes it. A ridge worth one step
   of evidence pulls the four scales toward their common value (a class the recent steps do not exercise
   follows the others), and every scale is bounded to [1e-4, 1e4] of the prior.
2. **Then additive host terms** on what is left: ``y ≈ Σ b_c·(s_c·t_c) + a + c_dec·decoding sequences +
   c_pf·prefill chunks`` (a prefill chunk costs the host more than a decoding sequence: block allocation, the
   request's first sampling), least squares on relative error with every coefficient ≥ 0 (Lawson–Hanson) and a
   weak ridge toward the scales (b = 1, host terms 0). The b are free: on a tiny model whose prefill costs the
   host per chunk rather than per token the GEMM share of the fit falls to almost nothing — a bound on b (it
   was [0.2, 5]) left the corrected error at twice the run's noise floor in a third of such runs.
3. **Which model corrects is decided out of sample.** Both candidates (scales alone; scales with host terms) are
   refitted on the whole window, each scores every step before learning from it, and the host-term model
   corrects only while its median error over the last ``CHOOSE_STEPS`` steps is lower (with a little hysteresis)
   — so the host terms can refine the scales' fit, never spoil it on noisy steps.
4. **A fast level on top.** The median log residual of the last ``LEVEL_STEPS`` steps against the model in use,
   applied only beyond twice its own standard error: when another tenant makes the machine slower or faster,
   the window fit lags (its robust loss treats the first shifted steps as outliers); the level follows in a few
   steps, and on steady steps it stays at 1.

The fit runs over a rolling window, recent steps weighted more (half-life 48 steps), refitted every step at
first, then every few steps. Until ``min_fit`` steps are seen the correction is the median measured/predicted
ratio of the steps so far (already right in scale after one step).

Every correction is scored out of sample: ``update`` first records the error of the correction it would have
made, then learns from the step. ``upper(q)`` adds the q-quantile of those relative errors (admission control
uses it as a safety margin); ``converged`` says whether the recent out-of-sample errors are small enough to
trust the correction (admission falls back to vLLM's own budget while they are not).

The plugin calls ``update`` on its record thread, off the engine's critical path; admission control reads
``upper`` and ``converged`` on the engine's thread.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

import numpy as np

from .predictor import GEMM_OPS, Prediction
from .step import Step

CLASSES = ("gemm", "attn", "other", "host")
NC = len(CLASSES)
NH = 3  # additive host terms: 1, decoding sequences, prefill chunks
NF = NC + NH  # features per step
LOG_BOUND = math.log(1e4)  # scales within [1e-4, 1e4]
LEVEL_STEPS = 8  # the recent level: median log residual of this many steps
LEVEL_FAST = 4  # a clear shift: this many residuals on one side, each beyond the spread over LEVEL_WINDOW steps
LEVEL_WINDOW = 32
CHOOSE_STEPS = 16  # the two candidate models are compared on this many recent out-of-sample errors
# The window refits share the engine's cores (and the GIL): on a 2-core CPU a tiny Llama's 2.8 ms steps took
# 4.8-5.6 ms, and varied three times as much from step to step (log-difference 0.14-0.20 against 0.05), while
# the record thread refitted every step (~2 ms each). A scheduled refit therefore waits until the engine has run
# REFIT_TIME_RATIO times the last refit's own cost (measured step time since it; so the fits cost the engine
# at most ~1/REFIT_TIME_RATIO of its time), or until REFIT_MAX_GAP steps passed. The cost is the record thread's
# own CPU time: its wall time also counts the waits for the GIL while the engine's thread holds it (on a busy
# 2-core machine several times the fit itself), and gating on that left the warm-up fits eight steps apart.
# During warm-up (the first WARM_REFIT·min_fit steps) every step refits whatever it costs: the first fits decide
# the first tens of steps, there are few of them, and the engine's own speed drifts then — on 36 runs of the tiny
# Llama (2 cores) its steps 0-10 ran 43 % slower than its steady state, steps 10-20 38 %, steps 20-30 9 %. Warm-up
# ended at 16 steps, and a refit gated on its cost from there left the correction up to eight steps stale while the
# speed still drifted: replayed on those runs, the median error over steps 10-30 was 0.62 of the rescue test's bound
# on average (worst 1.21, a failure); refitting every step to 32 gives 0.56 (worst 0.85) at any refit cost. This
# costs ~16 more refits (~1-2 ms each) once per engine.
REFIT_TIME_RATIO = 20.0
REFIT_MAX_GAP = 8
WARM_REFIT = 4
# the host-term model may correct once it has been scored out of sample on this many steps (and keeps doing so
# only while it is ahead over the last CHOOSE_STEPS): on the real engine the scales alone over-predict the decode
# steps 2-3x until the host terms take over, and waiting for eight scored steps kept them in use to step 17
CHOOSE_MIN = 4
_GEMM = (*GEMM_OPS, "lm_head")
_ATTN = ("attn_prefill", "attn_decode")
_HOST = ("host", "sampling")


def features(prediction: Prediction, step: Step) -> tuple[float, ...]:
    """(t_gemm, t_attn, t_other, t_host in ms, 1, decoding sequences, prefill chunks)."""
    ops = prediction.ops
    g = sum(ops.get(k, 0.0) for k in _GEMM)
    a = sum(ops.get(k, 0.0) for k in _ATTN)
    h = sum(ops.get(k, 0.0) for k in _HOST)
    o = max(0.0, prediction.total_s - g - a - h)
    return (1e3 * g, 1e3 * a, 1e3 * o, 1e3 * h, 1.0, float(len(step.decode_contexts)),
            float(len(step.prefill_seqs)))


def _huber_weights(r: np.ndarray, floor: float) -> np.ndarray:
    """Huber IRLS weights of residuals ``r`` (robust scale from the MAD); beyond 6 sigmas: zero."""
    s = max(1.4826 * float(np.median(np.abs(r))), floor)
    u = np.abs(r) / s
    w = np.minimum(1.0, 1.345 / np.maximum(u, 1e-12))
    w[u > 6.0] = 0.0
    return w


def nnls(A: np.ndarray, b: np.ndarray, iterations: int = 100) -> np.ndarray | None:
    """min ||A x − b|| subject to x ≥ 0 (Lawson–Hanson active set; a handful of columns here)."""
    m, n = A.shape
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    for _ in range(iterations):
        grad = A.T @ (b - A @ x)
        if free.all() or np.max(np.where(free, -np.inf, grad)) <= 1e-12 * max(1.0, float(np.abs(grad).max())):
            return x
        free[int(np.argmax(np.where(free, -np.inf, grad)))] = True
        while True:  # least squares on the free set, stepping back to the boundary where it goes negative
            z = np.zeros(n)
            sol, *_ = np.linalg.lstsq(A[:, free], b, rcond=None)
            z[free] = sol
            if np.all(z[free] > 0):
                x = z
                break
            neg = free & (z <= 0)
            alpha = float(np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300)))
            x = x + alpha * (z - x)
            free &= x > 1e-12
            x[~free] = 0.0
    return x if np.all(np.isfinite(x)) else None


def fit_scales(X: np.ndarray, y: np.ndarray, u0: np.ndarray | None = None, ridge: float = 1.0,
               iterations: int = 8, recency: np.ndarray | None = None) -> np.ndarray:
    """Log-scales ``u`` (one per class) with ``y ≈ X @ exp(u)``: robust Gauss-Newton on log residuals.

    ``X``: per-class predicted times (k × NC, ≥ 0), ``y``: measured (> 0). The ridge pulls the scales toward
    their mean (worth ``ridge`` average steps of evidence); bounds ±LOG_BOUND."""
    keep = X.sum(axis=1) > 0
    X, y = X[keep], y[keep]
    rec = np.ones(len(y)) if recency is None else recency[keep]
    if len(y) == 0:
        return np.zeros(NC) if u0 is None else u0
    ly = np.log(y)
    if u0 is None:
        u0 = np.full(NC, float(np.median(ly - np.log(X.sum(axis=1)))))
    u = np.clip(u0.astype(float), -LOG_BOUND, LOG_BOUND)
    P = np.eye(NC) - 1.0 / NC  # deviation from the common scale
    absent = ~(X > 0).any(axis=0)

    def residuals(uu: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s = np.exp(uu)
        f = X @ s
        return ly - np.log(f), s, f

    # the ridge is worth ``ridge`` average steps of evidence on a class (a step's evidence is its share squared)
    r0, s0, f0 = residuals(u)
    J0 = (X * s0) / f0[:, None]
    kappa = ridge * float(np.sum(rec[:, None] * J0 * J0)) / (NC * max(float(np.sum(rec)), 1e-12))

    def objective(uu: np.ndarray, w: np.ndarray) -> float:
        r = residuals(uu)[0]
        return float(np.sum(w * r * r)) + kappa * float(uu @ P @ uu)

    w = rec.copy()
    for it in range(iterations):
        r, s, f = residuals(u)
        if it > 0:
            w = rec * _huber_weights(r, 0.02)
        J = (X * s) / f[:, None]  # d log f / d u: each class's share of the fit
        H = J.T @ (J * w[:, None]) + kappa * P + 1e-9 * np.eye(NC)
        H[absent, absent] += 1.0  # a class absent from the window: held by the ridge alone
        g = J.T @ (w * r) - kappa * (P @ u)
        try:
            step = np.linalg.solve(H, g)
        except np.linalg.LinAlgError:
            break
        base = objective(u, w)
        t = 1.0
        while t > 1e-3:  # backtracking: a Gauss-Newton step on a robust loss may overshoot
            cand = np.clip(u + t * step, -LOG_BOUND, LOG_BOUND)
            if objective(cand, w) <= base:
                u = cand
                break
            t *= 0.5
        if float(np.max(np.abs(t * step))) < 1e-4:
            break
    return u


class ResidualTracker:
    def __init__(self, window: int = 256, min_fit: int = 8, ridge: float = 1.0, refit_every: int = 16,
                 converged_error: float = 0.25, halflife: float = 48.0, host_ridge: float = 0.01):
        if window < 8:
            raise ValueError(f"residual window must be >= 8, got {window}")
        self.window = window
        self.min_fit = min_fit
        self.ridge = ridge
        # the host-term model's ridge toward the scales: weak (a hundredth of a step), because whether that model
        # corrects at all is decided on its out-of-sample errors; on the real tiny-Llama engine runs a ridge of
        # one step (0.1) left the corrected median after step 30 at 0.32 (0.30), 0.01 at 0.29
        self.host_ridge = host_ridge
        self.refit_every = max(1, refit_every)
        self.converged_error = converged_error
        self.halflife = halflife
        self.n = 0
        self._refit_ms = 0.0  # duration of the last refit (ms, this thread's wall time)
        self._since_ms = 0.0  # measured step time since the last refit (ms)
        self._refit_n = 0  # self.n at the last refit
        # one plain tuple per step over the last `window` steps (arrays only when fitting or reporting):
        # (*features, measured ms, raw predicted ms, raw rel. error, scales-only model's rel. error,
        #  scales + host model's rel. error (nan while there is none), corrected rel. error)
        self._rows: deque[tuple[float, ...]] = deque(maxlen=window)
        # two candidate models, both refitted on the whole window: per-class scales alone, and the scales refined
        # with additive host terms; which one corrects is decided by their recent out-of-sample errors
        self._scales: np.ndarray | None = None  # scales-only model
        self._scales_h: np.ndarray | None = None  # scales of the host-term model
        self._host_terms: np.ndarray | None = None  # its additive host terms (ms)
        self._use_host = False
        self._u: np.ndarray | None = None  # log-scales of the last fit (warm start of the next)
        self._ratio_median = 1.0
        self._level = 1.0  # recent level over the fit (the fast time scale; 1 on steady steps)
        self._converged = False
        self._upper_cache: dict[float, float] = {}
        self._lock = threading.Lock()  # guards the window between update() and readers on other threads

    # --- estimates --------------------------------------------------------------------------------
    def _model(self, host: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
        """One candidate model's (per-class scales, additive host terms): scales only, or with host terms."""
        return (self._scales_h, self._host_terms) if host else (self._scales, None)

    def _model_ms(self, x: tuple[float, ...] | np.ndarray, host: bool) -> float | None:
        """One candidate model's estimate (ms): scales only, or scales with host terms."""
        s, h = self._model(host)
        if s is None:
            return None
        est = float(s[0] * x[0] + s[1] * x[1] + s[2] * x[2] + s[3] * x[3])
        if h is not None:
            est += float(h[0] * x[4] + h[1] * x[5] + h[2] * x[6])
        return est if est > 0 else None

    def _structural_ms(self, x: tuple[float, ...] | np.ndarray) -> float | None:
        """The model in use, without the recent level."""
        return self._model_ms(x, self._use_host)  # (``_choose`` sets it only while there are host terms)

    def _estimate_ms(self, x: tuple[float, ...]) -> float | None:
        est = self._structural_ms(x)
        return None if est is None else est * self._level

    def _update_level(self) -> None:
        """The fast time scale: the median log residual of the last ``LEVEL_STEPS`` steps against the current
        fit, applied only beyond its own standard error (soft threshold). When the machine's speed shifts under
        the engine (another tenant starts or stops, or the engine's first steps run slower than its later ones)
        the window fit lags by tens of steps and its robust loss treats the first shifted steps as outliers; the
        level follows within a few steps. A clear shift is followed sooner: when the last ``LEVEL_FAST`` residuals
        all lie on one side, each beyond the residuals' own spread over the last ``LEVEL_WINDOW`` steps (on steady
        steps: a chance of about 0.16⁴·2 ≈ 1/1500 per step), the level is their median. On steady steps it stays
        at 1 (its threshold is the noise of a median of a few residuals), so it adds no noise."""
        if self._scales is None:
            self._level = 1.0
            return
        with self._lock:
            rows = np.array(list(self._rows)[-LEVEL_WINDOW:], dtype=float).reshape(-1, NF + 6)
        s, h = self._model(self._use_host)
        est = rows[:, :NC] @ s + (rows[:, NC:NF] @ h if h is not None else 0.0)  # _structural_ms, row by row
        ok = est > 0
        r = np.log(rows[ok, NF] / est[ok])
        if len(r) < LEVEL_STEPS // 2:
            self._level = 1.0
            return
        a = r[-LEVEL_STEPS:]
        med = float(np.median(a))
        se = 1.25 * 1.4826 * float(np.median(np.abs(a - med))) / math.sqrt(len(a))  # s.e. of a median
        shift = math.copysign(max(0.0, abs(med) - 2.0 * se), med)
        last = r[-LEVEL_FAST:]
        if len(r) >= 2 * LEVEL_FAST and (np.all(last > 0) or np.all(last < 0)):
            spread = max(0.02, 1.4826 * float(np.median(np.abs(r - np.median(r)))))
            fast = float(np.median(last))
            if float(np.min(np.abs(last))) > spread and abs(fast) > abs(shift):
                shift = fast
        self._level = math.exp(max(-LOG_BOUND, min(LOG_BOUND, shift)))

    def correct(self, prediction: Prediction, step: Step) -> float:
        """Corrected expected step time in seconds (the raw prediction stays in ``prediction.total_s``)."""
        return self._correct_s(features(prediction, step), prediction.total_s)

    def _correct_s(self, x: tuple[float, ...], raw_s: float) -> float:
        est = self._estimate_ms(x)
        return 1e-3 * est if est is not None else raw_s * self._ratio_median

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

    def recent_error(self, last: int = 16) -> float | None:
        """Median |relative error| of the last ``last`` out-of-sample corrections (None before any step)."""
        with self._lock:
            cor = [abs(row[-1]) for row in list(self._rows)[-last:]]
        return float(np.median(cor)) if cor else None

    @property
    def converged(self) -> bool:
        """The correction is fitted and its recent out-of-sample median error is within ``converged_error``
        (judged on the record thread after each update; read on the engine's thread at no cost)."""
        return self._converged

    def _judge(self) -> bool:
        if self._scales is None or self.n < self.min_fit:
            return False
        e = self.recent_error()
        return e is not None and e <= self.converged_error

    # --- learning ---------------------------------------------------------------------------------
    def update(self, step: Step, prediction: Prediction, measured_s: float) -> float:
        """Learn from one measured step. Returns the correction made *before* learning from it (seconds, what
        ``correct`` gave for this step): the out-of-sample figure a record reports."""
        x = features(prediction, step)
        est = self._correct_s(x, prediction.total_s)  # scored before learning from this step
        if not (measured_s > 0 and math.isfinite(measured_s)) or not (prediction.total_s > 0):
            return est
        m_ms = 1e3 * measured_s
        e_s, e_h = (self._model_ms(x, host) for host in (False, True))
        row = (*x, m_ms, 1e3 * prediction.total_s, (measured_s - prediction.total_s) / measured_s,
               math.nan if e_s is None else (m_ms - e_s) / m_ms, math.nan if e_h is None else (m_ms - e_h) / m_ms,
               (measured_s - est) / measured_s)
        with self._lock:
            self._rows.append(row)
            self.n += 1
            # the error quantile over a window of steps moves slowly: recompute it every 8 steps once warm
            if self.n <= 64 or self.n % 8 == 0:
                self._upper_cache.clear()
        every = 4 if self.n <= 128 else self.refit_every
        self._since_ms += m_ms
        if self.n <= WARM_REFIT * self.min_fit or (self.n % every == 0 and (
                self._since_ms >= REFIT_TIME_RATIO * self._refit_ms
                or self.n - self._refit_n >= max(REFIT_MAX_GAP, every))):
            t0 = time.thread_time()
            self._refit()
            self._refit_ms = 1e3 * (time.thread_time() - t0)
            self._since_ms, self._refit_n = 0.0, self.n
        self._choose()
        self._update_level()
        self._converged = self._judge()
        return est

    def _choose(self) -> None:
        """Correct with the host-term model only while its recent out-of-sample error (the last
        ``CHOOSE_STEPS`` steps both models predicted before learning from them) is clearly lower."""
        with self._lock:
            rows = [r for r in list(self._rows)[-CHOOSE_STEPS:] if not (math.isnan(r[NF + 3]) or math.isnan(r[NF + 4]))]
        if self._host_terms is None or len(rows) < CHOOSE_MIN:
            self._use_host = False
            return
        e_s = float(np.median([abs(r[NF + 3]) for r in rows]))
        e_h = float(np.median([abs(r[NF + 4]) for r in rows]))
        self._use_host = e_h < (1.0 if self._use_host else 0.97) * e_s  # a little hysteresis

    def _refit(self) -> None:
        with self._lock:  # a consistent snapshot
            a = np.array(self._rows, dtype=float).reshape(-1, NF + 6)
        k = len(a)
        if k == 0:
            return
        X, H, y, p = a[:, :NC], a[:, NC:NF], a[:, NF], a[:, NF + 1]
        self._ratio_median = float(np.median(y / p))
        if k < self.min_fit:
            return
        # recent steps weigh more (half-life `halflife` steps): the machine's speed can shift under the engine
        # (another tenant starts or stops) and the fit must follow within tens of steps, not a whole window
        rec = 0.5 ** ((k - 1 - np.arange(k)) / self.halflife)
        # 1. multiplicative scales per op class (log space, robust)
        u = fit_scales(X, y, self._u, self.ridge, recency=rec)
        if not np.all(np.isfinite(u)):
            return
        self._u = u
        self._scales = np.exp(u)
        # 2. the same scales refined linearly with additive host terms (floor, per sequence, per chunk); whether
        # it corrects is decided out of sample (``_choose``): on noisy steps it may chase noise
        fit = self._backfit(X, H, y, u, rec)
        if fit is not None:
            self._scales_h, self._host_terms = fit

    def _backfit(self, X: np.ndarray, H: np.ndarray, y: np.ndarray, u: np.ndarray, rec: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray] | None:
        """The linear refinement of the scales: ``y ≈ Σ b_c·(s_c·t_c) + a + c_dec·n_dec + c_pf·n_pf``, least squares
        on relative error with every coefficient ≥ 0 (Huber, recency), a weak ridge toward b = 1 and the host terms
        0 (``host_ridge`` average steps each). The scaled classes are already in the engine's units, so the prior the
        ridge pulls toward is right whatever the raw prior was; b is free (≥ 0): on a tiny model whose prefill
        costs the host per chunk, not per token, the GEMM share can fall to almost nothing. Returns the refined
        per-class scales (linear, ≥ 0) and the host terms."""
        k = len(y)
        Z = np.hstack([X * np.exp(u), H])
        prior = np.concatenate([np.ones(NC), np.zeros(NH)])
        base = np.sqrt(rec) / y
        w = np.ones(k)
        th = prior.copy()
        for _ in range(3):
            sw = base * w
            A = Z * sw[:, None]
            lam = self.host_ridge * np.maximum(np.sum(A * A, axis=0) / k, 1e-12)
            # the ridge as extra rows: sqrt(lam)·(theta - prior)
            th = nnls(np.vstack([A, np.diag(np.sqrt(lam))]), np.concatenate([y * sw, np.sqrt(lam) * prior]))
            if th is None:
                return None
            w = _huber_weights((y - Z @ th) / y, 0.01)
        if not np.all(np.isfinite(th)):
            return None
        return np.minimum(np.exp(u) * th[:NC], math.exp(LOG_BOUND)), th[NC:]

    # --- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            a = np.array(self._rows, dtype=float).reshape(-1, NF + 6)
        k = len(a)

        def med_abs(col: int) -> float | None:
            return float(np.median(np.abs(a[:, col]))) if k else None

        s, h = self._model(self._use_host)
        host_floor = None
        if s is not None and k:
            # what the lightest step in the window costs the host: its scaled host prior plus the additive floor
            host_floor = 1e-3 * (float(s[3] * np.min(a[:, 3])) + (float(h[0]) if h is not None else 0.0))
        return {
            "n": self.n,
            "window": k,
            "median_abs_ratio_raw": med_abs(NF + 2),
            "median_abs_ratio_corrected": med_abs(NF + 5),
            "median_measured_over_predicted": self._ratio_median,
            "scales": None if s is None else {c: float(v) for c, v in zip(CLASSES, s, strict=True)},
            "host_floor_s": host_floor,
            "level": self._level,
            "per_decode_seq_s": None if h is None else float(h[1]) * 1e-3,
            "per_prefill_chunk_s": None if h is None else float(h[2]) * 1e-3,
            "converged": self.converged,
            "fitted": s is not None,
        }
