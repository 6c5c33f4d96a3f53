"""Specifications of the core predictor: shapes arithmetic, step validation, physics of the step equation."""

from __future__ import annotations

import json

import pytest

from m2live import ModelShape, ModelShapeError, Predictor, Step, StepError, get_model
from m2live.efficiency import forecast_clock_ratio

LLAMA8B = "meta-llama/Llama-3.1-8B"
H100 = "NVIDIA H100 80GB HBM3"


# ---- shapes -------------------------------------------------------------------------------------------
def test_llama31_8b_gemm_shapes_and_flops_match_hand_computation():
    m = get_model(LLAMA8B)
    # published config: hidden 4096, 32 heads x 128, 8 KV heads, intermediate 14336, vocab 128256
    assert m.gemms() == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    flops_per_token_layer = 2 * sum(n * k for n, k in m.gemms().values())
    assert flops_per_token_layer == 2 * (6144 * 4096 + 4096 * 4096 + 28672 * 4096 + 4096 * 14336)
    # 8.03 B parameters (embedding + untied LM head + 32 layers + norms)
    assert 8.0e9 < m.param_count() < 8.1e9
    assert m.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, bf16 = 128 KiB


def test_predictor_work_counts_projection_flops_and_weight_bytes():
    p = Predictor.for_gpu(H100, model=LLAMA8B)
    flops, nbytes = p.work(Step([(1, 0)]))
    m = p.model
    proj = 2 * sum(n * k for n, k in m.gemms().values()) * m.layers
    lm = 2 * m.vocab * m.hidden
    assert flops == pytest.approx(proj + lm, rel=0.01)  # attention of one token is negligible
    # one decode token reads every weight once: ~16 GB for 8 B bf16 parameters (minus the embedding table)
    assert 14.5e9 < nbytes < 16.5e9


def test_tensor_parallel_shards_the_projections():
    m = get_model(LLAMA8B)
    m2 = m.sharded(2)
    assert m2.gemms()["qkv"] == (3072, 4096) and m2.gemms()["down"] == (4096, 7168)
    assert m2.weight_bytes() < 0.55 * m.weight_bytes()


def test_tp_not_dividing_heads_is_an_error():
    with pytest.raises(ModelShapeError, match="does not divide"):
        get_model("Qwen/Qwen2.5-7B").sharded(8)  # 28 heads
    with pytest.raises(ModelShapeError):
        get_model(LLAMA8B).sharded(0)


def test_config_json_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    with pytest.raises(ModelShapeError, match="missing intermediate_size"):
        ModelShape.from_path(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelShapeError, match="not readable JSON"):
        ModelShape.from_path(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"],
                                                      "is_encoder_decoder": True}))
    with pytest.raises(ModelShapeError, match="not a decoder"):
        ModelShape.from_path(tmp_path)
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelShapeError, match="multiple"):
        ModelShape.from_path(tmp_path)
    cfg["num_key_value_heads"], cfg["num_hidden_layers"] = 2, -1
    with pytest.raises(ModelShapeError, match="positive integer"):
        ModelShape.from_config(cfg)
    with pytest.raises(ModelShapeError, match="unknown model"):
        get_model("no/such-model")


