"""Trace writer (bounded, non-blocking, every record written) and `m2live report` (PNG; bad input → exit 2)."""

from __future__ import annotations

import json
import random
import time

import pytest

from m2live import Predictor, Step
from m2live.cli import main
from m2live.record import StepRecord
from m2live.residuals import ResidualTracker
from m2live.trace import REQUIRED, TraceError, TraceWriter, read_trace


def _records(n: int = 120) -> list[StepRecord]:
    from conftest import MODELS

    p = Predictor.for_gpu("h100-sxm", MODELS / "bench-llama")
    tr = ResidualTracker()
    rng = random.Random(0)
    out = []
    for i in range(n):
        s = Step.build([rng.choice([64, 256])] if rng.random() < 0.3 else [], [rng.randint(50, 900)
                                                                             for _ in range(rng.randint(1, 12))])
        pr = p.predict(s, clock_mhz=rng.choice([1980.0, 1700.0, 1500.0]))
        meas = 2e-3 + 1.5 * pr.total_s * (1 + rng.gauss(0, 0.05))
        cor = tr.correct(pr, s)
        tr.update(s, pr, meas)
        c = s.counts()
        out.append(StepRecord(
            step=i + 1, time=time.time(), engine="0", gpu=pr.gpu, model=pr.model,
            num_prefill_tokens=c["prefill_tokens"], num_decode_tokens=c["decode_reqs"],
            num_prefill_seqs=len(s.prefill_seqs), num_decode_seqs=c["decode_reqs"],
            prefill_kv_tokens=c["prefill_kv_tokens"], decode_kv_tokens=c["decode_kv_tokens"],
            predicted_s=pr.total_s, corrected_s=cor, measured_s=meas, f_clk=pr.f_clk, clock_mhz=pr.clock_mhz,
            boost_mhz=1980.0, clock_source="replay", ops=pr.ops, factors=pr.factors, bound=pr.bound))
    return out


def test_trace_writer_writes_every_record(tmp_path):
    path = tmp_path / "sub" / "t.jsonl"
    w = TraceWriter(path, queue_size=10_000)
    recs = _records(200)
    t0 = time.perf_counter()
    for r in recs:
        w.submit(r)
    assert (time.perf_counter() - t0) / len(recs) < 1e-3  # submit never waits on the disk
    w.close()
    got = read_trace(path)
    assert [g["step"] for g in got] == list(range(1, 201)) and w.dropped == 0
    for k in REQUIRED:
        assert k in got[0]
    assert got[5]["ops"] == pytest.approx(recs[5].ops)
    w.submit(recs[0])  # after close: dropped, counted, no exception
    assert w.dropped == 1


def test_trace_writer_bounded_drops_oldest(tmp_path):
    w = TraceWriter(tmp_path / "t.jsonl", queue_size=5, flush_s=10.0)
    with w._q._cv:  # hold the writer's thread off (the lock is re-entrant for submit) while we overfill
        for r in _records(20):
            w.submit(r)
    w.close()
    got = read_trace(tmp_path / "t.jsonl")
    assert w.dropped == 15 and [g["step"] for g in got] == list(range(16, 21))


def test_report_png(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(r.to_json() + "\n" for r in _records()))
    out = tmp_path / "report.png"
    assert main(["report", str(trace), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000
    msg = capsys.readouterr().out
    assert "median |error| after warm-up" in msg and "corrected" in msg


@pytest.mark.parametrize("content,needle", [
    (None, "no trace file"),
    ("", "no step records"),
    ("not json\n", "not a JSON line"),
    ('{"step": 1}\n', "record lacks"),
    ('[1, 2]\n', "JSON object"),
])
def test_report_bad_trace_exit_2(tmp_path, capsys, content, needle):
    trace = tmp_path / "t.jsonl"
    if content is not None:
        trace.write_text(content)
    assert main(["report", str(trace), "-o", str(tmp_path / "r.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_report_bad_values(tmp_path, capsys):
    rec = _records(3)[0].to_dict()
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({**rec, "predicted_s": "fast"}) + "\n")
    assert main(["report", str(trace), "-o", str(tmp_path / "r.png")]) == 2
    trace.write_text(json.dumps({**rec, "measured_s": None}) + "\n")
    assert main(["report", str(trace), "-o", str(tmp_path / "r.png")]) == 2
    assert "no step in the trace has a measurement" in capsys.readouterr().err
    trace.write_text(json.dumps(rec) + "\n")
    assert main(["report", str(trace), "-o", str(tmp_path / "r.txt")]) == 2
    with pytest.raises(TraceError):
        read_trace(tmp_path / "missing.jsonl")
