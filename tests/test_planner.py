"""Capacity planner (`m2live rank`): workload specs, memory fit, ranking invariants, JSON schema, decision
quality on the real opbench / Vidur tables, and every bad-input path."""

from __future__ import annotations

import json
import math

import pytest
from conftest import OPBENCH, VIDUR

from m2live import Predictor, Step, all_gpus, get_gpu, get_model
from m2live.cli import main
from m2live.commands.rank_args import parse_prices, parse_tp_list
from m2live.planner import (
    BOUND_CLASSES,
    DecisionPoint,
    LayoutModel,
    PlanConfig,
    PlanError,
    evaluate_layout,
    memory_fit,
    rank,
    score_points,
    spearman,
    validate_opbench,
    validate_vidur,
)
from m2live.planner.layout import max_true
from m2live.record import StepRecord
from m2live.vllm_release import VllmRelease
from m2live.workload import WorkloadError, from_trace, parse_workload, preset

L8 = "meta-llama/Llama-3.1-8B"
L70 = "meta-llama/Llama-3.1-70B"


# ---- workloads ----------------------------------------------------------------------------------------------
def test_presets_are_distinct_and_ordered_by_context():
    st = {n: preset(n).stats() for n in ("chat", "summarisation", "long-context")}
    assert st["chat"].mean_prompt < st["summarisation"].mean_prompt < st["long-context"].mean_prompt
    for s in st.values():
        assert s.prompt_p["p50"] <= s.prompt_p["p90"] <= s.prompt_p["p99"]
        assert s.decode_ctx > s.mean_prompt  # decodes sit on top of the prompt
        assert s.prompt_attn >= s.mean_prompt  # E[p^2]/E[p] >= E[p]
    assert parse_workload("summarization").name == "summarisation"


def test_explicit_spec_statistics():
    wl = parse_workload("prompt=lognormal:450:0.6,output=uniform:32:160,rate=3")
    st = wl.stats()
    assert wl.rate == 3.0
    assert abs(st.prompt_p["p50"] - 450) / 450 < 0.03  # lognormal median
    assert abs(st.mean_output - 96) < 2  # uniform 32..160
    assert 32 <= st.output_p["p50"] <= 160 and st.output_p["p99"] <= 160
    fixed = parse_workload("prompt=1000,output=fixed:200").stats()
    assert fixed.mean_prompt == 1000 and fixed.mean_output == 200
    assert fixed.prefill_per_decode == pytest.approx(5.0)
    assert fixed.decode_ctx == pytest.approx(1000 + 199 / 2)
    over = parse_workload("chat,output=fixed:64,rate=2")
    assert over.prompt == preset("chat").prompt and over.output.describe() == "fixed:64" and over.rate == 2


@pytest.mark.parametrize("spec", [
    "", "nonsense", "prompt=lognormal:450", "prompt=abc:1,output=2", "prompt=10", "prompt=10,output=0",
    "prompt=10,output=uniform:50:10", "chat,rate=-1", "chat,rate=0", "chat,foo=1", "chat,,rate=1",
    "prompt=10,output=10,prompt=5", "prompt=lognormal:100:9,output=5", "trace:/nonexistent/trace.jsonl",
    "prompt=2000000,output=1",
])
def test_bad_workload_specs(spec):
    with pytest.raises(WorkloadError):
        parse_workload(spec)


def _simulated_trace(path, prompt: int, output: int, slots: int, n_requests: int) -> None:
    """Continuous batching, one request admitted per step while slots are free: prefill in one step (which
    samples the first token), then output-1 decode steps over contexts prompt .. prompt+output-2."""
    active: list[int] = []  # decode steps done per active request
    admitted = 0
    step_no = 0
    lines = []
    while admitted < n_requests or active:
        pre = prompt if (admitted < n_requests and len(active) < slots) else 0
        dec_ctx = [prompt + j for j in active]
        rec = StepRecord(step=step_no, time=0.0, engine="0", gpu="cpu", model="m", num_prefill_tokens=pre,
                         num_decode_tokens=len(dec_ctx), num_prefill_seqs=1 if pre else 0,
                         num_decode_seqs=len(dec_ctx), prefill_kv_tokens=0, decode_kv_tokens=sum(dec_ctx),
                         predicted_s=0.01, corrected_s=0.01, measured_s=0.01, f_clk=1.0, clock_mhz=1.0,
                         boost_mhz=1.0, clock_source="fixed")
        lines.append(rec.to_json())
        active = [j + 1 for j in active if j + 1 < output - 1]
        if pre:
            admitted += 1
            active.append(0)
        step_no += 1
    path.write_text("\n".join(lines) + "\n")


