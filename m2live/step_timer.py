"""Seconds per simulated engine step, from the predictor: ``StepTimer`` (cached per step shape) over ``BatchStep``.

A step lasts the predictor's total; under async scheduling (vLLM's default on GPUs) the host work of the next
step overlaps the device's work on this one, so a step lasts the longer of the two. A ``correct`` callable (e.g.
``ResidualTracker.correct``) replaces the predictor's total with a measured engine's calibrated step time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .predictor import Prediction, Predictor
from .step import Step


class BatchStep(Step):
    """A Step built from its prefill chunks and decode contexts directly (the simulator's steps hold up to
    ~1000 decodes; the predictor reads only the two lists and the counts): ``seqs`` is materialised on demand."""

    def __init__(self, prefills: list[tuple[int, int]], decodes: list[int]) -> None:  # noqa: D107
        object.__setattr__(self, "_pre", prefills)
        object.__setattr__(self, "_dec", decodes)
        object.__setattr__(self, "_tokens", sum(n for n, _ in prefills) + len(decodes))
        object.__setattr__(self, "prefill", None)

    @property
    def seqs(self) -> tuple[tuple[int, int], ...]:  # type: ignore[override]
        return tuple(self._pre) + tuple((1, c) for c in self._dec)  # type: ignore[attr-defined]

    def is_prefill(self, i: int) -> bool:
        return i < len(self._pre)  # type: ignore[attr-defined]

    @property
    def num_seqs(self) -> int:
        return len(self._pre) + len(self._dec)  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return self.num_seqs


class StepTimer:
    """Seconds per engine step from the predictor, cached per step shape (decode contexts enter it only through
    their count and sum, spread evenly; prefill chunks one by one). So a simulated Blackwell decode splits its KV
    by the mean context where the kernel splits by the longest (operators.TRTLLM_SPLIT_MIN_KEYS): the plugin and
    ``m2live predict`` hand the predictor every context."""

    def __init__(self, pred: Predictor, clock: str = "forecast", async_scheduling: bool = False,
                 correct: Callable[[Prediction, Step], float] | None = None):
        self.pred = pred
        self.clock = clock
        self.async_scheduling = async_scheduling
        self.correct = correct  # e.g. ResidualTracker.correct: a measured engine's calibrated step times
        self._cache: dict[tuple, float] = {}
        self.predictions = 0

    def step(self, prefills: Sequence[tuple[int, int]], n_dec: int, dec_ctx: int) -> Step:
        decs: list[int] = []
        if n_dec:
            base, extra = divmod(int(dec_ctx), n_dec)
            decs = [max(1, base + 1)] * extra + [max(1, base)] * (n_dec - extra)
        return BatchStep(list(prefills), decs)

    def __call__(self, prefills: tuple[tuple[int, int], ...], n_dec: int, dec_ctx: int) -> float:
        # decode contexts bucketed to 1/256 of their mean (< 0.5 % of the attention time): keeps the cache small.
        # The key is the bucket's midpoint itself: the bucket width grows with the context, so a bucket's index
        # alone would name different contexts at different widths
        q = max(1, (dec_ctx // max(1, n_dec)) // 256) * max(1, n_dec)
        mid = (dec_ctx // q) * q + q // 2 if n_dec else 0
        key = (prefills, n_dec, mid)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = self.time(self.step(prefills, n_dec, mid))
        return t

    def time(self, step: Step) -> float:
        self.predictions += 1
        f = 1.0 if self.clock == "boost" else self.pred.forecast_f_clk(step)
        p = self.pred.predict_fast(step, f)
        if self.correct is not None:
            return self.correct(p, step)
        if not self.async_scheduling:
            return p.total_s
        device = p.total_s - p.ops["host"] - p.ops["sampling"]
        return max(device, p.ops["host"] + p.ops["sampling"])
