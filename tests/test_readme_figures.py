"""The README quotes the machine-independent benchmarks (results/accuracy.json, ranking.json, public_serving.json,
kv_capacity.json): every figure of its status table and of its per-operator table must be the one the committed
JSON holds, so a regenerated result cannot leave a stale number behind (three were found stale by hand on
2026-12-05)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GPUS = ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA B300 SXM6 AC")  # the README's A100 / H100 / B300


def _json(name: str) -> dict:
    return json.loads((REPO / "results" / name).read_text())


def _status_row(what: str) -> str:
    """The status table's row whose first cell starts with ``what``."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Where it stands"):readme.index("## Results at a glance")]
    rows = [line for line in section.splitlines() if line.startswith(f"| {what}")]
    assert len(rows) == 1, f"README status table: {len(rows)} rows start with {what!r}"
    return rows[0]


def _join(values, fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in values)


def test_in_sample_operator_figures_are_accuracy_json():
    cal = _json("accuracy.json")["calibration"]
    gemm = _join((cal[g]["gemm/core"]["mape_in_sample"] for g in GPUS), ".2f")
    assert f"| {gemm} % |" in _status_row("GEMM, in-sample")
    pre = _join((cal[g]["prefill_attention/core"]["mape_in_sample"] for g in GPUS), ".2f")
    dec = _join((cal[g]["decode_attention/core"]["mape_in_sample"] for g in GPUS), ".2f")
    assert f"prefill {pre} %, decode {dec} %" in _status_row("prefill / decode attention, in-sample")


def test_other_head_dims_figures_are_accuracy_json():
    cal = _json("accuracy.json")["calibration"]
    cells = []
    for gpu, label, dims in (("NVIDIA H100 80GB HBM3", "H100", (64, 192, 256)), ("NVIDIA B300 SXM6 AC", "B300", (64, 256))):
        pre, dec = (_join((cal[gpu][f"{k}_attention/head_dim_{d}"]["mape_in_sample"] for d in dims), ".2f")
                    for k in ("prefill", "decode"))
        cells.append(f"{label} prefill {pre} %, decode {dec} %")
    assert f"| {'; '.join(cells)} |" in _status_row("attention at the other head dims")


def test_calibrated_default_budget_is_accuracy_json():
    summary = _json("accuracy.json")["calibrated"]["summary"]
    cells = {k: _join((summary[g]["zero_shot"][k] for g in GPUS), ".2f") for k in ("gemm", "prefill", "decode")}
    row = _status_row("calibrated mode, default budget")
    assert f"GEMM {cells['gemm']} %; prefill {cells['prefill']} %; decode {cells['decode']} %" in row


def test_fp8_figures_are_accuracy_json():
    fp8 = _json("accuracy.json")["fp8"]["gpus"]
    order = ("NVIDIA H100 80GB HBM3", "NVIDIA B300 SXM6 AC")
    ins = _join((fp8[g]["core"]["in_sample"]["mape"] for g in order), ".2f")
    loo = _join((fp8[g]["core"]["leave_one_gpu_out"]["mape"] for g in order), ".1f")
    assert f"in-sample {ins} %; leave-one-out {loo} %" in _status_row("fp8 GEMM")
    cal = _json("accuracy.json")["calibrated"]["summary"]
    zs = _join((cal[g]["zero_shot"]["gemm_fp8"] for g in order), ".2f")
    assert f"calibrated from the other family's constants {zs} %" in _status_row("fp8 GEMM")


def test_vidur_and_square_figures_are_accuracy_json():
    acc = _json("accuracy.json")
    v = {k: format(d["all"]["mape_forecast_clock"], ".1f") for k, d in acc["vidur_validation"].items()}
    row = _status_row("Vidur's profiles")
    assert (f"A100 {v['NVIDIA A100-SXM4-80GB / Meta-Llama-3-8B']} % (Llama-3-8B) / "
            f"{v['NVIDIA A100-SXM4-80GB / Llama-2-7b-hf']} % (Llama-2-7B), "
            f"H100 {v['NVIDIA H100 80GB HBM3 / Llama-2-7b-hf']} %, A40 {v['NVIDIA A40 / Llama-2-7b-hf']} %") in row
    square = acc["square_validation"]["mape_checked_from_outside"]
    assert f"| {square:.1f} % (" in _status_row("public square bf16 GEMMs")


