"""PrometheusExporter, asserted through the registry (get_sample_value) with records made from real
m2live predictions; plus the HTTP endpoint and the port-in-use error."""

from __future__ import annotations

import dataclasses
import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from servers import GPU, MODEL, free_port, step_records

from exporters import ExporterError
from exporters.prometheus import RESIDUAL_BUCKETS, STEP_BUCKETS, PrometheusExporter

L = {"engine": "0", "gpu": GPU, "model": MODEL}


def exporter(counters=None, **kw) -> tuple[PrometheusExporter, CollectorRegistry]:
    reg = CollectorRegistry()
    exp = PrometheusExporter(port=None, engine="0", gpu=GPU, model=MODEL, registry=reg, counters=counters, **kw)
    exp.start()
    return exp, reg


def le(v: float) -> str:
    return repr(float(v))


def bucket_of(bounds: tuple[float, ...], v: float) -> str:
    return next(le(b) for b in bounds if v <= b)


def test_every_metric_is_exported_with_the_records_values():
    recs = step_records(12)
    counts = {"hook_errors_total": 3, "mqtt_dropped_total": 7, "slo_violations_total": 5}
    exp, reg = exporter(counters=lambda: dict(counts))
    try:
        for r in recs:
            exp.submit(r)
        g = reg.get_sample_value
        last = recs[-1]
        n = len(recs)

        # histograms: count, sum, and the bucket the latest value falls into
        for name, get, bounds in (
            ("step_predicted_seconds", lambda r: r.predicted_s, STEP_BUCKETS),
            ("step_measured_seconds", lambda r: r.measured_s, STEP_BUCKETS),
            ("step_corrected_seconds", lambda r: r.corrected_s, STEP_BUCKETS),
            ("step_residual_ratio", lambda r: r.residual_ratio, RESIDUAL_BUCKETS),
            ("step_corrected_residual_ratio", lambda r: (r.measured_s - r.corrected_s) / r.measured_s,
             RESIDUAL_BUCKETS),
            ("hook_overhead_seconds", lambda r: r.hook_overhead_s, exp_bounds("hook_overhead_seconds")),
        ):
            vals = [get(r) for r in recs]
            assert g(f"m2live_{name}_count", L) == n, name
            assert g(f"m2live_{name}_sum", L) == pytest.approx(sum(vals)), name
            for b in bounds:
                assert g(f"m2live_{name}_bucket", {**L, "le": le(b)}) == sum(v <= b for v in vals), (name, b)
            assert g(f"m2live_{name}_bucket", {**L, "le": "+Inf"}) == n
        # the residual is (measured - predicted) / measured: positive when the engine was slower than predicted
        assert any(r.residual_ratio > 0 for r in recs) and any(r.residual_ratio < 0 for r in recs)

        assert g("m2live_steps_total", L) == n
        assert g("m2live_tokens_total", {**L, "kind": "prefill"}) == sum(r.num_prefill_tokens for r in recs)
        assert g("m2live_tokens_total", {**L, "kind": "decode"}) == sum(r.num_decode_tokens for r in recs)
        assert g("m2live_admission_flagged_total", L) == sum(bool(r.admission_flagged) for r in recs)

        # per-operator predicted time of the latest step: every op of the real prediction
        assert set(last.ops) >= {"qkv", "o", "gate_up", "down", "attn_decode", "lm_head", "sampling"}
        for op, t in last.ops.items():
            assert g("m2live_op_predicted_seconds", {**L, "op": op}) == pytest.approx(t), op
        # per-factor values: every (factor, op) the predictor reported; f_clk under op="step"
        pairs = [(f, op) for f, per_op in last.factors.items() for op in per_op]
        assert {"f_clk", "eta_wave", "eta_active", "eta_duty", "eta_mem"} <= {f for f, _ in pairs}
        for f, op in pairs:
            assert g("m2live_factor", {**L, "factor": f, "op": op}) == pytest.approx(last.factors[f][op]), (f, op)
        assert g("m2live_factor", {**L, "factor": "f_clk", "op": "step"}) == pytest.approx(last.f_clk)

        # clock, power, throttle reasons, admission: the latest step's values
        for name, v in (("sm_clock_mhz", last.clock_mhz), ("sm_clock_boost_mhz", last.boost_mhz),
                        ("power_watts", last.power_w), ("power_limit_watts", last.power_limit_w),
                        ("clock_event_reasons", last.clock_event_reasons),
                        ("temperature_celsius", last.temperature_c), ("clock_age_seconds", last.clock_age_s),
                        ("admission_token_budget", last.token_budget),
                        ("admission_max_active", last.max_active), ("slo_seconds", last.slo_s),
                        ("step_last_predicted_seconds", last.predicted_s),
                        ("step_last_measured_seconds", last.measured_s), ("capacity_seqs", last.capacity_seqs),
                        ("step_last_seqs", last.num_decode_seqs + last.num_prefill_seqs)):
            assert g(f"m2live_{name}", L) == pytest.approx(v), name
        assert g("m2live_sm_clock_boost_mhz", L) == 1980.0  # H100 SXM boost clock (datasheet)
        assert g("m2live_clock_source_info", {**L, "source": "nvml"}) == 1.0

        # counters read at scrape time from the callable
        for k, v in counts.items():
            assert g(f"m2live_{k}", L) == v, k
        counts["hook_errors_total"] = 4
        counts["mqtt_dropped_total"] = 100
        assert g("m2live_hook_errors_total", L) == 4
        assert g("m2live_mqtt_dropped_total", L) == 100
        assert g("m2live_exporter_dropped_total", L) == 0
        assert g("m2live_exporter_errors_total", L) == 0
    finally:
        exp.close()