def test_trace_workload_recovers_lengths(tmp_path):
    p = tmp_path / "trace.jsonl"
    _simulated_trace(p, prompt=500, output=100, slots=8, n_requests=60)
    wl = parse_workload(f"trace:{p}")
    st = wl.stats()
    assert wl.source == "trace" and wl.trace_steps
    # decode tokens per request are output-1 (the first token is sampled by the prefill step)
    assert abs(st.mean_output - 99) / 99 < 0.05
    assert abs(st.mean_prompt - 500) / 500 < 0.05
    assert parse_workload(str(p)).trace_info == wl.trace_info  # a bare .jsonl path works too
    r = rank(L8, wl, ["h100-sxm"], (1,), PlanConfig(slo_s=0.05))
    rep = r.layouts[0].replay
    assert rep and rep["steps"] > 0 and 0 < rep["mean_step_ms"] <= rep["p99_step_ms"] and rep["fits_recorded_batches"]


@pytest.mark.parametrize("content, msg", [
    ('{"num_prefill_tokens": 5}\n', "num_decode_tokens"),
    ('{"num_prefill_tokens": 5, "num_decode_tokens": 1, "decode_kv_tokens": -3}\n', "non-negative"),
    ("not json\n", ":1:"),
    ('{"num_prefill_tokens": 5, "num_decode_tokens": 0, "decode_kv_tokens": 0}\n', "no decode"),
    ("\n", "no steps"),
])
def test_bad_traces(tmp_path, content, msg):
    p = tmp_path / "t.jsonl"
    p.write_text(content)
    with pytest.raises(WorkloadError, match=msg):
        from_trace(p)


# ---- memory fit -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [L8, L70, "Qwen/Qwen2.5-7B"])
def test_more_tp_never_more_memory_per_gpu(model):
    shape = get_model(model)
    st = preset("chat").stats()
    cfg = PlanConfig()
    for g in all_gpus():
        prev = None
        for tp in (1, 2, 4, 8):
            try:
                shard = shape.sharded(tp)
            except ValueError:
                continue
            m = memory_fit(g, shard, st, cfg)
            if prev is not None:
                assert m.weight_bytes < prev.weight_bytes
                assert m.kv_bytes_per_token <= prev.kv_bytes_per_token
                assert m.activation_bytes <= prev.activation_bytes
                assert m.kv_tokens >= prev.kv_tokens
            prev = m


def test_activation_peak_is_the_larger_of_vllms_two_profile_passes():
    """vLLM's start-up profile runs the forward pass at the token budget, then the sampler over max_num_seqs rows of
    the whole vocabulary on every GPU (the logits are all-gathered): the peak is the larger pass, and the sampler's
    does not shrink with TP."""
    from m2live.planner.memory import SAMPLER_PROFILE_BYTES_PER_LOGIT, activation_bytes, engine_reserve_bytes
    shape = get_model(L8)
    fwd_only = activation_bytes(shape, 8192, 1)  # one sampled row: the forward pass binds
    assert fwd_only == pytest.approx(2 * 8192 * (2 * 4096 + 3 * 14336), rel=1e-9)
    for tp in (1, 2, 4, 8):
        a = activation_bytes(shape.sharded(tp), 8192, 1024)
        assert a >= SAMPLER_PROFILE_BYTES_PER_LOGIT * 1024 * shape.vocab  # full vocabulary on every rank
        assert a < fwd_only + SAMPLER_PROFILE_BYTES_PER_LOGIT * 1024 * shape.vocab + 2 * 10240 * 4096  # never the sum
    assert activation_bytes(shape, 8192, 1024, "fp8") >= activation_bytes(shape, 8192, 1024)
    assert engine_reserve_bytes(1) < engine_reserve_bytes(2) == engine_reserve_bytes(8)


