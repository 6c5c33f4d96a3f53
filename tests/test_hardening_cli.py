"""Issue 16, items 1 (control bounds, logging, counters), 4 (silent switch-offs), 5 (one line and exit 2 for every
bad input) and 6 (an unguarded vLLM read): no broker or engine needed here (see test_hardening_mqtt.py)."""

from __future__ import annotations

import csv
import json
import logging
import math
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import MODELS, OPBENCH, REPO

from m2live import Step, limits
from m2live.cli import main
from m2live.config import ConfigError, M2liveConfig
from m2live.step import StepError

GEMM = OPBENCH / "h100_sxm" / "gemm_bf16.csv"
PREDICT = ["predict", "--gpu", "h100-sxm", "--model", "meta-llama/Llama-3.1-8B"]


def monitor(tmp_path: Path, start_exporters: bool = False, **env: str):
    """A LiveMonitor as the plugin builds it (config from an environment), on a replayed clock."""
    from m2live.live import EngineInfo
    from m2live.shapes import get_model
    from m2live.telemetry import ClockReading, ReplayClockSource
    from vllm_hooks.sinks import start_monitor

    base = {"M2LIVE_PROM": "0", "M2LIVE_GPU": "NVIDIA H100 80GB HBM3", "M2LIVE_SAMPLE_MS": "5"}
    cfg = M2liveConfig.from_env({**base, **env})
    src = ReplayClockSource([ClockReading(0.0, 1500.0, 1980.0, 650.0, 700.0, 4, 70.0)])
    return start_monitor(cfg, EngineInfo(get_model(MODELS / "bench-llama"), "bench"),
                         step_of=lambda sched, out: out.step, clock_source=src, start_exporters=start_exporters)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@contextmanager
def logs() -> Iterator[_Lines]:
    h = _Lines()
    logger = logging.getLogger("m2live")
    logger.addHandler(h)
    try:
        yield h
    finally:
        logger.removeHandler(h)


def _trace_line(**override) -> str:
    rec = {"step": 1, "num_prefill_tokens": 0, "num_decode_tokens": 3, "decode_kv_tokens": 300,
           "predicted_s": 0.010, "corrected_s": 0.011, "measured_s": 0.012, "f_clk": 1.0,
           "ops": {"qkv": 0.004}, "factors": {"eta_mem": {"qkv": 0.8}}}
    return json.dumps({**rec, **override}) + "\n"


