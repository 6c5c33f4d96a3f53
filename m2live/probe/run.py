"""The probe run: open the device and the clock, measure the GEMM phase then the step phase (a failure in one is
recorded and the other still runs; SIGTERM stops measuring and keeps what was measured), write ``probe.json``
after every cell and ``probe.png`` after each phase."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .device import Interrupted, ProbeError, one_line, sigterm_interrupts
from .env import _Env, open_env
from .gemms import run_gemms
from .output import _Writer, default_out_dir, git_commit, prepare_out
from .plan import SCHEMA, ProbePlan, make_plan
from .plot import plot_probe
from .steps import run_steps

Say = Callable[[str], None]


def _plan_doc(plan: ProbePlan, env: _Env) -> dict:
    return {"ms": list(plan.ms), "ops": {op: list(nk) for op, nk in plan.gemm_ops.items()},
            "repeats": plan.repeats, "warmup_s": plan.warmup_s, "sustain_s": plan.sustain_s,
            "cooldown_s": plan.cooldown_s, "target_rep_s": plan.target_rep_s, "seed": plan.seed,
            "step_layers": plan.step_layers, "time_limit_s": plan.time_limit_s,
            "estimate_s": plan.estimate_s(), "timing": env.dev.timing,
            "l2_bytes_for_weight_rings": env.l2_bytes, "l2_ring_factor": plan.l2_ring_factor}


def _new_doc(plan: ProbePlan, env: _Env, out_dir: Path, dry_run: bool, quick: bool) -> dict[str, Any]:
    """The probe.json document before anything is measured: what runs where, the plan, empty sections."""
    torch, spec = env.torch, env.spec
    return {
        "schema": SCHEMA, "complete": False, "mode": plan.mode, "dry_run": dry_run, "quick": quick,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "gpu": {**env.gpu_info, "catalog_name": spec.name, "catalog_boost_mhz": spec.boost_mhz,
                "catalog_tdp_w": spec.tdp_w, "catalog_l2_bytes": spec.l2_bytes},
        "torch": torch.__version__, "cuda": getattr(torch.version, "cuda", None),
        "python": platform.python_version(), "m2live_commit": git_commit(),
        "clock_source": env.source.name,
        "plan": _plan_doc(plan, env),
        "model": plan.model.name,
        "gemm": {"cells": [], "mape": {}, "note": "OpModel.gemm with l2_warm=False; time = median per call over "
                 "the settled (second) half of the sustained phase; clock/power = median NVML samples there"},
        "steps": {"cells": [], "mape": {}},
        "mape": {}, "errors": [], "out_dir": str(out_dir),
    }


def _phase(doc: dict, name: str, fn: Callable[[], None], say: Say) -> None:
    """Run one phase; a failure inside it is recorded (one line) and the next phase still runs."""
    try:
        fn()
    except (Interrupted, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - a GPU-side failure must not lose the other phase's data
        msg = f"{name}: {one_line(e)}"
        doc["errors"].append(msg)
        say(f"error in {msg}")


def _plot_safe(out_dir: Path, doc: dict, say: Say) -> None:
    try:
        plot_probe(doc, out_dir / "probe.png")
    except Exception as e:  # noqa: BLE001 - a plotting problem never loses probe.json
        msg = f"plot: {one_line(e)}"
        if msg not in doc["errors"]:
            doc["errors"].append(msg)
        say(f"error in {msg}")


def _measure(env: _Env, plan: ProbePlan, doc: dict, writer: _Writer, say: Say, deadline: float | None,
             plot: bool) -> None:
    """Both phases under inference mode, the picture drawn between them; ``doc["complete"]`` at the end."""
    with env.torch.inference_mode():
        _phase(doc, "gemm", lambda: run_gemms(env, plan, doc, writer, say, deadline), say)
        if plot:
            _plot_safe(writer.out, doc, say)
        _phase(doc, "steps", lambda: run_steps(env, plan, doc, writer, say, deadline), say)
    doc["complete"] = not doc["errors"] and not doc["gemm"].get("skipped") and not doc["steps"].get("skipped")


def _finish(env: _Env, doc: dict, writer: _Writer, say: Say, plot: bool) -> None:
    """Stop the clock, release the source, summarise, write probe.json (and probe.png) for the last time."""
    env.sampler.stop()
    try:
        env.source.close()
    except Exception:  # noqa: BLE001
        pass
    doc["peak_memory_gb"] = env.dev.peak_memory_gb()
    doc["mape"] = {"gemm": doc["gemm"].get("mape", {}), "steps": doc["steps"].get("mape", {}),
                   "clock_forecast": {"gemm": doc["gemm"].get("clock_forecast_mape"),
                                      "steps": doc["steps"].get("clock_forecast_mape")}}
    writer.flush()
    if plot:
        _plot_safe(writer.out, doc, say)


def run_probe(out: str | os.PathLike | None = None, *, quick: bool = False, dry_run: bool = False,
              gpu: str | None = None, seed: int = 0, time_limit_s: float | None = None,
              say: Say = print, plot: bool = True) -> dict:
    """Run the probe and write ``probe.json`` and ``probe.png``; returns the JSON document."""
    t0 = time.monotonic()
    if time_limit_s is not None and not time_limit_s > 0:
        raise ProbeError(f"--time-limit must be positive, got {time_limit_s}")
    plan = make_plan(quick=quick, dry_run=dry_run, seed=seed, time_limit_s=time_limit_s)
    out_dir = prepare_out(out) if out is not None else None  # fail on a bad path before anything slow
    env = open_env(dry_run, gpu, plan)
    if out_dir is None:
        out_dir = prepare_out(default_out_dir(env.gpu_info.get("name") or env.spec.name, dry_run))
    doc = _new_doc(plan, env, out_dir, dry_run, quick)
    writer = _Writer(out_dir, doc, env.sampler, t0)
    deadline = t0 + plan.time_limit_s if plan.time_limit_s else None
    say(f"m2live probe ({plan.mode}): {doc['gpu'].get('name')} → predicting for {env.spec.name}; "
        f"torch {env.torch.__version__}; writing {out_dir}; estimate ~{plan.estimate_s():.0f} s of measuring")
    env.sampler.start()
    try:
        with sigterm_interrupts():
            _measure(env, plan, doc, writer, say, deadline, plot)
    except Interrupted:
        doc["errors"].append("interrupted by SIGTERM")
        say("interrupted: writing what was measured")
    finally:
        _finish(env, doc, writer, say, plot)
    return doc
