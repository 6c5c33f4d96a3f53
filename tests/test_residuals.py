"""ResidualTracker: the online host-term fit recovers a known host floor / scale and beats the raw prediction."""

from __future__ import annotations

import random

import pytest

from m2live import Predictor, Step
from m2live.residuals import ResidualTracker, features


@pytest.fixture(scope="module")
def predictor():
    from conftest import MODELS
    return Predictor.for_gpu("h100-sxm", MODELS / "tiny-llama")


def _random_step(rng: random.Random) -> Step:
    decodes = [rng.randint(10, 1500) for _ in range(rng.randint(0, 24))]
    prefills = [rng.choice([16, 64, 256, 512])] if rng.random() < 0.4 or not decodes else []
    return Step.build(prefills, decodes)


def _truth(p, step, rng, noise=0.03):
    gemm, attn, other, _host, _one, n_dec, _n_pf = features(p, step)  # ms, ms, ms, ms, 1, counts
    t = 2.0 + 3.0 * gemm + 0.7 * attn + other + 0.05 * n_dec  # ms: host floor, scaled body, per-sequence cost
    return 1e-3 * t * (1 + rng.gauss(0, noise))


def test_learns_host_terms_and_beats_raw(predictor):
    rng = random.Random(0)
    tr = ResidualTracker(window=256)
    for _ in range(400):
        s = _random_step(rng)
        p = predictor.predict(s, f_clk=1.0)
        tr.update(s, p, _truth(p, s, rng))
    st = tr.stats()
    assert st["n"] == 400 and st["fitted"]
    assert st["median_abs_ratio_corrected"] < 0.05 < st["median_abs_ratio_raw"]
    assert 1e-3 < st["host_floor_s"] < 3e-3  # floor vs a near-constant body: loosely identified
    # held-out steps: corrected within a few % of the truth
    errs = []
    for _ in range(100):
        s = _random_step(rng)
        p = predictor.predict(s, f_clk=1.0)
        m = _truth(p, s, rng, noise=0.0)
        c = tr.correct(p, s)
        errs.append(abs(c - m) / m)
        assert tr.upper(p, s, 0.95) >= c
    errs.sort()
    assert errs[50] < 0.04


def test_robust_to_outliers_and_drift(predictor):
    rng = random.Random(1)
    tr = ResidualTracker(window=128)
    for i in range(600):
        s = _random_step(rng)
        p = predictor.predict(s, f_clk=1.0)
        m = _truth(p, s, rng)
        if i >= 300:
            m *= 1.5  # the host got slower (another tenant): the forgetting fit follows
        if rng.random() < 0.05:
            m *= 10  # a GC pause / preemption spike
        tr.update(s, p, m)
    s = Step.build([], [500] * 8)
    p = predictor.predict(s, f_clk=1.0)
    truth = 1.5 * _truth(p, s, rng, noise=0.0)
    assert abs(tr.correct(p, s) - truth) / truth < 0.1


def test_before_fit_uses_ratio_and_ignores_bad_measurements(predictor):
    tr = ResidualTracker()
    s = Step.build([128], [100, 200])
    p = predictor.predict(s, f_clk=1.0)
    assert tr.correct(p, s) == pytest.approx(p.total_s)
    assert tr.upper(p, s) > tr.correct(p, s)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        tr.update(s, p, bad)
    assert tr.stats()["n"] == 0
    for _ in range(3):
        tr.update(s, p, 2 * p.total_s)
    assert tr.correct(p, s) == pytest.approx(2 * p.total_s, rel=1e-6)
    with pytest.raises(ValueError):
        ResidualTracker(window=2)


def test_warm_up_refits_every_step_however_costly(predictor, monkeypatch):
    """Through the first 4 x min_fit steps every step refits even when a refit costs more than the
    steps it corrects (an engine's first tens of steps drift in speed; a refit gated on its cost left the
    correction up to eight steps stale there); after that the cost gate spaces the refits out."""
    import m2live.residuals as residuals

    clock = [0.0]

    def thread_time() -> float:  # every refit appears to cost 50 ms of CPU, ten times the steps below
        clock[0] += 0.025
        return clock[0]

    monkeypatch.setattr(residuals.time, "thread_time", thread_time)
    rng = random.Random(3)
    tr = ResidualTracker(min_fit=8)
    warm = 4 * tr.min_fit
    changed = []
    last = None
    for i in range(1, warm + 17):
        s = _random_step(rng)
        p = predictor.predict(s, f_clk=1.0)
        tr.update(s, p, _truth(p, s, rng, noise=0.1) * (1 + 0.8 * 0.9**i))  # slower first steps, fading
        scales = tr.stats()["scales"]
        changed.append(last is not None and scales != last)
        last = scales
    assert all(changed[tr.min_fit:warm])  # refitted on every warm-up step
    assert not all(changed[warm:])  # then spaced out by the cost gate
