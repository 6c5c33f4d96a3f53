"""Where the probe's results go: the output directory (checked writable before anything slow) and
``probe.json``, rewritten atomically after every cell so a killed run still leaves its data."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from ..telemetry import ClockSampler
from .device import ProbeError


def _finite(x: Any) -> Any:
    """JSON-safe copy: non-finite floats become None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                           capture_output=True, text=True, timeout=3)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _slug(s: str) -> str:
    out = "".join(ch.lower() if ch.isalnum() else "-" for ch in s)
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-")


def default_out_dir(gpu_name: str, dry_run: bool, now: _dt.datetime | None = None) -> Path:
    now = now or _dt.datetime.now(_dt.UTC)
    base = "dry-run" if dry_run else _slug(gpu_name.replace("NVIDIA", ""))
    return Path("results") / "probe" / f"{base}-{now:%Y%m%d}"


def prepare_out(out: str | os.PathLike) -> Path:
    """``out`` as a directory that exists and is writable, or ProbeError in one line."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ProbeError(f"--out {out}: exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".probe-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ProbeError(f"--out {out}: not writable ({e.strerror or e})") from None
    return p


class _Writer:
    """Keeps probe.json current on disk (atomic replace) after every cell."""

    def __init__(self, out: Path, doc: dict, sampler: ClockSampler | None, t0: float):
        self.out, self.doc, self.sampler, self.t0 = out, doc, sampler, t0
        self.path = out / "probe.json"

    def clock_trace(self, max_points: int = 4000) -> dict[str, list]:
        rs = self.sampler.between(self.t0, float("inf")) if self.sampler is not None else []
        stride = max(1, math.ceil(len(rs) / max_points))
        rs = rs[::stride]
        return {"t_s": [round(r.t - self.t0, 4) for r in rs], "sm_mhz": [r.sm_mhz for r in rs],
                "power_w": [r.power_w for r in rs], "event_reasons": [r.event_reasons for r in rs]}

    def flush(self) -> None:
        self.doc["duration_s"] = time.monotonic() - self.t0
        self.doc["clock_trace"] = self.clock_trace()
        if self.sampler is not None:
            self.doc["sampler"] = {"reads": self.sampler.reads, "errors": self.sampler.errors,
                                   "period_s": self.sampler.period_s}
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_finite(self.doc), indent=1))
        os.replace(tmp, self.path)
