"""Speed benchmark → results/speed.json: time of one full-step prediction, in-process.

Steps of Llama-3.1-8B on H100-SXM: a mixed chunked-prefill step (one 2048-token chunk + 64 decodes), a pure
decode step (256 sequences), and the fast total-only path the admission controller uses. Each is timed
individually (perf_counter_ns) after a warm-up; median and p99 in microseconds. Those steps repeat, so every
shape-keyed cache (GEMM tiles per token count, the prefill grid's list schedule per chunk set) is warm: a serving
engine's decode steps are like that. A step whose prefill chunks were never seen pays for them once:
``*_new_shapes`` times such steps (each a chunk of a length and context not seen before, with 64 decodes), and
``admission_decide_new_shapes`` one admission decision per step over a queue whose running chunk moves on every
step (vLLM's defaults, SLO 25 ms: the budget search prices 3-8 candidate steps of new shapes).

    .venv/bin/python bench/speed.py --out results/speed.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from m2live import Predictor, Step  # noqa: E402
from m2live.admission import AdmissionController, QueueView  # noqa: E402
from m2live.cpu_device import _cpuinfo  # noqa: E402


def summary(samples: list[float], q: float = 0.99, digits: int = 2) -> dict[str, float | int]:
    """Median and the ``q`` quantile (named ``p99_us`` / ``p90_us``) of samples in microseconds."""
    s = sorted(samples)
    return {"median_us": round(statistics.median(s), digits), f"p{round(100 * q)}_us": round(s[int(q * len(s))], digits),
            "n": len(s)}


def timed_us(fn, *args) -> float:
    t0 = time.perf_counter_ns()
    fn(*args)
    return (time.perf_counter_ns() - t0) / 1e3


def timeit(fn, n: int) -> dict[str, float | int]:
    for _ in range(min(200, n // 10)):
        fn()
    return summary([timed_us(fn) for _ in range(n)])


def time_new_shapes(gpu: str, model: str, n: int) -> dict[str, float | int]:
    """Full-step and total-only predictions of steps whose prefill chunk was never seen (caches cold for it), each
    path on a fresh Predictor."""
    rng = random.Random(1)
    # distinct chunk lengths, so distinct token counts: every per-shape cache misses (the pick cached by tile rows
    # may hit, as it does in serving)
    steps = [Step.build([(c, rng.choice((0, rng.randint(1, 8192))))], [rng.randint(100, 4000) for _ in range(64)])
             for c in rng.sample(range(256, 4097), min(n, 4096 - 255))]
    out: dict[str, float | int] = {}
    for name, method in (("predict_full_breakdown", "predict"), ("predict_total_fast_path", "predict_total")):
        fn = getattr(Predictor.for_gpu(gpu, model=model), method)  # (step, f_clk as a ratio) both
        s = summary([timed_us(fn, st, 0.85) for st in steps], digits=1)
        out.update({f"{name}_median_us": s["median_us"], f"{name}_p99_us": s["p99_us"]})
    out["n"] = len(steps)
    return out


def time_admission(gpu: str, model: str, n: int) -> dict[str, float | int]:
    """One admission decision per step; the running prompt's chunk moves on each step, three 4 K prompts wait."""
    p = Predictor.for_gpu(gpu, model=model)
    ac = AdmissionController(p, None, slo_s=0.025)
    rng = random.Random(2)
    ctx = [rng.randint(100, 3000) for _ in range(48)]
    done, samples, evals, steps = 0, [], [], []
    for _ in range(n):
        ctx = [c + 1 for c in ctx]
        done = (done + 517) % 4096
        view = QueueView(ctx, [(4096 - done, done)] if done else [], [4096] * 3, 8192, 256)
        t0 = time.perf_counter_ns()
        d = ac.decide(view, None)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        evals.append(d.evaluations)
        steps.append(d.predicted_s * 1e6)
    out = summary(samples, q=0.9, digits=1)
    return {**out, "evaluations_mean": round(statistics.mean(evals), 2),
            "predicted_step_median_us": round(statistics.median(steps), 1),
            "fraction_of_step_median": round(statistics.median(samples) / statistics.median(steps), 4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/speed.json")
    ap.add_argument("-n", type=int, default=20000)
    args = ap.parse_args()
    p = Predictor.for_gpu("NVIDIA H100 80GB HBM3", model="meta-llama/Llama-3.1-8B")
    rng = random.Random(0)
    mixed = Step.build([(2048, 0)], [rng.randint(100, 4000) for _ in range(64)])
    decode = Step.build([], [rng.randint(100, 4000) for _ in range(256)])
    small = Step.build([(512, 1024)], [rng.randint(100, 4000) for _ in range(8)])
    res = {
        "generated": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip() + f", Python {platform.python_version()}",
        "cpu": f"{_cpuinfo()[0]}, {os.cpu_count()} logical CPUs",
        "gpu": p.gpu.name, "model": p.model.name,
        "predict_full_breakdown_mixed_2048+64": timeit(lambda: p.predict(mixed, f_clk=0.85), args.n),
        "predict_full_breakdown_decode_256": timeit(lambda: p.predict(decode, f_clk=0.85), args.n),
        "predict_full_breakdown_small_512+8": timeit(lambda: p.predict(small, f_clk=0.85), args.n),
        "predict_forecast_clock_mixed": timeit(lambda: p.predict(mixed), args.n // 2),
        "predict_total_fast_path_mixed": timeit(lambda: p.predict_total(mixed, 0.85), args.n),
        "mixed_new_shapes": time_new_shapes(p.gpu.name, p.model.name, max(200, args.n // 10)),
        "admission_decide_new_shapes": time_admission(p.gpu.name, p.model.name, max(200, args.n // 20)),
    }
    res["median_us"] = res["predict_full_breakdown_mixed_2048+64"]["median_us"]
    res["p99_us"] = res["predict_full_breakdown_mixed_2048+64"]["p99_us"]
    res["target_median_us"] = 20.0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
