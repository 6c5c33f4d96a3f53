"""JSONL step traces: one ``StepRecord.to_dict()`` per line.

``TraceWriter`` is a sink: ``submit`` puts the record on a bounded queue (dropping the oldest and counting when
full) and a daemon thread writes and flushes, so the engine step never waits on the disk. ``read_trace`` loads
a trace for ``m2live report`` and checks every record has the contract's fields.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path

from .record import StepRecord

REQUIRED = ("step", "num_prefill_tokens", "num_decode_tokens", "predicted_s", "corrected_s", "measured_s",
            "f_clk", "ops", "factors")


class TraceError(ValueError):
    """A trace file that cannot be read as m2live step records (one clear line)."""


class TraceWriter:
    def __init__(self, path: str | Path, queue_size: int = 4096, flush_s: float = 0.2):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1 << 16)  # noqa: SIM115 - closed in close()
        self._q: deque[StepRecord] = deque()
        self._max = max(1, queue_size)
        self._flush_s = flush_s
        self.dropped = 0
        self.written = 0
        self.errors = 0
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="m2live-trace", daemon=True)
        self._thread.start()

    def submit(self, record: StepRecord) -> None:
        with self._cv:
            if self._closed:
                self.dropped += 1
                return
            if len(self._q) >= self._max:
                self._q.popleft()
                self.dropped += 1
            self._q.append(record)
            self._cv.notify()

    def _drain(self) -> None:
        while True:
            with self._cv:
                if not self._q:
                    return
                batch = list(self._q)
                self._q.clear()
            try:
                self._f.write("".join(r.to_json() + "\n" for r in batch))
                self._f.flush()
                self.written += len(batch)
            except (OSError, ValueError, TypeError):
                self.errors += 1

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._q and not self._closed:
                    self._cv.wait(self._flush_s)
                closed = self._closed
            self._drain()
            if closed:
                return

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5.0)
        self._drain()
        try:
            self._f.close()
        except OSError:
            pass


def read_trace(path: str | Path) -> list[dict]:
    """All records of a trace; a missing, empty or malformed file is a ``TraceError``."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"no trace file at {path}")
    records: list[dict] = []
    try:
        lines = p.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: not readable ({e.__class__.__name__})") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise TraceError(f"{path}:{i}: not a JSON line") from None
        if not isinstance(rec, dict):
            raise TraceError(f"{path}:{i}: a record must be a JSON object")
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise TraceError(f"{path}:{i}: record lacks {', '.join(missing)}")
        for k in ("predicted_s", "corrected_s", "f_clk"):
            if not isinstance(rec[k], (int, float)) or isinstance(rec[k], bool):
                raise TraceError(f"{path}:{i}: {k} must be a number, got {rec[k]!r}")
        if rec["measured_s"] is not None and not isinstance(rec["measured_s"], (int, float)):
            raise TraceError(f"{path}:{i}: measured_s must be a number or null")
        records.append(rec)
    if not records:
        raise TraceError(f"{path}: the trace holds no step records")
    return records
