"""A wrong prior is rescued, in replay: the device spec deliberately scaled by 0.01 and by 100 (the test-only
``M2LIVE_DEVICE_SCALE`` knob), the online correction converges, admission falls back to vLLM's budget meanwhile
and never stops admitting.

The replayed engine is a Predictor on the unscaled device with distortions the model does not know (GEMMs 1.3×
slower, attention 0.8×, a host floor and per-sequence host costs, 5 % noise, 3 % of steps 5× slower spikes); the
prior is the same Predictor on the scaled device. No timing, no machine speed: every number is replayed.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from m2live import Predictor, Step
from m2live.admission import AdmissionController, QueueView
from m2live.config import ConfigError, M2liveConfig
from m2live.cpu_device import constants_from_measurement, scale_spec, spec_from_measurement
from m2live.hardware import get_gpu
from m2live.residuals import ResidualTracker, fit_scales

# a CPU device measurement of the kind cpu_kernels.microbenchmark returns (2 AVX-512 threads, bf16)
CPU = {"flops": 1.6e11, "bw": 1.7e10, "t_call": 8e-6, "attn_flops": 8e10, "attn_bw": 1.5e10, "t_attn": 8e-6,
       "threads": 2, "mhz": 2000.0, "kind": "replayed"}


def _predictor(device: str, scale: float) -> Predictor:
    from conftest import MODELS

    if device == "cpu":
        return Predictor(spec_from_measurement(CPU, scale), MODELS / "bench-llama",
                         constants=constants_from_measurement(CPU, scale))
    return Predictor(scale_spec(get_gpu(device), scale), MODELS / "bench-llama")


def _engine_time(p: Predictor, step: Step, rng: random.Random) -> float:
    pr = p.predict(step, f_clk=1.0)
    o = pr.ops
    g = sum(o[k] for k in ("qkv", "o", "gate_up", "down", "lm_head"))
    a = o["attn_prefill"] + o["attn_decode"]
    t = 1.3 * g + 0.8 * a + (pr.total_s - g - a) + 1.5e-3 + 40e-6 * len(step.decode_contexts) \
        + 300e-6 * len(step.prefill_seqs)
    t *= float(np.exp(rng.gauss(0.0, 0.05)))
    return 5 * t if rng.random() < 0.03 else t


def _replay(device: str, scale: float, n: int = 240, seed: int = 0, slow_from: int | None = None
            ) -> tuple[np.ndarray, np.ndarray, ResidualTracker]:
    """A steady mixed workload (4-24 decodes, a prefill chunk in 30 % of the steps): raw and corrected |error|.
    ``slow_from``: from that step on the engine runs 3x slower (another tenant started)."""
    rng = random.Random(seed)
    truth, prior = _predictor(device, 1.0), _predictor(device, scale)
    tr = ResidualTracker()
    raw, cor = [], []
    ctxs = [rng.randint(20, 900) for _ in range(8)]
    for i in range(n):
        ctxs = [c + 1 for c in ctxs if c < 1500]
        while len(ctxs) < rng.randint(4, 24):
            ctxs.append(rng.randint(16, 900))
        step = Step.build([(rng.choice([16, 48, 128, 256, 400]), 0)] if rng.random() < 0.3 else [], ctxs)
        measured = _engine_time(truth, step, rng) * (3.0 if slow_from is not None and i >= slow_from else 1.0)
        p = prior.predict(step, f_clk=1.0)
        cor.append(abs(tr.correct(p, step) - measured) / measured)  # scored before it learns from the step
        raw.append(abs(p.total_s - measured) / measured)
        tr.update(step, p, measured)
    return np.array(raw), np.array(cor), tr


@pytest.mark.parametrize("device", ["cpu", "h100-sxm"])
@pytest.mark.parametrize("scale", [0.01, 100.0])
def test_correction_converges_from_a_prior_off_by_100x(device: str, scale: float) -> None:
    raw, cor, tr = _replay(device, scale)
    assert np.median(raw[10:]) > 0.5  # the prior really is wrong (a GPU scaled 100x up keeps its host prior)
    assert np.median(cor[10:30]) <= 0.15  # corrected within 30 steps
    # never worse than raw after step 10 (in every window of ten steps: single steps are noise)
    for j in range(10, len(cor), 10):
        assert np.median(cor[j:j + 10]) <= np.median(raw[j:j + 10]), j
    # and it does not grow while the workload is steady: every later window stays within the bound
    windows = [float(np.median(cor[j:j + 30])) for j in range(30, len(cor), 30)]
    assert max(windows) <= 0.15, windows
    assert tr.converged


def _tiny_engine_time(truth: Predictor, step: Step, rng: random.Random) -> float:
    """A tiny model on a CPU, as the real-engine test runs it: the host dominates (a floor, a cost per decoding
    sequence, and a prefill chunk that costs the host per chunk, not per token), the device body a twentieth of
    the prior's; bimodal (one step in five twice as slow: another job on the core) plus 8 % noise."""
    t = 2.6e-3 + 0.2e-3 * len(step.decode_contexts) + 4.5e-3 * len(step.prefill_seqs) \
        + 0.05 * truth.predict(step, f_clk=1.0).t_blocks
    t *= float(np.exp(rng.gauss(0.0, 0.08)))
    return 2 * t if rng.random() < 0.2 else t


