"""The serving simulator against vLLM runs others published on GPUs (bench/public_serving.py; never fitted): a
regression floor on TPOT, and the TTFT shortfall the README reports (the API-server path m2live prices at its
priors) kept honest — a change that closes it should come with its reason."""

from __future__ import annotations

from conftest import REPO, load_script

BENCH = REPO / "bench" / "public_serving.py"


def test_published_gpu_serving_tpot_stays_within_its_floor_and_ttft_is_short_as_reported():
    mod = load_script(BENCH)
    points = [mod.run_point(p) for p in mod.POINTS]
    in_scope = [p for p in points if "scope" not in p]
    tpot = [abs(r["tpot_error"]) for p in in_scope for r in p["runs"]]
    ttft = [r["ttft_error"] for p in in_scope for r in p["runs"] if "ttft_error" in r]
    assert len(tpot) == 15 and len(ttft) == 14
    # 10.7 % with the L4 row scored on the simulated ITL it states (2026-12-07; 9.7 % on TPOT); 9.7 % with the Qwen3-8B row of 2026-12-07 (-3 %); 10.2 % with the B200 run's 5 and 10 req/s rows of 2026-12-07 (-23 / -30 %); 7.5 % with the A100 row of
    # 2026-12-06; 7.8 % with the two of 2026-12-05, 5.6 % before
    assert sum(tpot) / len(tpot) <= 0.12
    assert sum(e <= 0.15 for e in tpot) >= 9
    assert all(-0.75 < e < 0.0 for e in ttft)  # every published TTFT above the simulation, as the README says


def test_the_api_server_bound_run_is_missed_the_way_the_readme_says():
    """The published burst of 500 requests on a 0.6B model is bound by the API server's own work, which the
    simulator does not model: it comes out with a TTFT far short and a TPOT long (the simulated engine gets the
    requests faster than the server hands them over). A change that closes this should come with the API server's
    model."""
    mod = load_script(BENCH)
    out = [mod.run_point(p) for p in mod.POINTS if p.get("scope") == "API-server bound"]
    assert len(out) == 1
    (r,) = out[0]["runs"]
    assert r["ttft_error"] < -0.5 and r["tpot_error"] > 0.2  # -62 % and +37 % when written (2026-12-05)
