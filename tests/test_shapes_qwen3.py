"""Qwen3 (``model_type: qwen3``): explicit head_dim, per-head q/k RMSNorm, tied or untied LM head; the presets
carry the published config numbers; another unsupported model_type is one clear error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from m2live import ModelShape, ModelShapeError, Predictor, Step, get_model

# config.json of Qwen/Qwen3-32B on the Hugging Face hub (the fields m2live reads, verbatim values)
QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
    "hidden_size": 5120, "intermediate_size": 25600, "num_attention_heads": 64, "num_hidden_layers": 64,
    "num_key_value_heads": 8, "tie_word_embeddings": False, "vocab_size": 151936, "torch_dtype": "bfloat16",
}


def test_qwen3_config_parses_explicit_head_dim_qk_norm_and_untied_head(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_32B))
    m = ModelShape.from_path(tmp_path)
    assert m.head_dim == 128 and m.q_dim == 8192 != m.hidden == 5120  # head_dim is not hidden / heads (80)
    assert m.qk_norm and not m.qkv_bias and not m.tied_embeddings
    g = m.gemms()
    assert g["qkv"] == ((64 + 2 * 8) * 128, 5120) and g["o"] == (5120, 8192)
    assert g["gate_up"] == (2 * 25600, 5120) and g["down"] == (5120, 25600)
    preset = get_model("Qwen/Qwen3-32B")
    assert (preset.hidden, preset.intermediate, preset.layers, preset.heads, preset.kv_heads, preset.head_dim,
            preset.vocab, preset.qk_norm) == (m.hidden, m.intermediate, m.layers, m.heads, m.kv_heads,
                                              m.head_dim, m.vocab, m.qk_norm)
    assert preset.param_count() / 1e9 == pytest.approx(32.8, abs=0.05)  # the model card's 32.8 B
    assert get_model("Qwen3-8B").param_count() / 1e9 == pytest.approx(8.2, abs=0.05)  # and 8.2 B


def test_qwen3_tied_embeddings_hold_one_vocab_matrix(tmp_path):
    cfg = {**QWEN3_32B, "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
           "num_hidden_layers": 36, "tie_word_embeddings": True}  # Qwen3-4B's shape
    tied = ModelShape.from_config(cfg)
    untied = ModelShape.from_config({**cfg, "tie_word_embeddings": False})
    assert tied.tied_embeddings
    assert untied.weight_bytes() - tied.weight_bytes() == 151936 * 2560 * 2
    assert tied.param_count() / 1e9 == pytest.approx(4.02, abs=0.01)  # Qwen3-4B: 4.0 B with tied embeddings


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mamba", "deepseek_v3"])
def test_another_unsupported_model_type_is_one_line_error(tmp_path, model_type):
    cfg = {**QWEN3_32B, "model_type": model_type, "architectures": ["SomethingForCausalLM"]}
    with pytest.raises(ModelShapeError, match=f"model_type '{model_type}' is not a supported"):
        ModelShape.from_config(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "-m", "m2live", "predict", "--gpu", "h100", "--model", str(tmp_path),
                        "--decode", "10"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len([x for x in p.stderr.splitlines() if x.strip()]) == 1 and "model_type" in p.stderr


def test_qk_norm_weights_count_and_its_norm_runs_inside_the_rope_kernels():
    """Qwen3's q_norm / k_norm weights are in the model's bytes; compiled (vLLM's default), each head's norm is the
    prologue of the RoPE kernel reading that q or k, so the step's times equal those of the same shape without it."""
    q = get_model("Qwen/Qwen3-32B")
    plain = ModelShape(**{**q.__dict__, "qk_norm": False})
    step = Step.build([(1024, 0)], [2000] * 16)
    a = Predictor("h100-sxm", plain, tp=2).predict(step, f_clk=1.0)
    b = Predictor("h100-sxm", q, tp=2).predict(step, f_clk=1.0)
    for op in ("qkv", "o", "gate_up", "down", "attn_prefill", "attn_decode", "light", "lm_head"):
        assert b.ops[op] == a.ops[op], op
    assert q.weight_bytes() - plain.weight_bytes() == 2 * 64 * 128 * 2  # q_norm, k_norm weights per layer


def test_qwen3_32b_decode_step_on_h100_is_weight_stream_bound_and_sane():
    p = Predictor("NVIDIA H100 80GB HBM3", "Qwen/Qwen3-32B", tp=1)
    r = p.predict(Step(seqs=[(1, 1000)] * 8), f_clk=1.0)
    stream = p.model.weight_bytes() / p.gpu.mem_bw  # every weight read once: 65.5 GB at 3.35 TB/s = 19.6 ms
    assert stream < r.total_s < 1.4 * stream
    assert r.bound["gate_up"] == "memory"
    big = p.predict(Step(seqs=[(8192, 0)]), f_clk=1.0)  # a full prefill chunk is compute-bound
    flops = 2 * 8192 * sum(n * k for n, k in p.model.gemms().values()) * p.model.layers
    assert big.bound["gate_up"] == "compute"
    assert flops / p.gpu.peak_flops("bf16") < big.total_s < 3 * flops / p.gpu.peak_flops("bf16")
    for tp in (2, 4, 8):
        assert Predictor("h100-sxm", "Qwen/Qwen3-32B", tp=tp).predict(Step(seqs=[(1, 1000)] * 8),
                                                                     f_clk=1.0).total_s < r.total_s
