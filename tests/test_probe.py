"""The GPU probe (`m2live probe`): the dry run exercises the whole pipeline on the CPU (torch CPU, replayed clock,
perf_counter timing); the real run needs CUDA and NVML and says so in one line otherwise."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m2live.hardware import get_gpu
from m2live.predictor import OpModel
from m2live.probe import (
    CLOCK_EVENT_REASONS,
    M_QUICK,
    ProbeError,
    StepSpec,
    clock_stats,
    gemm_order,
    gemm_predictions,
    kernels,
    make_plan,
    mape,
    reason_names,
    ring_copies,
)
from m2live.telemetry import ClockReading

REPO = Path(__file__).resolve().parent.parent
H100 = "NVIDIA H100 80GB HBM3"


def _cli(*args: str, env_extra: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "m2live", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ---- the dry run: the whole pipeline on the CPU --------------------------------------------------------------
@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("probe")
    return _cli("probe", "--dry-run", "--out", str(out)), out


def test_dry_run_exits_0_and_writes_json_and_png(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stderr
    png = out / "probe.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    doc = json.loads((out / "probe.json").read_text())
    assert doc["schema"] == "m2live.probe/1" and doc["complete"] is True and doc["errors"] == []
    assert doc["dry_run"] is True and doc["clock_source"] == "replay"
    assert doc["gpu"]["catalog_name"] == H100 and doc["torch"]
    for key in ("date", "driver", "gpu", "plan", "model", "duration_s"):
        assert key in doc or key in doc["gpu"]


def test_dry_run_gemm_cells_are_complete_and_finite(dry_run):
    _, out = dry_run
    doc = json.loads((out / "probe.json").read_text())
    plan = make_plan(dry_run=True)
    cells = doc["gemm"]["cells"]
    assert sorted((c["op"], c["m"]) for c in cells) == sorted((op, m) for op in plan.gemm_ops for m in plan.ms)
    assert [c["order"] for c in cells] == list(range(len(cells)))
    boost = get_gpu(H100).boost_mhz
    for c in cells:
        assert math.isfinite(c["time_s"]) and c["time_s"] > 0, c
        assert (c["n"], c["k"]) == plan.gemm_ops[c["op"]]
        # the replayed clock droops from boost to 75 % of it: the medians must come from those samples
        assert c["samples"] >= 1 and 0.75 * boost - 1 <= c["clock_mhz"] <= boost
        assert c["power_w"] > 0 and c["power_limit_w"] == get_gpu(H100).tdp_w
        assert set(c["event_reason_names"]) <= set(CLOCK_EVENT_REASONS.values())
        assert set(c["pred"]) == {"live", "forecast", "boost"}
        for src, p in c["pred"].items():
            assert p["time_s"] > 0 and 0 < p["f_clk"] <= 1.0, (src, p)
            assert c["err"][src] == pytest.approx((p["time_s"] - c["time_s"]) / c["time_s"])
        assert c["pred"]["live"]["f_clk"] == pytest.approx(c["clock_mhz"] / boost)
    m = doc["mape"]["gemm"]
    assert set(m) == {"live", "forecast", "boost"} and all(math.isfinite(v) and v > 0 for v in m.values())
    assert m["boost"] == pytest.approx(mape((c["pred"]["boost"]["time_s"], c["time_s"]) for c in cells))
    assert set(doc["gemm"]["mape_by_op"]) == set(plan.gemm_ops)
    assert doc["mape"]["clock_forecast"]["gemm"] == pytest.approx(
        mape((c["pred"]["forecast"]["f_clk"], c["pred"]["live"]["f_clk"]) for c in cells))
    assert set(doc["gemm"]["clock_summary"]) == set(plan.gemm_ops)


def test_dry_run_steps_are_predicted_for_the_same_layers(dry_run):
    _, out = dry_run
    doc = json.loads((out / "probe.json").read_text())
    plan = make_plan(dry_run=True)
    steps = doc["steps"]
    assert steps["layers"] == plan.step_layers
    assert steps["host_constants"]["eager"]["alpha"] == 0 and steps["host_constants"]["eager"]["t_samp"] == 0
    assert sorted(c["name"] for c in steps["cells"]) == sorted(s.name for s in plan.steps)
    for c in steps["cells"]:
        assert c["mode"] == "eager" and c["time_s"] > 0 and math.isfinite(c["time_s"])
        assert set(c["pred"]) == {"live", "forecast", "boost"}
        assert all(p["time_s"] > 0 for p in c["pred"].values())
        assert c["pred"]["live"]["ops_s"]["qkv"] > 0
    assert set(doc["mape"]["steps"]["eager"]) == {"live", "forecast", "boost"}
    assert len(doc["clock_trace"]["t_s"]) == len(doc["clock_trace"]["sm_mhz"]) > 10


def test_dry_run_profiles_every_step_per_operator(dry_run):
    """Each step's operators are timed inside the step (profiler ranges named as the predictor's ops) and set
    against the prediction's per-op times; the summary is the MAPE of those pairs."""
    _, out = dry_run
    doc = json.loads((out / "probe.json").read_text())
    plan = make_plan(dry_run=True)
    recs = doc["steps"]["kernels"]
    assert sorted(r["name"] for r in recs) == sorted(s.name for s in plan.steps)
    known = set(kernels.GEMM_OPS) | set(kernels.ATTN_OPS) | {"light"}
    for r, sp in ((r, next(s for s in plan.steps if s.name == r["name"])) for r in recs):
        assert r["reps"] == plan.step_profile_reps and r["timing"] == "cpu ranges"
        ops = set(r["measured_s"])
        assert ops <= known and {"qkv", "o", "gate_up", "down", "lm_head", "light"} <= ops
        assert ("attn_prefill" in ops) == bool(sp.prefills) and ("attn_decode" in ops) == bool(sp.decode_batch)
        assert all(t > 0 for t in r["measured_s"].values())
        assert r["sum_s"] == pytest.approx(sum(r["measured_s"].values()))
        for op, e in r["err"].items():
            assert e == pytest.approx((r["pred_s"][op] - r["measured_s"][op]) / r["measured_s"][op])
        assert r["groups"]["gemm"]["measured_s"] == pytest.approx(sum(r["measured_s"][op] for op in kernels.GEMM_OPS))
    summary = doc["steps"]["kernel_mape"]
    assert summary["steps"] == len(recs)
    assert summary["mape_by_op"]["qkv"] == pytest.approx(mape((r["pred_s"]["qkv"], r["measured_s"]["qkv"]) for r in recs))
    assert sum(summary["measured_share"].values()) == pytest.approx(1.0)