def test_planner_and_published_serving_figures_are_their_json():
    r = _json("ranking.json")
    ob, vi = r["opbench"], r["vidur"]["m_set"]
    row = _status_row("capacity planning")
    assert (f"opbench {100 * ob['summary']['relative_speed_error_mean']:.1f} % (0.75 roofline "
            f"{100 * ob['baseline_summary']['relative_speed_error_mean']:.1f} %); Vidur "
            f"{100 * vi['summary']['relative_speed_error_mean']:.1f} % "
            f"({100 * vi['baseline_summary']['relative_speed_error_mean']:.1f} %)") in row
    s = _json("public_serving.json")["summary"]
    row = _status_row("published GPU serving runs")
    assert (f"TPOT {s['tpot_within_15pct']} of {s['tpot_runs']} within 15 % (MAPE {s['tpot_mape']:.1f} %; ITL where "
            f"the source states ITL); TTFT {s['ttft_within_25pct']} of {s['ttft_runs']} within 25 % (MAPE {s['ttft_mape']:.1f} %") in row


def test_kv_capacity_row_is_its_json():
    k = _json("kv_capacity.json")
    errs = [f"{100 * p['error']:+.1f} %".replace("-", "−") for p in k["points"] if "error" in p]
    row = _status_row("KV-cache sizing")
    assert f"MAPE {k['summary']['mape']:.1f} % over {k['summary']['logs']} logs" in row
    assert all(e in row for e in errs)


@pytest.mark.parametrize("page", ["README.md", "docs/accuracy.md"])
@pytest.mark.parametrize("gpu", GPUS)
def test_per_operator_table_is_the_loo_matrix(gpu, page):
    """Every cell of the per-operator table (in-sample, from each family, the roofline), in the README and in
    docs/accuracy.md alike."""
    loo = _json("accuracy.json")["loo_matrix"][gpu]
    readme = (REPO / page).read_text()
    short = gpu.removeprefix("NVIDIA ")
    family = {"NVIDIA A100-SXM4-80GB": "ampere", "NVIDIA H100 80GB HBM3": "hopper",
              "NVIDIA B300 SXM6 AC": "blackwell"}[gpu]
    for kind, label in (("gemm", "GEMM"), ("prefill_attention", "prefill attention"),
                        ("decode_attention", "decode attention")):
        cells = [f"**{loo[kind]['constants_from'][family]:.2f} %**"]
        cells += ["—" if src == family else f"{loo[kind]['constants_from'][src]:.2f} %"
                  for src in ("ampere", "hopper", "blackwell")]
        cells.append(f"{loo[kind]['baseline_eta0.75']:.2f} %")
        first = f"{short} ({family})" if kind == "gemm" else short
        assert f"| {first} | {label} | " + " | ".join(cells) + " |" in readme, (page, gpu, kind)


def test_serving_and_plugin_figures_are_their_runs_of_record():
    """The machine-dependent rows quote the committed runs of record (serving.json, serving_kv_bound.json,
    plugin.json)."""
    cal = _json("serving.json")["summary"]["calibrated"]
    n = cal["configurations"]
    assert (f"TPOT {cal['tpot_within_15pct']}/{n} (MAPE {100 * cal['tpot_ms']['mape']:.1f} %), "
            f"TTFT {cal['ttft_within_25pct']}/{n} ({100 * cal['ttft_ms']['mape']:.1f} %)") in _status_row(
        "serving vs a real vLLM-CPU server")
    kv = _json("serving_kv_bound.json")["summary"]["calibrated"]
    row = _status_row("serving with a KV cache too small")
    measured, simulated = zip(*kv["preemptions"], strict=True)
    assert f"preemptions {_join(measured, '.0f')} measured, {_join(simulated, '.0f')} simulated" in row
    n = kv["configurations"]
    assert (f"calibrated TTFT {kv['ttft_within_25pct']}/{n} (MAPE {100 * kv['ttft_ms']['mape']:.1f} %), "
            f"TPOT {kv['tpot_within_15pct']}/{n} ({100 * kv['tpot_ms']['mape']:.1f} %") in row
    p = _json("plugin.json")
    assert (f"| {100 * p['median_abs_error_corrected']:.1f} %; {100 * p['overhead_fraction_median']:.2f} % of a step |"
            in _status_row("live plugin"))