def test_kv_cache_of_a_public_vllm_start_up_log():
    """vLLM 0.31 serving meta-llama/Llama-3.1-8B-Instruct on one A100-SXM4-80GB at its defaults (API server: 2048
    tokens, 256 sequences; gpu_memory_utilization 0.92 of 79.25 GiB) logged 56.21 GiB of KV cache (460,496 tokens):
    public lab notes, never fitted on. The fit: 57.1 GiB (+1.6 %; 0.9 and a flat 1.5 GiB gave 54.5, -3 %)."""
    fit = memory_fit(get_gpu("NVIDIA A100-SXM4-80GB"), get_model(L8), preset("chat").stats(),
                     PlanConfig(max_num_seqs=256, max_batched_tokens=2048))
    assert fit.kv_bytes / 2**30 == pytest.approx(56.21, rel=0.03)


def test_model_that_does_not_fit_is_excluded_with_reason():
    r = rank(L70, preset("chat"), ["NVIDIA L4", "a100-80gb"], (1, 2), PlanConfig())
    ex = {(x.gpu, x.tp): x.reason for x in r.excluded}
    assert ("NVIDIA L4", 1) in ex and "weights" in ex[("NVIDIA L4", 1)] and "GB" in ex[("NVIDIA L4", 1)]
    assert ("NVIDIA A100-SXM4-80GB", 1) in ex
    assert all(x.fits for x in r.layouts)
    # whole catalog: 70B bf16 (141 GB of weights) never fits a single GPU with less than 141 GB
    for g in all_gpus():
        res = evaluate_layout(g, get_model(L70), 1, preset("chat"), PlanConfig())
        if g.mem_gb < 141:
            assert not res.fits and res.reason


def test_kv_cache_too_small_for_long_context_is_excluded():
    wl = parse_workload("prompt=fixed:120000,output=fixed:100")  # an L4 at vLLM's own limits for it
    res = evaluate_layout(get_gpu("NVIDIA L4"), get_model(L8), 1, wl, PlanConfig(max_num_seqs=256,
                                                                                   max_batched_tokens=2048))
    assert not res.fits and "KV cache" in res.reason and "p99 request" in res.reason
    assert "it would at gpu_memory_utilization" not in res.reason  # no share of an L4 holds 120k tokens of 8B
    # Llama-3.1-70B fp8 on one H100, ~9.8k-token requests: the share at which vLLM would hold one is named — vLLM
    # 0.32's sampler profile leaves 8.7k tokens at 0.92, 0.24's (the default release: 3.4 GB more activation peak
    # over 1024 rows of the vocabulary) none at all
    wl = parse_workload("prompt=fixed:9000,output=fixed:776")
    near = evaluate_layout(get_gpu("h100-sxm"), get_model(L70), 1, wl,
                           PlanConfig(precision="fp8", vllm_version=VllmRelease(0, 32)))
    assert not near.fits and near.reason.endswith("(it would at gpu_memory_utilization 0.93)")
    near = evaluate_layout(get_gpu("h100-sxm"), get_model(L70), 1, wl, PlanConfig(precision="fp8"))
    assert not near.fits and "leave no KV cache" in near.reason
    assert near.reason.endswith("(it would at gpu_memory_utilization 0.97)")


def test_tp_that_does_not_divide_heads_is_excluded():
    r = rank(L8, preset("chat"), ["h100-sxm"], (1, 3), PlanConfig())
    assert [x.tp for x in r.excluded] == [3] and "divide" in r.excluded[0].reason


