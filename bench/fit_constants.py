"""Fit the per-architecture constants of m2live/efficiency.py on the calibration tables, and check transfer.

Fits, per GPU folder of ../shared/data/opbench (A100-SXM4-80GB → ampere, H100 80GB HBM3 → hopper,
B300 SXM6 AC → blackwell):
  GEMM group       eta_tc, i_crit, k0, t_kernel, eta_mem, t_ramp, overlap, k_split and k_balance (on grids)
                   on GEMMs with N,K in [1024, 16384]
  attention group  t_attn, t_attn_over, eta_attn, k0_attn, eta_attn_mem, item_cost, block_cost, cta_bw, t_split,
                   t_merge, t_relayout, t_cache_cta, t_ramp_kv, l2_kv_bytes_per_clk, item_overlap, t_sched,
                   t_qrow on head_dim-128 attention rows (efficiency.FITTED_GROUPS); with --tiles NAME:8,16,32,64
                   also a query-tile table's entries after its first (decode_item_tile_cost); with
                   --head-dims 64,128,... the attention rows (prefill and decode) of those head dims, fitted and
                   scored, and then also softmax_overlap, k0_attn_fixed and item_cost_fixed where a family prices
                   them (the head dims pin them)
minimising the mean absolute percentage error (Nelder-Mead in log space, from the current constants), every row
predicted exactly as `m2live validate` does (burst clock from the power model, L2 re-reads of the loop).
Leave-one-architecture-out: the numbers fitted on one GPU predict each other GPU from its datasheet alone (that GPU
keeps its own kernel facts — tile shapes, the decode split rule — which are properties of its kernels, not fitted).
Writes results/constants.json; the values are then copied into efficiency.py with this file named as their source.

    .venv/bin/python bench/fit_constants.py [--out results/constants.json] [--maxiter 400]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from m2live.efficiency import (  # noqa: E402
    ARCH,
    ATTN_BENCH_WINDOW,
    FITTED_GROUPS,
    GEMM_BENCH_WINDOW,
    ArchConstants,
    in_use,
    transfer,
)
from m2live.hardware import get_gpu  # noqa: E402
from m2live.operators import tile_entry  # noqa: E402
from m2live.predictor import OpModel  # noqa: E402
from m2live.validate import gemm_ms, in_core_region, measured, prefill_ms, read_table  # noqa: E402

OPBENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "opbench"
GPUS = {"a100_sxm": ("NVIDIA A100-SXM4-80GB", "ampere"), "h100_sxm": ("NVIDIA H100 80GB HBM3", "hopper"),
        "b300_sxm": ("NVIDIA B300 SXM6 AC", "blackwell")}
# the attention group here also fits what only several head dims pin (--head-dims): the kernel's softmax overlap
# (softmax_overlap, where a family prices it) and the fixed shares of its prefill prologue and decode item's work
# (k0_attn_fixed, item_cost_fixed; a family at their neutral values, 0 and 1, is not moved: seed it first);
# m2live calibrate, on head_dim-128 rows, leaves them at the family's values
HEAD_DIM_CONSTANTS = ("softmax_overlap", "k0_attn_fixed", "item_cost_fixed")
GROUPS = {**FITTED_GROUPS, "attention": (*FITTED_GROUPS["attention"], *HEAD_DIM_CONSTANTS)}
HEAD_DIMS: set[int] = {128}  # --head-dims: the attention rows' head dims the fit and the scores take
BOUNDED = {"eta_tc", "eta_mem", "eta_attn", "eta_attn_mem", "k0_attn_fixed", "item_cost_fixed"}  # ratios kept in (0, 1]
# Piecewise-constant in the loss (a kernel heuristic's threshold): chosen on a grid before the simplex search.
GRID = {"gemm": {"k_split": (128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 4096),
                 "k_balance": (768, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 6144)},
        # vLLM's CUTLASS fp8 scaled-mm: 65536 = never splits K (its sm90/sm100 configs have no split-K; under a
        # fixed tile dispatch, efficiency.TILE_RULES, the split is off whatever the value)
        "fp8_gemm": {"k_split": (65536, 512, 1024, 1792, 4096)}}


def load(folder: str, max_rows: int, seed: int = 0, root: Path = OPBENCH,
         names: tuple[str, ...] = ("gemm_bf16.csv", "prefill_attention_bf16.csv", "decode_attention_bf16.csv"),
         ) -> dict[str, list]:
    """Rows as tuples: gemm (m, n, k, ms); prefill (b, isl, h, kv, d, ms); decode (b, step, h, kv, d, ms)."""
    out: dict[str, list] = {"gemm": [], "prefill_attention": [], "decode_attention": []}
    for name in names:
        t = read_table(root / folder / name)
        for kind, row, ms in zip(t.kinds, t.rows, measured(t), strict=True):
            if math.isnan(ms) or not (in_core_region(kind, row) if kind == "gemm"
                                      else int(row["head_dim"]) in HEAD_DIMS):
                continue
            if kind == "gemm":
                out[kind].append((int(row["m"]), int(row["n"]), int(row["k"]), ms))
            else:
                out[kind].append((int(row["batch_size"]), int(row["isl"] if kind == "prefill_attention"
                                  else row["step"]), int(row["num_heads"]), int(row["num_key_value_heads"]),
                                  int(row["head_dim"]), ms))
    rng = random.Random(seed)
    for k, rows in out.items():
        if len(rows) > max_rows:
            out[k] = rng.sample(rows, max_rows)
    return out


CLOCK = {"mode": "power"}
ONLY: set[str] = set()  # --only: the constants the simplex may move (empty: the whole group)
TILES: dict[str, tuple[int, ...]] = {}  # --tiles: query-tile tables the attention simplex fits, name -> tiles


def _clock(om: OpModel, window: tuple[int, int] = GEMM_BENCH_WINDOW):
    mode = CLOCK["mode"]
    if mode == "power":
        return lambda flops, t: om.burst_clock(flops, t, window)
    if mode == "forecast":
        return om.clock_ratio
    return lambda flops, t: 1.0


def predict(om: OpModel, kind: str, r: tuple) -> float:
    """One row in ms, exactly as `m2live validate` predicts it (validate.gemm_ms / prefill_ms)."""
    if kind == "gemm":
        return gemm_ms(om, r[0], r[1], r[2], _clock(om), l2_warm=True)
    b, x, h, kv, d = r[:5]
    if kind == "prefill_attention":
        return prefill_ms(om, b, x, h, kv, d, _clock(om, ATTN_BENCH_WINDOW))
    return om.decode_attention(b * x, b, h, kv, d, l2_warm=True).t * 1e3


def mape(gpu: str, c: ArchConstants, data: dict[str, list], kinds: tuple[str, ...],
         dtype: str = "bf16") -> dict[str, float]:
    om = OpModel(get_gpu(gpu), dtype=dtype, constants=c)
    res = {}
    for kind in kinds:
        rows = data[kind]
        errs = [abs(predict(om, kind, r) - r[-1]) / r[-1] for r in rows]
        res[kind] = 100.0 * float(np.mean(errs))
    return res


def fit_group(gpu: str, base: ArchConstants, group: str, data: dict[str, list], maxiter: int,
              rounds: int = 2, dtype: str = "bf16") -> ArchConstants:
    """Coordinate descent: the grid constants on a grid, then a simplex search over the rest; ``rounds`` times."""
    kinds = ("prefill_attention", "decode_attention") if group == "attention" else ("gemm",)
    grid = GRID.get(group, {})
    for _ in range(rounds if grid else 1):
        for name, values in grid.items():
            if not in_use(base, name):
                continue
            scores = {v: sum(mape(gpu, replace(base, **{name: float(v)}), data, kinds, dtype).values())
                      for v in values}
            base = replace(base, **{name: float(min(scores, key=scores.__getitem__))})
        base = _simplex(gpu, base, group, kinds, data, maxiter, dtype)
    return base


def _simplex(gpu: str, base: ArchConstants, group: str, kinds: tuple[str, ...], data: dict[str, list],
             maxiter: int, dtype: str = "bf16") -> ArchConstants:
    # a zero, or a constant only a kernel path this arch never takes prices (in_use), stays; grid constants are
    # chosen on their grid
    head_dims = {r[4] for k in kinds if k != "gemm" for r in data[k]}
    names = tuple(n for n in GROUPS[group] if getattr(base, n) != 0 and in_use(base, n)
                  and n not in GRID.get(group, {}) and (not ONLY or n in ONLY)
                  and (n not in HEAD_DIM_CONSTANTS or len(head_dims) > 1))  # rows of one head dim cannot pin them
    # --tiles: a query-tile table's entries after its first (held at 1.0), from the table's values or, for a table
    # not yet set, from the main loop's (decode_tile_cost)
    tiles = [(t, rows) for t, all_rows in TILES.items() for rows in all_rows[1:]] if group == "attention" else []
    x0 = np.array([math.log(getattr(base, n)) for n in names]
                  + [math.log(tile_entry(getattr(base, t) or base.decode_tile_cost, rows)) for t, rows in tiles])

    def consts(x: np.ndarray) -> ArchConstants:
        vals: dict = {n: float(math.exp(v)) for n, v in zip(names, x[:len(names)], strict=True)}
        for n in BOUNDED & vals.keys():
            vals[n] = min(vals[n], 1.0)
        # a table's fitted entries over its others (a tile the rows do not reach keeps its value), its first at 1.0
        tables = {t: {**dict(getattr(base, t)), TILES[t][0]: 1.0} for t in TILES if tiles}
        for (t, rows), v in zip(tiles, x[len(names):], strict=True):
            tables[t][rows] = float(math.exp(v))
        return replace(base, **vals, **{t: tuple(sorted(e.items())) for t, e in tables.items()})

    def loss(x: np.ndarray) -> float:
        m = mape(gpu, consts(x), data, kinds, dtype)
        return sum(m.values()) / len(m)

    r = minimize(loss, x0, method="Nelder-Mead", options={"maxiter": maxiter, "xatol": 1e-3, "fatol": 1e-3})
    return consts(r.x)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/constants.json")
    ap.add_argument("--maxiter", type=int, default=400)
    ap.add_argument("--clock", choices=("power", "boost", "forecast"), default="power",
                    help="clock of the GEMM and prefill rows: power (the burst model), boost, or forecast (sustained)")
    ap.add_argument("--groups", default="gemm,attention")
    ap.add_argument("--max-rows", type=int, default=2500, help="rows per kind used in the fit (random sample)")
    ap.add_argument("--only", default="", help="comma-separated constants the simplex may move (a model change "
                    "that touches one kind only refits that kind's constants and leaves the others as they are)")
    ap.add_argument("--gpus", default=",".join(GPUS), help="comma-separated opbench folders to refit (the others "
                    "keep efficiency.py's constants; all are scored)")
    ap.add_argument("--tiles", default="", help="a query-tile table the attention fit moves, as NAME:8,16,32,64 "
                    "(its first tile held at 1.0; e.g. decode_item_tile_cost)")
    ap.add_argument("--head-dims", default="128", help="comma-separated head dims of the attention rows fitted and "
                    "scored (default 128, the region the targets are stated on; more pin softmax_overlap)")
    args = ap.parse_args()
    try:
        HEAD_DIMS.clear()
        HEAD_DIMS.update(int(d) for d in args.head_dims.split(","))
    except ValueError:
        ap.error(f"--head-dims: comma-separated integers, got {args.head_dims!r}")
    ONLY.update(n for n in args.only.split(",") if n)
    if args.tiles:
        name, _, rows = args.tiles.partition(":")
        if name not in {f.name for f in fields(ArchConstants)} or not isinstance(getattr(ARCH["hopper"], name), tuple):
            ap.error(f"--tiles: {name!r} is not a query-tile table of ArchConstants (e.g. decode_item_tile_cost)")
        if len(args.gpus.split(",")) != 1:
            ap.error("--tiles fits one GPU's table: name that GPU alone with --gpus")
        TILES[name] = tuple(int(r) for r in rows.split(","))
    t0 = time.time()
    CLOCK["mode"] = args.clock
    fitted: dict[str, ArchConstants] = {}
    data = {f: load(f, args.max_rows) for f in GPUS}
    for folder, (gpu, arch) in GPUS.items():
        c = ARCH[arch]
        if folder not in args.gpus.split(","):
            fitted[arch] = c
            continue
        for group in args.groups.split(","):
            c = fit_group(gpu, c, group, data[folder], args.maxiter)
            print(f"{folder} {group}: " + ", ".join(f"{n}={getattr(c, n):.4g}" for n in GROUPS[group])
                  + "".join(f", {t}={getattr(c, t)}" for t in TILES), flush=True)
        fitted[arch] = replace(c, fitted_on=f"opbench {folder} ({gpu})")
    full = {f: load(f, 10**9) for f in GPUS}
    kinds = ("gemm", "prefill_attention", "decode_attention")
    report = {"fitted": {a: {**{n: getattr(c, n) for g in GROUPS.values() for n in g},
                             **{t: getattr(c, t) for t in TILES}} for a, c in fitted.items()},
              "in_sample": {}, "leave_one_gpu_out": {}, "seconds": None,
              "attention_head_dims": sorted(HEAD_DIMS)}  # the attention rows fitted and scored (128: the region)
    for folder, (gpu, arch) in GPUS.items():  # leave-one-architecture-out: every other family's numbers
        report["in_sample"][gpu] = mape(gpu, fitted[arch], full[folder], kinds)
        report["leave_one_gpu_out"][gpu] = {
            other: mape(gpu, transfer(fitted[arch], fitted[other]), full[folder], kinds)
            for other in fitted if other != arch}
    report["seconds"] = round(time.time() - t0, 1)
    report["constants"] = {a: asdict(c) for a, c in fitted.items()}
    write_report(report, args.out)
    return 0


def write_report(report: dict, out: str) -> None:
    """The fit's JSON under results/, and its in-sample / leave-one-out figures on stdout."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2, default=list))
    print(json.dumps({k: report[k] for k in ("in_sample", "leave_one_gpu_out")}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
