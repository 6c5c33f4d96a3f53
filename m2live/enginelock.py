"""One real vLLM engine at a time on a shared machine: tests, benchmarks, the demo and people take this lock.

Engines started together on a small machine pin to the same core and distort each other's step times, so every
engine run in this project holds an exclusive ``flock`` on one well-known file for its whole life.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Callable, Iterator

ENGINE_LOCK = "/tmp/m2live-engine.lock"


@contextlib.contextmanager
def engine_lock(on_wait: Callable[[], None] | None = None, path: str = ENGINE_LOCK) -> Iterator[None]:
    """Hold the machine-wide engine lock; ``on_wait`` is called once if another engine holds it."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
