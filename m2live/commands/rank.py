"""Rank GPU SKUs and tensor-parallel layouts for a model and workload (capacity planning), or score the ranking.

    m2live rank --model MODEL --workload SPEC [--gpus LIST|all] [--tp 1,2,4,8] [--slo-ms X]
                [--price GPU=$/h,...] [--plot FILE.png] [--json]
    m2live rank --validate DIR [DIR ...] [--json] [--plot FILE.png]

SPEC: a preset (chat, summarisation, long-context; optionally followed by overrides such as ``chat,rate=4``),
``prompt=DIST,output=DIST[,rate=REQ_PER_S]`` with DIST one of ``N``, ``fixed:N``, ``uniform:LO:HI``,
``normal:MEAN:STD``, ``lognormal:MEDIAN:SIGMA``, or ``trace:PATH`` (an m2live JSONL trace).
"""

from __future__ import annotations

import argparse
import json
import math

from rich.console import Console
from rich.table import Table

from ..hardware import all_gpus, get_gpu
from ..planner import (
    PlanConfig,
    PlanError,
    Ranking,
    parse_prices,
    parse_tp_list,
    rank,
    validate_opbench,
)
from ..validate import positive_float
from ..workload import parse_workload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="preset name or path to config.json / model directory")
    p.add_argument("--workload", help="preset, prompt=DIST,output=DIST[,rate=R], or trace:PATH")
    p.add_argument("--gpus", default="all", help="comma-separated NVML names or aliases, or 'all' (default)")
    p.add_argument("--tp", default="1,2,4,8", help="tensor-parallel sizes to consider (default 1,2,4,8)")
    p.add_argument("--slo-ms", help="per-step latency SLO in ms (= inter-token latency); default: none")
    p.add_argument("--price", help="$ per GPU-hour, e.g. 'h100-sxm=2.5,a100-80gb=1.6'; ranks per dollar "
                                   "when every fitting GPU has a price")
    p.add_argument("--rank-by", default="auto", choices=("auto", "gpu", "dollar", "layout"),
                   help="gpu: generated tokens/s per GPU; dollar: tokens per $; layout: tokens/s per replica")
    p.add_argument("--clock", default="forecast", choices=("forecast", "boost"),
                   help="SM clock for the predictions (default: forecast from the power cap)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8"),
                   help="linear-layer weights: bf16 (default), or fp8 (vLLM's W8A8 e4m3 with per-tensor scales; "
                        "attention and the KV cache stay bf16; GPUs without fp8 tensor cores are excluded)")
    p.add_argument("--max-seqs", default="1024", help="vLLM max_num_seqs (default 1024)")
    p.add_argument("--max-batched-tokens", default="8192", help="vLLM max_num_batched_tokens (default 8192)")
    p.add_argument("--top", default="0", help="show only the best N layouts in the table (default: all)")
    p.add_argument("--plot", metavar="FILE.png", help="write a picture: throughput vs SLO and ranked bars")
    p.add_argument("--validate", nargs="+", metavar="DIR",
                   help="instead of ranking: decision quality on measured opbench folders")
    p.add_argument("--calibration", metavar="CAL.json", help="one GPU's own constants (m2live calibrate fit); "
                                                          "that GPU must be among --gpus")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def calibrated_constants(path: str | None, gpus: list[str]) -> dict:
    """GPU name -> constants of the calibration at ``path``; refused when its GPU is not among those ranked."""
    if not path:
        return {}
    from ..calibrate import load

    cal = load(path)
    ranked = {get_gpu(g).name for g in gpus}
    if cal.gpu not in ranked:
        raise PlanError(f"calibration {path} is for {cal.gpu}, which is not among the GPUs ranked "
                        f"({', '.join(sorted(ranked))}): add it to --gpus or drop --calibration")
    return {cal.gpu: cal.arch_constants()}


def _pos_int(text: str, flag: str) -> int:
    s = str(text).strip()
    if not s.isdigit() or int(s) < 1:
        raise PlanError(f"{flag} must be a positive integer, got {text!r}")
    return int(s)


