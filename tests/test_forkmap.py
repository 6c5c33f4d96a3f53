"""fork_map: independent computations over forked processes, the results in the items' order and the same as one
process computes; an exception raised in a child is raised here; a child that dies is one line, not a hang; a
process with other threads computes here."""

from __future__ import annotations

import os
import threading
import time

import pytest

from m2live.forkmap import default_jobs, fork_map, jobs_arg


def _square_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


def test_results_in_order_and_the_same_as_here():
    items = list(range(37))
    here = [_square_pid(x)[0] for x in items]
    out = fork_map(_square_pid, items, jobs=3, key=lambda x: -x)  # a key that reverses the hand-out order
    assert [v for v, _ in out] == here
    pids = {p for _, p in out}
    if threading.active_count() == 1:
        assert os.getpid() not in pids and len(pids) >= 2  # computed in children
    else:
        assert pids == {os.getpid()}  # another thread here: computed here, never forked


def test_a_child_exception_is_raised_here():
    def boom(x: int) -> int:
        if x == 5:
            raise ValueError(f"bad item {x}")
        return x

    with pytest.raises(ValueError, match="bad item 5"):
        fork_map(boom, list(range(12)), jobs=2)


def test_a_child_that_dies_is_an_error_not_a_wait():
    """Run in a process of its own (a pytest process may hold threads, where fork_map computes in-process)."""
    import subprocess
    import sys

    code = (
        "import os, signal\n"
        "from m2live.forkmap import ForkMapError, fork_map\n"
        "def die(x):\n"
        "    if x == 7:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return x\n"
        "try:\n"
        "    fork_map(die, list(range(16)), jobs=2)\n"
        "except ForkMapError as e:\n"
        "    print('error:', e)\n"
    )
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("error: a worker process died") and "--jobs 1" in p.stdout, p
    assert time.monotonic() - t0 < 60


def test_other_threads_keep_the_work_here():
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    try:
        out = fork_map(_square_pid, list(range(8)), jobs=4)
    finally:
        stop.set()
        t.join()
    assert {p for _, p in out} == {os.getpid()}


def test_jobs_flag_and_default():
    assert jobs_arg(None, 3, ValueError) == 1 == default_jobs(3)
    assert jobs_arg("4", 400, ValueError) == 4 and jobs_arg("4", 2, ValueError) == 2
    for bad in ("0", "-1", "1.5", "", "x"):
        with pytest.raises(ValueError, match="--jobs must be a positive integer"):
            jobs_arg(bad, 10, ValueError)
    with pytest.raises(ValueError, match="at most"):
        jobs_arg("9" * 12, 10, ValueError)


def test_an_error_stops_only_this_maps_children_and_maps_nest():
    """In a process of its own: an exception in one item kills this map's children and leaves a process the caller
    started alive; a map inside a child's item (nested) works and leaves the outer map's items intact."""
    import subprocess
    import sys

    code = (
        "import multiprocessing as mp, os, time\n"
        "from m2live.forkmap import fork_map\n"
        "def inner(x):\n"
        "    return x + 1\n"
        "def outer(x):\n"
        "    return sum(fork_map(inner, list(range(x % 5 + 2)), jobs=2))\n"
        "def bad(x):\n"
        "    if x == 3:\n"
        "        raise ValueError('bad 3')\n"
        "    return x\n"
        "if __name__ == '__main__':\n"
        "    mine = mp.get_context('fork').Process(target=time.sleep, args=(30,))\n"
        "    mine.start()\n"
        "    try:\n"
        "        fork_map(bad, list(range(12)), jobs=2)\n"
        "    except ValueError as e:\n"
        "        print('raised', e)\n"
        "    print('caller child alive', mine.is_alive())\n"
        "    mine.kill()\n"
        "    print('nested', fork_map(outer, list(range(10)), jobs=2) == [outer(x) for x in range(10)])\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["raised bad 3", "caller child alive True", "nested True"], p.stdout
