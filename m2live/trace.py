"""JSONL step traces: one ``StepRecord.to_dict()`` per line.

``TraceWriter`` is a sink: ``submit`` puts the record on a bounded queue (dropping the oldest and counting when
full) and a daemon thread writes and flushes, so the engine step never waits on the disk. It writes whole lines
only: a batch that cannot be written completely (disk full, I/O error) is cut back out of the file, its records
are counted as dropped and the batch as an error (the first error of a run of them is logged, with the reason,
and so is the recovery). Opening a trace whose last line was torn by a crash or a full disk cuts that tail back
to the last newline, so a restarted engine appends after whole lines.

``read_trace`` loads a trace for ``m2live report``: it checks each record has the contract's fields with the
right types, and skips (and counts) torn or garbled lines instead of refusing the whole file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .limits import STEP_TOKENS
from .record import StepRecord
from .workqueue import DropOldestQueue

log = logging.getLogger("m2live")

REQUIRED = ("step", "num_prefill_tokens", "num_decode_tokens", "predicted_s", "corrected_s", "measured_s",
            "f_clk", "ops", "factors")


class TraceError(ValueError):
    """A trace file that cannot be read as m2live step records (one clear line)."""


class TraceWriter:
    def __init__(self, path: str | Path, queue_size: int = 4096, flush_s: float = 0.2):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._regular = stat.S_ISREG(os.fstat(self._fd).st_mode)
        self.repaired_bytes = self._cut_torn_tail()
        self._q: DropOldestQueue[StepRecord] = DropOldestQueue(queue_size)
        self._flush_s = flush_s
        self.written = 0
        self.errors = 0  # batches that could not be written (each also drops its records)
        self.lost = 0  # records lost in failed writes (counted in ``dropped`` as well)
        self._failing = 0  # failed batches since the last successful write (0: healthy)
        self._thread = threading.Thread(target=self._run, name="m2live-trace", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Records that never reached the file: displaced from the full queue, submitted after close, or lost in
        a failed write."""
        return self._q.dropped + self.lost

    def _cut_torn_tail(self) -> int:
        """Truncate a partial last line (no trailing newline) back to the last newline; returns bytes cut."""
        if not self._regular:
            return 0
        size = os.fstat(self._fd).st_size
        if size == 0:
            return 0
        with open(self.path, "rb") as f:
            pos = size
            while pos > 0:
                start = max(0, pos - 65536)
                f.seek(start)
                chunk = f.read(pos - start)
                if pos == size and chunk.endswith(b"\n"):
                    return 0  # ends in a whole line
                i = chunk.rfind(b"\n")
                if i >= 0:
                    pos = start + i + 1
                    break
                pos = start
        cut = size - pos
        os.ftruncate(self._fd, pos)
        log.warning("trace %s: cut a torn last line (%d bytes) left by an earlier run; appending after it",
                    self.path, cut)
        return cut

    def submit(self, record: StepRecord) -> None:
        self._q.put(record)

    def _write_all(self, data: bytes) -> None:
        """Write ``data`` completely or raise OSError after cutting what got in back out (whole lines only)."""
        good = os.fstat(self._fd).st_size if self._regular else 0
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                if n <= 0:
                    raise OSError("write returned 0 bytes")
                view = view[n:]
        except OSError:
            if self._regular and len(view) < len(data):
                try:
                    os.ftruncate(self._fd, good)
                except OSError:
                    pass
            raise

    def _run(self) -> None:
        while True:
            batch = self._q.take(self._flush_s)
            if not batch:
                if self._q.closed:
                    return
                continue
            try:
                data = "".join(r.to_json() + "\n" for r in batch).encode("utf-8")
                self._write_all(data)
                self.written += len(batch)
                if self._failing:
                    log.warning("trace %s: writing again after %d failed batch(es); %d record(s) lost in all",
                                self.path, self._failing, self.lost)
                    self._failing = 0
            except (OSError, ValueError, TypeError) as e:
                self.errors += 1
                self.lost += len(batch)
                self._failing += 1
                if self._failing == 1:
                    why = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
                    log.warning("trace %s: cannot write (%s); its records are dropped and counted "
                                "(m2live_trace_errors_total, m2live_trace_dropped_total) until it works again",
                                self.path, why)
            finally:
                self._q.done(len(batch))

    def close(self) -> None:
        if self._q.closed:
            return
        self._q.close()
        self._thread.join(timeout=5.0)
        try:
            os.close(self._fd)
        except OSError:
            pass


