"""The CPU device: timed on the engine's own kernels, cached under a key of everything that changes the answer,
dropped and re-measured when the first steps of a live run disagree with it. No bound here depends on how fast
this machine is: the figures are checked against each other and against what the cache holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from m2live import Predictor, Step
from m2live.cpu_device import (
    PriorCheck,
    cache_path,
    constants_from_measurement,
    cpu_device,
    cpu_device_model,
    cpu_flags,
    machine_key,
    measurement,
    spec_from_measurement,
    vllm_cpu_threads,
)
from m2live.cpu_kernels import OVERLAP_RANGE, overlap_exponent
from m2live.efficiency import ARCH
from m2live.predictor import OpModel
from m2live.shapes import get_model


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def tiny():
    from conftest import MODELS
    return get_model(MODELS / "tiny-llama")


def test_key_covers_flags_dtype_threads_versions_isa_and_model(tiny, monkeypatch) -> None:
    k = machine_key("bf16", tiny, threads=2)
    for part in ("+".join(cpu_flags()), "bf16", "threads=2", "torch=", "h256i704L2q4kv2d64"):
        assert part in k, (part, k)
    assert machine_key("fp32", tiny, threads=2) != k
    assert machine_key("bf16", tiny, threads=1) != k
    assert machine_key("bf16", None, threads=2) != k
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # another kernel: another measurement
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in machine_key("bf16", tiny, threads=2)


def test_measures_the_engines_kernels_and_caches_them(cache_home, tiny) -> None:
    pytest.importorskip("torch")
    m = measurement(budget_s=0.3, model=tiny)
    for k in ("flops", "bw", "t_call", "attn_flops", "attn_bw", "t_attn"):
        assert m[k] > 0, k
    try:
        import vllm  # noqa: F401
        assert "vLLM-CPU linear dispatch" in m["kind"] and "vLLM-CPU attention" in m["kind"]
    except ImportError:
        assert "torch" in m["kind"]
    data = json.loads(cache_path().read_text())
    assert list(data["entries"]) == [machine_key("bf16", tiny)]
    again = measurement(model=tiny)
    if m["busy"]:  # taken while other jobs loaded the machine: not trusted by the next start
        assert again["measured_at"] > m["measured_at"]
    else:  # read back, not measured again
        assert again["measured_at"] == m["measured_at"]
        m = again
    assert 1.0 <= m["overlap"] <= 8.0 and m["overlap_tokens"] >= 2
    spec, c, key = cpu_device_model(tiny)
    if not m["busy"]:
        assert spec.name == "cpu" and spec.bf16_tflops == pytest.approx(m["flops"] / 1e12)
        assert spec.mem_bw_gbs == pytest.approx(m["bw"] / 1e9)
        assert c.t_kernel == pytest.approx(m["t_call"]) and c.t_attn == pytest.approx(m["t_attn"])
        assert c.overlap == pytest.approx(m["overlap"])
    assert key == machine_key("bf16", tiny) and cpu_device(model=tiny).name == "cpu"
    # the prediction uses those numbers: a one-token step through the GEMMs costs at least the calls' fixed cost
    p = Predictor(spec, tiny, constants=c).predict(Step.build([], [100]), f_clk=1.0)
    assert p.ops["qkv"] >= tiny.layers * c.t_kernel


def test_measured_at_an_engines_thread_count_from_outside_it(cache_home, tiny) -> None:
    """``threads``: the measurement an engine of that many threads would take (simulate --gpu cpu, the serving
    bench), keyed by it, and the process's own thread count left as it was. In a fresh process: a vLLM-CPU worker
    run in this one (an earlier test) fixes torch's threads for good."""
    pytest.importorskip("torch")
    code = (
        "import json, torch\n"
        "from m2live.cpu_device import cpu_device, machine_key, measurement\n"
        "from m2live.shapes import get_model\n"
        f"tiny = get_model({str(tiny.name)!r})\n"
        "before = torch.get_num_threads()\n"
        "m = measurement(budget_s=0.3, model=tiny, threads=1)\n"
        "print(json.dumps({'before': before, 'after': torch.get_num_threads(), 'threads': m['threads'],\n"
        "    'key_ok': m['key'] == machine_key('bf16', tiny, threads=1),\n"
        "    'source': cpu_device(model=tiny, threads=1).source}))\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                       cwd=str(Path(__file__).resolve().parent.parent))
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["after"] == got["before"] and got["threads"] == 1 and got["key_ok"], got
    assert ", 1 threads" in got["source"]
    assert machine_key("bf16", tiny, threads=1) in json.loads(cache_path().read_text())["entries"]


def test_vllm_cpu_threads_follows_vllms_binding(monkeypatch) -> None:
    """vLLM-CPU's own rules: an explicit bind list (rank 0's), nobind (torch's default), and by default one thread
    per physical core of the first NUMA node less the reserved CPUs, unless that would leave none."""
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3,8|4-7")
    assert vllm_cpu_threads() == 5
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert vllm_cpu_threads() is None
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    cores = vllm_cpu_threads()
    assert cores is not None and 1 <= cores <= len(os.sched_getaffinity(0))
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU")
    assert vllm_cpu_threads(1) == (cores - 1 if cores > 1 else cores)  # one CPU kept for the API server
    assert vllm_cpu_threads(cores) == cores  # reserving every core would leave none: vLLM reserves none
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    assert vllm_cpu_threads(1) == (cores - 1 if cores > 1 else cores)


def test_overlap_exponent_is_read_back_from_the_combined_pass() -> None:
    # the p of (t_c^p + t_m^p)^(1/p) that gave a pass's time is recovered; beyond the sum (a job cut in) or at
    # the slower of the two it is clamped to the range OpModel.gemm takes
    for p in (1.0, 1.3, 2.0, 4.0):
        for tc, tm in ((3.0, 3.0), (1.0, 4.0), (5.0, 2.0)):
            both = (tc**p + tm**p) ** (1 / p)
            assert overlap_exponent(tc, tm, both) == pytest.approx(p, abs=2e-3)
    assert overlap_exponent(3.0, 3.0, 7.0) == OVERLAP_RANGE[0]
    assert overlap_exponent(3.0, 3.0, 3.0) == OVERLAP_RANGE[1]
    assert overlap_exponent(0.0, 3.0, 3.0) == OVERLAP_RANGE[0]
    # and the constants carry it into the GEMM model: an additive kernel prices a decode batch higher
    m = {"flops": 1e12, "bw": 50e9, "t_call": 5e-6, "t_attn": 1e-5, "kind": "x"}
    spec = spec_from_measurement(m)
    add, par = (OpModel(spec, constants=constants_from_measurement({**m, "overlap": p})) for p in (1.0, 8.0))
    t_add, t_par = (om.gemm(16, 4096, 4096, 1.0).t for om in (add, par))
    assert t_add > 1.3 * t_par
    assert constants_from_measurement(m).overlap == ARCH["cpu"].overlap  # an old measurement: the default


def test_prior_check_drops_a_measurement_the_engine_disagrees_with(cache_home, tiny) -> None:
    pytest.importorskip("torch")
    m0 = measurement(budget_s=0.3, model=tiny)
    key = machine_key("bf16", tiny)
    chk = PriorCheck(key, tiny, "bf16", n=8)
    for _ in range(50):  # host-dominated steps do not count against the device measurement
        chk.observe(1e-3, 0.1e-3, 10e-3)
    assert chk.verdict is None
    for _ in range(8):  # device-dominated steps 5x slower than predicted
        chk.observe(1e-3, 0.9e-3, 5e-3)
    assert chk.verdict == pytest.approx(5.0) and chk.remeasure_pending
    assert key not in json.loads(cache_path().read_text())["entries"]  # the next start measures again
    chk.budget_s = 0.3
    chk.idle()  # the engine idles: measured again now, in a child process (never beside the engine's threads)
    assert not chk.remeasure_pending and chk._child is not None
    chk.idle()  # idle again while it runs: no second child
    assert chk.wait(300) and chk.remeasured == 1
    again = json.loads(cache_path().read_text())["entries"][key]
    assert again["measured_at"] > m0["measured_at"] and again["threads"] == chk.threads


def test_remeasurement_child_failures_are_one_line(cache_home, tiny, caplog) -> None:
    from m2live.cpu_remeasure import main

    assert main(["--threads", "1", "--model", "{\"hidden\": 1}"]) == 2
    assert main(["--threads", "0"]) == 2
    chk = PriorCheck("k", tiny, "bf16", n=8)
    chk.remeasure_pending, chk.dtype = True, "int3"  # the child refuses it: one warning, nothing counted
    with caplog.at_level("WARNING", logger="m2live"):
        chk.idle()
        assert chk.wait(120)
    assert chk.remeasured == 0 and "re-measurement failed (exit 2)" in caplog.text
    assert "invalid choice: 'int3'" in caplog.text
    chk.remeasure_pending = True  # a child still running when the monitor closes is stopped
    chk.dtype = "bf16"
    chk.idle()
    chk.close()
    assert chk._child is None and chk.remeasured == 0


def test_prior_check_judges_the_device_by_its_slope_not_the_hosts_intercept(cache_home, tiny) -> None:
    # steps whose device bodies span 1-30 ms, each measured as that body plus 10 ms of host work the kernels do
    # not see: the ratio (up to 11x) would drop a right measurement; the slope (1.0) keeps it
    pytest.importorskip("torch")
    measurement(budget_s=0.3, model=tiny)
    key = machine_key("bf16", tiny)
    bodies = [1e-3, 30e-3, 2e-3, 15e-3, 1.5e-3, 8e-3, 1e-3, 25e-3]
    chk = PriorCheck(key, tiny, "bf16", n=8)
    for b in bodies:
        chk.observe(b, b, b + 10e-3)
    assert chk.verdict == pytest.approx(1.0) and not chk.remeasure_pending
    assert key in json.loads(cache_path().read_text())["entries"]
    # a device measurement 5x off is still seen through the same host work
    chk = PriorCheck(key, tiny, "bf16", n=8)
    for b in bodies:
        chk.observe(b, b, 5 * b + 10e-3)
    assert chk.verdict == pytest.approx(5.0) and chk.remeasure_pending


def test_prior_check_reads_no_slope_from_steps_of_near_equal_bodies(cache_home, tiny) -> None:
    # the admission engine test's first steps (ms): one prefill, then decodes whose bodies differ by < 1 % and
    # whose measured times jitter by 30 %; over all pairs the median slope is 22 (it dropped this right
    # measurement in 2 runs of 5): pairs of near-equal bodies carry noise over a tiny difference, not a slope
    pytest.importorskip("torch")
    measurement(budget_s=0.3, model=tiny)
    key = machine_key("bf16", tiny)
    chk = PriorCheck(key, tiny, "bf16", n=16)
    for b, y in [(103.47, 128.52), (9.04, 14.1), (9.05, 11.86), (9.053, 11.82), (9.056, 12.31), (9.06, 11.98),
                 (9.063, 12.0), (9.07, 11.76), (9.072, 13.63), (9.074, 14.6), (9.08, 15.13), (9.082, 13.11),
                 (9.084, 14.67), (9.09, 14.63), (9.093, 13.93), (9.1, 13.29)]:
        chk.observe(b * 1e-3, b * 1e-3, y * 1e-3)
    assert 1.2 < chk.verdict < 1.7 and not chk.remeasure_pending
    assert key in json.loads(cache_path().read_text())["entries"]


def test_prior_check_keeps_a_measurement_that_agrees(cache_home, tiny) -> None:
    pytest.importorskip("torch")
    measurement(budget_s=0.3, model=tiny)
    chk = PriorCheck(machine_key("bf16", tiny), tiny, "bf16", n=8)
    for r in (0.5, 2.0, 1.1, 0.9, 2.5, 0.4, 1.3, 1.0):
        chk.observe(1e-3, 0.9e-3, r * 1e-3)
    assert chk.verdict is not None and not chk.remeasure_pending
    assert machine_key("bf16", tiny) in json.loads(cache_path().read_text())["entries"]


def test_scale_knob_scales_throughput_and_fixed_costs() -> None:
    m = {"flops": 1e11, "bw": 1e10, "t_call": 1e-5, "attn_flops": 5e10, "attn_bw": 5e9, "t_attn": 2e-5,
         "threads": 2, "mhz": 2000.0}
    s1, s2 = spec_from_measurement(m), spec_from_measurement(m, 0.01)
    assert s2.bf16_tflops == pytest.approx(0.01 * s1.bf16_tflops) and "test knob" in s2.source
    c1, c2 = constants_from_measurement(m), constants_from_measurement(m, 0.01)
    assert c2.t_kernel == pytest.approx(100 * c1.t_kernel) and c2.eta_attn == pytest.approx(c1.eta_attn) == 0.5


def test_a_disturbed_measurement_is_recognised_and_merged_best_of() -> None:
    from m2live.cpu_device import _best_of, _disturbed

    quiet = {"flops": 1.6e11, "bw": 1.7e10, "t_call": 8e-6, "attn_flops": 8e10, "attn_bw": 1.5e10, "t_attn": 2e-5}
    loaded = {"flops": 3.7e10, "bw": 7e8, "t_call": 9e-6, "attn_flops": 9e10, "attn_bw": 1e9, "t_attn": 8e-3}
    assert _disturbed(loaded) and not _disturbed(quiet)
    best = _best_of(loaded, quiet)
    assert best["flops"] == 1.6e11 and best["bw"] == 1.7e10 and best["attn_flops"] == 9e10
    assert best["t_call"] == 8e-6 and best["t_attn"] == 2e-5


def test_other_work_beside_a_measurement_is_seen() -> None:
    """The cached CPU device must not be a measurement other work cut into: a 2-thread measurement taken beside
    a test run came out 3-6x slower than the machine and was kept (no call was slow enough to flag it). The CPU
    time other processes (and the hypervisor's steal) took while it ran is read from /proc: a process spinning
    beside it counts, this process's own work does not; such a measurement is marked busy (re-measured at the
    next start)."""
    import time

    from m2live.cpu_device import OTHERS_LIMIT, _cpu_snapshot, _others_cpus, _shared

    if _cpu_snapshot() is None:
        pytest.skip("no /proc here")

    def others_while(work) -> float:
        before = _cpu_snapshot()
        work()
        return _others_cpus(before, _cpu_snapshot())

    def spin(seconds: float = 1.0) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    own = others_while(spin)
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        beside = others_while(lambda: time.sleep(1.0))
    finally:
        burner.kill()
        burner.wait()
    assert beside > 0.5 and beside > own + 0.4, (own, beside)
    assert _shared({"others_cpus": beside}) and not _shared({"others_cpus": OTHERS_LIMIT / 2})
