"""Generate the Grafana dashboard ``dashboards/m2live.json`` from code (plain dicts: Grafana's JSON model).

    python dashboards/build.py            # (re)write dashboards/m2live.json
    python dashboards/build.py --check    # exit 1 if the committed JSON differs from what this file builds

Importable in Grafana (Dashboards → Import): the Prometheus data source is a template variable
(``datasource``), and the panels are templated by ``engine``, ``gpu`` and ``model`` (multi-select, "All").
Every expression uses ``$__rate_interval`` for rates, so it works at any scrape interval. ``PANELS`` is the
single source: the tests evaluate every expression in it against a real Prometheus.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "m2live.json"
UID = "m2live-steps"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'engine=~"$engine", gpu=~"$gpu", model=~"$model"'
RI = "$__rate_interval"
FACTORS = ("f_clk", "eta_wave", "eta_active", "eta_duty", "eta_mem")
# NVML clock event reasons (nvml.h, nvmlClocksEventReason*): bit value -> what it means
CLOCK_EVENT_BITS = ((0x1, "GPU idle"), (0x4, "SW power cap"), (0x8, "HW slowdown"), (0x20, "SW thermal"),
                    (0x40, "HW thermal"), (0x80, "HW power brake"))


def _mean(hist: str, by: str = "engine") -> str:
    """Mean value per observation of a histogram over the rate window."""
    return (f"sum by ({by}) (rate({hist}_sum{{{SEL}}}[{RI}])) / "
            f"sum by ({by}) (rate({hist}_count{{{SEL}}}[{RI}]))")


def _q(q: float, hist: str, by: str = "engine") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({hist}_bucket{{{SEL}}}[{RI}])))"


def _t(expr: str, legend: str, **extra: object) -> dict:
    return {"expr": expr, "legendFormat": legend, **extra}


# (title, panel type, unit, targets, width, extra panel options); rows are ("row", title)
PANELS: list[tuple] = [
    ("row", "Step time: prediction vs measurement"),
    ("Step time — predicted vs measured (mean per step)", "timeseries", "s", [
        _t(_mean("m2live_step_measured_seconds"), "measured {{engine}}"),
        _t(_mean("m2live_step_predicted_seconds"), "predicted (m2) {{engine}}"),
        _t(_mean("m2live_step_corrected_seconds"), "corrected {{engine}}"),
    ], 12, {}),
    ("Step time — p50 / p99, predicted vs measured", "timeseries", "s", [
        _t(_q(0.99, "m2live_step_measured_seconds"), "measured p99 {{engine}}"),
        _t(_q(0.99, "m2live_step_predicted_seconds"), "predicted p99 {{engine}}"),
        _t(_q(0.5, "m2live_step_measured_seconds"), "measured p50 {{engine}}"),
        _t(_q(0.5, "m2live_step_predicted_seconds"), "predicted p50 {{engine}}"),
    ], 12, {}),
    ("Latest step — predicted vs measured", "timeseries", "s", [
        _t(f"m2live_step_last_measured_seconds{{{SEL}}}", "measured {{engine}}"),
        _t(f"m2live_step_last_predicted_seconds{{{SEL}}}", "predicted {{engine}}"),
    ], 12, {}),
    ("Steps and tokens per second", "timeseries", "short", [
        _t(f"sum by (engine) (rate(m2live_steps_total{{{SEL}}}[{RI}]))", "steps/s {{engine}}"),
        _t(f"sum by (kind) (rate(m2live_tokens_total{{{SEL}}}[{RI}]))", "{{kind}} tokens/s"),
    ], 12, {}),
    ("row", "Residuals (measured − predicted) / measured"),
    ("Residual distribution (mechanistic prediction)", "heatmap", "percentunit", [
        _t(f"sum by (le) (increase(m2live_step_residual_ratio_bucket{{{SEL}}}[{RI}]))", "{{le}}",
           format="heatmap"),
    ], 12, {"heatmap": True}),
    ("Residual quantiles over time", "timeseries", "percentunit", [
        _t(_q(0.1, "m2live_step_residual_ratio", "gpu"), "raw p10 {{gpu}}"),
        _t(_q(0.5, "m2live_step_residual_ratio", "gpu"), "raw p50 {{gpu}}"),
        _t(_q(0.9, "m2live_step_residual_ratio", "gpu"), "raw p90 {{gpu}}"),
        _t(_q(0.1, "m2live_step_corrected_residual_ratio", "gpu"), "corrected p10 {{gpu}}"),
        _t(_q(0.5, "m2live_step_corrected_residual_ratio", "gpu"), "corrected p50 {{gpu}}"),
        _t(_q(0.9, "m2live_step_corrected_residual_ratio", "gpu"), "corrected p90 {{gpu}}"),
    ], 12, {}),
    ("row", "Where the time goes: operators and efficiency factors"),
    ("Predicted time per operator (latest step, stacked)", "timeseries", "s", [
        _t(f"avg by (op) (m2live_op_predicted_seconds{{{SEL}}})", "{{op}}"),
    ], 12, {"stack": True}),
    ("f_clk — SM clock ratio used for the prediction", "timeseries", "percentunit", [
        _t(f'avg by (engine) (m2live_factor{{{SEL}, factor="f_clk"}})', "f_clk {{engine}}"),
    ], 12, {}),
    *[(f"{f} per operator", "timeseries", "percentunit", [
        _t(f'avg by (op) (m2live_factor{{{SEL}, factor="{f}"}})', "{{op}}"),
    ], 8, {}) for f in FACTORS[1:4]],
    ("eta_mem per operator", "timeseries", "percentunit", [
        _t(f'avg by (op) (m2live_factor{{{SEL}, factor="eta_mem"}})', "{{op}}"),
    ], 24, {}),
    ("row", "Clock and power"),
    ("SM clock vs boost", "timeseries", "rotmhz", [
        _t(f"m2live_sm_clock_mhz{{{SEL}}}", "SM clock {{engine}}"),
        _t(f"m2live_sm_clock_boost_mhz{{{SEL}}}", "boost {{engine}}"),
    ], 8, {}),
    ("Power vs limit", "timeseries", "watt", [
        _t(f"m2live_power_watts{{{SEL}}}", "power {{engine}}"),
        _t(f"m2live_power_limit_watts{{{SEL}}}", "limit {{engine}}"),
    ], 8, {}),
    ("Clock event (throttle) reasons", "timeseries", "short", [
        _t(f"m2live_clock_event_reasons{{{SEL}}}", "bitmask {{engine}}"),
        *[_t(f"floor(m2live_clock_event_reasons{{{SEL}}} / {bit}) % 2", f"{name} {{{{engine}}}}")
          for bit, name in CLOCK_EVENT_BITS[1:]],
    ], 8, {}),
    ("Clock source and sample age", "timeseries", "s", [
        _t(f"m2live_clock_source_info{{{SEL}}}", "source={{source}} {{engine}}"),
        _t(f"m2live_clock_age_seconds{{{SEL}}}", "sample age {{engine}}"),
    ], 12, {}),
    ("What the predictions price: calibration and weights", "timeseries", "short", [
        _t(f"m2live_calibration_info{{{SEL}}}", "calibration={{calibration}} {{engine}}"),
        _t(f"m2live_weights_info{{{SEL}}}", "weights={{precision}} {{engine}}"),
    ], 12, {}),
    ("row", "Admission (SLO-aware token budget)"),
    ("Admission — token budget", "timeseries", "short", [
        _t(f"m2live_admission_token_budget{{{SEL}}}", "token budget {{engine}}"),
    ], 8, {}),
    ("Admission — max active requests", "timeseries", "short", [
        _t(f"m2live_admission_max_active{{{SEL}}}", "max active {{engine}}"),
    ], 8, {}),
    ("SLO vs measured step time", "timeseries", "s", [
        _t(f"m2live_slo_seconds{{{SEL}}}", "SLO {{engine}}"),
        _t(_q(0.99, "m2live_step_measured_seconds"), "measured p99 {{engine}}"),
        _t(f"m2live_step_last_measured_seconds{{{SEL}}}", "latest step {{engine}}"),
    ], 8, {}),
    ("SLO violations and flagged steps per second", "timeseries", "short", [
        _t(f"sum by (engine) (rate(m2live_slo_violations_total{{{SEL}}}[{RI}]))", "violations/s {{engine}}"),
        _t(f"sum by (engine) (rate(m2live_admission_flagged_total{{{SEL}}}[{RI}]))", "flagged/s {{engine}}"),
    ], 12, {}),
    ("SLO capacity — requests in a step vs the most the SLO allows", "timeseries", "short", [
        _t(f"m2live_step_last_seqs{{{SEL}}}", "requests in the latest step {{engine}}"),
        _t(f"m2live_capacity_seqs{{{SEL}}}", "capacity within the SLO {{engine}}"),
    ], 12, {}),
    ("row", "Plugin health"),
    ("Hook overhead per step", "timeseries", "s", [
        _t(_mean("m2live_hook_overhead_seconds"), "mean {{engine}}"),
        _t(_q(0.99, "m2live_hook_overhead_seconds"), "p99 {{engine}}"),
    ], 12, {}),
    ("Errors and drops", "timeseries", "short", [
        _t(f"sum by (engine) (m2live_hook_errors_total{{{SEL}}})", "hook errors {{engine}}"),
        _t(f"sum by (engine) (m2live_mqtt_dropped_total{{{SEL}}})", "MQTT dropped {{engine}}"),
        _t(f"sum by (engine) (m2live_exporter_dropped_total{{{SEL}}})", "exporter dropped {{engine}}"),
        _t(f"sum by (engine) (m2live_records_dropped_total{{{SEL}}})", "records dropped {{engine}}"),
    ], 12, {}),
]


def _variable(name: str, label: str, query: str) -> dict:
    return {
        "type": "query", "name": name, "label": label, "datasource": DS,
        "query": {"query": query, "refId": f"{name}-variable"}, "definition": query,
        "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "sort": 1, "hide": 0,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "regex": "",
    }


def _panel(pid: int, title: str, kind: str, unit: str, targets: list[dict], width: int, opts: dict,
           x: int, y: int) -> dict:
    height = 8
    custom: dict = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                    "spanNulls": True}
    if opts.get("stack"):
        custom |= {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60}
    panel: dict = {
        "id": pid, "type": kind, "title": title, "datasource": DS,
        "gridPos": {"h": height, "w": width, "x": x, "y": y},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "range": True, "editorMode": "code", **t}
                    for i, t in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }
    if opts.get("heatmap"):
        panel["fieldConfig"] = {"defaults": {"custom": {"hideFrom": {"legend": False, "tooltip": False,
                                                                      "viz": False}}}, "overrides": []}
        panel["options"] = {"calculate": False, "cellGap": 1, "yAxis": {"axisPlacement": "left", "unit": unit},
                            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64, "exponent": 0.5,
                                      "fill": "dark-orange", "scale": "exponential", "reverse": False},
                            "rowsFrame": {"layout": "auto"}, "tooltip": {"mode": "single", "yHistogram": True},
                            "legend": {"show": True}, "exemplars": {"color": "rgba(255,0,255,0.7)"}}
        for t in panel["targets"]:
            t["range"] = True
    return panel


def build() -> dict:
    panels: list[dict] = []
    pid, x, y, row_h = 1, 0, 0, 0
    for spec in PANELS:
        if spec[0] == "row":
            if x:
                y, x = y + row_h, 0
            panels.append({"id": pid, "type": "row", "title": spec[1], "collapsed": False, "panels": [],
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
            y, pid = y + 1, pid + 1
            continue
        title, kind, unit, targets, width, opts = spec
        if x + width > 24:
            y, x = y + row_h, 0
        p = _panel(pid, title, kind, unit, targets, width, opts, x, y)
        panels.append(p)
        row_h = p["gridPos"]["h"]
        x, pid = x + width, pid + 1
    return {
        "title": "m2live — engine steps: predicted vs measured, factors, clock, admission",
        "uid": UID,
        "description": "Mechanistic per-step predictions of vLLM engine steps (m2live), live clock, residuals, "
                       "per-operator and per-factor breakdown, admission control. Generated by dashboards/build.py.",
        "tags": ["m2live", "vllm", "llm-serving"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "timepicker": {},
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard",
        }]},
        "links": [],
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
            _variable("engine", "engine", "label_values(m2live_steps_total, engine)"),
            _variable("gpu", "GPU", 'label_values(m2live_steps_total{engine=~"$engine"}, gpu)'),
            _variable("model", "model", 'label_values(m2live_steps_total{engine=~"$engine", gpu=~"$gpu"}, model)'),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="fail if --out differs from the generated dashboard")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is out of date: run python dashboards/build.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(build()['panels'])} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