@pytest.mark.parametrize("name, preset", [
    ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-70B"),
    ("RedHatAI/Meta-Llama-3.1-70B-Instruct-FP8", "meta-llama/Llama-3.1-70B"),
    ("nvidia/Llama-3.1-8B-Instruct-FP8", "meta-llama/Llama-3.1-8B"),
    ("neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8-dynamic", "meta-llama/Llama-3.1-8B"),
    ("nvidia/Llama-3.3-70B-Instruct-FP8", "meta-llama/Llama-3.1-70B"),
    ("Qwen/Qwen3-32B-FP8", "Qwen/Qwen3-32B"),
    ("Qwen/Qwen3-8B-Base", "Qwen/Qwen3-8B"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-v0.3"),
    ("meta-llama/Llama-2-7b-chat-hf", "meta-llama/Llama-2-7b-hf"),
])
def test_checkpoints_of_a_presets_architecture_resolve_to_it(name, preset):
    """An instruct tune or an fp8 re-quantisation has its base model's config.json shapes."""
    assert get_model(name) is get_model(preset)


@pytest.mark.parametrize("name, billions", [
    # each model card's parameter count (Hugging Face); Qwen2.5-32B's card says 32.5 B, its safetensors 32.8 B
    ("meta-llama/Llama-3.2-3B", 3.21), ("meta-llama/Llama-3.1-405B", 405.0), ("Qwen/Qwen2.5-0.5B", 0.49),
    ("Qwen/Qwen2.5-3B", 3.09), ("Qwen/Qwen2.5-14B", 14.7), ("Qwen/Qwen2.5-32B", 32.5), ("Qwen/Qwen2.5-72B", 72.7),
    ("Qwen/Qwen3-0.6B", 0.6), ("Qwen/Qwen3-4B", 4.0), ("Qwen/Qwen3-14B", 14.8),
])
def test_presets_hold_their_model_cards_parameter_counts(name, billions):
    """A preset's shapes (copied from its config.json) give the parameter count its model card states, within 1 %
    (the cards round), and its instruct and fp8 checkpoints resolve to it."""
    import dataclasses

    m = get_model(name)
    assert m.param_count() / 1e9 == pytest.approx(billions, rel=0.01)
    base = name.split("/")[1]
    tuned = get_model(f"{base}-Instruct")
    assert get_model(f"{name}-Instruct-FP8") is tuned
    # the same shapes; the context (and so the name) may differ
    assert dataclasses.replace(tuned, name=m.name, max_context=m.max_context) == m


def test_an_instruct_tune_takes_its_own_config_context():
    """Qwen2.5's -Instruct config.json files state 32768 where the base models state 131072 (the length vLLM
    refuses a --max-model-len past); Llama's tunes keep their base's."""
    from m2live.simulate import ServingConfig, SimulationError, simulate

    for b in ("7", "14", "32", "72"):
        assert get_model(f"Qwen/Qwen2.5-{b}B").max_context == 131072
        assert get_model(f"Qwen/Qwen2.5-{b}B-Instruct").max_context == 32768
        assert get_model(f"qwen2.5-{b}b-instruct") is get_model(f"Qwen/Qwen2.5-{b}B-Instruct")
    assert get_model("meta-llama/Llama-3.1-8B-Instruct") is get_model("meta-llama/Llama-3.1-8B")
    cfg = ServingConfig(concurrency=1, num_prompts=1)
    with pytest.raises(SimulationError, match="context"):
        simulate("Qwen/Qwen2.5-7B-Instruct", "NVIDIA H200", 1, 40000, 16, cfg)
    assert simulate("Qwen/Qwen2.5-7B", "NVIDIA H200", 1, 40000, 16, cfg).ttft_ms > 0


@pytest.mark.parametrize("name", ["Qwen/Qwen3-32B-AWQ", "Qwen/Qwen3-1.7B-FP8",
                                  "meta-llama/Llama-3.1-8B-Instruct-GPTQ-INT4", "Qwen/Qwen3-30B-A3B", "instruct-fp8"])
def test_other_architectures_and_int4_checkpoints_stay_unknown(name):
    with pytest.raises(ModelShapeError, match="unknown model"):
        get_model(name)


def test_shipped_configs_load(tiny_model_dir, bench_model_dir):
    assert get_model(tiny_model_dir).hidden == 256
    b = get_model(bench_model_dir / "config.json")
    assert (b.hidden, b.layers, b.kv_heads, b.head_dim) == (1024, 8, 8, 64)


# ---- steps --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [[(0, 5)], [(-3, 0)], [(2.5, 0)], [("7", 0)], [(1, -1)], [(1,)], [True]])
def test_bad_token_counts_are_rejected(bad):
    with pytest.raises(StepError):
        Step(bad)


def test_prefill_decode_classification_and_counts():
    s = Step([(512, 0), (1, 900), (256, 1024), (1, 0)])
    assert s.prefill_seqs == [(512, 0), (256, 1024), (1, 0)]
    assert s.decode_contexts == [900]
    assert s.counts() == {"prefill_tokens": 769, "prefill_kv_tokens": 1024, "decode_reqs": 1,
                          "decode_kv_tokens": 900}
    # explicit flags win: a one-token last prefill chunk over a cache is still a prefill
    f = Step([(1, 100)], prefill=[True])
    assert f.num_prefill_tokens == 1 and f.num_decode_tokens == 0
    r = Step.from_counts(**s.counts())
    assert r.counts()["decode_kv_tokens"] == 900 and r.num_prefill_tokens == 769


# ---- physics of the step equation -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def h100() -> Predictor:
    return Predictor.for_gpu(H100, model=LLAMA8B)


def test_decode_step_is_memory_bound_on_h100(h100):
    r = h100.predict(Step.build([], [1000] * 16), f_clk=1.0)
    for op in ("qkv", "o", "gate_up", "down", "attn_decode"):
        assert r.bound[op] == "memory", (op, r.bound[op])
    # 16 GB of weights at 3.35 TB/s: a few ms, not tens
    assert 4e-3 < r.total_s < 12e-3


def test_large_prefill_is_compute_bound_on_h100(h100):
    r = h100.predict(Step([(8192, 0)]), f_clk=1.0)
    for op in ("qkv", "o", "gate_up", "down", "attn_prefill"):
        assert r.bound[op] == "compute", (op, r.bound[op])
    flops, _ = h100.work(Step([(8192, 0)]))
    # achieved rate between 40 % and 100 % of the dense bf16 peak at boost
    assert 0.4 < flops / r.t_blocks / h100.ops.peak < 1.0


def test_more_tokens_never_faster(h100):
    prev = 0.0
    for chunk in (1, 2, 16, 64, 100, 128, 255, 256, 512, 1000, 2048, 4096, 8192, 16384):
        t = h100.predict(Step.build([(chunk, 0)], [500] * 8), f_clk=0.9).total_s
        assert t >= prev * 0.999, chunk
        prev = t
    prev = 0.0
    for ctx in (1, 10, 100, 1000, 10000, 100000):
        t = h100.predict(Step.build([], [ctx] * 32), f_clk=0.9).total_s
        assert t >= prev, ctx
        prev = t


def test_lower_clock_never_faster(h100):
    step = Step.build([(2048, 0)], [1500] * 32)
    times = [h100.predict(step, f_clk=f).total_s for f in (1.0, 0.9, 0.8, 0.7, 0.6)]
    assert times == sorted(times)
    assert times[-1] > times[0] * 1.3  # compute-bound: the clock matters
    decode = Step.build([], [1000] * 8)
    assert h100.predict(decode, f_clk=0.6).total_s == pytest.approx(h100.predict(decode, f_clk=1.0).total_s,
                                                                     rel=0.05)  # memory-bound: it barely does


def test_clock_inputs_ratio_mhz_and_forecast(h100):
    step = Step([(4096, 0)])
    live = h100.predict(step, clock_mhz=1386)
    assert live.f_clk == pytest.approx(1386 / 1980) and live.clock_source == "live"
    assert h100.predict(step, f_clk=1386).f_clk == pytest.approx(live.f_clk)  # MHz given as f_clk
    fc = h100.predict(step)  # forecast from the power cap
    assert fc.clock_source == "forecast" and 0.5 < fc.f_clk < 1.0
    # a light decode step draws little power: the cap allows a higher clock than for a big prefill
    assert h100.forecast_f_clk(Step.build([], [100])) >= fc.f_clk
    with pytest.raises(ValueError):
        h100.predict(step, f_clk=-1.0)


def test_forecast_reproduces_its_anchor_and_predicts_h200_droop():
    # H100-SXM anchor: the seed's M=16384 GEMM (tensor activity 0.8915 in m2live, ENERGY_PER_FLOP) settles at
    # 1380/1980 (n=5); the law must give that back
    h = forecast_clock_ratio(700, 989.4e12 * 1980 / 1830, "hopper", 0.8915)
    assert h == pytest.approx(1380 / 1980, rel=0.01)
    # H200 (held out: same die and TDP) measured 1455/1980 = 0.735; a forecast within 8 % of it
    from m2live import get_gpu

    g = get_gpu("NVIDIA H200")
    assert forecast_clock_ratio(g.tdp_w, g.peak_flops(), g.arch, 0.8915) == pytest.approx(1455 / 1980, rel=0.08)


def test_tp_halves_gemm_time_and_adds_communication():
    p1 = Predictor.for_gpu(H100, model=LLAMA8B, tp=1)
    p2 = Predictor.for_gpu(H100, model=LLAMA8B, tp=2)
    step = Step([(4096, 0)])
    r1, r2 = p1.predict(step, f_clk=1.0), p2.predict(step, f_clk=1.0)
    for op in ("qkv", "o", "gate_up", "down"):
        assert 0.4 < r2.ops[op] / r1.ops[op] < 0.65, op
    assert r1.ops["allreduce"] == 0 and r2.ops["allreduce"] > 0
    assert r2.bound["allreduce"] == "communication"


def test_prediction_carries_every_term(h100):
    r = h100.predict(Step([(2048, 0), (1, 900), (1, 1500)]), f_clk=None)
    assert set(r.ops) >= {"qkv", "o", "gate_up", "down", "attn_prefill", "attn_decode", "light", "lm_head",
                          "allreduce", "launch", "host", "sampling"}
    assert r.total_s == pytest.approx(max(r.t_blocks, r.t_blocks + r.ops["launch"]) + r.ops["host"]
                                      + r.ops["sampling"])
    for factor in ("f_clk", "eta_wave", "eta_active", "eta_duty", "eta_mem"):
        assert factor in r.factors
        assert all(0 < v <= 1.0 for v in r.factors[factor].values()), factor
    assert h100.predict_total(Step([(2048, 0)]), 0.8) == pytest.approx(
        h100.predict(Step([(2048, 0)]), f_clk=0.8).total_s)


def test_h200_decode_faster_than_h100_same_compute():
    s = Step.build([], [2000] * 64)
    h100 = Predictor.for_gpu(H100, model=LLAMA8B).predict(s, f_clk=1.0).total_s
    h200 = Predictor.for_gpu("NVIDIA H200", model=LLAMA8B).predict(s, f_clk=1.0).total_s
    assert h200 < h100 * 0.85  # 4.8 vs 3.35 TB/s on a memory-bound step


def test_decode_split_rule_fills_the_sms_and_stops_when_full():
    from m2live.efficiency import decode_splits

    assert decode_splits(items=120, key_blocks=64, sms=132) == 1  # >= 80 % of the SMs: no split
    assert decode_splits(items=8, key_blocks=1, sms=132) == 1  # one key block: nothing to split
    s = decode_splits(items=8, key_blocks=128, sms=132)
    assert 1 < s <= 128 and 8 * s >= 0.8 * 132 * 0.85  # the split fills most of one wave
    assert all(decode_splits(i, 32, 108) <= 32 for i in range(1, 108))  # never more splits than key blocks


def test_fa2_split_rule_counts_two_ctas_per_sm_and_only_eligible_split_counts():
    """FlashAttention-2's set_params_splitkv runs the rule over twice the SMs and skips a split count that leaves
    the key blocks per split unchanged; FA3's counts the SMs once. The A100 (108 SMs) with 120 items: FA3's rule
    no longer splits (>= 80 % of 108), FA2's still does (< 80 % of 216)."""
    from m2live.efficiency import decode_splits, fa2_splits
    from m2live.predictor import OpModel

    assert decode_splits(items=120, key_blocks=64, sms=108) == 1
    assert fa2_splits(items=120, key_blocks=64, sms=108) > 1
    assert fa2_splits(items=180, key_blocks=64, sms=108) == 1  # >= 80 % of 216 slots
    for items in range(1, 173):
        for kb in (3, 7, 64, 100, 128, 1024):
            s = fa2_splits(items, kb, 108)
            assert 1 <= s <= min(kb, 128)
            assert s == 1 or -(-kb // s) != -(-kb // (s - 1))  # eligible: one key block fewer per split
    assert OpModel("NVIDIA A100-SXM4-80GB").c.decode_split_rule == "fa2"
    assert OpModel("NVIDIA L40S").c.decode_split_rule == "fa2"  # borrows FA2 with Ampere's constants
    assert OpModel("NVIDIA H100 80GB HBM3").c.decode_split_rule == "flash"


def test_fa2_decode_does_not_split_plain_multi_head_attention():
    """FlashAttention-2 (A100) splits the KV cache only for grouped-query heads: one long multi-head sequence
    streams through a single CTA per head, many times slower than the same cache read under GQA (opbench A100:
    ~380 us vs ~45 us at 16k context, b=1). FlashAttention-3 (H100) splits both."""
    from m2live.predictor import OpModel

    a100, h100 = OpModel("NVIDIA A100-SXM4-80GB"), OpModel("NVIDIA H100 80GB HBM3")
    mha = a100.decode_attention(16383, 1, 8, 8, 128).t
    gqa = a100.decode_attention(16383, 1, 64, 8, 128).t
    assert mha > 4 * gqa
    assert h100.decode_attention(16383, 1, 8, 8, 128).t < 1.5 * h100.decode_attention(16383, 1, 64, 8, 128).t


@pytest.mark.parametrize("ctx, b, kv, splits", [(131071, 1, 1, 148), (131071, 1, 8, 18), (1023, 1, 1, 2),
                                                 (8191, 1, 1, 16), (511, 1, 1, 1), (255, 1, 1, 1),
                                                 (131071, 16, 8, 1), (131071, 2, 4, 18), ([8191, 100], 2, 1, 16)])
def test_trtllm_decode_splits_by_flashinfers_rule(ctx, b, kv, splits):
    """The B300's decode kernel (FlashInfer's TRT-LLM generation kernel) splits each sequence's KV over
    min(ceil(longest sequence's keys / 512), SMs // (sequences x KV heads)) CTAs (computeCtaAndClusterConfig: each
    split at least two 256-key steps), never FlashAttention's wave-fill rule, and merges the splits in the kernel
    at t_merge each: the time moves by t_merge x splits. A batch of unequal sequences splits by its longest."""
    from dataclasses import replace

    from m2live.predictor import OpModel

    om = OpModel("NVIDIA B300 SXM6 AC")
    assert om.c.decode_split_rule == "trtllm" and om.gpu.sms == 148
    base = OpModel("NVIDIA B300 SXM6 AC", constants=replace(om.c, t_merge=0.0))
    more = OpModel("NVIDIA B300 SXM6 AC", constants=replace(om.c, t_merge=1e-6))
    contexts = ctx if isinstance(ctx, list) else b * ctx
    dt = (more.decode_attention(contexts, b, 8 * kv, kv, 128).t
          - base.decode_attention(contexts, b, 8 * kv, kv, 128).t)
    assert dt == pytest.approx(splits * 1e-6 if splits > 1 else 0.0, abs=1e-12)


def test_trtllm_decode_more_keys_are_never_faster():
    """The TRT-LLM decode kernel splits a sequence's KV into more pieces as it grows (at least 512 keys each), and
    each CTA runs whole 256-key steps: one more key never makes the call faster — not where a split is added
    (a CTA of 257-512 keys runs two steps either way), nor where the splits reach the SMs' cap."""
    from m2live.predictor import OpModel

    for gpu in ("NVIDIA B300 SXM6 AC", "NVIDIA B200"):
        om = OpModel(gpu)
        for b, kv in ((1, 1), (2, 1), (1, 8), (16, 1), (4, 8)):
            keys = [*range(1, 2200), *range(2200, 40000, 13)]
            t = [om.decode_attention(b * k, b, 8 * kv, kv, 128).t for k in keys]
            worst = max((t[i - 1] - t[i]) / t[i - 1] for i in range(1, len(t)))
            assert worst < 1e-9, (gpu, b, kv, worst)
        # a batch of unequal sequences: the kernel splits by the longest; growing one of them stays monotone to
        # within the switch of which sequence is the longest
        t = [om.decode_attention([k, 3000], 2, 8, 1, 128).t for k in range(1, 9000, 7)]
        assert max((t[i - 1] - t[i]) / t[i - 1] for i in range(1, len(t))) < 0.01


def test_fa3_decode_pays_its_tile_scheduler_up_to_992_sequences():
    """FlashAttention-3 over a varlen batch of at most 992 sequences (its dynamic-split path) finds each CTA's next
    tile by a warp's scan of 31 sequences at a time: t_sched per 31 sequences of the batch. The H100 table, one key
    of context, one KV head, 8 query heads: 512 sequences take 33.1 us and 1024 take 41.5 us (0.80), where the
    items' fixed costs alone make 512 half of 1024. Beyond 992 sequences, and on other kernels, no such cost."""
    from dataclasses import replace

    from m2live.efficiency import in_use
    from m2live.predictor import OpModel

    om = OpModel("NVIDIA H100 80GB HBM3")
    assert om.c.t_sched > 0 and in_use(om.c, "t_sched")
    bare = OpModel("NVIDIA H100 80GB HBM3", constants=replace(om.c, t_sched=0.0))
    for b in (64, 512, 992):
        assert om.decode_attention(b, b, 8, 1, 128).t > bare.decode_attention(b, b, 8, 1, 128).t
    for b in (993, 2048):
        assert om.decode_attention(b, b, 8, 1, 128).t == bare.decode_attention(b, b, 8, 1, 128).t
    # the batch is the call's: 990 decodes sharing it with 4 prefill chunks are past the dynamic path
    assert om.decode_attention(990, 990, 8, 1, 128, call_seqs=994).t == bare.decode_attention(990, 990, 8, 1, 128).t
    assert om.decode_attention(90, 90, 8, 1, 128, call_seqs=94).t > om.decode_attention(90, 90, 8, 1, 128).t
    ratio = om.decode_attention(512, 512, 8, 1, 128).t / om.decode_attention(1024, 1024, 8, 1, 128).t
    assert 0.72 < ratio < 0.88, ratio  # measured 0.80; without the scheduler's cost ~0.6
    for gpu in ("NVIDIA A100-SXM4-80GB", "NVIDIA B300 SXM6 AC"):
        c = OpModel(gpu).c
        assert c.t_sched == 0.0 and not in_use(c, "t_sched")


def test_fa3_decode_pays_per_packed_query_row():
    """FA3 packs a KV head's query heads into the rows of its decode tile (PackGQA) and gathers them in and writes
    them out row by row: t_qrow per query row of an item. The H100 table, one key of context, one KV head, 1024
    sequences (past the scheduler's batches): 8 / 32 / 64 query heads take 41.5 / 41.9 / 45.9 us, at 2048
    sequences 73.7 / 82.9 / 94.7 us. More query heads are never faster, and at short contexts 64 of them cost
    more than 8 by about what the table shows; other kernels price no such cost."""
    from dataclasses import replace

    from m2live.efficiency import in_use
    from m2live.predictor import OpModel

    om = OpModel("NVIDIA H100 80GB HBM3")
    assert om.c.t_qrow > 0 and in_use(om.c, "t_qrow")
    bare = OpModel("NVIDIA H100 80GB HBM3", constants=replace(om.c, t_qrow=0.0))
    for b, ctx in ((1, 8191), (64, 1023), (512, 1), (2048, 1), (2048, 255)):
        t = [om.decode_attention(b * ctx, b, g, 1, 128).t for g in (1, 8, 16, 32, 64)]
        assert t == sorted(t), (b, ctx, t)
        assert om.decode_attention(b * ctx, b, 64, 1, 128).t > bare.decode_attention(b * ctx, b, 64, 1, 128).t
    for b in (512, 2048):  # 64 over 8 query heads, measured 46.8 / 33.1 = 1.41 and 94.7 / 73.7 = 1.28
        grow = om.decode_attention(b, b, 64, 1, 128).t / om.decode_attention(b, b, 8, 1, 128).t
        bare_grow = bare.decode_attention(b, b, 64, 1, 128).t / bare.decode_attention(b, b, 8, 1, 128).t
        assert grow > bare_grow + 0.1 and 1.1 < grow < 1.6, (b, grow, bare_grow)
    for gpu in ("NVIDIA A100-SXM4-80GB", "NVIDIA B300 SXM6 AC"):
        c = OpModel(gpu).c
        assert c.t_qrow == 0.0 and not in_use(c, "t_qrow")


def test_trtllm_decode_items_cost_by_the_kernel_their_tile_runs():
    """For one new token FlashInfer runs query groups of <= 32 rows in its SwapsMmaAb kernels and 33-64 in its
    KeepsMmaAb kernel, whose items' fixed work does not follow the main loop's ratio: the B300 table at one key,
    one KV head, 2048 sequences of 8 / 16 / 32 / 64 query heads: 29.7 / 35.3 / 52.6 / 47.9 us — the 32-row
    swapped kernel the slowest."""
    from m2live.predictor import OpModel

    om = OpModel("NVIDIA B300 SXM6 AC")
    t = {g: om.decode_attention(2048, 2048, g, 1, 128).t for g in (8, 16, 32, 64)}
    assert t[8] < t[16] < t[64] < t[32], t
    assert 1.6 < t[32] / t[8] < 2.0, t  # measured 1.77
    # groups of 65-128 (no table row reaches them): the 128-row tile costs more an item than the 64-row one
    assert om.decode_attention(2048, 2048, 128, 1, 128).t > t[64]
    for gpu in ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"):
        assert OpModel(gpu).c.decode_item_tile_cost == ()  # their items follow decode_tile_cost (or none)


def test_trtllm_decode_larger_query_tiles_are_never_faster_over_a_long_kv():
    """TRT-LLM's generation kernels pack one KV head's query heads into a tile of 8/16/32/64 rows; its own cost
    model has the main loop slow with the tile (1.0 / 1.2 / 1.48 / 1.68): over a long KV, at the same KV bytes, a
    larger group is never faster (where the items' fixed work dominates, the 64-row kernel beats the 32-row one:
    above)."""
    from m2live.predictor import OpModel

    om = OpModel("NVIDIA B300 SXM6 AC")
    for b, ctx in ((1, 131071), (4, 16383), (64, 1023)):
        t = [om.decode_attention(b * (ctx + 1), b, g, 1, 128).t for g in (1, 8, 16, 32, 64)]
        assert t == sorted(t) and t[-1] > t[0], (b, ctx, t)


def test_fa3_prefill_splits_the_kv_of_a_small_grid():
    """FA3 (H100) splits the KV of a prefill whose query tiles leave the SMs idle (hopper/heuristics.h): none once
    they fill 80 % of the SMs or the KV is four blocks or fewer; a 2048-token prompt over four heads (64 query
    tiles on 132 SMs) is then faster than unsplit, and a full grid is never split."""
    from m2live.efficiency import fa3_splits
    from m2live.predictor import OpModel

    assert fa3_splits(120, 64, 132) == 1 and fa3_splits(8, 4, 132) == 1
    s = fa3_splits(8, 64, 132)
    assert 1 < s <= 64 and 8 * s >= 0.85 * 0.8 * 132
    h100 = OpModel("NVIDIA H100 80GB HBM3")
    assert h100.c.prefill_split and not OpModel("NVIDIA A100-SXM4-80GB").c.prefill_split
    from dataclasses import replace

    unsplit = OpModel("NVIDIA H100 80GB HBM3", constants=replace(h100.c, prefill_split=False))
    assert h100.prefill_attention([(2048, 0)], 4, 4, 128).t < unsplit.prefill_attention([(2048, 0)], 4, 4, 128).t
    # eight query heads on one KV head pack into 128 tiles: enough, no split
    assert h100.prefill_attention([(2048, 0)], 8, 1, 128).t == unsplit.prefill_attention([(2048, 0)], 8, 1, 128).t
    big = [(2048, 0)] * 16  # 16 x 8 heads x 16 query tiles: no split, the same time
    assert h100.prefill_attention(big, 8, 8, 128).t == unsplit.prefill_attention(big, 8, 8, 128).t


@pytest.mark.parametrize("gpu", ["NVIDIA A100-SXM4-80GB", "NVIDIA L40S", "NVIDIA B200",
                                 "NVIDIA RTX PRO 6000 Blackwell Server Edition"])
def test_small_prefill_grids_are_list_scheduled_within_their_bounds(gpu):
    """An unpacked prefill grid (FA2, TRT-LLM) of a few tiles per SM is list-scheduled in launch order: never
    shorter than its longest tile or than its work spread over every SM, the longest tile exactly when each SM
    holds one, and longer than the closed-form bound where the last long tiles start late (the A100's rows at
    1-6 tiles per SM were predicted ~8 % short under the bound alone)."""
    import math

    from m2live.operators import LIST_SCHEDULE_TILES_PER_SM
    from m2live.predictor import OpModel

    om = OpModel(gpu)
    bm, pad, k0, sms = om.c.attn_block_m, om.c.attn_row_pad, om.c.k0_attn, om.gpu.sms
    assert not om.c.prefill_pack_gqa and pad
    for isl, heads, b in ((1024, 1, 1), (2048, 4, 1), (4096, 8, 2), (777, 12, 3), (8192, 2, 1)):
        seqs = [(isl, 0)] * b
        starts = range(0, isl, bm)  # each tile's first query row; its rows' prologue padded
        per_head = [min(bm, isl - p0) * (p0 + (min(bm, isl - p0) + 1) / 2.0) + k0 * -(-min(bm, isl - p0) // pad) * pad
                    for p0 in starts]
        tiles = per_head * b * heads
        work, u_max = sum(tiles), max(tiles)
        if len(tiles) > LIST_SCHEDULE_TILES_PER_SM * sms:
            continue
        span = om._list_makespan(seqs, heads, 1, k0, work, 128)
        assert span >= u_max * (1 - 1e-12) and span >= work / sms * (1 - 1e-12)
        if len(tiles) <= sms:
            assert span == pytest.approx(u_max)
        bound = work / (sms * om._tile_makespan_fill(len(tiles), work, u_max))
        assert span >= bound * (1 - 1e-12), (isl, heads, b)
        assert math.isfinite(om.prefill_attention(seqs, heads, 1, 128).t)


def test_more_heads_never_make_a_prefill_faster_across_the_list_schedules_limit():
    """Past LIST_SCHEDULE_TILES_PER_SM tiles per SM the list schedule blends into the closed form over twice as
    many: one more head (more tiles, more work) never shortens the predicted time, there or anywhere."""
    from m2live.predictor import OpModel

    # (not the H100: FA3 splits a small grid's KV by a heuristic of its own, fa3_splits, and one more head can
    # change the split count and be faster, as the kernel is)
    # (on the B200, one query head on one KV head is a multi-head call, whose KV the TRT-LLM context kernel streams
    # in series, prefill_mha_kv_serial; a second query head on that KV head is grouped-query: the B300's table has
    # the two within a few per cent either way, and so does the model)
    for gpu in ("NVIDIA A100-SXM4-80GB", "NVIDIA L40S", "NVIDIA B200", "NVIDIA RTX PRO 6000 Blackwell Server Edition"):
        om = OpModel(gpu)
        for isl, b in ((1024, 1), (2048, 2), (1500, 1), (8192, 1), (512, 8)):
            for kv in ("mha", "one"):
                t = [om.prefill_attention([(isl, 0)] * b, h, h if kv == "mha" else 1, 128).t for h in range(1, 65)]
                if kv == "one" and om.c.prefill_mha_kv_serial:
                    assert t[1] >= 0.95 * t[0]
                    t = t[1:]
                assert all(y >= x * (1 - 1e-9) for x, y in zip(t, t[1:], strict=False)), (gpu, isl, b, kv)


def test_leave_one_gpu_out_transfers_fitted_numbers_not_kernel_facts():
    from m2live.efficiency import ARCH, FITTED, transfer

    moved = transfer(ARCH["hopper"], ARCH["ampere"])
    assert all(getattr(moved, n) == getattr(ARCH["ampere"], n) for n in FITTED)
    assert moved.split_needs_gqa == ARCH["hopper"].split_needs_gqa and moved.tiles == ARCH["hopper"].tiles


def test_single_token_prefill_is_the_decode_kernel_path():
    """A batch whose longest query is one token runs the decode path (FlashAttention: max_seqlen_q == 1)."""
    from m2live.predictor import OpModel

    om = OpModel("NVIDIA A100-SXM4-80GB")
    assert om.prefill_attention([(1, 0)] * 16, 32, 8, 128).t == om.decode_attention(0, 16, 32, 8, 128).t
    assert om.prefill_attention([(2, 0)] * 16, 32, 8, 128).t != om.decode_attention(0, 16, 32, 8, 128).t


def test_fa2_grouped_query_decode_pays_the_relayout_only_when_it_copies(monkeypatch: pytest.MonkeyPatch):
    """FA2 lays grouped queries out as rows of one KV head: three real copies (q in, the output and q back) only
    with >1 sequence and >1 KV head, their launches (t_relayout) and their traffic, which grows with the batch."""
    from dataclasses import replace

    from m2live import operators
    from m2live.efficiency import ARCH
    from m2live.predictor import OpModel

    om = OpModel("NVIDIA A100-SXM4-80GB")
    with_copy = {(b, h, kv): om.decode_attention(b * 100, b, h, kv, 128).t
                 for b, h, kv in ((8, 32, 8), (64, 32, 8), (512, 32, 8), (1, 32, 8), (8, 32, 1), (8, 8, 8))}
    monkeypatch.setattr(operators, "RELAYOUT_COPIES", 0)
    without = OpModel("NVIDIA A100-SXM4-80GB", constants=replace(ARCH["ampere"], t_relayout=0.0))

    def gap(b: int, h: int, kv: int) -> float:
        return with_copy[(b, h, kv)] - without.decode_attention(b * 100, b, h, kv, 128).t

    copy = 3 * 2 * 2 * 8 * 32 * 128  # three copies of batch x heads x head_dim bf16 elements, read and written
    assert gap(8, 32, 8) == pytest.approx(ARCH["ampere"].t_relayout + copy / (om.bw * om._eta_mem(copy / 3)))
    assert gap(8, 32, 8) < gap(64, 32, 8) < gap(512, 32, 8)
    assert gap(512, 32, 8) > 3 * ARCH["ampere"].t_relayout  # a large batch's copies outweigh their launches
    for b, h, kv in ((1, 32, 8), (8, 32, 1), (8, 8, 8)):  # one sequence, one KV head, no grouping: views only
        assert gap(b, h, kv) == 0.0


def test_fa2_decode_items_cost_more_with_more_real_query_rows_but_stream_alike():
    """FA2's decode tile is always 64 rows, but each real query row costs the CTA its q load and output write:
    at short contexts the items' fixed time grows with the query heads per KV head (flat to 8), while a long
    KV stream — masked rows are computed all the same — is priced alike."""
    from dataclasses import replace

    from m2live.efficiency import ARCH
    from m2live.predictor import OpModel

    om = OpModel("NVIDIA A100-SXM4-80GB")
    flat = OpModel("NVIDIA A100-SXM4-80GB", constants=replace(ARCH["ampere"], decode_tile_cost=()))
    short = [om.decode_attention(2048 * 2, 2048, h, 1, 128).t for h in (1, 8, 16, 32, 64)]
    assert short[0] == pytest.approx(flat.decode_attention(2048 * 2, 2048, 1, 1, 128).t)
    assert short[1] == pytest.approx(flat.decode_attention(2048 * 2, 2048, 8, 1, 128).t)
    assert short[1] < short[2] < short[3] < short[4] < 2 * short[1]
    long_ctx = (om.decode_attention(16 * 65536, 16, 64, 8, 128).t, flat.decode_attention(16 * 65536, 16, 64, 8, 128).t)
    assert long_ctx[0] == pytest.approx(long_ctx[1], rel=1e-3)


def test_fa2_split_decode_pays_its_partial_outputs_and_combine():
    """FA2's split-KV decode writes one fp32 partial output per split and query head and its combine kernel reads
    them back (4 rows per CTA at head_dim 128): the split's cost grows with the query heads it carries."""
    from dataclasses import replace

    from m2live.efficiency import ARCH
    from m2live.predictor import OpModel

    priced = OpModel("NVIDIA A100-SXM4-80GB")
    fixed = OpModel("NVIDIA A100-SXM4-80GB", constants=replace(ARCH["ampere"], combine_rows=0))
    gaps = [priced.decode_attention(16 * 4096, 16, h, 1, 128).t - fixed.decode_attention(16 * 4096, 16, h, 1, 128).t
            for h in (8, 32, 64)]
    assert 0 < gaps[0] < gaps[1] < gaps[2]
    h100 = OpModel("NVIDIA H100 80GB HBM3")  # FA3 / TRT-LLM keep t_split alone
    assert h100.c.combine_rows == 0 and ARCH["blackwell"].combine_rows == 0


def _decode_drops(gpu: str, floor: float) -> list:
    """(h, kv, b, step, warm) on opbench's grid where a larger batch or context is more than 1 - floor faster."""
    from m2live.predictor import OpModel

    om = OpModel(gpu)
    batches = [2**i for i in range(12)]
    steps = [2**i - 1 for i in range(1, 18)]
    drops = []
    for h, kv in ((8, 8), (32, 8), (64, 8), (32, 4), (64, 1)):
        for warm in (False, True):
            g = [[om.decode_attention(b * (s + 1), b, h, kv, 128, l2_warm=warm).t for s in steps] for b in batches]
            for i in range(len(batches)):
                for j in range(len(steps)):
                    if (j and g[i][j] < floor * g[i][j - 1]) or (i and g[i][j] < floor * g[i - 1][j]):
                        drops.append((h, kv, batches[i], steps[j], warm))
    return drops


@pytest.mark.parametrize("gpu, floor", [("NVIDIA A100-SXM4-80GB", 0.45), ("NVIDIA H100 80GB HBM3", 0.74),
                                        ("NVIDIA B300 SXM6 AC", 0.74)])
def test_decode_time_falls_at_most_a_split_step_as_batch_or_context_grows(gpu, floor):
    """More sequences or longer contexts make a decode call at most a split step faster on opbench's grid: where
    the batch grows past the split-KV rule's threshold the split (and its combine pass) ends, one CTA per item —
    the only dip the model has. The real kernel dips there too (A100, 64 query heads on one KV head, 255 cached
    tokens: 30.4 -> 23.5 us from batch 64 to 128); the model's A100 dip is deeper (up to 50 %, four cells below
    26 %), H100 / B300 within 26 %."""
    assert not _decode_drops(gpu, floor)



def test_fa2_decode_items_run_in_whole_waves_over_the_sms():
    """FA2 launches one CTA per (sequence x KV head) item: one item more than the SMs costs a whole item's fixed
    time more at short contexts (the SM holding two finishes last), one fewer nothing; FA3 prices the mean."""
    from m2live.predictor import OpModel

    a100 = OpModel("NVIDIA A100-SXM4-80GB")
    sms = a100.gpu.sms
    t = {b: a100.decode_attention(b * 4, b, 8, 1, 128).t for b in (sms - 1, sms, sms + 1, 2 * sms, 2 * sms + 1)}
    assert t[sms - 1] == pytest.approx(t[sms], rel=1e-3)
    assert t[sms + 1] - t[sms] > 0.8 * a100.c.item_cost  # (less the part the call's floor already covered)
    assert t[2 * sms] == pytest.approx(t[sms + 1], rel=1e-2)  # only the cache write grows within the wave
    assert t[2 * sms + 1] > t[2 * sms]
    h100 = OpModel("NVIDIA H100 80GB HBM3")
    n = h100.gpu.sms
    gap = h100.decode_attention((n + 1) * 4, n + 1, 8, 1, 128).t - h100.decode_attention(n * 4, n, 8, 1, 128).t
    assert gap < 0.1 * h100.c.item_cost


def test_vllm_caps_fa3_decode_splits_under_its_cuda_graph():
    """vLLM's full-CUDA-graph decode caps FA3's KV splits at 32 (flash_attn_max_num_splits_for_cuda_graph):
    one sequence over a long KV runs in at most 32 CTAs, so it streams slower than many sequences over the same
    bytes; the cap never applies to FA2's rule or where the items alone fill the SMs."""
    from dataclasses import replace

    from m2live.efficiency import decode_splits
    from m2live.predictor import OpModel

    h100 = OpModel("NVIDIA H100 80GB HBM3")
    assert h100.c.decode_max_splits == 32 and OpModel("NVIDIA A100-SXM4-80GB").c.decode_max_splits == 128
    assert decode_splits(1, 1024, 132, 32) <= 32 < decode_splits(1, 1024, 132)
    uncapped = OpModel("NVIDIA H100 80GB HBM3", constants=replace(h100.c, decode_max_splits=128))
    one_long = [m.decode_attention(131072, 1, 8, 1, 128).t for m in (h100, uncapped)]
    assert one_long[0] > one_long[1]
    many = [m.decode_attention(256 * 2048, 256, 32, 8, 128).t for m in (h100, uncapped)]
    assert many[0] == many[1]
    # the same bytes over more sequences stream faster under the cap
    assert h100.decode_attention(131072, 1, 8, 1, 128).t > h100.decode_attention(131072, 8, 8, 1, 128).t


@pytest.mark.parametrize("gpu, one_call", [("NVIDIA H100 80GB HBM3", True), ("NVIDIA A100-SXM4-80GB", True),
                                           ("NVIDIA L40S", True), ("NVIDIA B300 SXM6 AC", False)])
def test_a_mixed_step_pays_one_attention_call_on_flashattention(gpu, one_call):
    """vLLM's FlashAttention backends run a step's prefill chunks and decodes as one varlen call per layer (one
    launch, one KV-cache write): the call's fixed part is paid once, and the call is never shorter than either
    part alone. FlashInfer's backend (the B300's TRT-LLM kernels) runs a prefill and a decode kernel."""
    p = Predictor(gpu, "meta-llama/Llama-3.1-8B")
    c, L = p.ops.c, p.model.layers
    pre, dec = Step([(512, 0)]), Step([(1, 1000)] * 32)
    mixed = p.predict(Step([(512, 0)] + [(1, 1000)] * 32), f_clk=1.0).ops
    alone_pre = p.predict(pre, f_clk=1.0).ops["attn_prefill"]
    alone_dec = p.predict(dec, f_clk=1.0).ops["attn_decode"]
    together = mixed["attn_prefill"] + mixed["attn_decode"]
    assert c.attn_mixed_one_call is one_call
    assert together >= max(alone_pre, alone_dec) * (1 - 1e-9)
    if one_call:
        # ... and FA3's tile scheduler walks the whole call's sequences (t_sched; 0 off Hopper)
        h, kv, hd = p._attn_dims
        o = p.ops
        sched = L * (o.decode_attention([1000] * 32, 32, h, kv, hd, 1.0, call_seqs=33).t
                     - o.decode_attention([1000] * 32, 32, h, kv, hd, 1.0).t)
        assert (sched > 0) is (c.t_sched > 0)
        assert together == pytest.approx(alone_pre + alone_dec - c.t_attn_over * L + sched, rel=1e-6)
    else:
        assert together == pytest.approx(alone_pre + alone_dec, rel=1e-6)


def test_allreduce_rms_fusion_drops_the_norm_kernels_of_small_tp_steps():
    """vLLM >= 0.16 fuses each TP all-reduce with the add+RMSNorm after it on capability 9.0 / 10.x (FlashInfer's
    kernel) for steps whose message fits its size table: such a step loses the two norm kernels a layer, a larger
    one (the unfused compile range), TP=1 and an A100 are priced as before, and the switch off restores them."""
    from m2live.hardware import get_gpu
    from m2live.predictor import allreduce_fusion_max_bytes

    def total(gpu: str, tp: int, decodes: int, fusion: bool | None = None, model: str = "meta-llama/Llama-3.1-70B"):
        p = Predictor(gpu, model, tp=tp, allreduce_fusion=fusion)
        return p.predict(Step.build(decodes=[1500] * decodes), f_clk=1.0), p

    # H100, TP 8: 0.5 MiB / (8192 hidden x 2 B) = 32 tokens
    assert allreduce_fusion_max_bytes(get_gpu("h100-sxm"), 8) == 0.5 * 2**20
    fused, p = total("h100-sxm", 8, 32)
    plain, _ = total("h100-sxm", 8, 32, fusion=False)
    assert p.fusion_max_tokens == 32
    layers, t_k = p.model.layers, p.ops.c.t_kernel
    saved = plain.ops["light"] - fused.ops["light"]
    assert 2 * layers * t_k <= saved <= 2 * layers * t_k * 1.5  # two kernels a layer, and their few bytes
    assert fused.total_s == pytest.approx(plain.total_s - saved, rel=1e-9)
    above, _ = total("h100-sxm", 8, 33)
    above_off, _ = total("h100-sxm", 8, 33, fusion=False)
    assert above.total_s == above_off.total_s  # the unfused compile range
    # the B300's table is its own (4 MiB at TP 8: 256 tokens), the B200's 1 MiB (64)
    assert Predictor("b300", "meta-llama/Llama-3.1-70B", tp=8).fusion_max_tokens == 256
    assert Predictor("b200", "meta-llama/Llama-3.1-70B", tp=8).fusion_max_tokens == 64
    # no fusion: TP 1, no kernel (A100, sm_80), a TP size the table lacks
    for gpu, tp in (("h100-sxm", 1), ("a100-sxm4-80gb", 4), ("h100-sxm", 16)):
        assert allreduce_fusion_max_bytes(get_gpu(gpu), tp) == 0.0
    on, _ = total("a100-sxm4-80gb", 4, 8)
    off, _ = total("a100-sxm4-80gb", 4, 8, fusion=False)
    assert on.total_s == off.total_s


def test_the_lm_head_pays_the_sampler_per_logit_and_the_vocab_gather_under_tp():
    """After the LM head GEMM, vLLM's sampler makes passes over every sampled sequence's fp32 logits (26 B a logit)
    and, under TP, the vocab shards are all-gathered first: more sequences or a bigger vocabulary never cost less,
    the extra time is at least those bytes at the datasheet bandwidth, and a TP step's LM head holds NCCL's start."""
    from dataclasses import replace

    from m2live.predictor import SAMPLER_BYTES_PER_LOGIT

    base = get_model("meta-llama/Llama-3.1-8B")
    big = replace(base, vocab=2 * base.vocab, name="wide vocabulary")
    p, q = Predictor("h100-sxm", base), Predictor("h100-sxm", big)
    bw = p.gpu.mem_bw
    prev = 0.0
    for seqs in (1, 16, 128, 512):
        t = p.t_lm_head(seqs, 1.0).t
        gemm = p.ops.gemm(seqs, *p._lm_nk, 1.0).t
        assert t - gemm >= seqs * base.vocab * SAMPLER_BYTES_PER_LOGIT / bw
        assert t >= prev
        prev = t
        assert q.t_lm_head(seqs, 1.0).t > t
    tp2 = Predictor("h100-sxm", base, tp=2)
    gemm2 = tp2.ops.gemm(64, *tp2._lm_nk, 1.0).t
    assert tp2.t_lm_head(64, 1.0).t - gemm2 >= 64 * base.vocab * SAMPLER_BYTES_PER_LOGIT / bw + 20e-6


def test_trtllm_prefill_lone_tile_runs_its_softmax_in_series():
    """FlashInfer's TRT-LLM context kernels (B300, B200) ping-pong two 128-row query tiles per CTA, one's softmax
    under the other's MMAs; a chunk of an odd number of tiles leaves its last one alone, its softmax in series.
    The B300's table: at 16 K tokens on 8 KV heads a query head costs more at 128 tokens a prompt than at 256
    (3.31 against 2.82 us), and so does the model. A full pair adds nothing; the lone tile's cost grows with the
    keys it reads; a partner of any rows hides part of it, so a chunk grown by a few tokens is never much cheaper
    (no cliff where the lone tile finds a partner), and the lone tile never makes a call cheaper than pricing every
    tile as paired; the FA2 / FA3 kernels have no such tile."""
    from dataclasses import replace

    from m2live.predictor import OpModel

    b300 = OpModel("NVIDIA B300 SXM6 AC")
    assert b300.c.prefill_pingpong and b300.c.attn_row_pad * 2 == b300.c.attn_block_m

    def per_head(isl: int) -> float:
        t = [b300.prefill_attention([(isl, 0)] * (16384 // isl), h, 8, 128).t for h in (32, 96)]
        return (t[1] - t[0]) / 64

    assert per_head(128) > per_head(256)
    assert b300._lone_tile(256, 0, 128) == 0.0 and b300._lone_tile(512, 1000, 128) == 0.0
    assert 0.0 < b300._lone_tile(100, 0, 128) < b300._lone_tile(128, 0, 128) < b300._lone_tile(128, 4096, 128)
    assert b300._lone_tile(384, 0, 128) == b300._lone_tile(128, 256, 128)  # the third tile, after 256 rows
    assert 0.0 < b300._lone_tile(129, 0, 128) < b300._lone_tile(128, 0, 128) * 129 / 128  # a 1-row partner
    # the B200 has half the B300's SFUs: its lone tile's softmax weighs more against the same MMAs
    b200 = OpModel("NVIDIA B200")
    assert b200._lone_tile(128, 0, 128) > b300._lone_tile(128, 0, 128)
    for om in (b300, b200):
        paired = OpModel(om.gpu, constants=replace(om.c, prefill_pingpong=False))
        for ctx, heads, kv in ((0, 64, 8), (4096, 8, 1), (1000, 32, 32)):
            prev = prev_paired = 0.0
            for new in range(100, 700, 7):
                t = om.prefill_attention([(new, ctx)], heads, kv, 128).t
                t_paired = paired.prefill_attention([(new, ctx)], heads, kv, 128).t
                # (the paired pricing has small steps of its own where a chunk's tiles change the grid's fill; a
                # partner of a few rows short of the waiting tile's still leaves a sliver exposed)
                assert t >= t_paired and t - prev >= min(0.0, t_paired - prev_paired) - 0.02 * prev, (new, ctx)
                prev, prev_paired = t, t_paired
    for gpu in ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA L40S"):
        assert not OpModel(gpu).c.prefill_pingpong
    with pytest.raises(ValueError, match="prefill_pingpong"):
        replace(b300.c, prefill_pack_gqa=True)


def test_cli_models_lists_every_preset_and_its_json_rows_are_configs(tmp_path):
    """``m2live models`` names every preset; a ``--json`` row written as a config.json is a model that resolves to
    the same shapes (the directory form every --model takes), and an unknown name points at the closest presets."""
    import dataclasses
    import subprocess
    import sys

    from m2live.shapes import PRESETS

    r = subprocess.run([sys.executable, "-m", "m2live", "models", "--json"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["name"] for row in rows] == list(PRESETS)
    for row in rows:
        d = tmp_path / row["name"].replace("/", "_")
        d.mkdir()
        (d / "config.json").write_text(json.dumps(row))
        m = get_model(d)
        assert dataclasses.replace(m, name=row["name"]) == PRESETS[row["name"]], row["name"]
        assert row["parameters_b"] == round(m.param_count() / 1e9, 2)
    table = subprocess.run([sys.executable, "-m", "m2live", "models"], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and all(name in table.stdout for name in PRESETS)
    bad = subprocess.run([sys.executable, "-m", "m2live", "predict", "--gpu", "h100", "--model", "Qwen/Qwen3-1.7B",
                          "--decode", "1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "closest: Qwen/Qwen3-" in bad.stderr and "`m2live models`" in bad.stderr


@pytest.mark.parametrize("extra, says", [
    ({"model_type": "starcoder2", "architectures": ["Starcoder2ForCausalLM"]}, "not gated"),
    ({"architectures": ["Starcoder2ForCausalLM"]}, "not gated"),
    ({"model_type": "mistral", "num_local_experts": 8, "num_experts_per_tok": 2}, "mixture-of-experts"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128, "moe_intermediate_size": 768},
     "mixture-of-experts"),
])
def test_layers_m2live_does_not_price_are_refused_whatever_the_config_calls_them(extra, says):
    """A dense shape would misprice them silently: StarCoder2's MLP has one up projection, not a gated pair; a
    mixture-of-experts layer routes each token to a few of many expert MLPs. Both are refused in one line."""
    base = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 32000}
    with pytest.raises(ModelShapeError, match=says) as e:
        ModelShape.from_config({**base, **extra})
    assert "\n" not in str(e.value)
    assert ModelShape.from_config({**base, "model_type": "qwen2", "num_experts": 0}).hidden == 4096  # 0: dense