@pytest.mark.parametrize("page", ["README.md", "docs/calibration.md"])
def test_calibrated_table_is_accuracy_json(page):
    """Every row of the calibrated-mode table (zero-shot prior, calibrated, in-sample, in-sample calibrated; two
    decimals) at the default budget, bf16 kinds and fp8 GEMMs alike."""
    sec = _json("accuracy.json")["calibrated"]
    default = sec["default_budget"]
    text = (REPO / page).read_text()
    labels = {"gemm": "GEMM", "prefill": "prefill", "decode": "decode", "gemm_fp8": "fp8 GEMM"}
    seen = 0
    for gpu, g in sec["gpus"].items():
        zs = g["priors"]["zero_shot"]["by_budget"][default]["held_out"]
        ins = g["priors"]["in_sample"]["by_budget"][default]["held_out"]
        for kind, z in zs.items():
            i = ins[kind]
            row = (f"| {gpu.removeprefix('NVIDIA ')} | {labels[kind]} | {z['mape_prior']:.2f} % | "
                   f"**{z['mape_calibrated']:.2f} %** | {i['mape_prior']:.2f} % | {i['mape_calibrated']:.2f} % |")
            assert row in text, (page, row)
            seen += 1
    assert seen == 11  # three GPUs x three bf16 kinds, and the two fp8 GEMM tables


def test_fp8_carry_sentence_is_accuracy_json():
    """The README's figure for a bf16 calibration alone carried to the fp8 GEMMs (zero-shot, default budget)."""
    sec = _json("accuracy.json")["calibrated"]
    d = sec["default_budget"]
    cells = [sec["gpus"][g]["priors"]["zero_shot"]["by_budget"][d]["held_out"]["gemm_fp8"]
             for g in ("NVIDIA H100 80GB HBM3", "NVIDIA B300 SXM6 AC")]
    text = " / ".join(f"{c['mape_prior']:.2f} → {c['mape_carried']:.2f} %" for c in cells)
    assert f"other family's constants: {text} with no fp8 row measured" in (REPO / "README.md").read_text()


def test_docs_sibling_calibration_table_is_its_json():
    """docs/calibration.md's table of the calibrated mode against a sibling's datasheet quotes
    results/calibration_sibling.json (bench/calibration_sibling.py)."""
    doc = (REPO / "docs" / "calibration.md").read_text()
    short = {"h100_sxm": "H100", "b300_sxm": "B300"}
    for p in _json("calibration_sibling.json")["pairs"]:
        row = next(line for line in doc.splitlines()
                   if line.startswith(f"| {short[p['rows_of']]} → {p['presented_as'].removeprefix('NVIDIA ')} |"))
        for kind in ("gemm", "prefill_attention", "decode_attention"):
            assert f"{p['core_mape_prior'][kind]:.2f} → " in row, (kind, row)
            assert f"{p['core_mape_calibrated'][kind]:.2f} %" in row, (kind, row)


def test_readme_sibling_calibration_row_is_its_json():
    pairs = {p["rows_of"]: p for p in _json("calibration_sibling.json")["pairs"]}
    row = _status_row("calibrated against a sibling's datasheet")
    h, b = pairs["h100_sxm"], pairs["b300_sxm"]
    assert (f"H100 rows as H200: GEMM {h['core_mape_prior']['gemm']:.2f} → {h['core_mape_calibrated']['gemm']:.2f} %, "
            f"prefill {h['core_mape_calibrated']['prefill_attention']:.2f} %, "
            f"decode {h['core_mape_calibrated']['decode_attention']:.2f} %") in row
    assert (f"B300 rows as B200: GEMM {b['core_mape_calibrated']['gemm']:.2f} %") in row
    assert (f"prefill {b['core_mape_calibrated']['prefill_attention']:.2f} %, "
            f"decode {b['core_mape_calibrated']['decode_attention']:.2f} %") in row


def test_batch_speed_row_is_its_json():
    d = _json("simulate_speed.json")
    one, par = d["one_process"], d["default_processes"]
    row = _status_row("`simulate --batch`")
    assert f"{par['configurations']} outside-check-like configurations in {par['wall_s']:.1f} s" in row
    assert f"{one['wall_s']:.1f} s in one" in row and d["run_at"][:10] in row


def test_spread_lengths_row_is_its_run_of_record():
    """The status row of the spread-lengths check quotes results/serving_spread.json."""
    d = _json("serving_spread.json")
    cal, n = d["summary"]["calibrated"], d["summary"]["calibrated"]["configurations"]
    row = _status_row("serving with lengths spread")
    assert (f"calibrated TPOT {cal['tpot_within_15pct']}/{n} (MAPE {100 * cal['tpot_ms']['mape']:.1f} %), "
            f"TTFT {cal['ttft_within_25pct']}/{n} ({100 * cal['ttft_ms']['mape']:.1f} %)") in row
    assert " and ".join(f"x{x['measured_ttft_ratio']:.2f} measured, x{x['calibrated_ttft_ratio']:.2f} simulated"
                        for x in d["spread"]) in row and d["run_at"][:10] in row
