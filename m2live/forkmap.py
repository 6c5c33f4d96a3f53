"""``fork_map``: a list of independent, deterministic computations (a batch's configurations, a ranking's layouts)
spread over forked processes, the results back in the list's order — the same results as one process computes.

Forked, not spawned: a child starts with this process's state (the items, the function, whatever caches are
warm), so nothing goes to a child but a chunk of indices, and only the results come back (pickled). Where forking is
not safe — other threads in this process (a lock one of them holds would stay held in the child), a thread other
than the main one, or a caller that says so (a CPU device measured with torch's threads) — the items are computed
here. A child that dies (killed, out of memory) is one ``ForkMapError`` line, never a wait without end; Ctrl-C is
this process's alone (the children ignore it from their first instruction) and, like a SIGTERM to this process,
stops this map's children — only them — with the command.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from .cpu_device import allowed_cpus

T = TypeVar("T")
R = TypeVar("R")

MAX_JOBS = 256  # processes, not a thread count a typo can turn into millions
DEFAULT_MAX_JOBS = 8  # the default's ceiling, whatever the cores

# a child's map: its function and items (``_child_start``, ``_run_chunk``); empty in the process that maps
_JOB: dict[str, Any] = {}


class ForkMapError(OSError):
    """A child process died before its items were computed (the environment's: an OS error, one line)."""


def default_jobs(items: int, per: int = 4) -> int:
    """One process per CPU this process may run on (``cpu_device.allowed_cpus``), at most DEFAULT_MAX_JOBS, and
    at most one per ``per`` items."""
    return max(1, min(len(allowed_cpus()), DEFAULT_MAX_JOBS, items // per))


def _child_start(job: dict[str, Any]) -> None:
    """A child's first call: its job (inherited by the fork, never pickled), and the default SIGTERM."""
    _JOB.clear()
    _JOB.update(job)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run_chunk(indices: list[int]) -> list:
    fn, items = _JOB["fn"], _JOB["items"]
    return [fn(items[i]) for i in indices]


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def fork_map(fn: Callable[[T], R], items: Sequence[T], jobs: int,
             key: Callable[[T], Hashable] | None = None) -> list[R]:
    """``[fn(x) for x in items]``, in ``jobs`` forked processes where that is safe (else here). ``key`` sorts the
    items into the chunks handed out (items of one key together: a process then reuses what it built for the
    first of them). An exception ``fn`` raises in a child is raised here — where several items raise, the first
    in the hand-out order (``key``'s), not necessarily the first item. Results are the children's pickled copies.
    Safe means: this is the main thread and the only ``threading`` thread of this process (native threads — BLAS,
    OpenMP, torch — are not seen: a caller that runs torch says so with ``jobs`` 1)."""
    if (jobs <= 1 or len(items) < 2 or threading.active_count() > 1
            or threading.current_thread() is not threading.main_thread()):
        return [fn(x) for x in items]
    order = sorted(range(len(items)), key=(lambda i: key(items[i])) if key is not None else None)
    size = max(1, len(order) // (4 * jobs))
    chunks = [order[k:k + size] for k in range(0, len(order), size)]
    sys.stdout.flush(), sys.stderr.flush()  # nothing buffered here is written again by a child
    pool = ProcessPoolExecutor(min(jobs, len(chunks)), mp_context=multiprocessing.get_context("fork"),
                               initializer=_child_start, initargs=({"fn": fn, "items": items},))
    before = set(multiprocessing.active_children())
    # the children are forked at the first submit, with Ctrl-C ignored from their first instruction (Ctrl-C
    # reaches the whole process group: this process alone acts on it); SIGTERM here stops them too
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    old_term = signal.signal(signal.SIGTERM, _terminate)
    futures = []
    mine: set = set()
    try:
        try:
            futures.append(pool.submit(_run_chunk, chunks[0]))
        finally:
            signal.signal(signal.SIGINT, old_int if old_int is not None else signal.SIG_DFL)
            mine = set(multiprocessing.active_children()) - before  # this pool's processes, no one else's
        futures += [pool.submit(_run_chunk, chunk) for chunk in chunks[1:]]
        done = [result for f in futures for result in f.result()]
    except BaseException as e:  # a child died, Ctrl-C, SIGTERM, fn raised: the others are stopped, not left running
        for child in mine:
            child.kill()
        pool.shutdown(wait=True, cancel_futures=True)  # its manager thread ends with the killed children
        if isinstance(e, BrokenProcessPool):
            raise ForkMapError("a worker process died before its items were computed (killed, or out of "
                               "memory?): --jobs 1 computes them in this process") from None
        raise
    else:
        pool.shutdown(wait=True)  # every child reaped before the results are used
    finally:
        signal.signal(signal.SIGTERM, old_term if old_term is not None else signal.SIG_DFL)
    out: list = [None] * len(items)
    for i, result in zip(order, done, strict=True):
        out[i] = result
    return out


def jobs_arg(text: str | None, items: int, error: type[Exception], per: int = 4, flag: str = "--jobs") -> int:
    """A ``--jobs`` flag's process count: a positive integer up to MAX_JOBS (else one ``error`` line), at most one
    per item; unset, ``default_jobs``."""
    if text is None:
        return default_jobs(items, per)
    try:
        jobs = int(str(text).strip())
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise error(f"{flag} must be a positive integer, got {text!r}")
    if jobs > MAX_JOBS:
        raise error(f"{flag} must be at most {MAX_JOBS}, got {text!r}")
    return max(1, min(jobs, items))