def _floor(rows: list[tuple[float, int, int, int]]) -> float:
    """The in-sample noise floor: median relative error of the best linear fit on the step's shape."""
    y = np.array([r[0] for r in rows])
    X = np.array([[1.0, r[1], r[2], r[3]] for r in rows])
    th, *_ = np.linalg.lstsq(X / y[:, None], np.ones(len(y)), rcond=None)
    return float(np.median(np.abs(X @ th - y) / y))


@pytest.mark.parametrize("scale", [0.01, 100.0])
def test_a_host_dominated_tiny_model_is_rescued_to_its_noise_floor(scale: float) -> None:
    """The real-engine case in replay: 60 steps of 1-6 decodes and a prefill chunk in a quarter of them. The GEMM
    prior's shape is wrong here (prefill costs per chunk, not per token), so only the additive host terms with a
    GEMM share free to fall near zero fit it; after step 30 the corrected median is within twice the run's own
    noise floor, in every one of 12 seeded runs (the scales refined within [0.2, 5] missed it in a third)."""
    truth, prior = _predictor("cpu", 1.0), _predictor("cpu", scale)
    for seed in range(12):
        rng = random.Random(seed)
        tr = ResidualTracker()
        cor, rows = [], []
        ctxs = [rng.randint(20, 300) for _ in range(3)]
        for _ in range(60):
            ctxs = [c + 1 for c in ctxs if c < 600]
            while len(ctxs) < rng.randint(1, 6):
                ctxs.append(rng.randint(16, 300))
            step = Step.build([(rng.choice([33, 90, 150, 256]), 0)] if rng.random() < 0.25 else [], ctxs)
            measured = _tiny_engine_time(truth, step, rng)
            p = prior.predict(step, f_clk=1.0)
            cor.append(abs(tr.correct(p, step) - measured) / measured)
            tr.update(step, p, measured)
            rows.append((measured, len(step.prefill_seqs), len(step.decode_contexts), step.num_tokens))
        assert np.median(cor[30:]) <= min(0.15, 2 * _floor(rows)), (seed, np.median(cor[30:]), _floor(rows))


def test_a_machine_that_turns_3x_slower_is_followed_within_ten_steps() -> None:
    """Another tenant starts at step 100 and every step from then on is 3x slower: the window fit alone lags for
    a hundred steps (its median error stayed ~0.25-0.6); the fast level follows within ten."""
    _, cor, tr = _replay("cpu", 1.0, n=160, slow_from=100)
    assert np.median(cor[50:100]) <= 0.1
    assert np.median(cor[110:130]) <= 0.15 and np.median(cor[130:]) <= 0.15
    assert tr.stats()["level"] > 1.2  # part of the shift still carried by the level: the window fit lags


