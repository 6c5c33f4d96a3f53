"""vLLM serving at a fixed concurrency, simulated step by step: TTFT, TPOT and throughput.

What is simulated is what ``vllm.benchmarks.serve`` measures against an OpenAI server: a closed loop of
``concurrency`` requests in flight (``--max-concurrency C --request-rate inf``: all C sent at once, each
finished request replaced by the next at once) — or, with ``ServingConfig.request_rate``, its open loop (requests
sent on its Poisson schedule, at most C in flight) —, ``num_prompts`` requests in all (default 10 x C, the
convention of public serving sweeps), each with a fixed or listed prompt and output length (ignore-EOS), no
prefix shared between requests (with ``ServingConfig.test_run_cached``, one: the benchmark's untimed test run or
warm-ups send the first request's prompt before the timed run, and that request finds its prompt's full KV blocks
cached); a preempted request finds what is left of its own prefix in the prefix cache.
The benchmark's metrics are means over all requests, cold start included:

- TTFT = first token seen by the client - request sent;
- TPOT = (latency - TTFT) / (output tokens - 1) per request;
- output tokens/s = all output tokens / (last request done - first sent).

The engine is vLLM V1's ``Scheduler.schedule()`` (vllm 0.32/0.33) with the API server's defaults: chunked
prefill, one token budget per step, KV cache in blocks allocated as tokens are scheduled, preemption by
recompute (less the prefix still cached), decode CUDA graphs, async scheduling on GPUs — the rules in full are
``serving_engine``'s docstring.

Every step is timed by ``Predictor`` (forecast clock by default); a request needs ``frontend_s`` between client
and engine each way (HTTP, output streaming) and ``frontend_service_s`` + ``tokenize_s_per_token`` x its prompt
length of the API server's serial work (parsing; tokenisation on its one tokenizer thread): a burst of requests
reaches the engine spread out, and an idle engine starts its next step with the first arrival alone — which is
what desynchronises a closed loop of equal requests. Runs of pure-decode steps between events (an arrival, a
finish, a KV block shortage) are advanced in one go: their
times are the predictor's at a few points along the run (decode steps differ only in context), interpolated —
so a configuration costs milliseconds to a few tenths of a second, not one prediction per token.

Modules: ``serving_config`` (the benchmark's configuration, vLLM's defaults, the KV-cache capacity),
``step_timer`` (step seconds from the predictor), ``serving_engine`` (the scheduler, step by step),
``serving_metrics`` (what the benchmark reports); this one runs them (``simulate``) and re-exports their names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from .hardware import GIB, GpuSpec, get_gpu, tp_beyond_node
from .predictor import HostConstants, Prediction, Predictor
from .serving_config import (
    BLOCK_SIZE,
    CPU_BLOCK_SIZE,
    DEFAULT_PROMPTS_PER_CONCURRENCY,
    FRONTEND_S,
    FRONTEND_SERVICE_S,
    ServingConfig,
    SimulationError,
    cached_prefix,
    cuda_graph_capture_max,
    kv_capacity,
    send_schedule,
    server_settings,
    vllm_batch_defaults,
)
from .serving_engine import SEGMENT_SAMPLES, Engine, EngineStats
from .serving_metrics import ServingResult, bounds, summarize
from .shapes import ModelShape, get_model
from .step import Step
from .step_timer import BatchStep, StepTimer


def make_predictor(gpu: GpuSpec | str, model: ModelShape | str, tp: int, precision: str = "bf16",
                   graph_max_tokens: int | None = None, host: HostConstants | None = None,
                   **kw) -> Predictor:
    base = host or HostConstants()
    if graph_max_tokens is not None:
        base = replace(base, graph_max_tokens=graph_max_tokens)
    return Predictor(gpu, model, tp=tp, dtype=precision, host=base, **kw)


def simulate(model: ModelShape | str, gpu: GpuSpec | str, tp: int, isl: int | Sequence[int],
             osl: int | Sequence[int], cfg: ServingConfig, precision: str = "bf16",
             predictor: Predictor | None = None, keep_requests: bool = False,
             correct: Callable[[Prediction, Step], float] | None = None) -> ServingResult:
    """Simulate ``vllm.benchmarks.serve`` at a fixed concurrency against one vLLM server (one model replica
    on ``tp`` GPUs). ``isl`` / ``osl``: one length for every request, or a list cycled over the requests.
    ``correct``: step seconds from the raw prediction and the step (a calibrated engine), instead of the
    predictor's own total."""
    spec = get_gpu(gpu)
    shape = get_model(model)
    if precision not in ("bf16", "fp8"):
        raise SimulationError(f"precision must be bf16 or fp8, got {precision!r}")
    if tp > 1 and spec.interconnect == "none":
        raise SimulationError(f"{spec.name} has no GPU interconnect for TP={tp}")
    if beyond := tp_beyond_node(spec, tp):
        raise SimulationError(beyond)
    server = server_settings(cfg, spec, tp)
    max_tokens, max_seqs = server.max_num_batched_tokens, server.max_num_seqs
    graphs, async_sched = server.cuda_graph_max_batch, server.async_scheduling
    pred = predictor or make_predictor(spec, shape, tp, precision, graph_max_tokens=graphs,
                                       allreduce_fusion=server.allreduce_fusion)
    n = cfg.num_prompts or DEFAULT_PROMPTS_PER_CONCURRENCY * cfg.concurrency
    ratios = cfg.range_ratios
    if any(ratios):
        prompts, outputs, drawn = sampled_lengths(isl, osl, n, ratios, cfg.seed, shape.prompt_special_tokens)
    else:
        prompts = request_lengths(isl, n, "isl")
        outputs = request_lengths(osl, n, "osl")
        drawn = None
    longest = int((prompts + outputs).max())
    # the server's --max-model-len: given, or the longest request (what a server started for this run is given)
    model_len = cfg.max_model_len or longest
    if longest > model_len:
        raise SimulationError(f"a request of {longest} tokens is longer than --max-model-len {model_len}: the server "
                              f"refuses it (HTTP 400)")
    if shape.max_context is not None and model_len > shape.max_context:
        raise SimulationError(f"{'--max-model-len' if cfg.max_model_len else 'a request of'} {model_len} tokens is "
                              f"longer than {shape.name}'s context ({shape.max_context} tokens): vLLM refuses a "
                              f"max_model_len past it")
    fit = kv_capacity(spec, pred.model, max_tokens, max_seqs, cfg, model_len, precision)
    mem = fit.to_dict()
    bs = cfg.block_size or (CPU_BLOCK_SIZE if spec.arch == "cpu" else BLOCK_SIZE)
    sized_by_memory = cfg.num_gpu_blocks is None and cfg.kv_tokens is None
    if cfg.num_gpu_blocks is not None:
        kv_tokens = cfg.num_gpu_blocks * bs
    else:
        kv_tokens = cfg.kv_tokens if cfg.kv_tokens is not None else fit.kv_tokens
    if not sized_by_memory and kv_tokens > fit.kv_tokens:
        mem["note"] = (f"more than the {fit.kv_tokens} tokens the memory fit leaves at "
                       f"gpu_memory_utilization {cfg.utilization:g}")
    need_blocks = -(-model_len // bs)
    # the least share whose cache holds one request at full length and vLLM's null block
    u = fit.share_to_hold((need_blocks + 1) * bs, cfg.utilization)
    if kv_tokens // bs - 1 < need_blocks and sized_by_memory and cfg.gpu_memory_utilization is None:
        # vLLM's default share leaves a cache short of one request at full length, where vLLM refuses to start; a
        # server that runs this (the question asked) was given a larger share: the least that starts, in 0.01 steps
        if u <= 1:
            default = cfg.utilization
            cfg = replace(cfg, gpu_memory_utilization=u)
            fit = kv_capacity(spec, pred.model, max_tokens, max_seqs, cfg, model_len, precision)
            mem, kv_tokens = fit.to_dict(), fit.kv_tokens
            mem["note"] = (f"gpu_memory_utilization raised from vLLM's default {default:g} to {u:.2f}, the least at "
                           f"which one request at full length ({model_len} tokens) fits: vLLM refuses to start below")
            mem["utilization_raised_from"] = default
    blocks = kv_tokens // bs - 1  # vLLM keeps one block aside (the null block)
    if blocks < need_blocks:
        if not sized_by_memory:
            hint = ""
        elif u > 1:
            hint = ("; not even all of the GPU's memory would hold it: more GPUs (--tp) or "
                    + ("a shorter --max-model-len" if cfg.max_model_len else "shorter requests"))
        else:
            hint = f" at --gpu-memory-utilization {cfg.utilization:g} (it would start at {u:.2f})"
        raise SimulationError(f"the KV cache ({kv_tokens} tokens) cannot hold one request at full length "
                              f"({model_len} tokens): vLLM refuses to start with a max_model_len that long{hint}")
    timer = StepTimer(pred, cfg.clock, async_sched, correct)
    eng = Engine(timer, prompts, outputs, cfg.concurrency, max_tokens, max_seqs, blocks, bs,
                 cfg.long_prefill_token_threshold, cfg.frontend_s, cfg.frontend_service_s,
                 async_scheduling=async_sched,
                 first_cached=cached_prefix(int(prompts[0]), bs) if cfg.test_run_cached and cfg.prefix_caching
                 else 0,
                 tokenize_s_per_token=cfg.tokenize_s_per_token,
                 send_at=send_schedule(n, cfg.request_rate, cfg.seed) if cfg.open_loop else None,
                 prefix_caching=cfg.prefix_caching)
    if keep_requests:
        eng.itl_by_request = [[] for _ in range(n)]
    eng.run()
    res = summarize(eng, timer, cfg, spec, tp, precision, max_tokens, max_seqs, graphs, async_sched, mem,
                    kv_tokens, bs, keep_requests, model_len)
    if drawn is not None:
        res.assumptions["lengths"] = drawn
    return res


def sampled_lengths(isl: int | Sequence[int], osl: int | Sequence[int], n: int, ratios: tuple[float, float], seed: int,
                    special: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """The ``n`` prompt and output lengths of ``vllm bench serve --dataset-name random --random-range-ratio
    r --seed S`` (vLLM 0.32, benchmarks/datasets/utils.py ``get_sampling_params``): one generator,
    ``numpy.random.default_rng(S)``, draws every prompt's length uniformly from the integers of [floor(P (1 - r_in)),
    ceil(P (1 + r_in))] with P = isl less the ``special`` tokens the tokenizer adds (the server adds them back),
    then every output's from [floor(osl (1 - r_out)), ceil(osl (1 + r_out))] (at least 1; exactly that many with
    --ignore-eos) — the benchmark's own requests when ``n`` is its --num-prompts (the outputs are drawn after all
    ``n`` prompts). Also returns what was drawn, for the report."""
    if not (isinstance(isl, (int, np.integer)) and isinstance(osl, (int, np.integer))):
        raise SimulationError("random_range_ratio samples lengths around one --isl and one --osl, not a list")
    isl, osl = (int(request_lengths(v, 1, what)[0]) for v, what in ((isl, "isl"), (osl, "osl")))
    r_in, r_out = ratios
    real = max(0, isl - special)
    in_lo, in_hi = math.floor(real * (1.0 - r_in)), math.ceil(real * (1.0 + r_in))
    out_lo, out_hi = max(math.floor(osl * (1 - r_out)), 1), max(math.ceil(osl * (1 + r_out)), 1)
    if in_lo < 1:
        raise SimulationError(f"--isl {isl} is too short for a range ratio of {r_in:g}: the shortest prompt vLLM's "
                              f"benchmark could draw has no token besides the tokenizer's {special} (it refuses this)")
    if in_hi + special > MAX_LENGTH or out_hi > MAX_LENGTH:
        raise SimulationError(f"lengths drawn up to {max(in_hi + special, out_hi)} tokens: beyond any model's context "
                              f"(at most {MAX_LENGTH})")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(in_lo, in_hi + 1, size=n).astype(np.int64) + special
    outputs = rng.integers(out_lo, out_hi + 1, size=n).astype(np.int64)
    drawn = {"random_range_ratio": {"input": r_in, "output": r_out}, "seed": seed, "num_prompts": n,
             "isl_range": [in_lo + special, in_hi + special], "osl_range": [out_lo, out_hi],
             "mean_isl": float(prompts.mean()), "mean_osl": float(outputs.mean()),
             "prompt_special_tokens": special}
    return prompts, outputs, drawn


MAX_LENGTH = 1 << 30  # tokens: far beyond any model's context, well inside int64 sums


def request_lengths(x: int | Sequence[int], n: int, what: str) -> np.ndarray:
    """``n`` requests' prompt or output lengths from one length or a list (repeated), each checked in range."""
    vals = [x] if isinstance(x, (int, np.integer)) else list(x)
    if not vals:
        raise SimulationError(f"{what}: no length given")
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise SimulationError(f"{what} must be positive integers, got {v!r}")
        if v > MAX_LENGTH:
            raise SimulationError(f"{what} {v} is beyond any model's context (at most {MAX_LENGTH})")
    return np.resize(np.array(vals, dtype=np.int64), n)


__all__ = [  # every name m2live.simulate offered before the split
    "BLOCK_SIZE", "CPU_BLOCK_SIZE", "DEFAULT_PROMPTS_PER_CONCURRENCY", "FRONTEND_S", "FRONTEND_SERVICE_S", "GIB",
    "SEGMENT_SAMPLES", "BatchStep", "Engine", "EngineStats", "GpuSpec", "HostConstants", "ModelShape",
    "Prediction", "Predictor", "ServingConfig", "ServingResult", "SimulationError", "Step", "StepTimer", "bounds",
    "cached_prefix", "cuda_graph_capture_max", "get_gpu", "get_model", "kv_capacity", "make_predictor",
    "request_lengths", "sampled_lengths", "simulate",
    "summarize", "vllm_batch_defaults",
]