def _nonneg_int(text: str, flag: str) -> int:
    s = str(text).strip()
    if not s.isdigit():
        raise PlanError(f"{flag} must be a non-negative integer, got {text!r}")
    return int(s)


def parse_slo(text: str | None) -> float | None:
    if text is None:
        return None
    return positive_float(text, "--slo-ms (milliseconds)", PlanError) / 1e3


def parse_gpus(text: str) -> list[str]:
    if text.strip().lower() == "all":
        return [g.name for g in all_gpus()]
    names = [s.strip() for s in text.split(",")]
    if not names or any(not s for s in names):
        raise PlanError(f"--gpus {text!r}: expected comma-separated GPU names or 'all'")
    out: list[str] = []
    for n in names:
        g = get_gpu(n).name
        if g not in out:
            out.append(g)
    return out


_ABBR = {"compute": "cmp", "memory": "mem", "communication": "comm", "host": "host"}


def _short(name: str) -> str:
    return name.removeprefix("NVIDIA ").replace("GeForce ", "").replace(" Edition", "")


def run(args: argparse.Namespace) -> int:
    if args.validate:
        if args.model or args.workload:
            raise PlanError("--validate scores the ranking on measured tables; do not combine it with "
                            "--model/--workload")
        return run_validate(args)
    if not args.model:
        raise PlanError("--model is required (a preset such as meta-llama/Llama-3.1-8B or a config.json path)")
    if not args.workload:
        raise PlanError("--workload is required (chat, summarisation, long-context, "
                        "prompt=DIST,output=DIST[,rate=R] or trace:PATH)")
    wl = parse_workload(args.workload)
    gpus = parse_gpus(args.gpus)
    tps = parse_tp_list(args.tp)
    cfg = PlanConfig(slo_s=parse_slo(args.slo_ms), max_num_seqs=_pos_int(args.max_seqs, "--max-seqs"),
                     max_batched_tokens=_pos_int(args.max_batched_tokens, "--max-batched-tokens"),
                     clock=args.clock, prices=parse_prices(args.price), rank_by=args.rank_by,
                     constants=calibrated_constants(args.calibration, gpus), precision=args.precision)
    top = _nonneg_int(args.top, "--top")
    if args.plot and not str(args.plot).lower().endswith(".png"):
        raise PlanError(f"--plot {args.plot!r}: give a .png file name")
    r = rank(args.model, wl, gpus, tps, cfg, curve=bool(args.plot))
    if args.plot:
        plot_ranking(r, args.plot)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2, default=_json_default))
        return 0
    print_ranking(r, top)
    if args.plot:
        Console(width=140).print(f"plot written to {args.plot}")
    return 0


def _json_default(o: object) -> object:
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