# --- item 5: every bad input is one line on stderr and exit code 2 ---------------------------------------------------
def _cases(tmp: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    header_only = tmp / "header.csv"
    header_only.write_text(GEMM.read_text().splitlines()[0] + "\n")
    bad_ops, bad_factors = tmp / "ops.jsonl", tmp / "factors.jsonl"
    bad_ops.write_text(_trace_line(ops=[1, 2]) * 3)
    bad_factors.write_text(_trace_line(factors="fast") * 3)
    binary = tmp / "m2live.toml"
    binary.write_bytes(bytes(range(256)) * 4)
    png = str(tmp / "r.png")
    loop = tmp / "loop"
    loop.symlink_to(tmp / "loop2")
    (tmp / "loop2").symlink_to(loop)
    long_name = str(tmp / ("x" * 300))
    cfg = json.loads((MODELS / "tiny-llama" / "config.json").read_text())
    models = {}
    for name, change in (("archs_int", {"architectures": 5}), ("type_list", {"model_type": ["llama"]}),
                         ("hidden_1e15", {"hidden_size": 10**15}), ("text_list", {"text_config": [1]})):
        d = tmp / name
        d.mkdir()
        body = {**cfg, **change}
        if name == "text_list":
            body.pop("hidden_size")
        (d / "config.json").write_text(json.dumps(body))
        models[name] = str(d)
    deep = tmp / "deep"
    deep.mkdir()
    (deep / "config.json").write_text("[" * 100_000)
    clock_str = tmp / "clock.jsonl"
    clock_str.write_text(_trace_line(clock_mhz="fast") * 3)
    neg = tmp / "neg.jsonl"
    neg.write_text(_trace_line(predicted_s=-1.0) * 3)
    dup = tmp / "dup.csv"
    dup.write_text("device,vllm_version,kernel_source,m,m,k,latency_ms\nNVIDIA H100 80GB HBM3,0.24.0,x,1,32,32,0.1\n")
    extra = tmp / "extra.csv"
    extra.write_text("device,vllm_version,kernel_source,m,n,k,latency_ms\nNVIDIA H100 80GB HBM3,0.24.0,x,1,32,32,0.1,9\n")
    huge_ms = tmp / "huge" / "gemm_bf16.csv"
    huge_ms.parent.mkdir()
    huge_ms.write_text("device,vllm_version,kernel_source,m,n,k,latency_ms\n" + "".join(
        f"NVIDIA H100 80GB HBM3,0.24.0,x,{m},4096,4096,{'1e300' if m == 1 else 0.05}\n" for m in (1, 2, 4, 8, 16)))
    unmeasured = tmp / "unmeasured" / "gemm_bf16.csv"
    unmeasured.parent.mkdir()
    unmeasured.write_text("device,vllm_version,kernel_source,m,n,k,latency_ms\n" + "".join(
        f"NVIDIA H100 80GB HBM3,0.24.0,x,{m},4096,4096,\n" for m in (1, 2, 4, 8, 16)))
    batch_header = tmp / "batch.csv"
    batch_header.write_text("model,gpu,tp,isl,osl,concurrency,precision\n")
    sim = ["simulate", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "h100-sxm", "--isl", "100", "--osl", "10",
           "--concurrency", "2"]
    return {
        "ops symlink loop": (["ops", str(loop)], {}),
        "ops name too long": (["ops", long_name], {}),
        "plan -o /dev/full": (["calibrate", "plan", "--gpu", "h100-sxm", "--kind", "gemm", "-o", "/dev/full"], {}),
        "config architectures 5": ([*PREDICT[:3], "--model", models["archs_int"], "--decode", "10"], {}),
        "config model_type list": ([*PREDICT[:3], "--model", models["type_list"], "--decode", "10"], {}),
        "config hidden 1e15": ([*PREDICT[:3], "--model", models["hidden_1e15"], "--decode", "10"], {}),
        "config text_config list": ([*PREDICT[:3], "--model", models["text_list"], "--decode", "10"], {}),
        "config nested 1e5 deep": ([*PREDICT[:3], "--model", str(deep), "--decode", "10"], {}),
        "decode past the context": ([*PREDICT[:3], "--model", "meta-llama/Llama-2-7b-hf", "--decode", "100000"], {}),
        "report clock string": (["report", str(clock_str), "-o", png], {}),
        "report negative prediction": (["report", str(neg), "-o", png], {}),
        "validate duplicate column": (["validate", str(dup)], {}),
        "ops extra cells": (["ops", str(extra)], {}),
        "calibrate latency 1e300": (["calibrate", "fit", str(huge_ms.parent), "--gpu", "h100-sxm", "-o",
                                     str(tmp / "cal.json")], {}),
        "batch header only": (["simulate", "--batch", str(batch_header), "-o", str(tmp / "b.csv")], {}),
        "simulate rate 1e-300": ([*sim, "--request-rate", "1e-300"], {}),
        "simulate frontend 1e300": ([*sim, "--frontend-ms", "1e300"], {}),
        "simulate cache past memory": ([*sim, "--kv-cache-gib", "100"], {}),
        "simulate max-num-seqs 1e20": ([*sim, "--max-num-seqs", "1" + "0" * 20], {}),
        "rank max-seqs 1e20": (["rank", "--model", "meta-llama/Llama-3.1-8B", "--workload", "chat", "--gpus",
                                "h100-sxm", "--max-seqs", "1" + "0" * 20], {}),
        "rank superscript digit": (["rank", "--model", "meta-llama/Llama-3.1-8B", "--workload", "chat",
                                    "--max-batched-tokens", "\u00b2"], {}),
        "M2LIVE_ADMISSION without SLO": (["config", "check"], {"M2LIVE_ADMISSION": "1"}),
        "M2LIVE_TRACE a directory": (["config", "check"], {"M2LIVE_TRACE": str(tmp)}),
        "M2LIVE_PROM_HOST not a host": (["config", "check"], {"M2LIVE_PROM_HOST": "not a host!!"}),
        "M2LIVE_MQTT_URL broken IPv6": (["config", "check"], {"M2LIVE_MQTT_URL": "mqtt://[::1"}),
        "clock 1e-300": ([*PREDICT, "--decode", "100", "--clock-mhz", "1e-300"], {}),
        "clock inf": ([*PREDICT, "--decode", "100", "--clock-mhz", "inf"], {}),
        "decode count 1e30": ([*PREDICT, "--decode", "10x" + "1" + "0" * 30], {}),
        "400-digit prefill": ([*PREDICT, "--prefill", "9" * 400], {}),
        "decode 10x10000000": ([*PREDICT, "--decode", "10x10000000"], {}),
        "tp 1e23": ([*PREDICT, "--decode", "10", "--tp", "1" + "0" * 23], {}),
        "rank rate 1e308": (["rank", "--model", "meta-llama/Llama-3.1-8B", "--workload", "chat,rate=1e308",
                             "--gpus", "h100-sxm", "--tp", "1"], {}),
        "ops header only": (["ops", str(header_only)], {}),
        "ops -o /dev/full": (["ops", str(GEMM), "--gpu", "h100-sxm", "-o", "/dev/full"], {}),
        "ops clock inf": (["ops", str(GEMM), "--gpu", "h100-sxm", "--clock", "inf"], {}),
        "report ops list": (["report", str(bad_ops), "-o", png], {}),
        "report factors str": (["report", str(bad_factors), "-o", png], {}),
        "report warmup 1e30": (["report", str(bad_ops), "-o", png, "--warmup", "1" + "0" * 30], {}),
        "binary M2LIVE_CONFIG": (["config", "check"], {"M2LIVE_CONFIG": str(binary)}),
        "M2LIVE_QUEUE_SIZE=1e12": (["config", "check"], {"M2LIVE_QUEUE_SIZE": "1e12"}),
        "M2LIVE_MQTT_QUEUE_SIZE=0": (["config", "check"], {"M2LIVE_MQTT_QUEUE_SIZE": "0"}),
        "simulate goodput unknown key": (["simulate", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "h100-sxm",
                                          "--isl", "64", "--osl", "8", "--concurrency", "1", "--goodput", "itl:5"], {}),
        "simulate percentile 1e400": (["simulate", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "h100-sxm",
                                       "--isl", "64", "--osl", "8", "--concurrency", "1", "--metric-percentiles",
                                       "1e400"], {}),
        "M2LIVE_RESIDUAL_WINDOW=1e9": (["config", "check"], {"M2LIVE_RESIDUAL_WINDOW": "1e9"}),
        "M2LIVE_SLO_MS=1e-9": (["config", "check"], {"M2LIVE_SLO_MS": "1e-9"}),
        "misspelt M2LIVE_SLO_MSS": (["config", "check"], {"M2LIVE_SLO_MSS": "40"}),
        # a flag that would be accepted and then not read (found by an audit, 2026-12-06): refused instead
        "batch with --tp": (["simulate", "--batch", str(batch_header), "--tp", "2"], {}),
        "batch with --json": (["simulate", "--batch", str(batch_header), "--json"], {}),
        "rank --validate with --gpus": (["rank", "--validate", str(OPBENCH / "h100_sxm"), "--gpus", "h100-sxm"], {}),
        "rank --validate with --calibration": (["rank", "--validate", str(OPBENCH / "h100_sxm"), "--calibration",
                                                str(tmp / "none.json")], {}),
        "probe --calibrate --quick": (["probe", "--calibrate", "--quick", "--dry-run", "--out", str(tmp / "pq")], {}),
        "rank --validate unmeasured table": (["rank", "--validate", str(unmeasured.parent), str(OPBENCH / "a100_sxm")],
                                             {}),
    }


CASES = ["clock 1e-300", "clock inf", "decode count 1e30", "400-digit prefill", "decode 10x10000000", "tp 1e23",
         "rank rate 1e308", "ops header only", "ops -o /dev/full", "ops clock inf", "report ops list", "report factors str",
         "report warmup 1e30", "binary M2LIVE_CONFIG", "M2LIVE_QUEUE_SIZE=1e12", "M2LIVE_MQTT_QUEUE_SIZE=0",
         "simulate goodput unknown key", "simulate percentile 1e400", "M2LIVE_RESIDUAL_WINDOW=1e9",
         "M2LIVE_SLO_MS=1e-9", "misspelt M2LIVE_SLO_MSS", "ops symlink loop", "ops name too long",
         "plan -o /dev/full", "config architectures 5", "config model_type list", "config hidden 1e15",
         "config text_config list", "config nested 1e5 deep", "decode past the context", "report clock string",
         "report negative prediction", "validate duplicate column", "ops extra cells", "calibrate latency 1e300",
         "batch header only", "simulate rate 1e-300", "simulate frontend 1e300", "simulate cache past memory",
         "simulate max-num-seqs 1e20", "rank max-seqs 1e20", "rank superscript digit", "M2LIVE_ADMISSION without SLO",
         "M2LIVE_TRACE a directory", "M2LIVE_PROM_HOST not a host", "M2LIVE_MQTT_URL broken IPv6",
         "batch with --tp", "batch with --json", "rank --validate with --gpus", "rank --validate with --calibration",
         "probe --calibrate --quick", "rank --validate unmeasured table"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys, monkeypatch):
    for k in [k for k in __import__("os").environ if k.startswith("M2LIVE_")]:
        monkeypatch.delenv(k)
    cases = _cases(tmp_path)
    assert sorted(cases) == sorted(CASES)
    argv, env = cases[case]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, (case, err)
    assert len(lines) == 1 and "Traceback" not in err and lines[0].startswith("m2live "), (case, err)
    if argv[0] != "config":
        assert out == "", case
    for written in ("cal.json", "b.csv"):  # a refused input leaves no output file behind
        assert not (tmp_path / written).exists(), case


def test_an_unreadable_path_is_named_with_its_reason_not_an_errno(tmp_path, capsys):
    """open()'s errors read "PATH: reason", the way the other one-line errors name their file."""
    for path, reason in ((tmp_path / "missing.csv", "no such file or directory"), (tmp_path, "is a directory")):
        assert main(["ops", str(path), "--gpu", "h100-sxm"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"m2live ops: error: {path}: {reason}", err


@pytest.mark.parametrize("argv, says", [
    ([], "required: COMMAND"),
    (["simulate", "--precision", "int4"], "invalid choice: 'int4'"),
    (["rank", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["calibrate", "plan", "--gpu"], "expected one argument"),
    (["simulate", "--model", "x", "--async-scheduling", "maybe"], "--async-scheduling"),
])
def test_a_bad_command_line_is_one_line_not_the_usage_block(capsys, argv, says):
    """argparse's own errors (a missing subcommand, a bad choice, an unknown flag) are one line, exit 2, as every
    other error; --help still prints the usage."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("m2live") and says in err[0], err
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--help"])
    assert e.value.code == 0 and "usage: m2live simulate" in capsys.readouterr().out


def test_ops_to_a_full_device_in_a_real_process_is_one_line(tmp_path):
    """The same with the real file descriptors of a fresh process (no test runner in between)."""
    r = subprocess.run([sys.executable, "-m", "m2live", "ops", str(GEMM), "--gpu", "h100-sxm", "-o", "/dev/full"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "m2live ops: error: cannot write /dev/full: No space left on device"]


def test_limits_are_named_and_the_step_enforces_them():
    with pytest.raises(ValueError, match="MHz"):
        limits.CLOCK_MHZ.parse("1e-300", "--clock-mhz")
    assert limits.CLOCK_MHZ.parse("1410", "--clock-mhz") == 1410.0
    assert limits.QUEUE_SIZE.parse("1e3", "q") == 1000
    with pytest.raises(StepError, match="limits"):
        Step([(1, 10**30)])
    with pytest.raises(StepError, match="limits"):
        Step.from_counts(0, 0, 10**9, 0)  # refused before a billion-entry list is built
    for env in ({"M2LIVE_QUEUE_SIZE": "1e12"}, {"M2LIVE_RESIDUAL_WINDOW": "1e9"}, {"M2LIVE_SLO_MS": "1e-9"},
                {"M2LIVE_SLO_MS": "1e308"}, {"M2LIVE_GPU_INDEX": "1e9"}, {"M2LIVE_MQTT_QUEUE_SIZE": "1e12"}):
        with pytest.raises(ConfigError, match="within"):
            M2liveConfig.from_env(env)


# --- item 4: no silent switch-offs ------------------------------------------------------------------------------------
def test_config_check_prints_the_effective_config_with_secrets_masked(tmp_path, capsys, monkeypatch):
    for k in [k for k in __import__("os").environ if k.startswith("M2LIVE_")]:
        monkeypatch.delenv(k)
    f = tmp_path / "m2live.toml"
    f.write_text('enable = true\nslo_ms = 40\nmqtt_url = "mqtt://alice:S3CRET@127.0.0.1:1883"\n')
    monkeypatch.setenv("M2LIVE_CONFIG", str(f))
    monkeypatch.setenv("M2LIVE_MQTT_PASSWORD", "S3CRET2")
    monkeypatch.setenv("M2LIVE_PROM_PORT", "9555")
    assert main(["config", "check"]) == 0
    out, err = capsys.readouterr()
    assert "S3CRET" not in out + err and "mqtt://***@127.0.0.1:1883" in out and err == ""
    assert "slo_ms" in out and "40.0" in out and "9555" in out and str(f) in out
    monkeypatch.setenv("M2LIVE_SLO_MSS", "30")
    assert main(["config", "check", "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["config"]["mqtt_password"] == "***"
    assert "M2LIVE_SLO_MSS" in err and "did you mean M2LIVE_SLO_MS?" in err


def test_python_m_config_still_generates_the_readme_table():
    r = subprocess.run([sys.executable, "-m", "m2live.config"], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    assert r.returncode == 0 and "| `M2LIVE_MQTT_CONTROL` | 0 |" in r.stdout
    readme = (REPO / "README.md").read_text()
    for line in r.stdout.splitlines():
        if "MQTT_CONTROL" in line:
            assert line in readme


def test_unknown_variables_are_named_with_the_closest_known_one():
    cfg = M2liveConfig.from_env({"M2LIVE_SLO_MSS": "40", "M2LIVE_PROM_PROT": "9500", "M2LIVE_XYZZY": "1"})
    assert cfg.slo_ms is None
    joined = " | ".join(cfg.warnings)
    assert "M2LIVE_SLO_MSS is ignored (did you mean M2LIVE_SLO_MS?)" in joined
    assert "did you mean M2LIVE_PROM_PORT?" in joined and "M2LIVE_XYZZY is ignored" in joined
    with pytest.raises(ConfigError, match="did you mean 'slo_ms'"):
        M2liveConfig.from_dict({"slo_mss": 40})


def test_plugin_asked_to_run_with_a_bad_config_says_so_at_error(tmp_path):
    from vllm_hooks.plugin import enabled

    f = tmp_path / "m2live.toml"
    f.write_text("enable = true\nslo_ms = -5\n")
    with logs() as h:
        assert enabled({"M2LIVE_CONFIG": str(f)}) is False
    errors = h.at(logging.ERROR)
    assert len(errors) == 1 and "M2LIVE_SLO_MS" in errors[0] and str(f) in errors[0]
    with logs() as h:
        assert enabled({"M2LIVE_ENABLE": "maybe"}) is False
        assert enabled({"M2LIVE_ENABLE": "0"}) is False and enabled({}) is False  # off as asked: no error
    errors = h.at(logging.ERROR)
    assert len(errors) == 1 and "'maybe'" in errors[0]


class _SchedulerWithoutBudget:
    """Stands in for a later vLLM whose scheduler renamed ``max_num_scheduled_tokens``: it records what it is
    called with, as vLLM 0.33's ``schedule(throttle_prefills=...)`` would be."""

    def __init__(self, *args, **kwargs) -> None:
        self.max_num_active_reqs = 8
        self.requests, self.running, self.waiting = {}, [], []
        self.calls: list[tuple] = []

    def schedule(self, *args, **kwargs):
        self.calls.append(("schedule", args, kwargs))
        return "output"

    def update_from_output(self, *args, **kwargs):
        self.calls.append(("update", args, kwargs))
        return {}

    def shutdown(self) -> None:
        self.calls.append(("shutdown", (), {}))


def test_a_renamed_vllm_attribute_disables_m2live_with_an_error_not_a_crash():
    from vllm_hooks.scheduler import _make_class

    cls = _make_class(_SchedulerWithoutBudget)
    with logs() as h:
        s = cls(None)  # vLLM passes vllm_config; the guard trips before it is read
    assert s._m2live is None
    errors = h.at(logging.ERROR)
    assert len(errors) == 1 and "max_num_scheduled_tokens" in errors[0] and "0.32.0" in errors[0]
    # the engine runs as vLLM's own scheduler, every argument passed through unchanged
    assert s.schedule(throttle_prefills=True) == "output"
    assert s.update_from_output("output", model_runner_output="mro") == {}
    s.shutdown()
    assert s.calls == [("schedule", (), {"throttle_prefills": True}),
                       ("update", ("output",), {"model_runner_output": "mro"}), ("shutdown", (), {})]


# --- item 1, the engine side: bounds, log line, counters ----------------------------------------------------------
def test_remote_control_is_bounded_logged_and_counted(tmp_path):
    from prometheus_client import CollectorRegistry

    from exporters.prometheus import PrometheusExporter

    mon = monitor(tmp_path, M2LIVE_SLO_MS="5000")
    reg = CollectorRegistry()
    exp = PrometheusExporter(port=None, engine="0", gpu="g", model="m", registry=reg, counters=mon.counters)
    exp.start()
    try:
        with logs() as h:
            mon.on_control({"slo_ms": 1e-9})  # passed the old checks; the config would never allow it
            mon.on_control({"slo_ms": 1e308})
            assert mon.admission.slo_s == 5.0
            mon.on_control({"slo_ms": 40, "by": "alice"})
            assert mon.admission.slo_s == 0.04
        changed = [line for line in h.at(logging.WARNING) if "remote control applied" in line]
        assert len(changed) == 1 and "'alice'" in changed[0] and "5000.0 -> 40.0 ms" in changed[0]
        assert "Z by" in changed[0]  # when (UTC), who, what
        c = mon.counters()
        assert c["control_changes_total"] == 1 and c["control_rejected_total"] == 2
        labels = {"engine": "0", "gpu": "g", "model": "m"}
        assert reg.get_sample_value("m2live_control_changes_total", labels) == 1
        assert reg.get_sample_value("m2live_control_rejected_total", labels) == 2
        assert reg.get_sample_value("m2live_trace_errors_total", labels) == 0  # always exported
    finally:
        exp.close()
        mon.close()


@pytest.mark.parametrize("flags, says", [
    (["--time-limit", "inf"], "--time-limit must be more than 0"),
    (["--calibrate", "--holdout", "1e308"], "--holdout must be from 0 to"),
    (["--gpu", "zzz"], "unknown GPU 'zzz'"),
])
def test_probe_refuses_bad_flags_before_making_its_folder(tmp_path, capsys, flags, says):
    """A probe refused for its flags or GPU name says so in one line and leaves no empty output folder behind."""
    out = tmp_path / "probe"
    assert main(["probe", "--dry-run", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not out.exists()


def test_a_calibration_file_outside_what_any_fit_gives_is_refused(tmp_path, capsys):
    """A corrupted or hand-edited calibration (a constant at 1e300) is refused in one line instead of overflowing
    the model or predicting nonsense."""
    from m2live.calibration_file import Calibration
    from m2live.efficiency import constants_for
    from m2live.hardware import get_gpu

    gpu = get_gpu("h100-sxm")
    prior = constants_for(gpu)
    doc = Calibration(gpu.name, gpu.kernel_family, {"k0": {"prior": prior.k0, "fitted": prior.k0 * 1.1}}, {}, {}, "", "",
                      {}, None, {}).to_json()
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(doc))
    assert main(["ops", str(GEMM), "--gpu", "h100-sxm", "--calibration", str(good), "-o", str(tmp_path / "o.csv")]) == 0
    for name, value in (("k0", 1e300), ("t_kernel", 1e300), ("eta_tc", 1e300)):
        doc["constants"] = {name: {"prior": float(getattr(prior, name)), "fitted": value}}
        bad.write_text(json.dumps(doc))
        capsys.readouterr()
        assert main(["ops", str(GEMM), "--gpu", "h100-sxm", "--calibration", str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and name in err[0] and "outside what any fit gives" in err[0], err


def test_report_over_a_trace_shorter_than_the_warmup_says_so(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(_trace_line() * 5)
    assert main(["report", str(trace), "-o", str(tmp_path / "r.png"), "--warmup", "1000"]) == 0
    out = capsys.readouterr().out
    assert "over every measured step (none after the 1000-step warm-up)" in out and "after warm-up:" not in out


def test_a_fit_on_a_bound_of_its_range_is_a_loadable_calibration(tmp_path):
    """The fit clips every constant with BOUNDS to them, both ends included, so a constant fitted onto an end (the
    decode items' overlap at 1.0, the tensor ceiling at 1.3 — what `probe --calibrate --dry-run`'s CPU rows can give),
    or a rounding step past it (0.9999999999999999, an older fit's exp(log(1.0))), is a file `load` accepts; 1 %
    past either end is still refused. The fit itself now lands on the bound exactly."""
    from m2live.calibration_file import Calibration, load
    from m2live.calibration_params import BOUNDS, CalibrationError
    from m2live.efficiency import constants_for
    from m2live.hardware import get_gpu

    gpu = get_gpu("h100-sxm")
    prior = constants_for(gpu)
    path = tmp_path / "cal.json"
    for name, (lo, hi) in BOUNDS.items():
        near = (math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf))  # what exp(log(bound)) can give
        for value, ok in ((lo, True), (hi, True), (near[0], lo > 0), (near[1], True), (hi * 1.01, False),
                          (lo * 0.99 if lo > 0 else -1e-9, False)):
            doc = Calibration(gpu.name, gpu.kernel_family, {name: {"prior": float(getattr(prior, name)),
                                                                   "fitted": value}},
                              {}, {}, "", "", {}, None, {}).to_json()
            path.write_text(json.dumps(doc))
            if ok:
                assert load(path).constants[name]["fitted"] == pytest.approx(value, rel=1e-12), (name, value)
            else:
                with pytest.raises(CalibrationError):
                    load(path)


def test_the_fit_puts_a_constant_on_its_bound_never_a_rounding_step_past_it():
    from m2live.calibration_params import ALL_CALIBRATED, Params
    from m2live.efficiency import constants_for
    from m2live.hardware import get_gpu

    prior = constants_for(get_gpu("h100-sxm"))
    names = [n for n in ALL_CALIBRATED if float(getattr(prior, n, 0.0) or 0.0) > 0]
    par = Params(names, prior)
    for x in (par.lo, par.hi, par.lo - 1.0, par.hi + 1.0):  # the fit's steps are clipped, then exponentiated
        vals = par.values(par.clip(x))
        for (n, v), (a, b) in zip(vals.items(), par.bounds, strict=True):
            assert a <= v <= b, (n, v, a, b)


def test_rows_five_times_slower_than_the_prior_fit_into_a_calibration_that_loads(tmp_path):
    """The H100's planned bf16 and fp8 GEMMs, five times slower, as an H200's: the bf16 fit puts eta_mem on its lower
    bound and the fp8 fit starts from the family's fp8 constants times that ratio — a value under the bound that the
    fp8 fit kept and the reader refused (0.196 on Hopper, 0.174 on Blackwell) until the carried ratio was held within
    the bounds. The path the outside check runs: plan -> fit -> load -> validate --calibration."""
    from m2live import calibrate as cal
    from m2live.calibration_file import load

    data = OPBENCH.parent
    folder = tmp_path / "rows"
    folder.mkdir()
    for kind, src in (("gemm", data / "opbench" / "h100_sxm"), ("gemm_fp8", data / "opbench_fp8" / "h100_sxm")):
        table = cal.read_table(src / cal.FILES[kind])
        want = {cal.shape_key(kind, p) for p in cal.plan("NVIDIA H200", kind)}
        keep = [r for r in table.rows if cal.shape_key(kind, r) in want]
        with open(folder / cal.FILES[kind], "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(keep[0]))
            w.writeheader()
            w.writerows({**r, "device": "NVIDIA H200", "latency_ms": f"{5 * float(r['latency_ms']):.6g}"} for r in keep)
    out = tmp_path / "cal.json"
    assert main(["calibrate", "fit", str(folder), "--gpu", "h200", "-o", str(out)]) == 0
    c = load(out)
    assert c.constants["eta_mem"]["fitted"] == pytest.approx(0.2) and c.constants_fp8
    assert main(["validate", str(folder), "--calibration", str(out), "--json"]) == 0


def test_a_ratio_carried_to_fp8_stays_within_the_fits_bounds():
    """The fp8 fit starts from the family's fp8 constants times the bf16 fit's eta_mem ratio; a bf16 eta_mem on its
    lower bound (0.2) would carry Blackwell's fp8 0.79 to 0.174, under the bound — it stays on the bound, so what
    the fp8 fit writes is within the range the reader checks."""
    from m2live.calibration_params import BOUNDS, carry_to_fp8
    from m2live.efficiency import constants_for
    from m2live.hardware import get_gpu

    gpu = get_gpu("b300")
    for fitted in (BOUNDS["eta_mem"][0], BOUNDS["eta_mem"][1]):
        carried = carry_to_fp8(constants_for(gpu, "fp8"), constants_for(gpu), {"eta_mem": fitted})
        assert BOUNDS["eta_mem"][0] <= carried.eta_mem <= BOUNDS["eta_mem"][1]


def test_a_fit_onto_a_bound_writes_the_bound_itself():
    """The A100's planned attention rows as an L40S's or an RTX PRO 6000's, decode 2.5 or 3 times slower: the decode
    items' overlap is fitted onto its lower bound in some of these (which ones moves with the model), and the file
    then holds 1.0 itself — never 0.9999999999999999, which a point on the way from the prior
    (3.98 * (1 / 3.98) ** 1.0) gave and only the reader's tolerance let load."""
    from m2live import calibrate as cal
    from m2live.calibration_params import BOUNDS

    on_bound = 0
    for gpu, slow in (("NVIDIA L40S", 2.5), ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 3.0)):
        rows = []
        for kind, scale in (("prefill", 1.0), ("decode", slow)):
            want = {cal.shape_key(kind, p) for p in cal.plan(gpu, kind)}
            rows += [cal.Row(r.kind, r.cells, r.ms * scale)
                     for r in cal.rows_from_tables([OPBENCH / "a100_sxm" / cal.FILES[kind]])
                     if cal.shape_key(kind, r.cells) in want]
        c = cal.fit(None, gpu, rows=rows)
        fitted = c.constants["item_overlap"]["fitted"]
        assert not 1.0 - 1e-6 < fitted < 1.0, (gpu, slow, fitted)  # on the bound, or clearly off it
        on_bound += fitted == 1.0
        for n, v in c.constants.items():
            if n in BOUNDS:
                assert BOUNDS[n][0] <= v["fitted"] <= BOUNDS[n][1] or v["fitted"] == v["prior"], (n, v)
    assert on_bound, "no case fitted the overlap onto its bound: the test no longer reaches what it checks"
