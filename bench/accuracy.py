"""Accuracy benchmark → results/accuracy.json.

Per calibration GPU × operator kind (opbench tables): MAPE with the constants fitted on that GPU (in-sample),
with the constants fitted on the *other* GPU (leave-one-GPU-out: the held-out GPU is predicted from its
datasheet alone), and the constant-efficiency roofline baseline max(FLOPs/(0.75·P_datasheet),
bytes/(0.75·BW)), over the scored region (GEMM N,K in [1024, 16384]; attention head_dim 128), every row, and
each other head dim of the attention tables apart. Plus an independent validation on Vidur's Llama projection profiles (A100, H100, A40),
which were never used for fitting, on the public "maximum achievable matmul FLOPS" table (accuracy_mamf.py) and
on a public table of square bf16 torch.mm figures (accuracy_square.py; H200, B200, L40S, RTX PRO 6000 among them).

    .venv/bin/python bench/accuracy.py --out results/accuracy.json
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import functools
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accuracy_fp8 import score_fp8  # noqa: E402  (the "fp8" section: opbench_fp8 GEMMs)
from accuracy_mamf import score_mamf  # noqa: E402  (public matmul ceilings: validation only)
from accuracy_square import score_square  # noqa: E402  (public square torch.mm figures: validation only)

from m2live.efficiency import ARCH, FITTED_GROUPS, ArchConstants, in_use, transfer  # noqa: E402
from m2live.hardware import get_gpu  # noqa: E402
from m2live.planner import roofline_predictor  # noqa: E402
from m2live.predictor import OpModel  # noqa: E402
from m2live.validate import RowPredictor, in_core_region, mape, measured, read_table  # noqa: E402

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
GEMM_BASELINE = roofline_predictor(0.75)  # the same baseline the planner's decision-quality check uses
CALIBRATION = {"a100_sxm": "ampere", "h100_sxm": "hopper", "b300_sxm": "blackwell"}
# the nearest other calibration family: the "leave-one-GPU-out" column and the per-constant attribution use it;
# the full leave-one-architecture-out matrix (fit on one, predict the other two) is in "loo_matrix"
OTHER = {"ampere": "hopper", "hopper": "blackwell", "blackwell": "hopper"}
VIDUR_OPS = {  # Vidur column → our op, and its (N, K) for (n_head, n_kv, d, n_embd, n_expanded, tp)
    "attn_pre_proj": ("qkv", lambda h, kv, d, e, x, tp: ((h + 2 * kv) * d // tp, e)),
    "attn_post_proj": ("o", lambda h, kv, d, e, x, tp: (e, h * d // tp)),
    "mlp_up_proj": ("gate_up", lambda h, kv, d, e, x, tp: (2 * x // tp, e)),
    "mlp_down_proj": ("down", lambda h, kv, d, e, x, tp: (e, x // tp)),
}


def baseline_ms(kind: str, row: dict[str, str], gpu_name: str) -> float:
    """Constant-efficiency roofline: eta = 0.75 on both branches, datasheet dense bf16 peak."""
    if kind == "gemm":
        return GEMM_BASELINE(gpu_name, int(row["m"]), int(row["n"]), int(row["k"]))
    g = get_gpu(gpu_name)
    peak, bw = g.bf16_tflops * 1e12 * 0.75, g.mem_bw * 0.75
    b, h, kv, d = int(row["batch_size"]), int(row["num_heads"]), int(row["num_key_value_heads"]), int(row["head_dim"])
    if kind == "prefill_attention":
        isl = int(row["isl"])
        flops = 4 * h * d * b * isl * (isl + 1) / 2
        nbytes = 2 * d * b * isl * (2 * h + 2 * kv)
    else:
        ctx = int(row["step"]) + 1
        flops = 4 * h * d * b * ctx
        nbytes = 2 * d * b * (2 * kv * ctx + 2 * h)
    return max(flops / peak, nbytes / bw) * 1e3


def score_calibration() -> tuple[dict, dict]:
    """Per calibration GPU and kind: in-sample, leave-one-GPU-out (constants of OTHER[arch]) and baseline MAPE;
    and the leave-one-architecture-out matrix: each GPU predicted with each calibration family's fitted numbers
    (its own kernel facts and datasheet kept), the diagonal being in-sample."""
    out: dict = {}
    matrix: dict = {}
    sources = list(CALIBRATION.values())
    for folder, arch in CALIBRATION.items():
        rps = {src: RowPredictor(constants={arch: ARCH[arch] if src == arch else transfer(ARCH[arch], ARCH[src])})
               for src in sources}
        for path in sorted((SHARED / "opbench" / folder).glob("*.csv")):
            t = read_table(path)
            meas = measured(t)
            assert meas is not None
            preds = {src: rp.predict_table(t) for src, rp in rps.items()}
            groups: dict[str, list[tuple[float, float, dict[str, float]]]] = {}
            for i, (kind, row, m) in enumerate(zip(t.kinds, t.rows, meas, strict=True)):
                if math.isnan(m):  # a shape the table did not measure (validate.measured)
                    continue
                entry = (m, baseline_ms(kind, row, row["device"]), {src: p[i] for src, p in preds.items()})
                groups.setdefault(f"{kind}/all", []).append(entry)
                if in_core_region(kind, row):
                    groups.setdefault(f"{kind}/core", []).append(entry)
                elif kind != "gemm":  # attention at the table's other head dims (outside the scored region)
                    groups.setdefault(f"{kind}/head_dim_{row['head_dim']}", []).append(entry)
            gpu = t.rows[0]["device"]
            for key, vals in groups.items():
                kind, region = key.split("/")

                def err(pick, vals=vals) -> float:
                    return round(100 * sum(abs(pick(v) - v[0]) / v[0] for v in vals) / len(vals), 2)

                by_src = {src: err(lambda v, src=src: v[2][src]) for src in sources}
                out.setdefault(gpu, {})[key] = {
                    "kind": kind,
                    "region": ("N,K in [1024,16384], every M" if kind == "gemm" else "head_dim 128")
                    if region == "core" else "all rows" if region == "all" else region.replace("_", " "),
                    "rows": len(vals), "mape_in_sample": by_src[arch],
                    "mape_leave_one_gpu_out": by_src[OTHER[arch]],
                    "mape_baseline_eta0.75": err(lambda v: v[1]),
                    "constants_in_sample": arch, "constants_loo": OTHER[arch],
                }
                if region == "core":
                    matrix.setdefault(gpu, {})[kind] = {"constants_from": by_src,
                                                        "baseline_eta0.75": err(lambda v: v[1])}
    return out, matrix


def loo_attribution() -> dict:
    """Which transferred number costs the held-out GPU most: GEMM LOO MAPE (core region) when one fitted GEMM
    constant is the held-out GPU's own and every other fitted number still comes from the other GPU."""
    out: dict = {}
    for folder, arch in CALIBRATION.items():
        t = read_table(SHARED / "opbench" / folder / "gemm_bf16.csv")
        meas = measured(t)
        assert meas is not None
        core = [(i, row, m) for i, (kind, row, m) in enumerate(zip(t.kinds, t.rows, meas, strict=True), start=2)
                if in_core_region(kind, row)]

        def score(c: ArchConstants, core=core, path=t.path, arch=arch) -> float:
            rp = RowPredictor(constants={arch: c})
            return round(mape((rp.predict_row("gemm", row, i, path) for i, row, _ in core), (m for *_, m in core)), 2)

        loo = transfer(ARCH[arch], ARCH[OTHER[arch]])
        out[core[0][1]["device"]] = {
            "loo": score(loo), "in_sample": score(ARCH[arch]),
            "loo_with_own": {n: score(replace(loo, **{n: getattr(ARCH[arch], n)})) for n in FITTED_GROUPS["gemm"]
                             if in_use(ARCH[arch], n)},
        }
    return out