@dataclass
class TraceContents:
    """What ``load_trace`` found: the usable records and the lines it skipped (line number, why)."""

    records: list[dict]
    skipped: list[tuple[int, str]] = field(default_factory=list)


MAX_STEP_S = 3600.0  # a step record's times: an hour at most (the slowest CPU steps take seconds)
MAX_F_CLK = 10.0  # the clock over the device's rated boost (GeForce boards run ~1.2 x theirs)


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _is_seconds(v: object, zero: bool = False) -> bool:
    """A step or operator time: a number in (0, MAX_STEP_S] ([0, MAX_STEP_S] where ``zero``)."""
    return _is_num(v) and (v >= 0 if zero else v > 0) and v <= MAX_STEP_S


def _problem(rec: object) -> str | None:
    """Why ``rec`` is not a usable step record (None: it is)."""
    if not isinstance(rec, dict):
        return "a record must be a JSON object"
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        return f"record lacks {', '.join(missing)}"
    for k in ("predicted_s", "corrected_s"):
        if not _is_seconds(rec[k]):
            return f"{k} must be seconds in (0, {MAX_STEP_S:g}], got {str(rec[k])[:32]!r}"
    if not (_is_num(rec["f_clk"]) and 0 < rec["f_clk"] <= MAX_F_CLK):
        return f"f_clk must be a clock ratio in (0, {MAX_F_CLK:g}], got {str(rec['f_clk'])[:32]!r}"
    clock = rec.get("clock_mhz")
    if clock is not None and not (_is_num(clock) and clock > 0):
        return f"clock_mhz must be a positive number or null, got {str(clock)[:32]!r}"
    m = rec["measured_s"]
    if m is not None and not _is_seconds(m):
        return f"measured_s must be seconds in (0, {MAX_STEP_S:g}] or null, got {str(m)[:32]!r}"
    for k in ("num_prefill_tokens", "num_decode_tokens"):
        if not (_is_num(rec[k]) and 0 <= rec[k] <= STEP_TOKENS.hi):
            return f"{k} must be a token count in 0 .. {int(STEP_TOKENS.hi)}, got {str(rec[k])[:32]!r}"
    ops = rec["ops"]
    if not isinstance(ops, dict) or not all(isinstance(o, str) and _is_seconds(t, zero=True) for o, t in ops.items()):
        return "ops must be an object of {operator: seconds}"
    fac = rec["factors"]
    if not isinstance(fac, dict) or not all(
            isinstance(per, dict) and all(v is None or (isinstance(v, int | float) and not isinstance(v, bool))
                                          for v in per.values())
            for per in fac.values()):
        return "factors must be an object of {factor: {operator: value}}"
    return None


class JsonLineError:
    """A line of a JSON-lines file that is not JSON (torn by a crash, garbled): its reason."""

    def __init__(self, why: str) -> None:
        self.why = why


def json_lines(path: Path) -> list[tuple[int, object]]:
    """(line number, parsed value or ``JsonLineError``) for every non-blank line of a JSON-lines file; the one
    reader of traces (``load_trace`` checks step records, ``workload.from_trace`` the shape fields). OSError
    when the file cannot be read."""
    out: list[tuple[int, object]] = []
    for i, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            out.append((i, json.loads(raw.decode("utf-8"))))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            out.append((i, JsonLineError(getattr(e, "msg", type(e).__name__))))
    return out


def load_trace(path: str | Path) -> TraceContents:
    """The usable records of a trace and the torn or garbled lines skipped; a missing file, or one without a
    single usable record, is a ``TraceError`` (naming the first problem)."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"no trace file at {path}")
    try:
        lines = json_lines(p)
    except OSError as e:
        raise TraceError(f"{path}: not readable ({e.strerror or e.__class__.__name__})") from None
    out = TraceContents([])
    for i, rec in lines:
        if isinstance(rec, JsonLineError):
            out.skipped.append((i, "not a JSON line"))
            continue
        why = _problem(rec)
        if why is not None:
            out.skipped.append((i, why))
            continue
        out.records.append(rec)
    if not out.records:
        if out.skipped:
            n, (line, why) = len(out.skipped), out.skipped[0]
            raise TraceError(f"{path}: no usable step records ({n} line(s) skipped; line {line}: {why})")
        raise TraceError(f"{path}: the trace holds no step records")
    return out


def read_trace(path: str | Path) -> list[dict]:
    """All usable records of a trace (torn or garbled lines skipped: ``load_trace`` counts them)."""
    return load_trace(path).records
