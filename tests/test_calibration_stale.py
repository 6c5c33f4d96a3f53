"""A calibration fitted under an older model is named when it is loaded.

A calibration's fitted values were fitted alongside every constant the fit held fixed. When a later m2live adds a
term (FA3's tile scheduler, 2026-12-06) or refits a prior, an older file's fitted values may count that change
twice (an H100 decode calibration made before the scheduler term absorbed its cost into item_cost: +31 % at 512
sequences x 1 key). The file records what it was fitted under; loading it compares that with the model of today
and says what changed, in one warning line, and still predicts with it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from m2live.calibration_file import Calibration, held_constants, load
from m2live.cli import main
from m2live.efficiency import constants_for
from m2live.hardware import get_gpu

GEMM = Path(__file__).resolve().parents[2] / "shared" / "data" / "opbench" / "h100_sxm" / "gemm_bf16.csv"


def _calibration(name: str = "h100-sxm") -> tuple[Calibration, dict]:
    """A calibration of one decode constant as `calibrate fit` writes it (priors and held constants of today)."""
    gpu = get_gpu(name)
    prior = constants_for(gpu)
    consts = {"item_cost": {"prior": prior.item_cost, "fitted": prior.item_cost * 1.2}}
    cal = Calibration(gpu.name, gpu.kernel_family, consts, {"decode": 16}, {}, "0", "2026-12-07", {}, None, {},
                      {"bf16": held_constants(prior, consts)})
    return cal, cal.to_json()


def test_a_calibration_of_todays_model_has_nothing_changed_and_round_trips(tmp_path, caplog):
    cal, doc = _calibration()
    assert "held" in doc and "t_sched" in doc["held"]["bf16"] and "item_cost" not in doc["held"]["bf16"]
    assert "fitted_on" not in doc["held"]["bf16"]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="m2live"):
        back = load(path)
    assert back.changed() == [] and not caplog.records
    assert back.held == cal.held  # tuples stored as lists, compared as stored


def test_a_term_changed_since_the_fit_is_named_on_load(tmp_path, caplog):
    """A held constant of another value (the file's model had no tile scheduler) and a prior refitted since are
    each named, with the value then and now."""
    prior = constants_for(get_gpu("h100-sxm"))
    assert prior.t_sched > 0  # the term this test stands for
    _, doc = _calibration()
    doc["held"]["bf16"]["t_sched"] = 0.0
    doc["constants"]["item_cost"]["prior"] = prior.item_cost * 0.8
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="m2live"):
        cal = load(path)
    changed = cal.changed()
    assert any(c.startswith("t_sched 0 -> ") for c in changed), changed
    assert any(c.startswith("item_cost prior ") for c in changed), changed
    assert len(caplog.records) == 1 and "refit it" in caplog.records[0].getMessage()
    # the calibration still predicts: the warning says, it does not refuse
    assert cal.arch_constants().item_cost == doc["constants"]["item_cost"]["fitted"]


def test_a_term_added_since_counts_from_its_default():
    """A file written before a field existed lacks it in its held constants: the field's default stood in for it
    then, so a non-default value today is a change and a default one is not."""
    _, doc = _calibration()
    del doc["held"]["bf16"]["t_sched"]  # written before the field existed (its default, 0, stood for it)
    assert any(c.startswith("t_sched 0 -> ") for c in Calibration.from_json(doc).changed())
    _, doc = _calibration("a100-sxm4-80gb")
    assert constants_for(get_gpu("a100-sxm4-80gb")).t_sched == 0.0  # Ampere has no such term
    del doc["held"]["bf16"]["t_sched"]
    assert Calibration.from_json(doc).changed() == []
    doc["held"]["bf16"]["t_gone"] = 1.0  # a constant the model has since dropped
    assert Calibration.from_json(doc).changed() == ["t_gone (no longer in the model)"]


def test_a_file_without_held_constants_is_checked_on_its_priors():
    _, doc = _calibration()
    del doc["held"]
    assert Calibration.from_json(doc).changed() == []
    doc["constants"]["item_cost"]["prior"] *= 0.8
    assert [c.split(" ")[:2] for c in Calibration.from_json(doc).changed()] == [["item_cost", "prior"]]


def test_the_cli_says_so_in_one_warning_line_and_predicts(tmp_path, capsys):
    _, doc = _calibration()
    doc["held"]["bf16"]["t_sched"] = 0.0
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    out = tmp_path / "o.csv"
    assert main(["ops", str(GEMM), "--gpu", "h100-sxm", "--calibration", str(path), "-o", str(out)]) == 0
    # (an in-process plugin test may have given the m2live logger its own handler: only the CLI's lines count)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("m2live ops: warning: ")]
    assert len(err) == 1 and "t_sched" in err[0], err
    assert out.stat().st_size > 0


def test_malformed_held_constants_are_one_line_errors(tmp_path, capsys):
    _, doc = _calibration()
    path = tmp_path / "bad.json"
    for bad in ([1, 2], {"int4": {}}, {"bf16": 3}):
        doc["held"] = bad
        path.write_text(json.dumps(doc))
        assert main(["ops", str(GEMM), "--gpu", "h100-sxm", "--calibration", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'held'" in err[0], err


def test_held_values_no_model_holds_are_one_line_errors(tmp_path, capsys):
    """An integer past any float, or lists nested deeper than a table, are refused when read, never a traceback
    when compared."""
    _, doc = _calibration()
    path = tmp_path / "odd.json"
    deep: list = [1.0]
    for _ in range(600):
        deep = [deep]
    for bad in (10**400, deep, {"a": 1}, float("nan")):
        doc["held"]["bf16"]["t_sched"] = bad
        path.write_text(json.dumps(doc))
        assert main(["ops", str(GEMM), "--gpu", "h100-sxm", "--calibration", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'held'" in err[0], err


def test_a_change_the_fp8_constants_share_is_named_once():
    """The fp8 constants share every field but their GEMM group's with the bf16 ones: a change to one of those is
    named once, not again for fp8."""
    gpu = get_gpu("h100-sxm")
    prior, prior8 = constants_for(gpu), constants_for(gpu, "fp8")
    consts = {"item_cost": {"prior": prior.item_cost, "fitted": prior.item_cost}}
    consts8 = {"eta_tc": {"prior": prior8.eta_tc, "fitted": prior8.eta_tc}}
    cal = Calibration(gpu.name, gpu.kernel_family, consts, {"decode": 16, "gemm_fp8": 32}, {}, "0", "", {}, None,
                      consts8, {"bf16": held_constants(prior, consts), "fp8": held_constants(prior8, consts8)})
    doc = cal.to_json()
    for dtype in ("bf16", "fp8"):
        doc["held"][dtype]["t_sched"] = 0.0
    doc["held"]["fp8"]["item_cost"] = prior.item_cost * 0.8  # the fp8 side held the bf16 prior that moved
    doc["constants"]["item_cost"]["prior"] = prior.item_cost * 0.8
    changed = Calibration.from_json(doc).changed()
    assert [c.split(" ")[0] for c in changed].count("t_sched") == 1, changed
    assert [c.split(" ")[0] for c in changed].count("item_cost") == 1, changed


def test_config_check_says_it_once_and_passes(tmp_path):
    """`m2live config check` reads M2LIVE_CALIBRATION to validate it and says what changed once, as a warning
    (exit 0): a calibration of an older model is still a calibration."""
    import os
    import subprocess
    import sys

    _, doc = _calibration()
    doc["held"]["bf16"]["t_sched"] = 0.0
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    env = {**os.environ, "M2LIVE_CALIBRATION": str(path), "M2LIVE_GPU": "h100-sxm"}
    p = subprocess.run([sys.executable, "-m", "m2live", "config", "check"], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert p.returncode == 0, p.stderr
    warned = [line for line in p.stderr.splitlines() if "was fitted under a model that has changed" in line]
    assert len(warned) == 1 and warned[0].startswith("m2live config: warning: "), p.stderr
