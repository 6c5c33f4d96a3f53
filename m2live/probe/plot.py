"""probe.png: SM clock and power vs M per op; GEMM and step predicted vs measured (live / forecast / boost clock);
the clock over the whole run. matplotlib is imported when a picture is drawn."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SRC_STYLE = {"live": ("tab:green", "o"), "forecast": ("tab:orange", "s"), "boost": ("tab:red", "^")}


def _fmt_mape(m: dict | None) -> str:
    m = m or {}
    return ", ".join(f"{src} {m[src]:.1f}%" for src in ("live", "forecast", "boost") if m.get(src) is not None)


def _clock_and_power(ax_clk: Any, ax_pw: Any, cells: list[dict], gpu: dict) -> None:
    """Settled SM clock and board power against M, one line per op, with the max clock and power limit."""
    ops = sorted({c["op"] for c in cells})
    for op in ops:
        mine = sorted((c for c in cells if c["op"] == op), key=lambda c: (c["m"], c.get("repeat", 0)))
        ms = [c["m"] for c in mine]
        ax_clk.plot(ms, [c.get("clock_mhz") or float("nan") for c in mine], "o-", label=op)
        ax_pw.plot(ms, [c.get("power_w") or float("nan") for c in mine], "o-", label=op)
    boost = gpu.get("max_sm_mhz") or gpu.get("catalog_boost_mhz")
    if boost:
        ax_clk.axhline(boost, color="gray", ls="--", lw=1, label=f"max clock {boost:.0f} MHz")
    if gpu.get("power_limit_w"):
        ax_pw.axhline(gpu["power_limit_w"], color="gray", ls="--", lw=1,
                      label=f"power limit {gpu['power_limit_w']:.0f} W")
    for ax, title, unit in ((ax_clk, "SM clock (settled median) vs M", "MHz"),
                            (ax_pw, "board power (settled median) vs M", "W")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens M")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ops:
            ax.legend(fontsize=8)


def _scatter(ax: Any, rows: list[dict], mape_: dict | None, title: str, unit: float, ulabel: str) -> None:
    """Predicted against measured, one colour per clock source, on log axes with the diagonal."""
    lo, hi = float("inf"), 0.0
    for src, (color, marker) in SRC_STYLE.items():
        pts = [(c["time_s"] * unit, c["pred"][src]["time_s"] * unit) for c in rows if src in c.get("pred", {})]
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        m = (mape_ or {}).get(src)
        ax.scatter(xs, ys, s=18, c=color, marker=marker, alpha=0.75,
                   label=f"{src} clock" + (f" (MAPE {m:.1f}%)" if m is not None else ""))
        lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], color="gray", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax.set_xlabel(f"measured ({ulabel})")
    ax.set_ylabel(f"predicted ({ulabel})")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")


def _steps(ax: Any, steps: list[dict], doc: dict) -> None:
    """Steps: the graph mode (else the only one) per clock source; the other mode at the live clock, hollow."""
    step_mape = doc.get("steps", {}).get("mape", {})
    graph_rows = [c for c in steps if c["mode"] == "graph"] or steps
    mode = graph_rows[0]["mode"] if graph_rows else "graph"
    _scatter(ax, graph_rows, step_mape.get(mode),
             f"decoder steps ({doc.get('steps', {}).get('layers', '?')} layers, {mode}): predicted vs measured",
             1e3, "ms")
    other = [c for c in steps if c["mode"] != mode and "live" in c.get("pred", {})]
    if other:
        ax.scatter([c["time_s"] * 1e3 for c in other], [c["pred"]["live"]["time_s"] * 1e3 for c in other],
                   s=26, facecolors="none", edgecolors="tab:blue",
                   label=f"{other[0]['mode']}: {_fmt_mape(step_mape.get(other[0]['mode']))}")
        ax.legend(fontsize=8)


def _timeline(ax: Any, doc: dict, steps: list[dict]) -> None:
    """The SM clock and power over the whole run, with the start of the step phase marked."""
    tr = doc.get("clock_trace", {})
    if tr.get("t_s"):
        ax.plot(tr["t_s"], tr["sm_mhz"], lw=0.8, color="tab:blue", label="SM clock")
        ax.set_ylabel("MHz")
        ax2 = ax.twinx()
        ax2.plot(tr["t_s"], [p if p is not None else float("nan") for p in tr["power_w"]], lw=0.8,
                 color="tab:red", alpha=0.6, label="power")
        ax2.set_ylabel("W")
        for c in steps[:1]:
            ax.axvline(c["t_start_s"], color="k", ls=":", lw=1)
            ax.text(c["t_start_s"], ax.get_ylim()[1], " steps", va="top", fontsize=8)
    ax.set_xlabel("time since start (s)")
    ax.set_title("NVML SM clock and power over the run" if not doc.get("dry_run")
                 else "replayed clock over the run (dry run: synthetic)")
    ax.grid(alpha=0.3)


def _title(doc: dict) -> str:
    gpu = doc.get("gpu", {})
    head = (f"m2live probe ({doc.get('mode')}) on {gpu.get('name')} — {doc.get('date', '')[:10]}, "
            f"torch {doc.get('torch')}, driver {gpu.get('driver') or 'n/a'}")
    sub = f"GEMM MAPE: {_fmt_mape(doc.get('gemm', {}).get('mape'))}"
    step_mape = doc.get("steps", {}).get("mape", {})
    if step_mape:
        sub += "   |   steps MAPE " + "; ".join(f"{m}: {_fmt_mape(v)}" for m, v in step_mape.items())
    if not doc.get("complete", True):
        sub += "   [partial]"
    return head + "\n" + sub


def plot_probe(doc: dict, path: str | os.PathLike) -> Path:
    """probe.png: SM clock and power vs M per op; GEMM and step predicted vs measured (live / forecast /
    boost clock); the clock over the whole run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in doc.get("gemm", {}).get("cells", []) if c.get("time_s")]
    steps = [c for c in doc.get("steps", {}).get("cells", []) if c.get("time_s")]
    fig = plt.figure(figsize=(15, 13))
    gs = fig.add_gridspec(3, 2, height_ratios=[1, 1, 0.8], hspace=0.35, wspace=0.22)
    _clock_and_power(fig.add_subplot(gs[0, 0]), fig.add_subplot(gs[0, 1]), cells, doc.get("gpu", {}))
    _scatter(fig.add_subplot(gs[1, 0]), cells, doc.get("gemm", {}).get("mape"),
             "projection GEMMs: predicted vs measured", 1e6, "us")
    _steps(fig.add_subplot(gs[1, 1]), steps, doc)
    _timeline(fig.add_subplot(gs[2, :]), doc, steps)
    fig.suptitle(_title(doc), fontsize=11)
    out = Path(path)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
