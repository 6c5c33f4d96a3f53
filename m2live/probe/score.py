"""Scoring (pure): m2live's predictions for a GEMM cell at three clocks, the clock/power statistics of a window
of NVML readings, and the MAPE summaries of the measured cells. No torch, no device."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ..predictor import OpModel
from ..validate import mape

SOURCES = ("live", "forecast", "boost")  # the clock a prediction used: measured, power-cap forecast, boost

# NVML clock-event (formerly "throttle") reason bits, nvml.h nvmlClocksEventReason*.
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


def reason_names(mask: int | None) -> list[str]:
    if not mask:
        return []
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    rest = mask & ~sum(CLOCK_EVENT_REASONS)
    if rest:
        names.append(f"0x{rest:x}")
    return names


def gemm_predictions(om: OpModel, m: int, n: int, k: int, clock_mhz: float | None) -> dict[str, dict]:
    """OpModel.gemm (weights cold in L2) at the live clock, at the power-cap forecast (as Predictor derives it
    from the op's tensor and DRAM activity at boost), and at boost."""
    boost = om.gemm(m, n, k, 1.0, l2_warm=False)
    flops = 2.0 * m * n * k
    nbytes = om.elt * (m * k + n * k + m * n)
    f_fc = om.clock_ratio(flops, boost.t, nbytes)
    out = {"boost": (1.0, boost), "forecast": (f_fc, om.gemm(m, n, k, f_fc, l2_warm=False))}
    if clock_mhz is not None and clock_mhz > 0:
        f_live = clock_mhz / om.gpu.boost_mhz
        out["live"] = (f_live, om.gemm(m, n, k, f_live, l2_warm=False))
    return {src: {"f_clk": f, "time_s": t.t, "bound": t.bound} for src, (f, t) in out.items()}


def clock_stats(readings: Sequence[Any]) -> dict[str, Any]:
    """Median SM clock, power, temperature; OR of the event-reason masks; min/max clock; sample count."""
    if not readings:
        return {"samples": 0}
    mhz = [r.sm_mhz for r in readings]
    power = [r.power_w for r in readings if r.power_w is not None]
    temp = [r.temperature_c for r in readings if r.temperature_c is not None]
    masks = [int(r.event_reasons) for r in readings if r.event_reasons is not None]
    mask = 0
    for x in masks:
        mask |= x
    return {
        "samples": len(readings),
        "clock_mhz": statistics.median(mhz), "clock_min_mhz": min(mhz), "clock_max_mhz": max(mhz),
        "max_mhz": readings[-1].max_mhz,
        "power_w": statistics.median(power) if power else None,
        "power_limit_w": readings[-1].power_limit_w,
        "temperature_c": statistics.median(temp) if temp else None,
        "event_reasons": mask if masks else None,
        "event_reason_names": reason_names(mask) if masks else [],
    }


def errors(pred: dict[str, dict], measured_s: float) -> dict[str, float]:
    """Signed relative error (predicted − measured) / measured of each clock's prediction."""
    return {src: (p["time_s"] - measured_s) / measured_s for src, p in pred.items()}


def _time_mape(cells: list[dict]) -> dict[str, float | None]:
    """MAPE of the predicted times against the measured ones, per clock source."""
    return {src: mape((c["pred"][src]["time_s"], c["time_s"]) for c in cells if src in c["pred"])
            for src in SOURCES}


def clock_forecast_mape(cells: list[dict]) -> float | None:
    """The power-cap forecast of the clock itself, against the clock measured (the seed's open item)."""
    return mape((c["pred"]["forecast"]["f_clk"], c["pred"]["live"]["f_clk"]) for c in cells
                if c.get("time_s") and "live" in c["pred"])


def summarise_gemm(cells: list[dict]) -> dict:
    done = [c for c in cells if c.get("time_s")]
    by_op = {op: _time_mape([c for c in done if c["op"] == op]) for op in sorted({c["op"] for c in done})}
    return {"mape": _time_mape(done), "mape_by_op": by_op, "clock_forecast_mape": clock_forecast_mape(done),
            "cells_measured": len(done)}


def summarise_steps(cells: list[dict]) -> dict:
    return {mode: _time_mape([c for c in cells if c["mode"] == mode and c.get("time_s")])
            for mode in sorted({c["mode"] for c in cells})}


def clock_summary(cells: list[dict], max_mhz: float | None) -> dict:
    """Per op: settled clock at the largest M measured and the droop below the max (boost) clock."""
    out = {}
    for op in sorted({c["op"] for c in cells if c.get("clock_mhz")}):
        mine = sorted((c for c in cells if c["op"] == op and c.get("clock_mhz")), key=lambda c: c["m"])
        clk = statistics.median(c["clock_mhz"] for c in mine if c["m"] == mine[-1]["m"])
        ref = max_mhz or mine[-1].get("max_mhz")
        out[op] = {"m": mine[-1]["m"], "clock_mhz": clk, "droop": (1 - clk / ref) if ref else None,
                   "clock_at_min_m_mhz": mine[0]["clock_mhz"], "min_m": mine[0]["m"]}
    return out


def pct(x: float | None) -> str:
    return "   n/a" if x is None else f"{100 * x:+6.1f}%"


def error_line(err: dict[str, float]) -> str:
    """``err live +x% forecast +y% boost +z%`` for a progress line."""
    return f"err live {pct(err.get('live'))} forecast {pct(err.get('forecast'))} boost {pct(err.get('boost'))}"