class _Ev:
    def __init__(self, name: str, start: float, end: float, cpu_us: float, device: str = "DeviceType.CPU"):
        self.name, self.device_type, self.cpu_time_total = name, device, cpu_us
        self.time_range = type("R", (), {"start": start, "end": end})()


def test_per_rep_times_assigns_ranges_to_their_repetition_and_skips_device_copies():
    evs = [_Ev("m2live::step", 0, 100, 100), _Ev("m2live::qkv", 1, 10, 9), _Ev("m2live::qkv", 20, 30, 10),
           _Ev("m2live::light", 40, 45, 5), _Ev("m2live::step", 200, 300, 100), _Ev("m2live::qkv", 201, 220, 19),
           _Ev("m2live::qkv", 201, 220, 500, device="DeviceType.CUDA"), _Ev("aten::mm", 202, 210, 8),
           _Ev("m2live::light", 150, 160, 7)]  # between the repetitions: never counted
    reps = kernels.per_rep_times(evs, cuda=False)
    assert reps == [pytest.approx({"qkv": 19e-6, "light": 5e-6}), pytest.approx({"qkv": 19e-6})]


def test_dry_run_time_limit_leaves_valid_partial_output(tmp_path):
    proc = _cli("probe", "--dry-run", "--time-limit", "0.01", "--out", str(tmp_path), "--no-plot")
    assert proc.returncode == 1, proc.stderr
    doc = json.loads((tmp_path / "probe.json").read_text())
    assert doc["complete"] is False and doc["gemm"]["skipped"] and doc["steps"]["skipped"]