def exp_bounds(name: str) -> tuple[float, ...]:
    from exporters.prometheus import _HISTOGRAMS

    return _HISTOGRAMS[name][1]


def test_bucket_layout_spans_half_a_millisecond_to_five_seconds_and_minus_one_to_one():
    assert STEP_BUCKETS[0] == 0.0005 and STEP_BUCKETS[-1] == 5.0
    assert RESIDUAL_BUCKETS[0] == -1.0 and RESIDUAL_BUCKETS[-1] == 1.0 and 0.0 in RESIDUAL_BUCKETS
    assert list(STEP_BUCKETS) == sorted(STEP_BUCKETS) and list(RESIDUAL_BUCKETS) == sorted(RESIDUAL_BUCKETS)
    # adjacent step buckets at most 2x apart, so a quantile is resolved to better than a factor 2
    assert all(b / a <= 2.0 for a, b in zip(STEP_BUCKETS, STEP_BUCKETS[1:], strict=False))
    exp, reg = exporter()
    try:
        r = step_records(1)[0]
        exp.submit(dataclasses.replace(r, measured_s=0.0004, predicted_s=0.0004))  # below the first bucket
        exp.submit(dataclasses.replace(r, measured_s=7.0, predicted_s=7.0))  # above the last
        g = reg.get_sample_value
        assert g("m2live_step_measured_seconds_bucket", {**L, "le": "0.0005"}) == 1
        assert g("m2live_step_measured_seconds_bucket", {**L, "le": "5.0"}) == 1
        assert g("m2live_step_measured_seconds_bucket", {**L, "le": "+Inf"}) == 2
        assert g("m2live_step_residual_ratio_bucket", {**L, "le": "0.0"}) == 2  # exact predictions
        assert g("m2live_step_residual_ratio_bucket", {**L, "le": "-0.025"}) == 0
    finally:
        exp.close()


