"""A bounded hand-off between a producer that must never wait (an engine step, a sink's ``publish``) and one
consumer thread: the record thread, the trace writer, the Prometheus fold, the MQTT pump all use it."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class DropOldestQueue(Generic[T]):
    """FIFO of at most ``maxsize`` items. ``put`` never blocks: a full queue displaces its oldest item, a closed
    one refuses the new item; both count in ``dropped``. The consumer ``take``s items and reports them handled
    with ``done``; ``join`` waits until everything put so far has been handled."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = max(1, maxsize)
        self.dropped = 0
        self.closed = False
        self._q: deque[T] = deque()
        self._taken = 0  # handed to the consumer, not yet done
        self._cv = threading.Condition()

    def __len__(self) -> int:
        return len(self._q)

    @property
    def taken(self) -> int:
        """Items handed to the consumer and not yet reported ``done``."""
        return self._taken

    def put(self, item: T) -> None:
        with self._cv:
            if self.closed:
                self.dropped += 1
                return
            if len(self._q) >= self.maxsize:
                self._q.popleft()
                self.dropped += 1
            self._q.append(item)
            self._cv.notify_all()

    def take(self, timeout: float, most: int | None = None) -> list[T]:
        """Up to ``most`` items (all if None), waiting at most ``timeout`` s for the first; [] if none came."""
        with self._cv:
            if not self._q and not self.closed:
                self._cv.wait(timeout)
            n = len(self._q) if most is None else min(most, len(self._q))
            items = [self._q.popleft() for _ in range(n)]
            self._taken += n
            return items

    def done(self, n: int) -> None:
        with self._cv:
            self._taken -= n
            self._cv.notify_all()

    def join(self, timeout: float) -> bool:
        """True once every item put has been handled; False if ``timeout`` s pass first."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._q or self._taken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        """Refuse new items and wake the consumer, which drains what is left and stops on an empty ``take``."""
        with self._cv:
            self.closed = True
            self._cv.notify_all()