def test_sigterm_mid_run_keeps_what_was_measured(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-m", "m2live", "probe", "--dry-run", "--no-plot", "--out", str(tmp_path)],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "probe.json").exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, err
    doc = json.loads((tmp_path / "probe.json").read_text())
    assert doc["complete"] is False and "interrupted by SIGTERM" in doc["errors"]
    assert doc["gemm"]["cells"] and all(c["time_s"] > 0 for c in doc["gemm"]["cells"])


# ---- the real run needs CUDA and NVML: one line, exit 2 -------------------------------------------------------
def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("m2live probe: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_probe_without_cuda_exits_2_with_one_line(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = _one_line_error(_cli("probe", "--quick", "--out", str(tmp_path)))
    assert "CUDA" in line and "--dry-run" in line


BLOCKER = """
import importlib.abc, sys
BLOCK = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ImportError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, Block())
"""


def test_probe_without_torch_exits_2_with_one_line(tmp_path):
    code = BLOCKER + "import sys; from m2live.cli import main; sys.exit(main(sys.argv[2:]))"
    proc = subprocess.run([sys.executable, "-c", code, "torch", "probe", "--quick", "--out", str(tmp_path)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=60)
    assert "cannot import torch" in _one_line_error(proc)


def test_cli_help_imports_without_aiomqtt_torch_or_vllm():
    """Every subcommand module is imported for --help: none may import aiomqtt, torch or vLLM at module level
    (the GPU machine the probe runs on has no aiomqtt)."""
    code = BLOCKER + (
        "import m2live.cli\n"
        "try:\n    m2live.cli.main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "leaked = sorted(BLOCK & {m.split('.')[0] for m in sys.modules})\n"
        "assert not leaked, leaked\n"
        "assert 'probe' in m2live.cli.COMMANDS\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, "aiomqtt,torch,vllm"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "probe" in proc.stdout


@pytest.mark.parametrize("args, needle", [
    (["--dry-run", "--gpu", "NVIDIA H900"], "unknown GPU"),
    (["--dry-run", "--time-limit", "0"], "--time-limit"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    line = _one_line_error(_cli("probe", *args, "--out", str(tmp_path)))
    assert needle in line


def test_out_path_that_is_a_file_is_one_line_exit_2(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    line = _one_line_error(_cli("probe", "--dry-run", "--out", str(f)))
    assert "not a directory" in line


# ---- the plan and the scoring ---------------------------------------------------------------------------------
def test_quick_plan_fits_six_minutes_and_40_gb():
    plan = make_plan(quick=True)
    assert plan.ms == M_QUICK and set(plan.gemm_ops) == {"qkv", "o", "gate_up", "down"}
    assert plan.gemm_ops == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                             "down": (4096, 14336)}
    # measuring + ~60 s of start-up (python, torch, CUDA context, weights) under 6 minutes, with the cap below
    assert plan.estimate_s() + 60 < 300
    assert plan.time_limit_s is not None and plan.time_limit_s + 30 <= 360
    m = plan.model
    weights = plan.step_layers * m.layer_weight_bytes() + 2 * m.vocab * m.hidden * 2
    kv = max(s.kv_tokens for s in plan.steps) * 2 * plan.step_layers * m.kv_heads * m.head_dim * 2
    assert (weights + kv) / 1e9 < 0.5 * plan.memory_cap_gb
    full = make_plan()
    kv_full = max(s.kv_tokens for s in full.steps) * 2 * full.step_layers * m.kv_heads * m.head_dim * 2
    assert (full.step_layers * m.layer_weight_bytes() + 2 * m.vocab * m.hidden * 2 + kv_full) / 1e9 < 38


def test_gemm_order_is_random_complete_and_seeded():
    plan = make_plan(quick=True)
    order = gemm_order(plan)
    cells = [(op, m, r) for r in range(plan.repeats) for op in plan.gemm_ops for m in plan.ms]
    assert sorted(order) == sorted(cells) and order != cells
    assert gemm_order(plan) == order
    assert gemm_order(make_plan(quick=True, seed=1)) != order


def test_weight_ring_always_misses_l2():
    h100 = get_gpu(H100)
    for n, k in make_plan(quick=True).gemm_ops.values():
        copies = ring_copies(2 * n * k, h100.l2_bytes)
        assert copies >= 2 and copies * 2 * n * k >= 4 * h100.l2_bytes
    assert ring_copies(2 * 4096 * 4096, 0) == 2


def test_mape_and_reason_names():
    assert mape([(1.1, 1.0), (0.8, 1.0)]) == pytest.approx(15.0)
    assert mape([]) is None
    assert reason_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert reason_names(0) == [] and reason_names(None) == []
    assert reason_names(0x1000) == ["0x1000"]


def test_clock_stats_medians_and_reason_union():
    rs = [ClockReading(t=i, sm_mhz=mhz, max_mhz=1980, power_w=p, power_limit_w=700, event_reasons=r)
          for i, (mhz, p, r) in enumerate([(1980, 300, 0), (1500, 690, 0x4), (1400, 700, 0x4)])]
    s = clock_stats(rs)
    assert s["clock_mhz"] == 1500 and s["power_w"] == 690 and s["clock_min_mhz"] == 1400
    assert s["event_reasons"] == 0x4 and s["event_reason_names"] == ["sw_power_cap"]
    assert clock_stats([]) == {"samples": 0}


def test_gemm_predictions_order_the_three_clocks():
    om = OpModel(H100)
    big = gemm_predictions(om, 16384, 28672, 4096, clock_mhz=1380)
    assert big["live"]["f_clk"] == pytest.approx(1380 / 1980)
    # compute-bound at full tensor activity: the power cap forecasts a droop, the live clock is lower still
    assert big["forecast"]["f_clk"] < 1.0
    assert big["boost"]["time_s"] < big["forecast"]["time_s"] and big["boost"]["time_s"] < big["live"]["time_s"]
    small = gemm_predictions(om, 1, 4096, 4096, clock_mhz=None)
    assert "live" not in small and small["forecast"]["f_clk"] == 1.0 and small["boost"]["bound"] != "compute"


def test_step_spec_shapes():
    s = StepSpec("chunk", ((1024, 2048),), 16, 2048)
    step = s.step()
    assert s.kind == "mixed" and step.num_tokens == 1024 + 16 and step.decode_contexts == [2048] * 16
    assert s.kv_tokens == 3072 + 16 * 2049 and s.max_position == 3072
    assert StepSpec("d", (), 4, 100).kind == "decode" and StepSpec("p", ((8, 0),)).kind == "prefill"


def test_torch_decoder_attention_matches_reference():
    """The decoder's attention (KV-cache write, bottom-right causal chunk over a cache, GQA decode) equals a
    per-head softmax written out by hand."""
    torch = pytest.importorskip("torch")
    from m2live.probe import TorchDecoder, _Device

    dev = _Device(torch, cuda=False)
    dev.dtype = torch.float32
    shape = make_plan(dry_run=True).model
    model = TorchDecoder(dev, shape, layers=1, max_pos=64, seed=3)
    spec = StepSpec("mix", ((5, 0), (3, 6)), 2, 7)
    inp = model.inputs(spec, seed=4)
    T, H, KV, D = inp["T"], shape.heads, shape.kv_heads, shape.head_dim
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(T, n, D, generator=g) for n in (H, KV, KV))
    lay = inp["layers"][0]
    out = model._attention(q, k, v, lay, spec)
    assert out.shape == (T, H * D)
    # reference: each query token attends to its sequence's cache up to and including its own position
    caches = [(kc[0], vc[0], c) for (n, c), (kc, vc) in zip(spec.prefills, lay["pre"], strict=True)]
    kd, vd = lay["dec"]
    seq_of_token = []
    for j, (n, c) in enumerate(spec.prefills):
        seq_of_token += [(j, c + i) for i in range(n)]
    seq_of_token += [(len(caches) + b, spec.decode_ctx) for b in range(spec.decode_batch)]
    caches += [(kd[b], vd[b], spec.decode_ctx) for b in range(spec.decode_batch)]
    ref = torch.empty(T, H, D)
    for t, (s, pos) in enumerate(seq_of_token):
        kc, vc, _ = caches[s]
        for h in range(H):
            kh, vh = kc[h // (H // KV), : pos + 1], vc[h // (H // KV), : pos + 1]
            w = torch.softmax(kh @ q[t, h] / math.sqrt(D), dim=0)
            ref[t, h] = w @ vh
    assert torch.allclose(out.view(T, H, D), ref, atol=1e-4)
    # and the new tokens' K landed in the caches at their positions
    assert torch.equal(lay["pre"][1][0][0, :, 6:9], k[5:8].transpose(0, 1))
    assert torch.equal(kd[:, :, 7], k[8:10])


def test_probe_error_is_a_value_error():
    assert issubclass(ProbeError, ValueError)


def test_profiler_ranges_leave_the_forward_unchanged():
    """The per-operator ranges only name what runs: the forward computes the same logits with and without them,
    and every operator of a mixed step opens its range."""
    torch = pytest.importorskip("torch")
    from m2live.probe import TorchDecoder, _Device

    dev = _Device(torch, cuda=False)
    dev.dtype = torch.float32
    model = TorchDecoder(dev, make_plan(dry_run=True).model, layers=2, max_pos=64, seed=3)
    inp = model.inputs(StepSpec("mix", ((5, 0), (3, 6)), 2, 7), seed=4)
    opened: list[str] = []
    ranges = kernels.scopes(torch)

    def scope(name: str):
        opened.append(name)
        return ranges(name)

    plain = model.forward(inp)
    assert torch.equal(model.forward(inp, scope), plain)
    assert set(opened) == {*kernels.GEMM_OPS, *kernels.ATTN_OPS, "light"}
    assert opened.count("qkv") == opened.count("attn_decode") == 2 and opened.count("lm_head") == 1
