"""Shared test helpers: the engine lock (one real vLLM engine at a time on a 2-core machine), free ports,
the shipped model configs."""

from __future__ import annotations

import os
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
