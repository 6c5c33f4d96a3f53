"""Clock sources and the sampler thread (replay/fixed sources and a fake sysfs tree; no monkeypatching)."""

from __future__ import annotations

import json
import time

import pytest

from m2live.telemetry import (
    ClockReading,
    ClockSampler,
    CpufreqClockSource,
    FixedClockSource,
    NvmlClockSource,
    ReplayClockSource,
    TelemetryError,
    open_best_source,
)


def _readings():
    return [ClockReading(t=0.0, sm_mhz=m, max_mhz=1980.0, power_w=600.0, power_limit_w=700.0,
                         event_reasons=4, temperature_c=60.0) for m in (1980.0, 1500.0, 1380.0)]


def test_replay_cycles_and_stamps_time():
    src = ReplayClockSource(_readings(), loop=True)
    got = [src.read() for _ in range(4)]
    assert [r.sm_mhz for r in got] == [1980.0, 1500.0, 1380.0, 1980.0]
    assert all(r.t > 0 for r in got) and got[0].power_limit_w == 700.0 and got[1].event_reasons == 4
    assert abs(got[2].ratio - 1380 / 1980) < 1e-12


def test_replay_no_loop_repeats_last(tmp_path):
    p = tmp_path / "clock.jsonl"
    p.write_text("\n".join(json.dumps(r.to_dict()) for r in _readings()) + "\n")
    src = ReplayClockSource(str(p), loop=False)
    assert [src.read().sm_mhz for _ in range(5)] == [1980.0, 1500.0, 1380.0, 1380.0, 1380.0]


def test_replay_bad_input(tmp_path):
    with pytest.raises(TelemetryError):
        ReplayClockSource([])
    p = tmp_path / "bad.jsonl"
    p.write_text('{"sm_mhz": "x"}\n')
    with pytest.raises(TelemetryError):
        ReplayClockSource(str(p))
    with pytest.raises(TelemetryError):
        ReplayClockSource(str(tmp_path / "missing.jsonl"))


def test_fixed_source():
    r = FixedClockSource(1200, 2400).read()
    assert r.sm_mhz == 1200 and r.ratio == 0.5
    with pytest.raises(TelemetryError):
        FixedClockSource(0, 1)


def test_cpufreq_from_fake_sysfs(tmp_path):
    for i, (cur, mx) in enumerate([(2000000, 3000000), (1000000, 3000000)]):
        d = tmp_path / "devices" / "system" / "cpu" / f"cpu{i}" / "cpufreq"
        d.mkdir(parents=True)
        (d / "scaling_cur_freq").write_text(f"{cur}\n")
        (d / "cpuinfo_max_freq").write_text(f"{mx}\n")
    r = CpufreqClockSource(str(tmp_path)).read()
    assert r.sm_mhz == 1500.0 and r.max_mhz == 3000.0
    with pytest.raises(TelemetryError):
        CpufreqClockSource(str(tmp_path / "nothing"))


class _Flaky:
    name = "flaky"

    def __init__(self):
        self.n = 0

    def read(self) -> ClockReading:
        self.n += 1
        if self.n % 2 == 0:
            raise OSError("device went away")
        return ClockReading(t=time.monotonic(), sm_mhz=1000.0 + self.n, max_mhz=2000.0)

    def close(self) -> None:
        pass


def test_sampler_caches_counts_errors_and_keeps_history():
    s = ClockSampler(_Flaky(), period_s=0.005, history=1000).start()
    try:
        t0 = time.monotonic()
        time.sleep(0.15)
        r, age = s.latest()
        assert r is not None and r.sm_mhz > 1000 and 0 <= age < 0.5
        assert s.errors >= 3 and s.reads >= 3
        hist = s.between(t0 - 1, time.monotonic())
        assert len(hist) >= 3 and all(h.sm_mhz % 2 == 1 for h in hist)  # odd reads succeeded
    finally:
        s.stop()
    assert not s.running


def test_sampler_latest_is_cheap_and_never_blocks():
    s = ClockSampler(ReplayClockSource(_readings()), period_s=0.01).start()
    try:
        t0 = time.perf_counter()
        for _ in range(10000):
            s.latest()
        assert (time.perf_counter() - t0) / 10000 < 20e-6
    finally:
        s.stop()
    with pytest.raises(ValueError):
        ClockSampler(FixedClockSource(1, 1), period_s=0)