def test_scales_recover_a_known_distortion_in_log_space() -> None:
    rng = np.random.default_rng(0)
    X = rng.uniform(0.1, 5.0, size=(64, 4))
    X[:, 1] *= rng.random(64) < 0.5  # attention absent in half of the steps
    true = np.array([0.01, 0.02, 0.005, 0.01])  # a prior 100x too slow, unevenly by class
    y = X @ true * np.exp(rng.normal(0, 0.02, 64))
    y[::13] *= 8  # spikes
    s = np.exp(fit_scales(X, y))
    assert s == pytest.approx(true, rel=0.15)


def test_correction_is_never_worse_than_raw_on_a_good_prior() -> None:
    raw, cor, _ = _replay("cpu", 1.0, seed=3)
    assert np.median(cor[30:]) < np.median(raw[30:])


# ---- admission on a bad prior ----------------------------------------------------------------------------------
def _view(n_dec: int = 8) -> QueueView:
    return QueueView(decode_contexts=[300] * n_dec, partial_prefills=[], waiting_prompts=[400] * 40,
                     max_num_batched_tokens=2048, max_num_seqs=64)


def test_admission_falls_back_to_vllms_budget_in_bounded_steps_until_the_correction_converges() -> None:
    prior = _predictor("cpu", 0.01)  # a prior 100x too slow: uncorrected, nothing would ever fit the SLO
    truth = _predictor("cpu", 1.0)
    tr = ResidualTracker()
    c = AdmissionController(prior, tr, slo_s=0.100)
    rng = random.Random(0)
    budgets = []
    for _ in range(9):
        d = c.decide(_view(), 1.0)
        assert d.fallback and d.flagged and d.admitted > 0 and d.max_active == 64
        budgets.append(d.token_budget)
    assert budgets == sorted(budgets) and budgets[-1] == 2048  # doubling up to vLLM's limit
    assert all(b2 <= 2 * b1 for b1, b2 in zip(budgets, budgets[1:], strict=False))
    assert c.fallbacks == 9
    # the engine runs; the tracker learns from its steps
    for _ in range(40):
        step = Step.build([(rng.choice([64, 256]), 0)] if rng.random() < 0.5 else [], [300] * rng.randint(4, 16))
        tr.update(step, prior.predict(step, f_clk=1.0), _engine_time(truth, step, rng))
    assert tr.converged
    d = c.decide(_view(), 1.0)
    assert not d.fallback and not d.flagged and 0 < d.admitted and d.token_budget < 2048
    assert d.predicted_s <= 0.090 + 1e-12


def test_admission_never_stops_admitting_for_good() -> None:
    """An SLO no step can meet: admissions stop (flagged) for a bounded stretch, then vLLM's budget returns."""
    p = _predictor("cpu", 1.0)
    c = AdmissionController(p, None, slo_s=1e-5, fallback_after=8)
    ds = [c.decide(_view(), 1.0) for _ in range(20)]
    assert all(d.flagged for d in ds)
    assert all(d.admitted == 0 and not d.fallback for d in ds[:7])
    assert all(d.fallback and d.admitted > 0 for d in ds[8:])
    assert ds[-1].token_budget == 2048 and c.fallbacks == 13


def test_device_scale_knob_is_a_validated_config_field() -> None:
    assert M2liveConfig.from_env({"M2LIVE_DEVICE_SCALE": "0.01"}).device_scale == 0.01
    assert M2liveConfig.from_env({}).device_scale == 1.0
    for bad in ("0", "-1", "nan", "abc"):
        with pytest.raises(ConfigError, match="M2LIVE_DEVICE_SCALE"):
            M2liveConfig.from_env({"M2LIVE_DEVICE_SCALE": bad})
    spec = scale_spec(get_gpu("h100-sxm"), 100.0)
    assert spec.bf16_tflops == pytest.approx(100 * get_gpu("h100-sxm").bf16_tflops)
    assert spec.mem_bw_gbs == pytest.approx(100 * get_gpu("h100-sxm").mem_bw_gbs)
    cpu = constants_from_measurement(CPU, 0.01)
    assert cpu.t_kernel == pytest.approx(100 * CPU["t_call"])  # the CPU device's fixed costs scale inversely
