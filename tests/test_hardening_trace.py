"""Trace writes on a full disk (/dev/full and a real, tiny tmpfs), torn lines, and a report that skips what it
cannot read — issue 16, item 2."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import step_records, wait_until
from test_hardening_cli import logs, monitor

from m2live.cli import main
from m2live.trace import TraceWriter, load_trace, read_trace


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB tmpfs (needs root / CAP_SYS_ADMIN; skipped where mounting is not permitted)."""
    d = tmp_path / f"tiny-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)  # lazy: an open fd never blocks it


def _lines_are_whole(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), "the trace ends in a partial line"
    return [json.loads(line) for line in data.splitlines()]


def test_a_write_error_is_logged_once_counted_and_drops_are_counted(tmp_path):
    recs = step_records(30)
    with logs() as h:
        w = TraceWriter("/dev/full", queue_size=100, flush_s=0.01)
        for i, r in enumerate(recs):
            w.submit(r)
            if i % 10 == 9:
                wait_until(lambda: not len(w._q), 5, "the writer to take the batch")
        w.close()
    assert w.written == 0 and w.errors >= 2 and w.lost == 30 and w.dropped == 30
    warned = [m for m in h.at(logging.WARNING) if "/dev/full" in m]
    assert len(warned) == 1 and "No space left on device" in warned[0]


def test_the_monitor_exports_trace_errors_and_drops(tmp_path):
    from test_telemetry import _Out

    from m2live import Step

    mon = monitor(tmp_path, M2LIVE_TRACE="/dev/full")
    try:
        for k in range(1, 6):
            o = _Out(Step.build([], [50] * k))
            mon.before_schedule(None, (512, 32))
            mon.on_schedule(None, o)
            mon.on_update(o)
        assert mon.flush()
        mon.trace.close()  # drains the trace queue: every record is written or counted
        c = mon.counters()
        assert c["trace_dropped_total"] == 5 and c["trace_errors_total"] >= 1
        assert c["exporter_errors_total"] == 0  # counted once, as the trace's (an alert per kind of error)
    finally:
        mon.close()


def test_a_full_filesystem_leaves_whole_lines_and_writing_resumes(tiny_fs):
    path = tiny_fs / "trace.jsonl"
    filler = tiny_fs / "filler"
    filler.write_bytes(b"\0" * (64 * 1024 - 12 * 1024))  # leave ~12 KiB: a few records fit, then ENOSPC
    recs = step_records(60)
    with logs() as h:
        w = TraceWriter(path, queue_size=1000, flush_s=0.01)
        for r in recs[:40]:
            w.submit(r)
            wait_until(lambda: not len(w._q), 5, "the writer to take each record")
        written_full, errors_full = w.written, w.errors
        got = _lines_are_whole(path)  # a failed batch was cut back out: no partial line
        assert len(got) == written_full and 0 < written_full < 40 and errors_full >= 1
        assert w.dropped == 40 - written_full
        filler.unlink()
        for r in recs[40:]:
            w.submit(r)
        w.close()
    got = _lines_are_whole(path)
    assert [g["step"] for g in got] == [r.step for r in recs[:written_full]] + [r.step for r in recs[40:]]
    assert w.written + w.dropped == 60
    warned = h.at(logging.WARNING)
    assert sum("cannot write" in m for m in warned) == 1 and sum("writing again" in m for m in warned) == 1


def test_a_torn_tail_is_cut_back_on_open_so_a_restart_appends_whole_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    recs = step_records(5)
    good = "".join(r.to_json() + "\n" for r in recs[:3])
    path.write_text(good + recs[3].to_json()[:57])  # a crash (or a full disk) tore the last line
    with logs() as h:
        w = TraceWriter(path)
        w.submit(recs[4])
        w.close()
    assert w.repaired_bytes == 57 and any("torn" in m for m in h.at(logging.WARNING))
    contents = load_trace(path)
    assert [r["step"] for r in contents.records] == [recs[i].step for i in (0, 1, 2, 4)]
    assert contents.skipped == []
    # a torn file with no newline at all is cut to empty
    path.write_text('{"step": 1, "num_pre')
    TraceWriter(path).close()
    assert path.read_bytes() == b""


def test_report_skips_torn_and_garbled_lines_and_says_how_many(tmp_path, capsys):
    from test_trace_report import _records

    recs = [r.to_json() for r in _records(60)]
    bad_ops = json.loads(recs[10])
    bad_ops["ops"] = "fast"
    lines = recs[:10] + [json.dumps(bad_ops), "\x00\x00garbage", *recs[10:], recs[0][:40]]
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(("\n".join(lines)).encode() + b"\xff\xfe")
    contents = load_trace(trace)
    assert len(contents.records) == 60 and [n for n, _ in contents.skipped] == [11, 12, 63]
    assert "ops must be" in contents.skipped[0][1]
    assert len(read_trace(trace)) == 60
    assert main(["report", str(trace), "-o", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "3 torn or garbled line(s) skipped (first: line 11: ops must be" in out
    assert os.path.getsize(tmp_path / "r.png") > 10_000


def test_the_planner_reads_a_torn_trace_and_counts_what_it_skipped(tmp_path):
    from m2live.workload import from_trace

    trace = tmp_path / "t.jsonl"
    recs = [r.to_json() for r in step_records(30)]
    trace.write_text("\n".join(recs) + "\n" + recs[0][:33])  # the engine died mid-line
    wl = from_trace(trace)
    assert wl.trace_info["steps"] == 30 and wl.trace_info["skipped_lines"] == 1
