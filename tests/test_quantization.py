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
    assert info.weights.precision == want and info.kv_cache_dtype == "auto"
    if qc is FP8_STATIC:
        assert info.weights.act_scale == "static"


def test_an_fp8_kv_cache_is_priced_by_its_bytes(tmp_path, capfd):
    """vLLM's --kv-cache-dtype fp8 read from a real VllmConfig: the plugin's predictor holds twice the tokens per
    byte and streams half the KV bytes in decode; an unknown value falls back to the model's dtype, said once."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    from m2live.live.device import predicted_kv_cache
    from m2live.live.logs import install_log_handler
    from m2live.step import Step
    from vllm_hooks.adapter import engine_info

    vc = EngineArgs(model=str(MODELS / "tiny-llama"), load_format="dummy", skip_tokenizer_init=True,
                    kv_cache_dtype="fp8").create_engine_config()
    info = engine_info(vc)
    assert info.kv_cache_dtype == "fp8"
    install_log_handler()  # the plugin's own stderr handler, as a monitor installs it
    assert predicted_kv_cache(info, "0") == "fp8"
    assert "one byte per cached element" in capfd.readouterr().err
    from dataclasses import replace as dc_replace

    assert predicted_kv_cache(dc_replace(info, kv_cache_dtype="int3"), "0") == "auto"
    assert "not one m2live knows" in capfd.readouterr().err
    step = Step.build([], [4000] * 32)
    mons = {kv: _monitor(WeightFormat(), "NVIDIA H100 80GB HBM3", kv_cache_dtype=kv) for kv in ("auto", "fp8")}
    try:
        p16, p8 = mons["auto"].predictor, mons["fp8"].predictor
        assert p8.kv_cache_dtype == "fp8" and p8.model.kv_bytes_per_token() * 2 == p16.model.kv_bytes_per_token()
        assert p8.predict(step).ops["attn_decode"] < 0.7 * p16.predict(step).ops["attn_decode"]
    finally:
        for m in mons.values():
            m.close()


def _monitor(weights: WeightFormat, gpu: str, env: dict | None = None, kv_cache_dtype: str = "auto"):
    from conftest import free_port

    from m2live.config import M2liveConfig
    from m2live.live import EngineInfo
    from m2live.shapes import get_model
    from vllm_hooks.sinks import start_monitor

    cfg = M2liveConfig.from_env({"M2LIVE_PROM_PORT": str(free_port()), "M2LIVE_GPU": gpu, **(env or {})})
    info = EngineInfo(get_model(MODELS / "bench-llama"), "bench", weights=weights, kv_cache_dtype=kv_cache_dtype)
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


# ---- the commands: the checkpoint's own format when --precision is not given ---------------------------------
@pytest.mark.parametrize("model, want", [
    ("RedHatAI/Meta-Llama-3.1-70B-Instruct-FP8", ("fp8", "static")),
    ("RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic", ("fp8", "dynamic")),
    ("nvidia/Llama-3.3-70B-Instruct-FP8", ("fp8", "static")),
    ("Qwen/Qwen3-32B-FP8", ("fp8", "dynamic")),  # Qwen's own FP8: 128 x 128 blocks, dynamic input scales
    ("Qwen/Qwen3-8B-FP8", ("fp8", "dynamic")),
    ("someone/Qwen3-32B-FP8", ("fp8", "static")),  # a third party's plain -FP8: by the common (static) rule
    ("meta-llama/Llama-3.1-70B-Instruct", ("bf16", "static")),
    ("hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4", ("bf16", "static")),
])
def test_a_checkpoint_id_says_its_weights(model, want):
    from m2live.quantization import model_weights

    w = model_weights(model)
    assert (w.precision, w.act_scale) == want


def test_a_config_json_says_its_weights(tmp_path):
    import json

    from m2live.quantization import model_weights, weights_for

    cfg = json.loads((MODELS / "tiny-llama" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": CT_FP8_DYNAMIC}))
    for given in (tmp_path, tmp_path / "config.json", str(tmp_path)):
        assert (model_weights(given).precision, model_weights(given).act_scale) == ("fp8", "dynamic")
    assert model_weights(MODELS / "tiny-llama").precision == "bf16"
    assert weights_for("bf16", tmp_path).precision == "bf16"  # --precision wins
    assert weights_for("float8", MODELS / "tiny-llama") == WeightFormat("fp8", "static", "--precision fp8")
    with pytest.raises(ValueError, match="bf16 or fp8"):
        weights_for("int4", tmp_path)


def test_simulate_predict_and_rank_take_the_checkpoints_weights(tmp_path):
    import json

    from conftest import one_line_error, run

    fp8_70b = "RedHatAI/Meta-Llama-3.1-70B-Instruct-FP8"
    sim = ["simulate", "--model", fp8_70b, "--gpu", "h200", "--isl", "1024", "--osl", "128", "--concurrency", "8"]
    p = run(*sim, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["assumptions"]["weights"]["precision"] == "fp8 (static input scales)"
    assert "does not fit" in one_line_error(run(*sim, "--precision", "bf16"))  # 141 GB of bf16 weights
    batch = tmp_path / "b.csv"
    batch.write_text("model,gpu,tp,isl,osl,concurrency,precision\n"
                     f"{fp8_70b},h200,2,1024,128,8,\n{fp8_70b},h200,2,1024,128,8,bf16\n")
    p = run("simulate", "--batch", str(batch))
    assert p.returncode == 0, p.stderr
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(p.stdout)))
    assert rows[0]["precision"] == "" and float(rows[0]["tpot_ms"]) < 0.8 * float(rows[1]["tpot_ms"])
    step = ["predict", "--gpu", "h100-sxm", "--decode", "1000x16", "--json"]
    a = json.loads(run(*step, "--model", "meta-llama/Llama-3.1-8B-Instruct").stdout)
    b = json.loads(run(*step, "--model", "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8").stdout)
    assert b["ops"]["gate_up"] < 0.7 * a["ops"]["gate_up"]
    rank = ["rank", "--workload", "chat", "--tp", "1", "--gpus", "a100-80gb,h100-sxm", "--json"]
    r8 = run(*rank, "--model", "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8")
    r16 = run(*rank, "--model", "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8", "--precision", "bf16")
    assert r8.returncode == 0 and r16.returncode == 0, r8.stderr + r16.stderr
    excluded = {e["gpu"]: e["reason"] for e in json.loads(r8.stdout)["excluded"]}
    assert "no fp8 tensor cores" in excluded["NVIDIA A100-SXM4-80GB"]
    assert "NVIDIA A100-SXM4-80GB" in {e["gpu"] for e in json.loads(r16.stdout)["ranking"]}


def test_an_fp8_engine_predicts_with_its_gpus_fp8_calibration(tmp_path):
    """M2LIVE_CALIBRATION on an fp8 engine: the projections take the calibration's fp8 constants, the attention its
    bf16 ones."""
    from dataclasses import replace

    from conftest import run

    from m2live import calibrate as cal
    from m2live.efficiency import constants_for
    from m2live.hardware import get_gpu

    h100 = "NVIDIA H100 80GB HBM3"
    prior = constants_for(get_gpu(h100), "fp8")
    truth = replace(prior, eta_tc=prior.eta_tc * 0.9, eta_mem=prior.eta_mem * 0.92)
    rows = [cal.Row("gemm_fp8", r) for r in cal.plan(h100, "gemm_fp8")]
    ms = cal.predict_rows(get_gpu(h100), truth, rows)
    d = tmp_path / "meas"
    d.mkdir()
    (d / "gemm_fp8.csv").write_text("device,m,n,k,latency_ms\n" + "".join(
        f"{h100},{r.cells['m']},{r.cells['n']},{r.cells['k']},{m:.8g}\n" for r, m in zip(rows, ms, strict=True)))
    out = tmp_path / "cal.json"
    assert run("calibrate", "fit", str(d), "--gpu", h100, "-o", str(out)).returncode == 0
    mon = _monitor(weight_format(FP8_STATIC), h100, {"M2LIVE_CALIBRATION": str(out)})
    try:
        p = mon.predictor
        assert p.dtype == "fp8" and mon.calibration != "none"
        assert p.gemm_ops.c.eta_mem == pytest.approx(truth.eta_mem, rel=0.05)
        assert p.ops.c.eta_attn == constants_for(get_gpu(h100)).eta_attn  # no bf16 row: the family's
    finally:
        mon.close()


def test_simulate_and_predict_take_an_fp8_kv_cache(tmp_path):
    import csv
    import io
    import json

    from conftest import one_line_error, run

    sim = ["simulate", "--model", "meta-llama/Llama-3.1-70B", "--gpu", "h100-sxm", "--tp", "2", "--precision",
           "fp8", "--isl", "8192", "--osl", "256", "--concurrency", "48", "--json"]
    a, b = run(*sim), run(*sim, "--kv-cache-dtype", "fp8")
    assert a.returncode == 0 and b.returncode == 0, b.stderr
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert (ja["assumptions"]["kv_cache_dtype"], jb["assumptions"]["kv_cache_dtype"]) == ("auto", "fp8")
    assert jb["memory"]["kv_tokens"] == pytest.approx(2 * ja["memory"]["kv_tokens"], rel=1e-4)
    assert jb["ttft_ms"] < ja["ttft_ms"]  # twice the cache: fewer requests wait for blocks
    batch = tmp_path / "b.csv"
    batch.write_text("model,gpu,tp,isl,osl,concurrency,precision,kv_cache_dtype\n"
                     "meta-llama/Llama-3.1-8B,h100-sxm,1,1024,128,8,fp8,fp8\n"
                     "meta-llama/Llama-3.1-8B,h100-sxm,1,1024,128,8,fp8,\n")
    p = run("simulate", "--batch", str(batch))
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(io.StringIO(p.stdout)))
    assert float(rows[0]["tpot_ms"]) <= float(rows[1]["tpot_ms"])
    batch.write_text("model,gpu,tp,isl,osl,concurrency,precision,kv_cache_dtype\n"
                     "meta-llama/Llama-3.1-8B,h100-sxm,1,1024,128,8,fp8,int4\n")
    assert f"{batch}:2:" in one_line_error(run("simulate", "--batch", str(batch)))
    step = ["predict", "--gpu", "h100-sxm", "--model", "meta-llama/Llama-3.1-8B", "--decode", "8000x32", "--json"]
    d16, d8 = (json.loads(run(*step, *x).stdout)["ops"]["attn_decode"] for x in ([], ["--kv-cache-dtype", "fp8"]))
    assert d8 < 0.7 * d16


def test_rank_prices_an_fp8_kv_cache_and_says_so():
    import json

    from conftest import run

    rank = ["rank", "--model", "meta-llama/Llama-3.1-8B", "--workload", "chat", "--tp", "1", "--gpus", "h100-sxm",
            "--json"]
    a, b = (json.loads(run(*rank, *x).stdout) for x in ([], ["--kv-cache-dtype", "fp8"]))
    assert (a["assumptions"]["kv_cache_dtype"], b["assumptions"]["kv_cache_dtype"]) == ("auto", "fp8")
    ma, mb = a["ranking"][0]["memory"], b["ranking"][0]["memory"]
    assert mb["kv_bytes_per_token"] * 2 == ma["kv_bytes_per_token"]
    assert mb["kv_tokens"] >= 2 * ma["kv_tokens"]


def _checkpoint(tmp_path, name: str, quantization_config: dict | None = None, sidecar: dict | None = None):
    """A checkpoint directory of tiny-llama's shapes: its config.json (with ``quantization_config``) and, as
    ModelOpt before 0.31 exported, an ``hf_quant_config.json`` beside it (``sidecar``)."""
    import json

    cfg = json.loads((MODELS / "tiny-llama" / "config.json").read_text())
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": quantization_config}
                                                          if quantization_config else {})}))
    if sidecar is not None:
        (d / "hf_quant_config.json").write_text(json.dumps(sidecar))
    return d


MODELOPT_LEGACY_KV = {"producer": {"name": "modelopt", "version": "0.15.1"},
                      "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}


@pytest.mark.parametrize("qc, sidecar, weights, kv", [
    (None, MODELOPT_LEGACY_KV, ("fp8", "static"), "fp8"),  # ModelOpt before 0.31: the sidecar file
    (None, {**MODELOPT_LEGACY_KV, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}},
     ("fp8", "static"), "auto"),
    ({**MODELOPT_FP8, "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}, None,
     ("fp8", "static"), "fp8"),
    ({**MODELOPT_FP8, "kv_cache_quant_algo": "FP8"}, None, ("fp8", "static"), "fp8"),
    (MODELOPT_FP8, None, ("fp8", "static"), "auto"),
    ({**MODELOPT_NVFP4, "kv_cache_quant_algo": "FP8"}, None, ("bf16", "static"), "fp8"),  # weights not modelled
    ({**CT_FP8_STATIC, "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}, None,
     ("fp8", "static"), "auto"),  # vLLM 0.32 promotes ModelOpt exports only
    (None, None, ("bf16", "static"), "auto"),
])
def test_auto_kv_cache_dtype_is_the_checkpoints_as_vllm_resolves_it(tmp_path, qc, sidecar, weights, kv):
    """``--kv-cache-dtype auto`` as vLLM 0.32 resolves it (``resolve_kv_cache_dtype_string``): a ModelOpt
    checkpoint that names an fp8 KV cache runs one; a given dtype is kept; an id without a file says nothing."""
    from m2live.quantization import model_kv_cache_dtype, model_weights

    d = _checkpoint(tmp_path, "ckpt", qc, sidecar)
    w = model_weights(d)
    assert (w.precision, w.act_scale) == weights
    assert model_kv_cache_dtype("auto", d)[0] == kv
    assert model_kv_cache_dtype(None, d / "config.json")[0] == kv
    assert model_kv_cache_dtype("bfloat16", d) == ("bfloat16", "--kv-cache-dtype bfloat16")
    assert model_kv_cache_dtype("auto", "nvidia/Llama-3.1-8B-Instruct-FP8")[0] == "auto"


def test_simulate_predict_and_rank_take_the_checkpoints_fp8_kv_cache(tmp_path):
    """A ModelOpt FP8 checkpoint that names an fp8 KV cache, given as a directory: simulate holds twice the cache
    tokens and says why, predict streams half the KV bytes, rank reports fp8; --kv-cache-dtype still wins."""
    import json

    from conftest import run

    d = _checkpoint(tmp_path, "ckpt", None, MODELOPT_LEGACY_KV)
    sim = ["simulate", "--model", str(d), "--gpu", "h100-sxm", "--isl", "512", "--osl", "16", "--concurrency", "2",
           "--json"]
    auto, given = (json.loads(run(*sim, *x).stdout) for x in ([], ["--kv-cache-dtype", "bfloat16"]))
    assert auto["assumptions"]["kv_cache_dtype"] == "fp8" and given["assumptions"]["kv_cache_dtype"] == "bfloat16"
    assert "ModelOpt" in auto["assumptions"]["kv_cache_dtype_why"]
    assert auto["memory"]["kv_tokens"] == pytest.approx(2 * given["memory"]["kv_tokens"], rel=1e-3)
    step = ["predict", "--gpu", "h100-sxm", "--model", str(d), "--decode", "4000x128", "--json"]
    d8, d16 = (json.loads(run(*step, *x).stdout)["ops"]["attn_decode"] for x in ([], ["--kv-cache-dtype", "bf16"]))
    # enough sequences that the KV stream, not the call's fixed costs, sets a tiny model's decode time (at 32
    # sequences of 4000 tokens the fixed part is ~30 %: 0.70)
    assert d8 < 0.7 * d16
    r = run("rank", "--model", str(d), "--workload", "chat", "--tp", "1", "--gpus", "h100-sxm", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["assumptions"]["kv_cache_dtype"] == "fp8"
