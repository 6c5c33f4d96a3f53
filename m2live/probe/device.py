"""Timing on the device: CUDA (events, CUDA-graph capture) or, for the dry run, the CPU (``perf_counter``).
torch is never imported here; the caller loads it with ``load_torch`` and passes it in."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

Rep = tuple[float, float, float]  # one timed repetition: (start, end) on time.monotonic(), device seconds


class ProbeError(ValueError):
    """A probe that cannot run here (no CUDA, no NVML, unknown GPU, bad output path): one line, exit 2."""


class Interrupted(BaseException):
    """SIGTERM during a run (``timeout``, a device lease ending): stop measuring, write what we have."""


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted()


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside: SIGTERM raises ``Interrupted`` (main thread only; elsewhere signals cannot be handled)."""
    in_main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _raise_interrupted) if in_main else None
    try:
        yield
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def load_torch(dry_run: bool) -> Any:
    """torch, with CUDA and bf16 unless ``dry_run``; ProbeError (one line) when it cannot be had."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - ImportError or a broken install: say so in one line
        raise ProbeError(f"m2live probe needs PyTorch{'' if dry_run else ' with CUDA'}: cannot import torch "
                         f"({e.__class__.__name__}: {e})") from None
    if not dry_run:
        if not torch.cuda.is_available():
            raise ProbeError(f"m2live probe needs PyTorch with CUDA and an NVIDIA GPU: torch {torch.__version__}"
                             f" sees no CUDA device (use --dry-run to exercise the pipeline on the CPU)")
        if not torch.cuda.is_bf16_supported():
            raise ProbeError(f"{torch.cuda.get_device_name()} has no bf16 support; the probe measures bf16")
    return torch


class _Device:
    def __init__(self, torch: Any, cuda: bool):
        self.torch = torch
        self.cuda = cuda
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.dtype = torch.bfloat16
        self.timing = "cuda-events" if cuda else "perf_counter"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def time_once(self, launch: Callable[[], Any]) -> float:
        """Seconds of one ``launch()`` on the device (GPU time between two events; CPU wall time)."""
        if self.cuda:
            ev = self.torch.cuda.Event
            s, e = ev(enable_timing=True), ev(enable_timing=True)
            s.record()
            launch()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3
        t0 = time.perf_counter()
        launch()
        return time.perf_counter() - t0

    def repeat(self, launch: Callable[[], Any], min_s: float, min_reps: int, max_reps: int = 100000) -> list[Rep]:
        """Back-to-back timed repetitions for at least ``min_s`` and ``min_reps``: (t0, t1 monotonic, secs)."""
        out: list[Rep] = []
        start = time.monotonic()
        while True:
            t0 = time.monotonic()
            dt = self.time_once(launch)
            t1 = time.monotonic()
            out.append((t0, t1, dt))
            if len(out) >= max_reps or (len(out) >= min_reps and t1 - start >= min_s):
                return out

    def graph(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Capture ``fn`` (already warmed up) into a CUDA graph and return its replay."""
        torch = self.torch
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return g.replay

    def empty_cache(self) -> None:
        if self.cuda:
            self.torch.cuda.empty_cache()

    def peak_memory_gb(self) -> float | None:
        if self.cuda:
            return self.torch.cuda.max_memory_allocated() / 1e9
        return None


def settled(reps: list[Rep], t_start: float, t_end: float) -> tuple[list[Rep], list[Rep], float]:
    """Split repetitions into (early, settled) halves by time; returns the settled window's start."""
    t_mid = t_start + (t_end - t_start) / 2.0
    late = [r for r in reps if r[0] >= t_mid]
    if len(late) < max(1, len(reps) // 2):
        late = reps[len(reps) // 2:]
        t_mid = late[0][0] if late else t_start
    early = reps[: len(reps) - len(late)]
    return early, late, t_mid


def one_line(e: BaseException) -> str:
    """``Class: message``, first line only."""
    return f"{e.__class__.__name__}: {e}".splitlines()[0]

