"""The Prometheus rules shipped beside the dashboard (dashboards/m2live.rules.yml): valid for promtool, their own
unit tests pass (dashboards/m2live.rules.test.yml: each alert quiet on a healthy engine and firing, with its
labels and annotations, on a sick one), and a REAL Prometheus loading them over real exporters computes the
recorded ratios from the records' own values and raises exactly the alerts the records call for.
tests/test_exporters_engine.py loads them too, over the plugin on a real vLLM engine."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import threading

import pytest
from conftest import REPO, RULES, rule_metric_names
from servers import (
    _need,
    free_port,
    prometheus_fixture,  # noqa: F401  (fixture `prometheus`)
    step_records,
    wait_until,
)

from exporters.prometheus import PrometheusExporter

RULE_TESTS = REPO / "dashboards" / "m2live.rules.test.yml"

pytestmark = pytest.mark.servers


def test_promtool_accepts_the_rules():
    p = subprocess.run([_need("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"SUCCESS: \d+ rules found", p.stdout + p.stderr)


def test_the_rules_own_unit_tests_pass():
    p = subprocess.run([_need("promtool"), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_alert_is_unit_tested_quiet_and_firing():
    rules = RULES.read_text()
    tests = RULE_TESTS.read_text()
    alerts = re.findall(r"- alert: (\w+)", rules)
    assert len(alerts) >= 10
    for a in alerts:
        quiet = re.search(rf"alertname: {a}, exp_alerts: \[\]", tests)
        firing = re.search(rf"alertname: {a}\n\s+exp_alerts:\n\s+- exp_labels:", tests)
        assert quiet and firing, f"{a}: needs a case where it stays quiet and one where it fires"
    # every recording rule is read by an alert (no dead rules)
    for rec in re.findall(r"- record: (\S+)", rules):
        assert rules.count(rec) >= 2, f"recording rule {rec} is used by no alert"


def test_the_rules_read_only_series_the_exporter_serves():
    exp = PrometheusExporter(port=None, engine="0", gpu="g", model="m")
    for r in step_records(3):
        exp.submit(r)
    served = {m.name for m in exp.collect()}
    served |= {n + "_total" for n in served}  # counters are served as <name>_total
    # the plugin's own counters that the exporter only relays (m2live.live.monitor.Monitor.counters)
    relayed = {"m2live_clock_errors_total"}
    missing = rule_metric_names(RULES.read_text()) - served - relayed
    assert not missing, f"the rules read series no exporter serves: {sorted(missing)}"


def _feed(exp: PrometheusExporter, stop: threading.Event, measured_over_predicted: float, engine: str) -> None:
    """A live engine: a step every 20 ms; the measurement is the prediction x ``measured_over_predicted``, the
    corrected prediction equals the prediction (the correction has learnt nothing), every step within the SLO."""
    i = 0
    while not stop.is_set():
        for r in step_records(10, start=i, engine=engine):
            m = r.predicted_s * measured_over_predicted
            exp.submit(dataclasses.replace(r, measured_s=m, corrected_s=r.predicted_s, slo_violation=False,
                                           admission_flagged=False))
            if stop.wait(0.02):
                return
        i += 10


def test_a_real_prometheus_records_the_ratios_and_raises_the_alerts_the_records_call_for(prometheus):
    """Two engines, each with its own exporter (as data-parallel engines run): one whose steps take exactly
    their prediction, one whose steps take 1.5 x it; only the second has records dropped by its MQTT sink."""
    dropped = {"n": 0.0}

    def counters() -> dict[str, float]:
        dropped["n"] += 3.0  # the sink keeps losing records
        return {"mqtt_dropped_total": dropped["n"]}

    ports = {"steady": free_port(), "drift": free_port()}
    exps = {"steady": PrometheusExporter("127.0.0.1", ports["steady"], engine="steady").start(),
            "drift": PrometheusExporter("127.0.0.1", ports["drift"], engine="drift", counters=counters).start()}
    stop = threading.Event()
    feeders = [threading.Thread(target=_feed, args=(exps[e], stop, k, e), daemon=True)
               for e, k in (("steady", 1.0), ("drift", 1.5))]
    for f in feeders:
        f.start()
    try:
        prom = prometheus([f"127.0.0.1:{p}" for p in ports.values()], scrape_interval="1s", rule_files=[RULES])
        wait_until(prom.targets_up, 20, "Prometheus to scrape both exporters")
        rules = prom.api("rules")["groups"]
        assert {g["name"] for g in rules} == {"m2live.records", "m2live.alerts"}
        assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules

        def by_engine(expr: str) -> dict[str, float]:
            return {s["metric"]["engine"]: float(s["value"][1]) for s in prom.query(expr)}

        wait_until(lambda: len(by_engine("m2live:step_measured_over_predicted:ratio_rate30m")) == 2, 30,
                   "the recording rules over both engines")
        within = by_engine("m2live:step_corrected_within_20pct:ratio_rate15m")
        assert within == {"steady": 1.0, "drift": 0.0}  # residual 0 vs (1.5 - 1) / 1.5 = 0.33
        ratio = by_engine("m2live:step_measured_over_predicted:ratio_rate30m")
        assert ratio["steady"] == pytest.approx(1.0, rel=1e-9) and ratio["drift"] == pytest.approx(1.5, rel=1e-9)

        def alerts() -> set[tuple[str, str, str]]:
            return {(a["labels"]["alertname"], a["labels"]["engine"], a["state"]) for a in prom.alerts()}

        want = {("M2liveCorrectedPredictionOff", "drift", "pending"), ("M2liveModelOffDatasheet", "drift", "pending"),
                ("M2liveTelemetryLost", "drift", "firing")}  # no `for`: a loss fires at once
        wait_until(lambda: want <= alerts(), 30, f"the alerts {sorted(want)}")
        assert alerts() == want  # and nothing for the steady engine
        lost = [a for a in prom.alerts() if a["labels"]["alertname"] == "M2liveTelemetryLost"]
        assert [a["labels"]["sink"] for a in lost] == ["mqtt"]
        assert re.fullmatch(r"m2live engine drift: \d+ step records lost by the mqtt sink in 10 min",
                            lost[0]["annotations"]["summary"])
    finally:
        stop.set()
        for f in feeders:
            f.join(5)
        for e in exps.values():
            e.close()