def print_ranking(r: Ranking, top: int = 0) -> None:
    c = Console(width=160)
    st = r.workload.stats()
    cfg = r.config
    slo = "none" if cfg.slo_s is None else f"{cfg.slo_s * 1e3:g} ms/step"
    c.print(f"[bold]{r.model.name}[/bold] ({r.model.param_count() / 1e9:.1f} B params) — workload "
            f"{r.workload.describe()}")
    c.print(f"  mean prompt {st.mean_prompt:.0f}, mean output {st.mean_output:.0f}, decode context "
            f"{st.decode_ctx:.0f}, p99 request {st.total_p['p99']:.0f} tokens; SLO {slo}; clock {cfg.clock}; "
            f"{cfg.precision} weights; "
            f"max_num_seqs {cfg.max_num_seqs}, token budget {cfg.max_batched_tokens}")
    metric = {"gpu": "out tok/s per GPU", "dollar": "out tokens per $", "layout": "out tok/s per replica"}
    t = Table(title=f"ranking by {metric[r.rank_by]}")
    cols = ["#", "GPU", "TP", "tok/s/GPU", "tok/s", "k tok/$", "batch", "prefill/step", "step ms",
            "chunk budget", "f_clk", "bound", "limited by", "KV tokens", "conc.", "TTFT ms", "TPOT ms"]
    if r.workload.rate:
        cols.append("GPUs for rate")
    for col in cols:
        t.add_column(col, justify="left" if col in ("GPU", "bound", "limited by") else "right")
    shown = r.layouts[:top] if top else r.layouts
    for x in shown:
        per_dollar = x.output_tokens_per_dollar
        sh = x.bound_shares.get(x.bound, 0.0)
        row = [str(x.rank) if x.rank else "-", _short(x.gpu), str(x.tp)]
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
        if r.workload.rate:
            row.append(str(x.fleet["gpus"]) if x.fleet else "")
        t.add_row(*row)
    c.print(t)
    if shown and shown[0].steps:
        st_t = Table(title="representative steps: predicted ms (bound)")
        names: list[str] = []
        for x in shown[:6]:
            for s in x.steps:
                if s["name"] not in names:
                    names.append(s["name"])
        st_t.add_column("layout")
        for n in names:
            st_t.add_column(n, justify="right")
        for x in shown[:6]:
            by = {s["name"]: s for s in x.steps}
            st_t.add_row(f"{_short(x.gpu)} tp{x.tp}",
                         *[f"{by[n]['step_ms']:.2f} ({_ABBR[by[n]['bound']]})" if n in by else "-" for n in names])
        c.print(st_t)
    if any(x.replay for x in shown):
        rt = Table(title="recorded trace replayed (its own batches)")
        for col in ("layout", "mean step ms", "p99 step ms", "tok/s", "within SLO", "fits batches"):
            rt.add_column(col, justify="left" if col == "layout" else "right")
        for x in shown[:10]:
            if x.replay:
                rp = x.replay
                rt.add_row(f"{_short(x.gpu)} tp{x.tp}", f"{rp['mean_step_ms']:.2f}", f"{rp['p99_step_ms']:.2f}",
                           f"{rp['tokens_per_s']:,.0f}",
                           f"{rp['within_slo']:.1%}" if "within_slo" in rp else "",
                           "yes" if rp["fits_recorded_batches"] else "no")
        c.print(rt)
    unmet = [x for x in r.layouts if not x.feasible]
    for x in unmet:
        c.print(f"  [yellow]SLO unmet[/yellow] {_short(x.gpu)} tp{x.tp}: {x.reason}")
    if r.excluded:
        et = Table(title="excluded layouts (do not fit)")
        et.add_column("GPU")
        et.add_column("TP", justify="right")
        et.add_column("reason")
        for x in r.excluded:
            et.add_row(_short(x.gpu), str(x.tp), x.reason)
        c.print(et)
    c.print(f"memory reserve: {cfg.reserve_fraction:.0%} of device memory + {cfg.reserve_bytes / 2**30:g} GiB "
            "(CUDA context, workspaces, graphs); activations at the token budget; KV cache gets the rest.")
    c.print("tok/s, conc., TTFT and TPOT: m2live simulate's closed loop (vLLM V1 scheduler) at the operating point's "
            "concurrency, lowered until the mean TPOT meets the SLO; batch / step ms: the steady-state step.")