def test_nvml_absent_falls_back():
    # this CI machine has no NVIDIA driver: NVML must fail cleanly and the best source must say so
    try:
        NvmlClockSource(0).close()
        pytest.skip("an NVIDIA GPU is present")
    except TelemetryError:
        pass
    src, why = open_best_source()
    assert src.name in ("cpufreq", "fixed") and "nvml unavailable" in why
    r = src.read()
    assert r.sm_mhz > 0 and r.max_mhz > 0


# --- the monitor's hot path reads the sampler (replayed clock); no vLLM needed ----------------------------
class _Out:
    """What the monitor keys a step by: any object; here it carries the Step the converter returns."""

    def __init__(self, step):
        self.step = step
        self.total_num_scheduled_tokens = step.num_tokens


def _monitor(tmp_path, **env):
    from conftest import MODELS

    from m2live.config import M2liveConfig
    from m2live.live import EngineInfo
    from m2live.shapes import get_model
    from vllm_hooks.sinks import start_monitor

    cfg = M2liveConfig.from_env({"M2LIVE_PROM": "0", "M2LIVE_GPU": "NVIDIA H100 80GB HBM3",
                                 "M2LIVE_TRACE": str(tmp_path / "t.jsonl"), "M2LIVE_SAMPLE_MS": "5", **env})
    src = ReplayClockSource([ClockReading(0.0, 1500.0, 1980.0, 650.0, 700.0, 4, 70.0)])
    return start_monitor(cfg, EngineInfo(get_model(MODELS / "bench-llama"), "bench"),
                         step_of=lambda sched, out: out.step, clock_source=src, start_exporters=False)