def score_vidur() -> dict:
    """Vidur mlp.csv: per-op median kernel times of Llama projections at num_tokens, TP emulated by shards."""
    gpus = {"a100": "NVIDIA A100-SXM4-80GB", "h100": "NVIDIA H100 80GB HBM3", "a40": "NVIDIA A40"}
    opbench = {"a100": "a100_sxm", "h100": "h100_sxm"}  # the same GPU measured by the opbench collector
    out: dict = {}
    for folder, gpu_name in gpus.items():
        try:
            om = OpModel(get_gpu(gpu_name))
        except KeyError:
            continue
        for path in sorted((SHARED / "vidur" / folder).glob("*/mlp.csv")):
            errs: dict[str, list[float]] = {}
            errs_f: dict[str, list[float]] = {}
            shapes: list[tuple[int, int, int, float]] = []
            with open(path, newline="") as f:
                for row in csv.DictReader(f):
                    h, kv = int(row["n_head"]), int(row["n_kv_head"])
                    e, x = int(row["n_embd"]), int(row["n_expanded_embd"])
                    tp, m = int(row["num_tensor_parallel_workers"]), int(row["num_tokens"])
                    d = e // h
                    for col, (op, nk) in VIDUR_OPS.items():
                        ms = float(row[f"time_stats.{col}.median"])
                        n, k = nk(h, kv, d, e, x, tp)
                        if col == "mlp_up_proj" and row.get("use_gated_mlp", "True") != "True":
                            n //= 2
                        # Vidur times each projection over repeated runs (sustained load): score the boost
                        # clock and the clock forecast from the power cap. Its loop re-runs the whole layer (one
                        # copy of each projection's weights, the others streaming through L2 in between), not
                        # one operator over the opbench collector's six copies: weights from DRAM (l2_warm=False;
                        # with the collector's L2 rule, before 2026-12-05: H100 13.61 against 13.42 % now)
                        tb = om.gemm(m, n, k, 1.0, l2_warm=False).t
                        f = om.clock_ratio(2.0 * m * n * k, tb)  # sustained: Vidur's repeated timings
                        tf = om.gemm(m, n, k, f, l2_warm=False).t
                        errs.setdefault(op, []).append(abs(tb * 1e3 - ms) / ms)
                        errs_f.setdefault(op, []).append(abs(tf * 1e3 - ms) / ms)
                        shapes.append((m, n, k, ms))
            key = f"{gpu_name} / {path.parent.name}"
            out[key] = {op: {"rows": len(v), "mape_boost_clock": round(100 * sum(v) / len(v), 2),
                             "mape_forecast_clock": round(100 * sum(errs_f[op]) / len(v), 2)}
                        for op, v in errs.items()}
            allv = [e for v in errs.values() for e in v]
            allf = [e for v in errs_f.values() for e in v]
            out[key]["all"] = {"rows": len(allv), "mape_boost_clock": round(100 * sum(allv) / len(allv), 2),
                               "mape_forecast_clock": round(100 * sum(allf) / len(allf), 2)}
            out[key]["arch_constants"] = om.gpu.arch + (f" (borrowed from {om.c.borrowed_from})"
                                                        if om.c.borrowed_from else "")
            if folder in opbench:
                out[key]["vs_opbench"] = vidur_vs_opbench(shapes, opbench[folder])
    return out