# ---- ranking invariants ---------------------------------------------------------------------------------------
def test_h200_never_slower_than_h100_on_memory_bound_decode():
    h100 = Predictor.for_gpu("NVIDIA H100 80GB HBM3", model=L8)
    h200 = Predictor.for_gpu("NVIDIA H200", model=L8)
    for b in (1, 4, 16, 32):
        for ctx in (256, 2048, 8192):
            s = Step.build([], [ctx] * b)
            p1, p2 = h100.predict(s), h200.predict(s)
            shares = {k: 0.0 for k in BOUND_CLASSES}
            for op, t in p1.ops.items():
                if p1.bound.get(op) in shares:
                    shares[p1.bound[op]] += t
            assert shares["memory"] > shares["compute"]  # the regime this invariant is about
            assert p2.total_s <= p1.total_s, (b, ctx)
    r = rank(L8, preset("chat"), ["h100-sxm", "NVIDIA H200"], (1,), PlanConfig(slo_s=0.03))
    tps = {x.gpu: x.output_tokens_per_s for x in r.layouts}
    assert tps["NVIDIA H200"] >= tps["NVIDIA H100 80GB HBM3"]


def test_engine_limits_are_vllms_for_each_device_unless_given():
    """rank runs each layout with the limits vLLM's OpenAI server gives that device in the simulated release (an
    L40S 2048 tokens / 256 sequences, an H100 8192 / 1024; a B200 8192 / 1024 in 0.24, 16384 / 1024 from 0.28),
    or the ones given; the sampler's start-up profile, and so the KV cache, follows them."""
    wl = preset("chat")
    limits = {g: evaluate_layout(get_gpu(g), get_model(L8), 1, wl, PlanConfig()).engine_limits
              for g in ("NVIDIA L40S", "h100-sxm", "NVIDIA B200")}
    assert limits["NVIDIA L40S"] == {"max_num_seqs": 256, "max_batched_tokens": 2048}
    assert limits["h100-sxm"] == limits["NVIDIA B200"] == {"max_num_seqs": 1024, "max_batched_tokens": 8192}
    new = evaluate_layout(get_gpu("NVIDIA B200"), get_model(L8), 1, wl, PlanConfig(vllm_version=VllmRelease(0, 32)))
    assert new.engine_limits == {"max_num_seqs": 1024, "max_batched_tokens": 16384}
    given = evaluate_layout(get_gpu("NVIDIA L40S"), get_model(L8), 1, wl, PlanConfig(max_num_seqs=64))
    assert given.engine_limits == {"max_num_seqs": 64, "max_batched_tokens": 2048}
    assert given.memory.kv_tokens > evaluate_layout(get_gpu("NVIDIA L40S"), get_model(L8), 1, wl,
                                                    PlanConfig()).memory.kv_tokens  # a lighter sampler profile


def test_operating_point_meets_slo_and_search_is_tight():
    wl = preset("chat")
    cfg = PlanConfig(slo_s=0.04)
    shape = get_model(L8)
    for gname in ("h100-sxm", "a100-80gb", "NVIDIA L40S"):
        g = get_gpu(gname)
        res = evaluate_layout(g, shape, 1, wl, cfg)
        assert res.feasible and res.step_ms <= 40.0 + 1e-9
        assert res.decode_batch >= 1 and res.output_tokens_per_s > 0
        assert abs(sum(res.bound_shares.values()) - 1) < 1e-9 and res.bound in BOUND_CLASSES
        lm = LayoutModel(g, shape, 1, wl.stats(), cfg)
        cap, _ = lm.resource_cap()
        b_max = lm.max_batch(cfg.slo_s, cap)
        assert b_max >= res.decode_batch
        if b_max < cap:  # SLO-limited: one more decode would break the SLO
            assert lm.t_steady(b_max + 1) > cfg.slo_s
        assert lm.kv_needed(res.decode_batch) <= res.memory.kv_tokens
        assert 0 < res.chunk_budget <= lm.cfg.max_batched_tokens


@pytest.mark.parametrize("model,tp,wl,slo", [(L8, 1, "summarisation", 0.048), (L8, 1, "summarisation", 0.05),
                                            ("meta-llama/Llama-3.1-70B", 2, "chat", 0.018)])
