"""JSONL step traces: one ``StepRecord.to_dict()`` per line.

``TraceWriter`` is a sink: ``submit`` puts the record on a bounded queue (dropping the oldest and counting when
full) and a daemon thread writes and flushes, so the engine step never waits on the disk. ``read_trace`` loads
a trace for ``m2live report`` and checks every record has the contract's fields.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from .record import StepRecord
from .workqueue import DropOldestQueue

REQUIRED = ("step", "num_prefill_tokens", "num_decode_tokens", "predicted_s", "corrected_s", "measured_s",
            "f_clk", "ops", "factors")


class TraceError(ValueError):
    """A trace file that cannot be read as m2live step records (one clear line)."""


class TraceWriter:
    def __init__(self, path: str | Path, queue_size: int = 4096, flush_s: float = 0.2):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1 << 16)  # noqa: SIM115 - closed in close()
        self._q: DropOldestQueue[StepRecord] = DropOldestQueue(queue_size)
        self._flush_s = flush_s
        self.written = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="m2live-trace", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self._q.dropped

    def submit(self, record: StepRecord) -> None:
        self._q.put(record)

    def _run(self) -> None:
        while True:
            batch = self._q.take(self._flush_s)
            if not batch:
                if self._q.closed:
                    return
                continue
            try:
                self._f.write("".join(r.to_json() + "\n" for r in batch))
                self._f.flush()
                self.written += len(batch)
            except (OSError, ValueError, TypeError):
                self.errors += 1
            finally:
                self._q.done(len(batch))

    def close(self) -> None:
        if self._q.closed:
            return
        self._q.close()
        self._thread.join(timeout=5.0)
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
