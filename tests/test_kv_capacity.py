"""The KV-cache sizing against public vLLM start-up logs (bench/kv_capacity.py; never fitted): each log with its
settings stated within 5 % of the cache it logged, and the one whose gpu_memory_utilization is not stated implies a
utilisation a deployment would set (between vLLM's default and 1)."""

from __future__ import annotations

from conftest import REPO, load_script

BENCH = REPO / "bench" / "kv_capacity.py"


def test_start_up_logs_are_within_five_percent():
    mod = load_script(BENCH)
    points = [mod.run_point(p) for p in mod.POINTS]
    scored = [p for p in points if "error" in p]
    assert len(scored) >= 3
    assert all(abs(p["error"]) <= 0.05 for p in scored), [(p["checkpoint"], p["error"]) for p in scored]
    for p in points:
        if "error" not in p:
            assert p["at_default"]["fitted_kv_gib"] < p["logged_kv_gib"]
            assert mod.GPU_MEMORY_UTILIZATION < p["implied_utilization"] <= 1.0
