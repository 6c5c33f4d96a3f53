"""Decision quality of the GPU ranking, and example capacity plans → results/ranking.json.

1. opbench (``../shared/data/opbench/*``): GEMM-sum workloads made of Llama-like projection shapes (each model of
   ``planner.opbench.VALIDATION_MODELS``: qkv / o / gate_up / down at TP 1/2/4/8, mapped to the nearest (N, K)
   every table has) at M ∈ {1, 16, 64, 256, 1024, 4096, 8192}; predicted (the OpModel `m2live validate` uses) vs measured order of
   the GPUs: top-1 hit rate (within 3 % of the measured best), Spearman ρ, mean regret, pairwise order
   accuracy, and the error of the predicted speed ratios; the same for a constant-η roofline baseline.
2. Vidur (``../shared/data/vidur``, an independent software stack): Llama-2-7b-hf's real projection shapes,
   summed per num_tokens and TP, on every profiled GPU the catalog knows (A100, H100, A40).
3. Example plans (`m2live rank`) for three model x workload cases over the whole catalog, with timings.

Usage: python bench/ranking.py --out results/ranking.json [--opbench DIR ...] [--vidur DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from m2live.hardware import all_gpus  # noqa: E402
from m2live.planner import PlanConfig, rank, validate_opbench, validate_vidur  # noqa: E402
from m2live.workload import parse_workload  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
EXAMPLES = (
    ("meta-llama/Llama-3.1-8B", "chat", 50.0),
    ("meta-llama/Llama-3.1-8B", "long-context", 100.0),
    ("meta-llama/Llama-3.1-70B", "summarisation", 80.0),
)


def _clean(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def example_plans() -> list[dict]:
    gpus = [g.name for g in all_gpus()]
    out = []
    for model, wl, slo in EXAMPLES:
        t0 = time.perf_counter()
        r = rank(model, parse_workload(wl), gpus, (1, 2, 4, 8), PlanConfig(slo_s=slo / 1e3))
        dt = time.perf_counter() - t0
        top = [{"rank": x.rank, "gpu": x.gpu, "tp": x.tp,
                "output_tokens_per_s_per_gpu": x.output_tokens_per_s_per_gpu, "decode_batch": x.decode_batch,
                "step_ms": x.step_ms, "bound": x.bound, "limited_by": x.limited_by}
               for x in r.layouts if x.feasible][:8]
        out.append({"model": model, "workload": wl, "slo_ms": slo, "gpus": len(gpus),
                    "layouts_evaluated": len(r.layouts) + len(r.excluded), "layouts_excluded": len(r.excluded),
                    "layouts_slo_unmet": sum(not x.feasible for x in r.layouts),
                    "seconds": dt, "top": top,
                    "excluded_examples": [{"gpu": x.gpu, "tp": x.tp, "reason": x.reason} for x in r.excluded[:5]]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/ranking.json")
    ap.add_argument("--opbench", nargs="*", default=None, help="opbench folders (default: shared/data/opbench/*)")
    ap.add_argument("--vidur", default=str(SHARED / "vidur"), help="Vidur profiles root (with NOTICE.md)")
    args = ap.parse_args()
    dirs = args.opbench if args.opbench else sorted(str(p) for p in (SHARED / "opbench").iterdir() if p.is_dir())

    t0 = time.perf_counter()
    opbench = validate_opbench(dirs)
    opbench["folders"] = dirs
    opbench["seconds"] = time.perf_counter() - t0
    result: dict = {"opbench": opbench}

    vidur_root = Path(args.vidur)
    if vidur_root.is_dir():
        t0 = time.perf_counter()
        vm = validate_vidur(vidur_root)
        va = validate_vidur(vidur_root, ms=None)
        va.pop("points")  # ~1000 points: keep the summaries
        va["layouts"].pop("points")
        result["vidur"] = {"root": str(vidur_root), "m_set": vm, "all_num_tokens": va,
                           "seconds": time.perf_counter() - t0}
    result["examples"] = example_plans()
    result["notes"] = (
        "Ranking decision quality on measured tables. In opbench (A100, H100, B300) the measured best GPU is the "
        "B300 at every point, in Vidur (A100, H100, A40) the H100: per-GPU top-1, Spearman and regret are "
        "necessary but weak checks there; relative_speed_error (predicted vs measured time ratio to the best GPU) "
        "is sharper. The 'layouts' blocks rank every GPU x TP layout by GPU-time (TP x shard time), where the "
        "measured winner changes with M (opbench: B300 tp1 vs tp2; Vidur: A100 tp1 vs H100 tp1/tp2): a "
        "decision that is not trivial."
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_clean(result), indent=2) + "\n")

    s = opbench["summary"]
    print(f"opbench {', '.join(opbench['gpus'])}: {s['points']} points, top-1 {s['top1_hit_rate']:.0%}, "
          f"Spearman {s['spearman_mean']:+.2f}, regret {s['regret_mean']:.2%}, "
          f"speed-ratio error {s['relative_speed_error_mean']:.1%} "
          f"(roofline {opbench['baseline_summary']['relative_speed_error_mean']:.1%})")
    lay = opbench["layouts"]["summary"]
    print(f"opbench GPU x TP layouts (GPU-time): {lay['points']} points, top-1 {lay['top1_hit_rate']:.0%}, "
          f"Spearman {lay['spearman_mean']:+.3f}, pairwise {lay['pairwise_accuracy']:.1%} (roofline "
          f"{opbench['layouts']['baseline_summary']['pairwise_accuracy']:.1%}), regret {lay['regret_mean']:.2%}")
    if "vidur" in result:
        for key in ("m_set", "all_num_tokens"):
            v = result["vidur"][key]
            s = v["summary"]
            print(f"vidur [{key}] {sorted(v['gpus_used'])}: {s['points']} points, top-1 {s['top1_hit_rate']:.0%}, "
                  f"Spearman {s['spearman_mean']:+.2f}, regret {s['regret_mean']:.2%}, speed-ratio error "
                  f"{s['relative_speed_error_mean']:.1%} (roofline "
                  f"{v['baseline_summary']['relative_speed_error_mean']:.1%})")
            lay, lb = v["layouts"]["summary"], v["layouts"]["baseline_summary"]
            print(f"  GPU x TP layouts: {lay['points']} points, top-1 {lay['top1_hit_rate']:.0%} (roofline "
                  f"{lb['top1_hit_rate']:.0%}), Spearman {lay['spearman_mean']:+.3f}, pairwise "
                  f"{lay['pairwise_accuracy']:.1%} (roofline {lb['pairwise_accuracy']:.1%}), regret "
                  f"{lay['regret_mean']:.2%} (max {lay['regret_max']:.1%})")
    for e in result["examples"]:
        best = e["top"][0] if e["top"] else None
        pick = f"{best['gpu']} tp{best['tp']} {best['output_tokens_per_s_per_gpu']:.0f} tok/s/GPU" if best else "-"
        print(f"{e['model']} {e['workload']} SLO {e['slo_ms']:g} ms: best {pick}; "
              f"{e['layouts_excluded']} excluded; {e['seconds']:.2f} s")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