def test_slo_violations_come_from_the_records_without_a_counters_callable():
    exp, reg = exporter()
    try:
        recs = step_records(15, slo_s=0.01)
        for r in recs:
            exp.submit(r)
        want = sum(r.measured_s > 0.01 for r in recs)
        assert 0 < want < len(recs)
        assert reg.get_sample_value("m2live_slo_violations_total", L) == want
        assert reg.get_sample_value("m2live_hook_errors_total", L) == 0
        assert reg.get_sample_value("m2live_mqtt_dropped_total", L) == 0
    finally:
        exp.close()


def test_unknown_values_remove_their_series():
    exp, reg = exporter()
    try:
        r = step_records(1)[0]
        exp.submit(r)
        assert reg.get_sample_value("m2live_power_watts", L) == r.power_w
        assert reg.get_sample_value("m2live_slo_seconds", L) == r.slo_s
        # a CPU device has no power reading; admission switched off has no SLO
        exp.submit(dataclasses.replace(r, power_w=None, power_limit_w=None, clock_event_reasons=None,
                                       slo_s=None, token_budget=None, max_active=None))
        for name in ("power_watts", "power_limit_watts", "clock_event_reasons", "slo_seconds",
                     "admission_token_budget", "admission_max_active"):
            assert reg.get_sample_value(f"m2live_{name}", L) is None, name
        assert reg.get_sample_value("m2live_sm_clock_mhz", L) == r.clock_mhz
    finally:
        exp.close()


def test_clock_source_info_follows_set_clock_source():
    exp, reg = exporter()
    try:
        exp.submit(step_records(1)[0])
        assert reg.get_sample_value("m2live_clock_source_info", {**L, "source": "nvml"}) == 1
        exp.set_clock_source("forecast")  # NVML failed: the plugin fell back to the forecast clock
        assert reg.get_sample_value("m2live_clock_source_info", {**L, "source": "forecast"}) == 1
        assert reg.get_sample_value("m2live_clock_source_info", {**L, "source": "nvml"}) is None
    finally:
        exp.close()


def test_weights_info_says_what_the_predictions_price():
    exp, reg = exporter()
    try:
        assert reg.get_sample_value("m2live_weights_info", {**L, "precision": "bf16"}) is None  # not told yet
        exp.set_weights("fp8 (static input scales)")
        assert reg.get_sample_value("m2live_weights_info", {**L, "precision": "fp8 (static input scales)"}) == 1
        exp.set_weights("bf16")
        assert reg.get_sample_value("m2live_weights_info", {**L, "precision": "bf16"}) == 1
        assert reg.get_sample_value("m2live_weights_info", {**L, "precision": "fp8 (static input scales)"}) is None
    finally:
        exp.close()


def test_build_info_names_m2live_and_the_vllm_it_runs_in():
    import m2live

    exp, reg = exporter()
    try:
        assert reg.get_sample_value("m2live_build_info", {**L, "version": m2live.__version__,
                                                          "vllm_version": "unknown"}) == 1  # not told yet
        exp.set_vllm_version("0.32.0")
        assert reg.get_sample_value("m2live_build_info", {**L, "version": m2live.__version__,
                                                          "vllm_version": "0.32.0"}) == 1
        assert reg.get_sample_value("m2live_build_info", {**L, "version": m2live.__version__,
                                                          "vllm_version": "unknown"}) is None
    finally:
        exp.close()


def test_engines_get_their_own_series():
    exp, reg = exporter()
    try:
        for r in step_records(4, engine="0") + step_records(6, engine="1"):
            exp.submit(r)
        assert reg.get_sample_value("m2live_steps_total", L) == 4
        assert reg.get_sample_value("m2live_steps_total", {**L, "engine": "1"}) == 6
    finally:
        exp.close()


def test_submit_is_bounded_drops_oldest_and_counts():
    reg = CollectorRegistry()
    exp = PrometheusExporter(port=None, registry=reg, queue_size=10, engine="0", gpu=GPU, model=MODEL)
    recs = step_records(25)
    for r in recs:  # not started: nothing drains the queue
        exp.submit(r)
    assert exp.dropped == 15
    exp.start()
    try:
        assert reg.get_sample_value("m2live_steps_total", L) == 10
        assert reg.get_sample_value("m2live_exporter_dropped_total", L) == 15
        # the oldest were dropped: the newest 10 remain
        assert reg.get_sample_value("m2live_step_predicted_seconds_sum", L) == pytest.approx(
            sum(r.predicted_s for r in recs[15:]))
    finally:
        exp.close()


