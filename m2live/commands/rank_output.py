"""What ``m2live rank`` prints and plots: the ranking tables and picture, and the decision-quality table."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from ..planner import LayoutResult, PlanConfig, Ranking
from ..planner.memory import reserve_label

_ABBR = {"compute": "cmp", "memory": "mem", "communication": "comm", "host": "host"}
_METRIC = {"gpu": "out tok/s per GPU", "dollar": "out tokens per $", "layout": "out tok/s per replica"}
_UNIT = {"gpu": "generated tokens/s per GPU", "dollar": "generated tokens per $",
         "layout": "generated tokens/s per replica"}


def short(name: str) -> str:
    return name.removeprefix("NVIDIA ").replace("GeForce ", "").replace(" Edition", "")


def json_default(o: object) -> object:
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


# ---- the ranking --------------------------------------------------------------------------------------------
def _limits_text(cfg: PlanConfig) -> str:
    """The engine limits in the header: the ones given, and whose the others are (vLLM's for each device)."""
    given = [f"{label} {v}" for label, v in (("max_num_seqs", cfg.max_num_seqs),
                                              ("token budget", cfg.max_batched_tokens)) if v]
    if len(given) < 2:
        given.append(f"vLLM {cfg.vllm_version}'s {'limits' if not given else 'other limit'} for each device")
    return ", ".join(given)


def _header(c: Console, r: Ranking) -> None:
    st = r.workload.stats()
    cfg = r.config
    slo = "none" if cfg.slo_s is None else f"{cfg.slo_s * 1e3:g} ms/step"
    c.print(f"[bold]{r.model.name}[/bold] ({r.model.param_count() / 1e9:.1f} B params) — workload "
            f"{r.workload.describe()}")
    c.print(f"  mean prompt {st.mean_prompt:.0f}, mean output {st.mean_output:.0f}, decode context "
            f"{st.decode_ctx:.0f}, p99 request {st.total_p['p99']:.0f} tokens; SLO {slo}; clock {cfg.clock}; "
            f"{cfg.precision} weights; "
            + _limits_text(cfg))
    ctx = r.model.max_context
    if ctx is not None and st.total_p["p99"] > ctx:
        c.print(f"  [yellow]requests longer than the model's context ({ctx} tokens) are refused by the server: the "
                f"simulated serving leaves them out (requests_past_context in --json)[/yellow]")


def _layout_row(x: LayoutResult, with_rate: bool) -> list[str]:
    per_dollar = x.output_tokens_per_dollar
    sh = x.bound_shares.get(x.bound, 0.0)
    row = [str(x.rank) if x.rank else "-", short(x.gpu), str(x.tp)]
    if x.feasible:
        row += [f"{x.output_tokens_per_s_per_gpu:,.0f}", f"{x.output_tokens_per_s:,.0f}",
                f"{per_dollar / 1e3:,.0f}" if per_dollar else "", str(x.decode_batch),
                str(x.prefill_tokens_per_step), f"{x.step_ms:.2f}",
                "" if x.chunk_budget is None else str(x.chunk_budget), f"{x.f_clk:.2f}",
                f"{x.bound} {sh:.0%}", x.limited_by, f"{x.memory.kv_tokens:,}"]
        sv = x.serving or {}
        row += [str(sv.get("concurrency", "")), f"{sv['ttft_ms']:,.0f}" if sv else "",
                f"{sv['tpot_ms']:.1f}" if sv else ""]
    else:
        row += ["0", "0", "", "0", "", f"{x.step_ms:.2f}", "", f"{x.f_clk:.2f}", f"{x.bound} {sh:.0%}",
                "[red]SLO unmet[/red]", f"{x.memory.kv_tokens:,}", "", "", ""]
    if with_rate:
        row.append(str(x.fleet["gpus"]) if x.fleet else "")
    return row


def _ranking_table(r: Ranking, shown: list[LayoutResult]) -> Table:
    t = Table(title=f"ranking by {_METRIC[r.rank_by]}")
    cols = ["#", "GPU", "TP", "tok/s/GPU", "tok/s", "k tok/$", "batch", "prefill/step", "step ms",
            "chunk budget", "f_clk", "bound", "limited by", "KV tokens", "conc.", "TTFT ms", "TPOT ms"]
    if r.workload.rate:
        cols.append("GPUs for rate")
    for col in cols:
        t.add_column(col, justify="left" if col in ("GPU", "bound", "limited by") else "right")
    for x in shown:
        t.add_row(*_layout_row(x, bool(r.workload.rate)))
    return t


def _steps_table(shown: list[LayoutResult]) -> Table:
    t = Table(title="representative steps: predicted ms (bound)")
    names: list[str] = []
    for x in shown[:6]:
        for s in x.steps:
            if s["name"] not in names:
                names.append(s["name"])
    t.add_column("layout")
    for n in names:
        t.add_column(n, justify="right")
    for x in shown[:6]:
        by = {s["name"]: s for s in x.steps}
        t.add_row(f"{short(x.gpu)} tp{x.tp}",
                  *[f"{by[n]['step_ms']:.2f} ({_ABBR[by[n]['bound']]})" if n in by else "-" for n in names])
    return t


def _replay_table(shown: list[LayoutResult]) -> Table:
    t = Table(title="recorded trace replayed (its own batches)")
    for col in ("layout", "mean step ms", "p99 step ms", "tok/s", "within SLO", "fits batches"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for x in shown[:10]:
        if x.replay:
            rp = x.replay
            t.add_row(f"{short(x.gpu)} tp{x.tp}", f"{rp['mean_step_ms']:.2f}", f"{rp['p99_step_ms']:.2f}",
                      f"{rp['tokens_per_s']:,.0f}", f"{rp['within_slo']:.1%}" if "within_slo" in rp else "",
                      "yes" if rp["fits_recorded_batches"] else "no")
    return t


def _excluded_table(excluded: list[LayoutResult]) -> Table:
    t = Table(title="excluded layouts (do not fit)")
    t.add_column("GPU")
    t.add_column("TP", justify="right")
    t.add_column("reason")
    for x in excluded:
        t.add_row(short(x.gpu), str(x.tp), x.reason)
    return t


def print_ranking(r: Ranking, top: int = 0) -> None:
    c = Console(width=160)
    cfg = r.config
    _header(c, r)
    shown = r.layouts[:top] if top else r.layouts
    c.print(_ranking_table(r, shown))
    if shown and shown[0].steps:
        c.print(_steps_table(shown))
    if any(x.replay for x in shown):
        c.print(_replay_table(shown))
    for x in r.layouts:
        if not x.feasible:
            c.print(f"  [yellow]SLO unmet[/yellow] {short(x.gpu)} tp{x.tp}: {x.reason}")
    if r.excluded:
        c.print(_excluded_table(r.excluded))
    if cfg.constants:
        own = "; ".join(f"{short(g)} from its {k['constants'].fitted_on}" for g, k in sorted(cfg.constants.items()))
        rest = {x.gpu for x in (*r.layouts, *r.excluded)} - set(cfg.constants)
        c.print(f"calibrated: {own}" + ("; the other GPUs from their datasheets and their family's constants."
                                         if rest else "."))
    c.print(f"memory reserve: {cfg.reserve_fraction:.0%} of device memory + {reserve_label(cfg.reserve_bytes)}; the "
            "activation peak of vLLM's start-up profile; KV cache gets the rest.")
    c.print("tok/s, conc., TTFT and TPOT: m2live simulate's closed loop (vLLM V1 scheduler) at the operating point's "
            "concurrency, lowered until the mean TPOT meets the SLO; batch / step ms: the steady-state step.")


def _plot_slo_curves(ax, r: Ranking) -> None:
    """Throughput reachable under each SLO, for the best TP of each of the ten best GPUs."""
    best: dict[str, LayoutResult] = {}
    for x in r.layouts:  # best TP per GPU (ranked order)
        if x.feasible:
            best.setdefault(x.gpu, x)
    for x in list(best.values())[:10]:
        xs = [p["slo_ms"] for p in x.curve if p["output_tokens_per_s_per_gpu"] > 0]
        ys = [p["output_tokens_per_s_per_gpu"] for p in x.curve if p["output_tokens_per_s_per_gpu"] > 0]
        if xs:
            ax.plot(xs, ys, marker="o", ms=3, label=f"{short(x.gpu)} tp{x.tp}")
    if r.config.slo_s is not None:
        ax.axvline(r.config.slo_s * 1e3, color="grey", ls="--", lw=1, label="SLO")
    ax.set_xscale("log")
    ax.set_xlabel("per-step latency SLO (ms)")
    ax.set_ylabel("generated tokens/s per GPU")
    ax.set_title("throughput reachable under the SLO (best TP per GPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _plot_ranked_bars(ax, r: Ranking) -> None:
    """The twenty best layouts' scores, coloured by what bounds their operating point."""
    colors = {"compute": "tab:red", "memory": "tab:blue", "communication": "tab:purple", "host": "tab:grey"}
    top = [x for x in r.layouts if x.feasible][:20]
    scores = [x.score or 0.0 for x in top]
    labels = [f"{short(x.gpu)} tp{x.tp}" for x in top]
    ax.barh(range(len(top))[::-1], scores, color=[colors.get(x.bound, "k") for x in top])
    ax.set_yticks(range(len(top))[::-1], labels, fontsize=7)
    ax.set_xlabel(_UNIT[r.rank_by])
    ax.set_title("ranking (colour: what bounds the operating point)")
    for b, col in colors.items():
        ax.bar(0, 0, color=col, label=b)
    ax.legend(fontsize=7, loc="lower right")


def plot_ranking(r: Ranking, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6.5))
    _plot_slo_curves(ax1, r)
    _plot_ranked_bars(ax2, r)
    slo = "no SLO" if r.config.slo_s is None else f"SLO {r.config.slo_s * 1e3:g} ms"
    fig.suptitle(f"{r.model.name} — {r.workload.describe()} — {slo}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- decision quality ---------------------------------------------------------------------------------------
def _quality_cells(s: dict) -> list[str]:
    if not s.get("points"):
        return ["0", "", "", "", "", "", ""]
    return [str(s["points"]), f"{s['top1_hit_rate']:.0%}",
            "" if s["spearman_mean"] is None else f"{s['spearman_mean']:+.2f}",
            f"{s['regret_mean']:.2%}", f"{s['regret_max']:.2%}",
            "" if s["pairwise_accuracy"] is None else f"{s['pairwise_accuracy']:.0%}",
            f"{s['relative_speed_error_mean']:.1%}"]


def _quality_table(out: dict) -> Table:
    t = Table(title="decision quality: predicted vs measured GPU order (GEMM-sum workloads)")
    for col in ("M", "points", "top-1 hit", "Spearman ρ", "mean regret", "max regret", "pairs right",
                "speed-ratio err"):
        t.add_column(col, justify="right")
    for m, s in out["by_m"].items():
        t.add_row(m, *_quality_cells(s))
    t.add_section()
    t.add_row("all", *_quality_cells(out["summary"]))
    if "baseline_summary" in out:
        t.add_row("roofline η=0.75", *_quality_cells(out["baseline_summary"]))
    lay = out.get("layouts")
    if lay and lay["summary"].get("points"):
        t.add_section()
        t.add_row("GPU×TP layouts", *_quality_cells(lay["summary"]))
        if "baseline_summary" in lay:
            t.add_row("  roofline η=0.75", *_quality_cells(lay["baseline_summary"]))
    return t


def print_validation(out: dict) -> None:
    c = Console(width=140)
    c.print(f"GPUs: {', '.join(out['gpus'])}; {len(out['workloads'])} projection workloads "
            f"× M in {out['ms']}; predictor: {out['predictor']}")
    c.print(_quality_table(out))
    lay = out.get("layouts")
    if lay and lay["summary"].get("points"):
        c.print(f"GPU×TP layouts: {lay['what']}; measured best: {lay['measured_winners']}")
    c.print(f"measured best GPU per point: {out['measured_winners']}")
    if "note" in out:
        c.print(f"[yellow]{out['note']}[/yellow]")


def plot_validation(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6))
    for g in out["gpus"]:
        xs = [p["measured_ms"][g] for p in out["points"] if g in p["measured_ms"]]
        ys = [p["predicted_ms"][g] for p in out["points"] if g in p["predicted_ms"]]
        ax.scatter(xs, ys, s=10, label=short(g))
    lo = min([p for pt in out["points"] for p in pt["measured_ms"].values()] or [1e-3])
    hi = max([p for pt in out["points"] for p in pt["measured_ms"].values()] or [1.0])
    ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured GEMM-sum time (ms)")
    ax.set_ylabel("predicted (ms)")
    s = out["summary"]
    ax.set_title(f"top-1 {s.get('top1_hit_rate', 0):.0%}, regret {s.get('regret_mean', 0):.2%}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