def test_sawtooth_step_time_search_finds_the_largest_batch(model, tp, wl, slo):
    """fp8 on Hopper the step time is a sawtooth in the tokens (a GEMM's emptier last tile row is slower, as
    opbench_fp8 measures): bisection alone stops short of batches that fit; the search that goes on from each
    answer to the step filling the next tile row finds the largest, every B tried for the truth. bf16 unchanged."""
    lm = LayoutModel(get_gpu("h100-sxm"), get_model(model), tp, preset(wl).stats(),
                     PlanConfig(slo_s=slo, precision="fp8"))
    cap, _ = lm.resource_cap()

    def ok(b: int) -> bool:
        return lm.t_steady(b) <= slo

    truth = max(b for b in range(1, cap + 1) if ok(b))
    assert max_true(1, cap, ok) < truth  # what bisection alone returns
    assert lm.max_batch(slo, cap) == truth
    def chunk_ok(c: int) -> bool:  # the chunk search's own test (LayoutModel.chunk_budget)
        return lm.time(Step.build([(c, max(0, (lm.p_attn - min(c, lm.p_attn)) // 2))], [lm.ctx] * truth)) <= slo

    chunk = lm.chunk_budget(truth, slo)  # the same search over the chunk: it fits, and on a sawtooth as well
    assert chunk == 0 or chunk_ok(chunk)
    if slo == 0.048:  # every chunk tried once: none larger fits (the budget's whole range, ~8 K predictions)
        assert not any(chunk_ok(c) for c in range(chunk + 1, lm.cfg.max_batched_tokens - truth + 1))
    bf = LayoutModel(get_gpu("h100-sxm"), get_model(model), tp, preset(wl).stats(), PlanConfig(slo_s=slo))
    cap, _ = bf.resource_cap()
    assert bf.pred.tile_row_end(129) == 129
    assert bf.max_batch(slo, cap) == max_true(1, cap, lambda b: bf.t_steady(b) <= slo)


def test_looser_slo_never_fewer_decodes_and_impossible_slo_is_reported():
    shape = get_model(L8)
    g = get_gpu("h100-sxm")
    prev = 0
    for slo in (0.01, 0.02, 0.05, 0.1):
        lm = LayoutModel(g, shape, 1, preset("chat").stats(), PlanConfig(slo_s=slo))
        cap, _ = lm.resource_cap()
        b = lm.max_batch(slo, cap)
        assert b >= prev
        prev = b
    r = rank(L8, preset("chat"), ["h100-sxm", "NVIDIA L4"], (1,), PlanConfig(slo_s=0.0005))
    assert all(not x.feasible and x.rank is None and "SLO" in x.reason for x in r.layouts)


def test_prices_rank_per_dollar_and_fleet_sizing():
    wl = parse_workload("chat,rate=20")
    r = rank(L8, wl, ["h100-sxm", "a100-80gb"], (1, 2),
             PlanConfig(slo_s=0.05, prices=parse_prices("h100-sxm=$4,a100-80gb=0.5/h")))
    assert r.rank_by == "dollar"
    scores = [x.output_tokens_per_dollar for x in r.layouts if x.feasible]
    assert scores == sorted(scores, reverse=True)
    assert [x.rank for x in r.layouts if x.feasible] == list(range(1, len(scores) + 1))
    for x in r.layouts:
        demand = 20 * wl.stats().mean_output
        assert x.fleet["replicas"] == max(1, math.ceil(demand / x.output_tokens_per_s))
        assert x.fleet["gpus"] == x.fleet["replicas"] * x.tp
        assert x.fleet["cost_per_hour"] == pytest.approx(x.fleet["gpus"] * x.price_per_gpu_hour)
        assert x.output_tokens_per_dollar == pytest.approx(x.output_tokens_per_s * 3600 / (x.tp * x.price_per_gpu_hour))
    # a lower price for the same GPU can only raise its tokens per dollar
    cheap = rank(L8, wl, ["h100-sxm"], (1,), PlanConfig(slo_s=0.05, prices={"NVIDIA H100 80GB HBM3": 1.0}))
    dear = rank(L8, wl, ["h100-sxm"], (1,), PlanConfig(slo_s=0.05, prices={"NVIDIA H100 80GB HBM3": 4.0}))
    assert cheap.layouts[0].output_tokens_per_dollar == pytest.approx(4 * dear.layouts[0].output_tokens_per_dollar)


# ---- CLI: JSON schema, table, plot ----------------------------------------------------------------------------
def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["rank", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_rank_vllm_version_flag(capsys):
    """rank --vllm-version: the release's memory share (0.9 before 0.21), its engine limits per device and its
    sampler profile; the JSON says which release; a release before V1's is one line, exit 2."""
    import json

    base = ["--model", L8, "--workload", "chat", "--gpus", "NVIDIA B200", "--tp", "1", "--json"]
    got = {}
    for v in ("0.15", "0.24", "0.32"):
        rc, out, _ = _run(capsys, *base, "--vllm-version", v)
        assert rc == 0
        got[v] = json.loads(out)
    assert [got[v]["assumptions"]["vllm_version"] for v in got] == ["0.15.0", "0.24.0", "0.32.0"]
    assert got["0.15"]["assumptions"]["memory_reserve_fraction"] == pytest.approx(0.10)
    assert got["0.24"]["assumptions"]["memory_reserve_fraction"] == pytest.approx(0.08)
    lim = {v: got[v]["ranking"][0]["engine_limits"]["max_batched_tokens"] for v in got}
    assert lim == {"0.15": 8192, "0.24": 8192, "0.32": 16384}
    kv = {v: got[v]["ranking"][0]["memory"]["kv_tokens"] for v in got}
    assert kv["0.15"] < kv["0.24"] < kv["0.32"]  # a larger reserve, then 0.32's lighter sampler profile
    rc, _, err = _run(capsys, *base, "--vllm-version", "0.7")
    assert rc == 2 and "--vllm-version" in err and len(err.strip().splitlines()) == 1


def test_rank_async_scheduling_switch(capsys):
    """--async-scheduling off: the simulated server pays each step's host work after its device work, so under
    the same TPOT SLO it serves no more than with it on; the JSON says which was assumed."""
    runs = {}
    for mode in ("auto", "off"):
        rc, out, _ = _run(capsys, "--model", L8, "--workload", "chat", "--gpus", "h100-sxm", "--tp", "1",
                          "--slo-ms", "20", "--async-scheduling", mode, "--json")
        assert rc == 0
        runs[mode] = json.loads(out)
    assert runs["off"]["assumptions"]["async_scheduling"] is False
    assert isinstance(runs["auto"]["assumptions"]["async_scheduling"], str)
    on, off = (runs[m]["ranking"][0]["serving"] for m in ("auto", "off"))
    assert off["output_tokens_per_s"] < on["output_tokens_per_s"]


def test_json_schema(capsys):
    rc, out, _ = _run(capsys, "--model", L70, "--workload", "chat", "--gpus", "h100-sxm,NVIDIA L4,NVIDIA H200",
                      "--tp", "1,2,4,8", "--slo-ms", "60", "--price", "h100-sxm=2.5", "--json")
    assert rc == 0
    d = json.loads(out)
    assert set(d) >= {"model", "workload", "slo_ms", "rank_by", "assumptions", "prices", "ranking", "excluded"}
    assert d["slo_ms"] == 60 and d["model"]["name"] == L70 and d["rank_by"] == "gpu"
    assert d["workload"]["stats"]["mean_prompt"] > 0
    assert {"memory_reserve_fraction", "memory_reserve_gib", "clock", "max_num_seqs"} <= set(d["assumptions"])
    ranked = [x for x in d["ranking"] if x["rank"] is not None]
    assert ranked and [x["rank"] for x in ranked] == list(range(1, len(ranked) + 1))
    assert [x["score"] for x in ranked] == sorted((x["score"] for x in ranked), reverse=True)
    for x in d["ranking"]:
        assert x["fits"] is True and isinstance(x["tp"], int) and x["gpu"].startswith("NVIDIA")
        assert {"weights_gb", "kv_cache_gb", "reserve_gb", "activations_gb", "kv_tokens"} <= set(x["memory"])
        op = x["operating_point"]
        assert {"decode_batch", "prefill_tokens_per_step", "step_ms", "f_clk", "chunk_budget"} <= set(op)
        assert x["bound"] in BOUND_CLASSES and set(x["bound_shares"]) == set(BOUND_CLASSES)
        assert x["output_tokens_per_s_per_gpu"] == pytest.approx(x["output_tokens_per_s"] / x["tp"])
        assert x["steps"] and all({"name", "step_ms", "bound"} <= set(s) for s in x["steps"])
        if x["feasible"]:
            assert op["step_ms"] <= 60 + 1e-9
        if x["gpu"] == "NVIDIA H100 80GB HBM3":
            assert x["output_tokens_per_dollar"] == pytest.approx(x["output_tokens_per_s"] * 3600 / (2.5 * x["tp"]))
        else:
            assert x["output_tokens_per_dollar"] is None
    ex = {(x["gpu"], x["tp"]): x for x in d["excluded"]}
    assert ("NVIDIA L4", 1) in ex and ex[("NVIDIA L4", 1)]["reason"] and ex[("NVIDIA L4", 1)]["fits"] is False


def test_table_and_plot(capsys, tmp_path):
    png = tmp_path / "rank.png"
    rc, out, _ = _run(capsys, "--model", L8, "--workload", "long-context", "--gpus", "h100-sxm,a100-80gb,NVIDIA L4",
                      "--tp", "1,2", "--slo-ms", "100", "--plot", str(png))
    assert rc == 0 and "ranking by" in out and "excluded layouts" in out and "L4" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


BAD = [
    (["--model", L8, "--workload", "chat", "--gpus", "h100-sxm,nosuchgpu"], "unknown GPU"),
    (["--model", L8, "--workload", "prompt=10"], "output"),
    (["--model", L8, "--workload", "chat", "--tp", "0"], "--tp"),
    (["--model", L8, "--workload", "chat", "--tp", "1,two"], "--tp"),
    (["--model", L8, "--workload", "chat", "--tp", "1,,2"], "--tp"),
    (["--model", L8, "--workload", "chat", "--price", "h100-sxm=abc"], "--price"),
    (["--model", L8, "--workload", "chat", "--price", "h100-sxm=-2"], "--price"),
    (["--model", L8, "--workload", "chat", "--price", "nosuchgpu=2"], "unknown GPU"),
    (["--model", L8, "--workload", "chat", "--price", "h100-sxm"], "--price"),
    (["--model", L8, "--workload", "chat", "--slo-ms", "-5"], "--slo-ms"),
    (["--model", L8, "--workload", "chat", "--slo-ms", "fast"], "--slo-ms"),
    (["--model", L8, "--workload", "chat", "--max-seqs", "0"], "--max-seqs"),
    (["--model", L8, "--workload", "chat", "--plot", "x.jpg"], ".png"),
    (["--model", L8, "--workload", "chat", "--gpus", "h100-sxm", "--rank-by", "dollar"], "price"),
    (["--workload", "chat"], "--model"),
    (["--model", L8], "--workload"),
    (["--model", "no/such-model", "--workload", "chat"], "unknown model"),
    (["--validate", "/nonexistent/opbench"], "no such directory"),
    (["--validate", str(OPBENCH / "NOTICE.md")], "no opbench"),
]


@pytest.mark.parametrize("argv, msg", BAD)
def test_bad_input_exits_2_with_one_line(capsys, argv, msg):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("m2live rank: error:") and msg in lines[0], err
    assert out == ""


def test_parsers():
    assert parse_tp_list("8,1, 2,2") == [1, 2, 8]
    with pytest.raises(PlanError):
        parse_tp_list("128")
    assert parse_prices("NVIDIA H200=3.5, a100-80gb=$1.25/h") == {"NVIDIA H200": 3.5, "NVIDIA A100-SXM4-80GB": 1.25}
    assert parse_prices(None) == {}


# ---- decision quality -----------------------------------------------------------------------------------------
def test_metric_arithmetic():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    # three GPUs; the predictor (time = index + 1) picks A, but B is measured fastest by 10 %
    pts = [DecisionPoint("w", 1, ((1, 1),), {"A": 1.1, "B": 1.0, "C": 3.0})]
    order = {"A": 1.0, "B": 2.0, "C": 3.0}
    out = score_points(pts, lambda g, m, n, k: order[g])
    p = out["points"][0]
    assert p["pick"] == "A" and not p["hit"] and p["regret"] == pytest.approx(0.1)
    assert p["spearman"] == pytest.approx(0.5) and p["pairs"] == 3 and p["pairs_agree"] == 2
    # within 3 % of the best counts as a hit
    pts = [DecisionPoint("w", 1, ((1, 1),), {"A": 1.02, "B": 1.0})]
    assert score_points(pts, lambda g, m, n, k: order[g])["summary"]["top1_hit_rate"] == 1.0


def test_validate_on_real_opbench_tables(capsys):
    dirs = sorted(str(p) for p in OPBENCH.iterdir() if p.is_dir())
    out = validate_opbench(dirs)
    s = out["summary"]
    assert len(out["gpus"]) == len(dirs) >= 2
    assert out["ms"] == [1, 16, 64, 256, 1024, 4096, 8192]
    assert s["points"] == len(out["points"]) >= 7 * 5
    # the real Llama-3.1-8B shapes exist in the grid at TP=4 (qkv 1536x4096, o 4096x1024, gate_up 7168x4096,
    # down 4096x3584): that workload must be there and marked exact
    assert any(w["name"] == "Llama-3.1-8B tp4" for w in out["workloads"])
    assert s["top1_hit_rate"] >= 0.9 and s["spearman_mean"] >= 0.8 and s["regret_mean"] <= 0.02
    assert s["pairwise_accuracy"] >= 0.9
    assert s["relative_speed_error_mean"] <= 0.15  # predicted GPU speed ratios within 15 % of measured
    for p in out["points"]:
        assert set(p["measured_ms"]) == set(out["gpus"]) and all(v > 0 for v in p["predicted_ms"].values())
    # GPU x TP layouts by GPU-time: the measured winner changes with M (H100 tp1 vs tp2), so order matters
    lay = out["layouts"]["summary"]
    assert lay["points"] >= 7 and lay["pairwise_accuracy"] >= 0.9 and lay["regret_mean"] <= 0.03
    assert len(out["layouts"]["measured_winners"]) >= 2
    rc = main(["rank", "--validate", *dirs, "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["summary"] == json.loads(json.dumps(s))


def test_validate_on_vidur_profiles():
    out = validate_vidur(VIDUR)
    s = out["summary"]
    used = set(out["gpus_used"])
    assert {"NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"} <= used
    assert s["points"] >= 4 * 6  # Llama-2-7b-hf at TP 1/2/4/8 x M in {1,...,4096}
    assert s["top1_hit_rate"] >= 0.9 and s["regret_mean"] <= 0.02 and s["spearman_mean"] >= 0.8
    lay = out["layouts"]["summary"]
    # regret 0.8 % before the A100's cuBLAS tile policy (efficiency.TILE_POLICY_CHIPS), 3.5 % with it: Vidur
    # profiled an older cuBLAS that did not keep the large tile (docs/accuracy.md, Vidur validation)
    assert lay["points"] >= 6 and lay["pairwise_accuracy"] >= 0.9 and lay["regret_mean"] <= 0.04


def test_ranking_in_processes_is_the_ranking_of_one_process(tmp_path):
    """rank evaluates its layouts in forked processes (--jobs; default one per core): the same JSON, byte for
    byte, as one process writes — run as a user runs it (a process of its own, where forking is allowed)."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "m2live", "rank", "--model", "meta-llama/Llama-3.1-8B", "--workload", "chat",
            "--gpus", "h100-sxm,NVIDIA A100-SXM4-80GB,NVIDIA L40S", "--tp", "1,2", "--json"]
    one = subprocess.run([*argv, "--jobs", "1"], capture_output=True, text=True, timeout=600)
    three = subprocess.run([*argv, "--jobs", "3"], capture_output=True, text=True, timeout=600)
    assert one.returncode == three.returncode == 0, three.stderr
    assert one.stdout == three.stdout and '"ranking"' in one.stdout
    bad = subprocess.run([*argv, "--jobs", "x"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.strip() == "m2live rank: error: --jobs must be a positive integer, got 'x'"