def plot_ranking(r: Ranking, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    feas = [x for x in r.layouts if x.feasible]
    best: dict[str, object] = {}
    for x in feas:  # best TP per GPU (ranked order)
        best.setdefault(x.gpu, x)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6.5))
    for x in list(best.values())[:10]:
        xs = [p["slo_ms"] for p in x.curve if p["output_tokens_per_s_per_gpu"] > 0]
        ys = [p["output_tokens_per_s_per_gpu"] for p in x.curve if p["output_tokens_per_s_per_gpu"] > 0]
        if xs:
            ax1.plot(xs, ys, marker="o", ms=3, label=f"{_short(x.gpu)} tp{x.tp}")
    if r.config.slo_s is not None:
        ax1.axvline(r.config.slo_s * 1e3, color="grey", ls="--", lw=1, label="SLO")
    ax1.set_xscale("log")
    ax1.set_xlabel("per-step latency SLO (ms)")
    ax1.set_ylabel("generated tokens/s per GPU")
    ax1.set_title("throughput reachable under the SLO (best TP per GPU)")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7)
    colors = {"compute": "tab:red", "memory": "tab:blue", "communication": "tab:purple", "host": "tab:grey"}
    top = feas[:20]
    scores = [x.score or 0.0 for x in top]
    labels = [f"{_short(x.gpu)} tp{x.tp}" for x in top]
    ax2.barh(range(len(top))[::-1], scores, color=[colors.get(x.bound, "k") for x in top])
    ax2.set_yticks(range(len(top))[::-1], labels, fontsize=7)
    unit = {"gpu": "generated tokens/s per GPU", "dollar": "generated tokens per $",
            "layout": "generated tokens/s per replica"}[r.rank_by]
    ax2.set_xlabel(unit)
    ax2.set_title("ranking (colour: what bounds the operating point)")
    for b, col in colors.items():
        ax2.bar(0, 0, color=col, label=b)
    ax2.legend(fontsize=7, loc="lower right")
    slo = "no SLO" if r.config.slo_s is None else f"SLO {r.config.slo_s * 1e3:g} ms"
    fig.suptitle(f"{r.model.name} — {r.workload.describe()} — {slo}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_validate(args: argparse.Namespace) -> int:
    out = validate_opbench(args.validate)
    if args.plot:
        if not str(args.plot).lower().endswith(".png"):
            raise PlanError(f"--plot {args.plot!r}: give a .png file name")
        plot_validation(out, args.plot)
    if args.json:
        print(json.dumps(out, indent=2, default=_json_default))
        return 0
    c = Console(width=140)
    c.print(f"GPUs: {', '.join(out['gpus'])}; {len(out['workloads'])} projection workloads "
            f"× M in {out['ms']}; predictor: {out['predictor']}")
    t = Table(title="decision quality: predicted vs measured GPU order (GEMM-sum workloads)")
    for col in ("M", "points", "top-1 hit", "Spearman ρ", "mean regret", "max regret", "pairs right",
                "speed-ratio err"):
        t.add_column(col, justify="right")

    def fmt(s: dict) -> list[str]:
        if not s.get("points"):
            return ["0", "", "", "", "", "", ""]
        return [str(s["points"]), f"{s['top1_hit_rate']:.0%}",
                "" if s["spearman_mean"] is None else f"{s['spearman_mean']:+.2f}",
                f"{s['regret_mean']:.2%}", f"{s['regret_max']:.2%}",
                "" if s["pairwise_accuracy"] is None else f"{s['pairwise_accuracy']:.0%}",
                f"{s['relative_speed_error_mean']:.1%}"]

    for m, s in out["by_m"].items():
        t.add_row(m, *fmt(s))
    t.add_section()
    t.add_row("all", *fmt(out["summary"]))
    if "baseline_summary" in out:
        t.add_row("roofline η=0.75", *fmt(out["baseline_summary"]))
    lay = out.get("layouts")
    if lay and lay["summary"].get("points"):
        t.add_section()
        t.add_row("GPU×TP layouts", *fmt(lay["summary"]))
        if "baseline_summary" in lay:
            t.add_row("  roofline η=0.75", *fmt(lay["baseline_summary"]))
    c.print(t)
    if lay and lay["summary"].get("points"):
        c.print(f"GPU×TP layouts: {lay['what']}; measured best: {lay['measured_winners']}")
    c.print(f"measured best GPU per point: {out['measured_winners']}")
    if "note" in out:
        c.print(f"[yellow]{out['note']}[/yellow]")
    return 0


def plot_validation(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6))
    for g in out["gpus"]:
        xs = [p["measured_ms"][g] for p in out["points"] if g in p["measured_ms"]]
        ys = [p["predicted_ms"][g] for p in out["points"] if g in p["predicted_ms"]]
        ax.scatter(xs, ys, s=10, label=_short(g))
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
