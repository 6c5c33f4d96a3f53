"""``m2live report``: one PNG that a person reads at a glance from a JSONL step trace.

Four panels: predicted (mechanistic) and corrected vs measured step time over the run; the residual histogram
of both; the predicted time stacked per operator; the clock (SM clock vs boost) with the efficiency factors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .trace import TraceError, load_trace

_OP_ORDER = ("qkv", "o", "gate_up", "down", "attn_prefill", "attn_decode", "light", "allreduce", "lm_head",
             "launch", "host", "sampling")


def _bins(n: int, max_bins: int = 400) -> list[slice]:
    if n <= max_bins:
        return [slice(i, i + 1) for i in range(n)]
    edges = np.linspace(0, n, max_bins + 1).astype(int)
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def summarize(records: list[dict], warmup: int = 20) -> dict:
    meas = np.array([r["measured_s"] or np.nan for r in records], float)
    pred = np.array([r["predicted_s"] for r in records], float)
    corr = np.array([r["corrected_s"] for r in records], float)
    ok = np.isfinite(meas) & (meas > 0)
    after = ok.copy()
    after[: min(warmup, len(after))] = False
    warmed = bool(after.any())
    if not warmed:  # a trace no longer than the warm-up: every measured step (said so: after_warmup False)
        after = ok

    def median_ape(x: np.ndarray) -> float | None:
        return float(np.median(np.abs(x[after] - meas[after]) / meas[after])) if after.any() else None

    return {"steps": len(records), "measured_steps": int(ok.sum()), "after_warmup": warmed,
            "median_abs_error_raw": median_ape(pred), "median_abs_error_corrected": median_ape(corr)}


def write_report(trace: str | Path, out: str | Path, warmup: int = 20) -> dict:
    """Render ``trace`` to the PNG ``out``; returns the summary (``skipped_lines``: torn or garbled lines left out)."""
    contents = load_trace(trace)
    records = contents.records
    if all(r["measured_s"] is None for r in records):  # load_trace keeps only positive times or null
        raise TraceError(f"{trace}: no step in the trace has a measurement")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(len(records))
    meas = np.array([r["measured_s"] if r["measured_s"] else np.nan for r in records], float) * 1e3
    pred = np.array([r["predicted_s"] for r in records], float) * 1e3
    corr = np.array([r["corrected_s"] for r in records], float) * 1e3
    summ = summarize(records, warmup)
    summ["skipped_lines"] = len(contents.skipped)
    summ["first_skipped"] = (f"line {contents.skipped[0][0]}: {contents.skipped[0][1]}" if contents.skipped
                             else None)
    first = records[0]
    model = str(first.get("model", ""))
    if model.startswith("/"):
        model = Path(model).name  # a model directory: its name reads better than the path
    fig, ax = plt.subplots(2, 2, figsize=(14, 9))
    fig.suptitle(f"m2live · {model} on {first.get('gpu', '')} · engine {first.get('engine', '0')} · "
                 f"{len(records)} steps", fontsize=12)

    # 1. over time
    a = ax[0, 0]
    a.plot(steps, meas, lw=0.8, color="black", label="measured")
    a.plot(steps, pred, lw=0.8, color="tab:blue", alpha=0.8, label="predicted (mechanistic)")
    a.plot(steps, corr, lw=0.8, color="tab:orange", alpha=0.9, label="corrected (online fit)")
    a.set_yscale("log")
    a.set_xlabel("engine step")
    a.set_ylabel("step time (ms)")
    er, ec = summ["median_abs_error_raw"], summ["median_abs_error_corrected"]
    if er is not None:
        a.set_title(f"step time · median |error| after warm-up: raw {er:.0%}, corrected {ec:.0%}")
    a.legend(loc="upper right", fontsize=8)
    a.grid(alpha=0.3)

    # 2. residual histogram
    a = ax[0, 1]
    ok = np.isfinite(meas)
    r_raw = np.clip((meas[ok] - pred[ok]) / meas[ok], -2, 1)
    r_cor = np.clip((meas[ok] - corr[ok]) / meas[ok], -2, 1)
    bins = np.linspace(-2, 1, 61)
    a.hist(r_raw, bins=bins, alpha=0.5, color="tab:blue", label="raw")
    a.hist(r_cor, bins=bins, alpha=0.6, color="tab:orange", label="corrected")
    a.axvline(0, color="black", lw=0.8)
    a.set_xlabel("residual (measured − predicted) / measured  (clipped to [−2, 1])")
    a.set_ylabel("steps")
    a.set_title("residual distribution")
    a.legend(fontsize=8)

    # 3. stacked per-op predicted time (binned means)
    a = ax[1, 0]
    ops = [o for o in _OP_ORDER if any(o in r.get("ops", {}) for r in records)]
    ops += sorted({k for r in records for k in r.get("ops", {})} - set(ops))
    sl = _bins(len(records))
    x = np.array([s.start for s in sl])
    mat = np.zeros((len(ops), len(sl)))
    for j, s in enumerate(sl):
        chunk = records[s]
        for i, o in enumerate(ops):
            mat[i, j] = 1e3 * np.mean([float(r.get("ops", {}).get(o, 0.0) or 0.0) for r in chunk])
    if ops:
        a.stackplot(x, mat, labels=ops, alpha=0.85)
        a.legend(loc="upper left", fontsize=7, ncol=3)
    a.set_xlabel("engine step")
    a.set_ylabel("predicted time per op (ms)")
    a.set_title("predicted breakdown by operator")
    a.grid(alpha=0.3)

    # 4. clock and factors
    a = ax[1, 1]
    clock = np.array([float(r.get("clock_mhz") or np.nan) for r in records])
    boost = np.array([float(r.get("boost_mhz") or np.nan) for r in records])
    a.plot(steps, clock, color="tab:red", lw=0.9, label="SM clock used (MHz)")
    a.plot(steps, boost, color="gray", lw=0.8, ls="--", label="boost (MHz)")
    a.set_xlabel("engine step")
    a.set_ylabel("MHz")
    sources = sorted({str(r.get("clock_source")) for r in records})
    a.set_title(f"clock (source: {', '.join(sources)}) and efficiency factors")
    b = a.twinx()
    fac_names = sorted({k for r in records for k in r.get("factors", {})})
    for name in fac_names:
        vals = []
        for r in records:
            d = r.get("factors", {}).get(name) or {}
            v = [float(t) for t in d.values() if isinstance(t, (int, float))]
            vals.append(np.mean(v) if v else np.nan)
        b.plot(steps, vals, lw=0.8, alpha=0.8, label=name)
    b.set_ylabel("factor (mean over ops)")
    b.set_ylim(0, 1.1)
    h1, l1 = a.get_legend_handles_labels()
    h2, l2 = b.get_legend_handles_labels()
    a.legend(h1 + h2, l1 + l2, loc="lower left", fontsize=7, ncol=2)
    a.grid(alpha=0.3)

    fig.tight_layout()
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise TraceError(f"cannot write {out}: {e.strerror or e.__class__.__name__}") from None
    finally:
        plt.close(fig)
    return summ
