"""M2liveConfig: environment, config file (JSON/TOML), precedence, data-parallel derivation, bad values."""

from __future__ import annotations

import json

import pytest

from m2live.config import OPTIONS, ConfigError, M2liveConfig, readme_table


def test_defaults():
    c = M2liveConfig.from_env({})
    assert not c.enable and c.slo_ms is None and not c.admission_on
    assert c.prom_enable and c.prom_host == "127.0.0.1" and c.prom_port == 9400
    assert c.mqtt_url is None and c.trace is None and c.sample_ms == 20.0 and c.slo_margin == 0.1
    assert c.fault_every == 0


def test_env_values():
    c = M2liveConfig.from_env({"M2LIVE_ENABLE": "1", "M2LIVE_SLO_MS": "40", "M2LIVE_PROM_PORT": "9555",
                               "M2LIVE_GPU": "h100-sxm", "M2LIVE_MQTT_URL": "mqtt://127.0.0.1:1883",
                               "M2LIVE_TRACE": "/tmp/t.jsonl", "M2LIVE_SAMPLE_MS": "10", "OTHER": "x"})
    assert c.enable and c.slo_ms == 40.0 and c.admission_on and c.prom_port == 9555 and c.gpu == "h100-sxm"
    assert c.mqtt_url.startswith("mqtt://") and c.trace == "/tmp/t.jsonl" and c.sample_ms == 10.0
    assert not M2liveConfig.from_env({"M2LIVE_SLO_MS": "40", "M2LIVE_ADMISSION": "off"}).admission_on


def test_file_json_and_toml_env_wins(tmp_path):
    j = tmp_path / "m.json"
    j.write_text(json.dumps({"slo_ms": 30, "prom_port": 9600, "M2LIVE_GPU": "cpu"}))
    c = M2liveConfig.from_env({"M2LIVE_CONFIG": str(j), "M2LIVE_PROM_PORT": "9700"})
    assert c.slo_ms == 30.0 and c.prom_port == 9700 and c.gpu == "cpu" and c.source == [str(j), "env"]
    t = tmp_path / "m.toml"
    t.write_text('[m2live]\nslo_ms = 25.5\nprom_enable = false\nmodel = "meta-llama/Llama-3.1-8B"\n')
    c = M2liveConfig.from_env({"M2LIVE_CONFIG": str(t)})
    assert c.slo_ms == 25.5 and not c.prom_enable and c.model == "meta-llama/Llama-3.1-8B"


def test_for_engine_offsets_port_and_trace():
    c = M2liveConfig.from_env({"M2LIVE_TRACE": "/x/trace.jsonl"})
    e0, e2 = c.for_engine(0), c.for_engine(2)
    assert e0.engine == "0" and e0.prom_port == 9400 and e0.trace == "/x/trace.jsonl"
    assert e2.engine == "2" and e2.prom_port == 9402 and e2.trace == "/x/trace.dp2.jsonl"
    assert e2.mqtt_instance.endswith("-2") and c.engine is None


@pytest.mark.parametrize("env,needle", [
    ({"M2LIVE_SLO_MS": "-5"}, "M2LIVE_SLO_MS"),
    ({"M2LIVE_SLO_MS": "abc"}, "M2LIVE_SLO_MS"),
    ({"M2LIVE_PROM_PORT": "70000"}, "M2LIVE_PROM_PORT"),
    ({"M2LIVE_PROM_PORT": "12.5"}, "M2LIVE_PROM_PORT"),
    ({"M2LIVE_ENABLE": "maybe"}, "M2LIVE_ENABLE"),
    ({"M2LIVE_SAMPLE_MS": "0"}, "M2LIVE_SAMPLE_MS"),
    ({"M2LIVE_MQTT_URL": "http://x"}, "M2LIVE_MQTT_URL"),
    ({"M2LIVE_FAULT": "explode"}, "M2LIVE_FAULT"),
    ({"M2LIVE_CONFIG": "/nonexistent/m2live.toml"}, "cannot read"),
])
def test_bad_values_one_line(env, needle):
    with pytest.raises(ConfigError) as e:
        M2liveConfig.from_env(env)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="neither valid JSON nor TOML"):
        M2liveConfig.from_env({"M2LIVE_CONFIG": str(p)})
    p.write_text(json.dumps({"no_such_option": 1}))
    with pytest.raises(ConfigError, match="unknown m2live option"):
        M2liveConfig.from_env({"M2LIVE_CONFIG": str(p)})


def test_readme_table_lists_every_option():
    t = readme_table()
    for env, *_ in OPTIONS.values():
        assert f"`{env}`" in t
    assert "`M2LIVE_CONFIG`" in t


def test_config_check_says_which_device_the_plugin_would_predict_for(tmp_path):
    """`m2live config check` names the device: M2LIVE_GPU's (a catalog name or a GPU spec file), or, with no
    NVIDIA driver on the machine, the CPU device of a CPU engine."""
    import os
    import subprocess
    import sys

    def device(**env: str) -> str:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("M2LIVE_")}
        r = subprocess.run([sys.executable, "-m", "m2live", "config", "check", "--json"], capture_output=True,
                           text=True, env={**clean, **env}, timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["device"]

    assert device(M2LIVE_GPU="h100") == "NVIDIA H100 80GB HBM3 (M2LIVE_GPU)"
    assert device(M2LIVE_GPU="cpu") == "the CPU device (M2LIVE_GPU)"
    row = json.loads(subprocess.run([sys.executable, "-m", "m2live", "gpus", "--json"], capture_output=True,
                                    text=True, timeout=60).stdout)[0]
    row.update(name="My A100", aliases=[], nvml_names=[])
    (tmp_path / "a100.json").write_text(json.dumps(row))
    assert device(M2LIVE_GPU=str(tmp_path / "a100.json")) == "My A100 (M2LIVE_GPU)"
    from conftest import nvml_answers

    if nvml_answers():
        assert "(NVML GPU 0; " in device()
    else:
        assert device().startswith("the CPU device, for a CPU engine (NVML: ")