def test_monitor_predicts_with_live_clock_and_pairs_async_steps(tmp_path):
    from m2live import Step
    from m2live.trace import read_trace

    mon = _monitor(tmp_path)
    try:
        outs = [_Out(Step.build([64], [100 + i for i in range(k)])) for k in range(1, 7)]
        # async order: schedule(N+1) happens before update(N)
        mon.before_schedule(None, (512, 32))
        mon.on_schedule(None, outs[0])
        for i in range(1, len(outs)):
            mon.before_schedule(None, (512, 32))
            mon.on_schedule(None, outs[i])
            time.sleep(0.01)
            mon.on_update(outs[i - 1])
        time.sleep(0.01)
        mon.on_update(outs[-1])
        mon.on_update(_Out(Step.build([], [5])))  # an output never scheduled by us: ignored
    finally:
        mon.close()
    recs = read_trace(tmp_path / "t.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    for r in recs:
        assert r["clock_source"] == "replay" and r["clock_mhz"] == 1500.0 and r["power_w"] == 650.0
        assert r["f_clk"] == 1500.0 / 1980.0 and r["clock_event_reasons"] == 4
        assert 0.005 < r["measured_s"] < 0.5  # the interval between consecutive updates, ~10 ms
    assert recs[2]["num_decode_tokens"] == 3 and recs[2]["decode_kv_tokens"] == 100 + 101 + 102
    assert mon.hook_errors == 0 and mon.steps == 6


def test_records_carry_the_slo_capacity_where_an_slo_is_in_force(tmp_path):
    """With an SLO, every record from the first decode on says how many requests could decode together within it
    (the admission controller's rule at the step's decode context and clock, at most max_num_seqs); without one,
    nothing. An SLO changed over MQTT is re-priced at once."""
    from m2live import Step
    from m2live.trace import read_trace

    for slo, want in (("3", "some"), (None, None)):
        d = tmp_path / f"slo{slo}"
        d.mkdir()
        mon = _monitor(d, **({"M2LIVE_SLO_MS": slo} if slo else {}))
        try:
            steps = [Step.build([64], [])] + [Step.build([], [300 + i] * 8) for i in range(6)]
            for i, st in enumerate(steps):
                if i == 4 and slo:
                    mon.on_control({"slo_ms": 2000})  # loose enough for max_num_seqs
                mon.before_schedule(None, (4096, 512))
                o = _Out(st)
                mon.on_schedule(None, o)
                time.sleep(0.005)
                mon.on_update(o)
                assert mon.flush()
        finally:
            mon.close()
        caps = [r["capacity_seqs"] for r in read_trace(d / "t.jsonl")]
        if want is None:
            assert caps == [None] * 7
        else:
            assert caps[0] is None  # no decode context yet
            assert all(isinstance(c, int) and 0 <= c < 512 for c in caps[1:4]), caps  # a 3 ms SLO binds
            assert caps[4:] == [512] * 3, caps  # the looser SLO, priced at once: max_num_seqs


def test_a_failing_capacity_leaves_the_record_and_is_counted(tmp_path):
    from m2live import Step
    from m2live.trace import read_trace

    mon = _monitor(tmp_path, M2LIVE_SLO_MS="40")
    try:
        def broken(*a, **k):
            raise RuntimeError("capacity broke")

        mon.control.admission.capacity = broken
        for k in range(3):
            mon.before_schedule(None, (4096, 512))
            o = _Out(Step.build([], [300 + k] * 4))
            mon.on_schedule(None, o)
            mon.on_update(o)
            assert mon.flush()
    finally:
        mon.close()
    recs = read_trace(tmp_path / "t.jsonl")
    assert len(recs) == 3 and all(r["capacity_seqs"] is None for r in recs)  # every step recorded all the same
    assert mon.hook_errors == 1  # counted once: retried a second later, not on every step


def test_monitor_contains_errors_and_takes_control(tmp_path):
    from m2live import Step

    mon = _monitor(tmp_path, M2LIVE_FAULT="predict:2")

    class BadSink:
        def submit(self, record):
            raise RuntimeError("sink down")

    mon.add_sink(BadSink())
    try:
        for k in range(1, 5):
            o = _Out(Step.build([], [50] * k))
            mon.before_schedule(None, (512, 32))
            mon.on_schedule(None, o)
            mon.on_update(o)
        assert mon.flush()  # records are built on the record thread
        c = mon.counters()
        assert c["hook_errors_total"] == 2 + 2  # two injected predictor faults, two failing sink submits
        assert c["exporter_errors_total"] == 2 and mon.steps == 2
        assert not mon.admission_active
        mon.on_control({"slo_ms": 40})
        assert mon.admission_active and mon.admission.slo_s == 0.04
        mon.on_control({"admission": False})
        assert not mon.admission_active
        mon.on_control({"slo_ms": -1})  # invalid: counted, not raised
        assert mon.counters()["hook_errors_total"] == 5
    finally:
        mon.close()


def test_record_thread_keeps_the_engine_hooks_short_and_counts_drops(tmp_path):
    """The engine's thread only queues a measured step; a stalled record thread never blocks it: the bounded queue
    displaces its oldest step (counted), and flush()/close() drain what is left."""
    import threading

    from m2live import Step

    mon = _monitor(tmp_path, M2LIVE_QUEUE_SIZE="64")  # the record queue holds at least 64 steps
    gate = threading.Event()
    seen: list[int] = []
    mon.observers.append(lambda rec, step, ids: (gate.wait(10), seen.append(rec.step)))
    try:
        t0 = time.perf_counter()
        for _ in range(200):
            o = _Out(Step.build([], [100, 200]))
            mon.before_schedule(None, (512, 32))
            mon.on_schedule(None, o)
            mon.on_update(o)
        hooks_s = time.perf_counter() - t0
        assert not mon.flush(timeout=0.2)  # the record thread is stuck in the observer
        assert mon.counters()["records_dropped_total"] >= 200 - 64 - 1
        gate.set()
        assert mon.flush(timeout=10)
        assert mon.steps == len(seen) == 200 - mon.records_dropped
        assert seen == sorted(seen) and seen[-1] == 200  # oldest displaced, newest kept, in order
        assert hooks_s < 1.0  # 200 steps through the hooks while nothing was being recorded
    finally:
        gate.set()
        mon.close()


def test_nvml_power_is_the_instantaneous_field_where_the_driver_has_it():
    """nvmlDeviceGetPowerUsage is a one-second average on Ampere and newer; the instantaneous field
    (NVML_FI_DEV_POWER_INSTANT, read into NVML's own field-value struct) is used where it answers, the average
    where it does not (an older driver: asked once, then no more)."""
    import types

    import pynvml

    class Driver(types.SimpleNamespace):
        def nvmlDeviceGetFieldValues(self, handle, ids):
            self.asked += 1
            v = pynvml.c_nvmlFieldValue_t()
            v.fieldId, v.valueType = ids[0], pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            v.nvmlReturn = pynvml.NVML_SUCCESS if self.instant_mw else pynvml.NVML_ERROR_NOT_SUPPORTED
            v.value.uiVal = self.instant_mw or 0
            return [v]

        def nvmlDeviceGetPowerUsage(self, handle):
            return 512_000  # the 1 s average, mW

    consts = {k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith("NVML_")}
    for instant, want in ((689_500, 689_500.0), (0, 512_000)):
        src = NvmlClockSource.__new__(NvmlClockSource)
        src._nv, src._h, src._instant = Driver(**consts, asked=0, instant_mw=instant), 0, None
        assert src._power_mw() == want and src._power_mw() == want
        assert src._nv.asked == (2 if instant else 1)
