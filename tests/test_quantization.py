"""The weights' format of a served model: bf16, or vLLM's W8A8 fp8 linear layers with static or dynamic input
scales, from a checkpoint's quantization_config and the engine's --quantization (m2live.quantization), and the
plugin predicting with it."""

from __future__ import annotations

import pytest
from conftest import MODELS

from m2live.quantization import WeightFormat, weight_format

# quantization_config blocks as the checkpoints' config.json files write them
FP8_STATIC = {"quant_method": "fp8", "activation_scheme": "static"}
FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
MODELOPT_FP8 = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None}
MODELOPT_NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
CT_FP8_DYNAMIC = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
    "group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
CT_FP8_STATIC = {"quant_method": "compressed-tensors", "config_groups": {
    "group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}
CT_W4A16 = {"quant_method": "compressed-tensors", "config_groups": {
    "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
                "input_activations": None}}}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128}


@pytest.mark.parametrize("qc, method, want", [
    (None, None, ("bf16", "static")),
    ({}, "", ("bf16", "static")),
    (None, "fp8", ("fp8", "dynamic")),  # vLLM's online quantisation of a bf16 checkpoint
    (None, "fp8_per_tensor", ("fp8", "dynamic")),
    (FP8_STATIC, "fp8", ("fp8", "static")),
    ({"quant_method": "fp8"}, "fp8", ("fp8", "dynamic")),  # activation_scheme's default
    (FP8_BLOCK, "fp8", ("fp8", "dynamic")),
    ({"quant_method": "fbgemm_fp8"}, "fbgemm_fp8", ("fp8", "dynamic")),
    (MODELOPT_FP8, "modelopt", ("fp8", "static")),
    (CT_FP8_DYNAMIC, "compressed-tensors", ("fp8", "dynamic")),
    (CT_FP8_STATIC, "compressed-tensors", ("fp8", "static")),
])
def test_fp8_and_bf16_formats(qc, method, want):
    w = weight_format(qc, method)
    assert (w.precision, w.act_scale) == want
    assert "not modelled" not in w.why


@pytest.mark.parametrize("qc, method", [(AWQ, "awq"), (CT_W4A16, "compressed-tensors"),
                                        (MODELOPT_NVFP4, "modelopt"), (None, "gptq_marlin"),
                                        ({"quant_method": "compressed-tensors"}, None)])
def test_other_quantisations_are_priced_as_bf16_and_say_so(qc, method):
    w = weight_format(qc, method)
    assert w.precision == "bf16" and "not modelled" in w.why


def test_block_scales_are_named():
    assert "per-block" in weight_format(FP8_BLOCK).why
    assert WeightFormat("fp8", "dynamic").label == "fp8 (dynamic input scales)"
    assert WeightFormat().label == "bf16"


# ---- the plugin: vLLM's own resolved config -> the predictor's precision ------------------------------------
def _engine_config(tmp_path, quantization: str | None, quant_config: dict | None = None):
    """A real VllmConfig for the tiny model (dummy weights, nothing loaded), with a checkpoint quantization_config
    written into a copy of its config.json."""
    pytest.importorskip("vllm")
    import json

    from vllm.engine.arg_utils import EngineArgs

    d = tmp_path / "model"
    d.mkdir()
    cfg = json.loads((MODELS / "tiny-llama" / "config.json").read_text())
    if quant_config is not None:
        cfg["quantization_config"] = quant_config
    (d / "config.json").write_text(json.dumps(cfg))
    return EngineArgs(model=str(d), load_format="dummy", skip_tokenizer_init=True, quantization=quantization,
                      dtype="bfloat16").create_engine_config()


@pytest.mark.parametrize("quantization, qc, want", [(None, None, "bf16"), ("fp8", None, "fp8"),
                                                    (None, FP8_STATIC, "fp8")])
def test_engine_info_reads_the_engines_weights(tmp_path, quantization, qc, want):
    from vllm_hooks.adapter import engine_info

    info = engine_info(_engine_config(tmp_path, quantization, qc))
    assert info.weights.precision == want
    if qc is FP8_STATIC:
        assert info.weights.act_scale == "static"


def _monitor(weights: WeightFormat, gpu: str):
    from conftest import free_port

    from m2live.config import M2liveConfig
    from m2live.live import EngineInfo
    from m2live.shapes import get_model
    from vllm_hooks.sinks import start_monitor

    cfg = M2liveConfig.from_env({"M2LIVE_PROM_PORT": str(free_port()), "M2LIVE_GPU": gpu})
    info = EngineInfo(get_model(MODELS / "bench-llama"), "bench", weights=weights)
    return start_monitor(cfg, info, step_of=lambda s, o: None)


def test_the_plugin_prices_the_engines_fp8_weights_and_exports_which(capfd):
    from m2live.step import Step

    fp8 = weight_format(CT_FP8_DYNAMIC)
    step = Step.build([], [512] * 32)
    mons = {w.precision: _monitor(w, "NVIDIA H100 80GB HBM3") for w in (WeightFormat(), fp8)}
    try:
        p8, p16 = mons["fp8"].predictor, mons["bf16"].predictor
        assert (p8.dtype, p8.act_scale, p16.dtype) == ("fp8", "dynamic", "bf16")
        # a memory-bound decode step reads half the weight bytes
        assert p8.predict(step).ops["gate_up"] < 0.7 * p16.predict(step).ops["gate_up"]
        mon = mons["fp8"]
        labels = {"engine": mon.engine, "gpu": mon.gpu.name, "model": mon.model_label,
                  "precision": "fp8 (dynamic input scales)"}
        assert mon.prometheus.registry.get_sample_value("m2live_weights_info", labels) == 1.0
    finally:
        for m in mons.values():
            m.close()
    cpu = _monitor(fp8, "cpu")  # the CPU device has no fp8 tensor cores: bf16, and it says so
    try:
        assert cpu.predictor.dtype == "bf16" and cpu.weights == "bf16"
        assert "no fp8 tensor cores: its linear layers are priced as bf16" in capfd.readouterr().err
    finally:
        cpu.close()