@functools.lru_cache(maxsize=4)
def _opbench_gemm_ms(folder: str) -> dict[tuple[int, int, int], float]:
    """One opbench GEMM table as (M, N, K) -> measured ms (read once: two Vidur models share the A100's)."""
    t = read_table(SHARED / "opbench" / folder / "gemm_bf16.csv")
    return {(int(r["m"]), int(r["n"]), int(r["k"])): v for r, v in zip(t.rows, measured(t), strict=True)
            if not math.isnan(v)}


def vidur_vs_opbench(shapes: list[tuple[int, int, int, float]], folder: str) -> dict:
    """The two measurements of one GPU side by side, no model: Vidur's time over the opbench collector's at the
    (M, N, K) both hold, median ratio by M, and the MAPE opbench's own times would score as a prediction of
    Vidur's: a model fitted on opbench inherits that gap."""
    ob = _opbench_gemm_ms(folder)
    lo = [ms / ob[(m, n, k)] for m, n, k, ms in shapes if (m, n, k) in ob and m <= 64]
    hi = [ms / ob[(m, n, k)] for m, n, k, ms in shapes if (m, n, k) in ob and m > 64]
    both = [(ob[(m, n, k)], ms) for m, n, k, ms in shapes if (m, n, k) in ob]
    return {"opbench": folder, "shared_shapes": len(lo) + len(hi),
            # a model exact on every opbench row would score this on these Vidur rows
            "mape_of_opbench_as_prediction": round(100 * statistics.fmean(abs(o / v - 1) for o, v in both), 2),
            "median_vidur_over_opbench_m_le_64": round(statistics.median(lo), 3) if lo else None,
            "median_vidur_over_opbench_m_gt_64": round(statistics.median(hi), 3) if hi else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/accuracy.json")
    args = ap.parse_args()
    calibration, loo_matrix = score_calibration()
    res = {
        "generated": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "clock": "boost (opbench rows are short bursts of a CUDA-graph loop)",
        "fitted_on": {a: ARCH[a].fitted_on for a in CALIBRATION.values()},
        "calibration": calibration,
        "loo_matrix": loo_matrix,
        "vidur_validation": score_vidur(),
        "mamf_validation": score_mamf(),
        "square_validation": score_square(),
        "gemm_loo_attribution": loo_attribution(),
        "fp8": score_fp8(),
    }
    from accuracy_calibrated import calibrated_section  # plan -> fit on those rows -> score the others

    res["calibrated"] = calibrated_section()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    for gpu, kinds in res["calibration"].items():
        for key, v in kinds.items():
            print(f"{gpu:24s} {key:26s} rows={v['rows']:6d} in-sample={v['mape_in_sample']:6.2f}% "
                  f"LOO={v['mape_leave_one_gpu_out']:6.2f}% baseline={v['mape_baseline_eta0.75']:6.2f}%")
    for gpu, kinds in res["loo_matrix"].items():
        for kind, v in kinds.items():
            print(f"LOO matrix {gpu:24s} {kind:18s} " + "  ".join(f"from {src} {x:6.2f}%" for src, x
                                                                in v["constants_from"].items())
                  + f"  baseline {v['baseline_eta0.75']:.2f}%")
    for key, ops in res["vidur_validation"].items():
        print(f"vidur {key}: " + ", ".join(f"{op} {v['mape_boost_clock']:.1f}% boost / "
                                           f"{v['mape_forecast_clock']:.1f}% forecast"
                                           for op, v in ops.items() if isinstance(v, dict) and op != "vs_opbench"))
        if "vs_opbench" in ops:
            v = ops["vs_opbench"]
            print(f"vidur {key} vs {v['opbench']}: opbench's own times as a prediction "
                  f"{v['mape_of_opbench_as_prediction']:.1f}% on {v['shared_shapes']} shared shapes (median ratio "
                  f"{v['median_vidur_over_opbench_m_le_64']} at M <= 64, {v['median_vidur_over_opbench_m_gt_64']} above)")
    for r in res["mamf_validation"]["rows"]:
        print(f"MAMF {r['gpu']:26s} {r['dtype']:4s} measured {r['measured_tflops']:7.1f} TF  predicted "
              f"{r['predicted_tflops']:7.1f} TF ({r['error_pct']:+.1f} %) at {r['burst_sm_mhz']} MHz")
    for r in res["square_validation"]["rows"]:
        print(f"square {r['gpu'][:44]:44s} n={str(r['n'])[:7]:7s} measured {r['measured_tflops']:7.1f} TF  "
              f"predicted {r['predicted_tflops']:7.1f} TF ({r['error_pct']:+.1f} %) at {r['burst_sm_mhz']} MHz")
    for gpu, v in res["gemm_loo_attribution"].items():
        print(f"GEMM LOO {gpu}: {v['loo']:.2f}% (in-sample {v['in_sample']:.2f}%); with its own "
              + ", ".join(f"{n} {x:.2f}%" for n, x in v["loo_with_own"].items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