def test_a_malformed_record_is_counted_not_raised():
    exp, reg = exporter()
    try:
        good = step_records(2)
        exp.submit(good[0])
        exp.submit(dataclasses.replace(good[1], ops={"qkv": "not a number"}))
        exp.submit(good[1])
        assert reg.get_sample_value("m2live_exporter_errors_total", L) == 1
        assert reg.get_sample_value("m2live_op_predicted_seconds", {**L, "op": "qkv"}) == good[1].ops["qkv"]
    finally:
        exp.close()


def test_counters_callable_failure_does_not_break_the_scrape():
    def broken() -> dict:
        raise RuntimeError("boom")

    exp, reg = exporter(counters=broken)
    try:
        exp.submit(step_records(1)[0])
        assert reg.get_sample_value("m2live_steps_total", L) == 1
        assert reg.get_sample_value("m2live_hook_errors_total", L) == 0
        assert reg.get_sample_value("m2live_exporter_errors_total", L) >= 1
    finally:
        exp.close()


def test_http_endpoint_serves_the_metrics_and_releases_the_port():
    port = free_port()
    exp = PrometheusExporter("127.0.0.1", port, engine="0", gpu=GPU, model=MODEL)
    exp.start()
    try:
        for r in step_records(3):
            exp.submit(r)
        with urllib.request.urlopen(exp.url, timeout=5) as resp:
            text = resp.read().decode()
        assert f'm2live_steps_total{{engine="0",gpu="{GPU}",model="{MODEL}"}} 3.0' in text
        assert "m2live_step_residual_ratio_bucket" in text and "m2live_factor{" in text
    finally:
        exp.close()
    again = PrometheusExporter("127.0.0.1", port).start()  # closed cleanly: the port can be reused
    again.close()


def test_port_in_use_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        exp = PrometheusExporter("127.0.0.1", port)
        with pytest.raises(ExporterError, match=rf"^port {port} on 127.0.0.1 is already in use"):
            exp.start()
        exp.close()


def test_bad_port_is_rejected_at_construction():
    with pytest.raises(ExporterError, match="0..65535"):
        PrometheusExporter(port=70000)


def _monitor(port: int, engine_index: int = 0):
    from m2live.config import M2liveConfig
    from m2live.live import EngineInfo
    from m2live.shapes import get_model
    from vllm_hooks.sinks import start_monitor

    cfg = M2liveConfig.from_dict({"enable": True, "gpu": GPU, "prom_port": port})
    info = EngineInfo(model_shape=get_model(MODEL), model_name=MODEL, engine_index=engine_index, device="cpu")
    return start_monitor(cfg, info, step_of=lambda scheduler, output: None)


def test_port_in_use_leaves_the_engine_running_without_the_exporter(capfd):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        mon = _monitor(port)
        try:
            assert mon.prometheus is None and mon.exporter_errors == 1
            assert f"port {port} on 127.0.0.1 is already in use" in capfd.readouterr().err
        finally:
            mon.close()


def test_data_parallel_engines_serve_on_consecutive_ports():
    base = free_port()
    while True:  # the next port must be free too
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
                break
            except OSError:
                base = free_port()
    mons = [_monitor(base, 0), _monitor(base, 1)]
    try:
        for i, mon in enumerate(mons):
            assert mon.prometheus is not None and mon.prometheus.port == base + i
            with urllib.request.urlopen(mon.prometheus.url, timeout=5) as resp:
                assert f'm2live_clock_source_info{{engine="{i}"' in resp.read().decode()
    finally:
        for mon in mons:
            mon.close()
