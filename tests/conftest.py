"""Shared test helpers: the engine lock (one real vLLM engine at a time on a 2-core machine), free ports,
the shipped model configs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import free_port  # noqa: F401 - one free_port for the tests (re-exported)

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
OPBENCH = SHARED / "data" / "opbench"
VIDUR = SHARED / "data" / "vidur"
MODELS = REPO / "m2live" / "data" / "models"

os.environ.setdefault("HF_HUB_OFFLINE", "1")

M2 = [sys.executable, "-m", "m2live"]
RULES = REPO / "dashboards" / "m2live.rules.yml"  # the Prometheus rules shipped beside the dashboard


def rule_metric_names(text: str) -> set[str]:
    """The m2live_* series the rules read (histogram suffixes dropped), comments left out."""
    body = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    exprs = re.findall(r"expr: ([^\n]+(?:\n {10,}[^\n]+)*)", body)
    names = set().union(*(re.findall(r"\bm2live_[a-z_]+", e) for e in exprs))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def nvml_answers() -> bool:
    """Whether an NVIDIA driver answers NVML here (the tests of what happens without one skip where one does)."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def load_script(path: Path, name: str | None = None):
    """A script of the repository (bench/*.py, dashboards/*.py) imported as a module, without running its main."""
    spec = importlib.util.spec_from_file_location(name or f"m2live_script_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The m2live command in a subprocess, as a user runs it."""
    return subprocess.run([*M2, *args], capture_output=True, text=True, timeout=timeout)


def one_line_error(p: subprocess.CompletedProcess) -> str:
    """The command failed as promised: exit 2, one line on stderr, no traceback; returns that line."""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, p.stderr
    return lines[0]


@pytest.fixture
def engine_lock() -> Iterator[None]:
    """Hold the machine-wide lock that serialises real vLLM engines (tests, benchmarks, people)."""
    from m2live.enginelock import engine_lock as hold

    with hold():
        yield


@pytest.fixture
def tiny_model_dir() -> Path:
    return MODELS / "tiny-llama"


@pytest.fixture
def bench_model_dir() -> Path:
    return MODELS / "bench-llama"
