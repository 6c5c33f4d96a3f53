"""Speed benchmark → results/speed.json: time of one full-step prediction, in-process.

Steps of Llama-3.1-8B on H100-SXM: a mixed chunked-prefill step (one 2048-token chunk + 64 decodes), a pure
decode step (256 sequences), and the fast total-only path the admission controller uses. Each is timed
individually (perf_counter_ns) after a warm-up; median and p99 in microseconds.

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
from m2live.cpu_device import _cpuinfo  # noqa: E402


def timeit(fn, n: int) -> dict[str, float]:
    for _ in range(min(200, n // 10)):
        fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    samples.sort()
    return {"median_us": round(statistics.median(samples), 2), "p99_us": round(samples[int(0.99 * len(samples))], 2),
            "n": n}


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
