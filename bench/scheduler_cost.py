"""CPU time of vLLM V1's scheduler per engine step and per running sequence → results/scheduler_cost.json.

The engine core's host work per step — ``Scheduler.schedule()`` and ``Scheduler.update_from_output()`` — is the
largest part of what ``HostConstants.alpha`` (per sampled sequence) stands for; under async scheduling it overlaps
the device's step, and a step lasts the longer of the two, so at a few hundred sequences and a short device step it
is what bounds the step. Timed here in-process on vLLM's own Scheduler (the one ``tests/test_simulate.py`` checks
the simulator against, tests/vllm_loop.py), with no model: B running requests decode one token a step, every request sampling one
token; 200 steps after three warm-up steps, per B. The model runner's input preparation and the outputs' hand-off
to the API server are not in it. Host-CPU dependent: the JSON names this machine's CPU.

    .venv/bin/python bench/scheduler_cost.py --out results/scheduler_cost.json     # seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

from tokenize_cost import write_host_result  # noqa: E402

from m2live.predictor import HostConstants  # noqa: E402

BATCHES = (16, 64, 256)
STEPS = 200


def time_scheduler(batch: int, steps: int = STEPS) -> dict:
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm_loop import VllmLoop  # a real vLLM Scheduler without a model (tests/vllm_loop.py)

    loop = VllmLoop([64] * batch, [1 << 20] * batch, batch, 8192, 1024, 200_000)
    s = loop.s

    def output(sched) -> ModelRunnerOutput:
        ids = list(sched.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=[[7] for _ in ids])

    for _ in range(3):  # the prompts' prefill, then decodes
        out = s.schedule()
        s.update_from_output(out, output(out))
    t_sched = t_update = 0.0
    for _ in range(steps):
        a = time.perf_counter()
        out = s.schedule()
        b = time.perf_counter()
        mro = output(out)
        c = time.perf_counter()
        s.update_from_output(out, mro)
        t_update += time.perf_counter() - c
        t_sched += b - a
    return {"batch": batch, "schedule_us": round(t_sched / steps * 1e6, 1),
            "update_from_output_us": round(t_update / steps * 1e6, 1),
            "us_per_sequence": round((t_sched + t_update) / steps / batch * 1e6, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = [time_scheduler(b) for b in BATCHES]
    for r in rows:
        print(f"B={r['batch']}: schedule {r['schedule_us']} us, update_from_output {r['update_from_output_us']} us "
              f"a step: {r['us_per_sequence']} us per sequence")
    write_host_result(a.out, __doc__, rows=rows, prior_alpha_us=HostConstants().alpha * 1e6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
