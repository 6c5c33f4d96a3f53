"""Fit the fp8 (W8A8) GEMM constants of m2live/efficiency.py (``FP8_GEMM_FIT``) on ../shared/data/opbench_fp8 ONLY.

vLLM's fp8 linear layer (CutlassFP8ScaledMMLinearKernel) on H100 80GB HBM3 → hopper and B300 SXM6 AC →
blackwell, GEMMs with N,K in [1024, 16384], every M. Group ``fp8_gemm`` = the bf16 GEMM group (eta_tc, i_crit,
k0, t_kernel, eta_mem, t_ramp, overlap; k_split no longer, since the shipped fp8 constants carry vLLM's CUTLASS
dispatch, which never splits K: efficiency.ONLY_WHERE) plus the two constants
of vLLM's CUDA input quantisation that every row includes (q_row, q_sm_bw), and the fitted kernel facts
(efficiency.FP8_KERNEL_FITTED: Hopper's ragged-M cost tma_oob, seeded where the table shows it, SEED_ARCH; a zero
stays zero). The machinery (loader, MAPE, grid +
Nelder-Mead coordinate descent) is bench/fit_constants.py's; this file only says what is fitted on what.
Leave-one-GPU-out: the numbers fitted on one GPU predict the other from its datasheet and its own kernel facts.
Writes results/fp8_constants.json; the values are then copied into efficiency.FP8_GEMM_FIT.

    .venv/bin/python bench/fit_fp8.py [--out results/fp8_constants.json] [--maxiter 300] [--max-rows 2000]
                                      [--gpus h100_sxm,b300_sxm]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fit_constants import fit_group, load, mape, write_report  # noqa: E402

from m2live.efficiency import ARCH_FP8, FITTED_GROUPS, transfer_fp8  # noqa: E402

OPBENCH_FP8 = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "opbench_fp8"
GPUS = {"h100_sxm": ("NVIDIA H100 80GB HBM3", "hopper"), "b300_sxm": ("NVIDIA B300 SXM6 AC", "blackwell")}
GROUP = "fp8_gemm"
# Starting point for the quantisation constants where efficiency.py has none yet: ~0.5 us of SM time per token
# row and kernel (the tables' latency grows by ~7 ns per row at N = K = 32 on both GPUs), ~15 GB/s per SM.
SEED = {"q_row": 0.5e-6, "q_sm_bw": 15e9}
# ... and for the kernel facts only one architecture's table shows (efficiency.FP8_KERNEL_FITTED): Hopper's scaled-mm
# slows where its activation tiles reach past M (~10 % at a last tile row all but empty, read off the table's
# M = 128 k + 1 rows against M = 128 (k + 1)); the B300's keeps 0
SEED_ARCH = {"hopper": {"tma_oob": 0.1}}


def load_fp8(folder: str, max_rows: int) -> dict[str, list]:
    return load(folder, max_rows, root=OPBENCH_FP8, names=("gemm_fp8.csv",))


def fit(maxiter: int, max_rows: int, gpus: tuple[str, ...] = tuple(GPUS)) -> dict:
    """Refit the fp8 constants of the opbench_fp8 folders in ``gpus``; the others keep efficiency.py's (all are
    scored)."""
    t0 = time.time()
    fitted = {}
    for folder, (gpu, arch) in GPUS.items():
        base = ARCH_FP8[arch]
        if folder not in gpus:
            fitted[arch] = base
            continue
        seed = {**SEED, **SEED_ARCH.get(arch, {})}
        base = replace(base, **{n: v for n, v in seed.items() if getattr(base, n) == 0.0})
        c = fit_group(gpu, base, GROUP, load_fp8(folder, max_rows), maxiter, dtype="fp8")
        fitted[arch] = replace(c, fitted_on=f"opbench_fp8 {folder} ({gpu}), bench/fit_fp8.py")
        print(f"{folder}: " + ", ".join(f"{n}={getattr(c, n):.4g}" for n in FITTED_GROUPS[GROUP]), flush=True)
    full = {f: load_fp8(f, 10**9) for f in GPUS}
    report: dict = {"fitted_on": "../shared/data/opbench_fp8 gemm_fp8.csv, N,K in [1024, 16384], every M",
                    "fitted": {a: {n: getattr(c, n) for n in FITTED_GROUPS[GROUP]} for a, c in fitted.items()},
                    "in_sample": {}, "leave_one_gpu_out": {}}
    for folder, (gpu, arch) in GPUS.items():
        other = "blackwell" if arch == "hopper" else "hopper"
        report["in_sample"][gpu] = mape(gpu, fitted[arch], full[folder], ("gemm",), "fp8")["gemm"]
        loo = transfer_fp8(fitted[arch], fitted[other])
        report["leave_one_gpu_out"][gpu] = {"gemm": mape(gpu, loo, full[folder], ("gemm",), "fp8")["gemm"],
                                            "constants_from": other}
    report["rows"] = {GPUS[f][0]: len(full[f]["gemm"]) for f in GPUS}
    report["seconds"] = round(time.time() - t0, 1)
    report["constants"] = {a: asdict(c) for a, c in fitted.items()}
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/fp8_constants.json")
    ap.add_argument("--maxiter", type=int, default=300)
    ap.add_argument("--max-rows", type=int, default=2000, help="rows per GPU used in the fit (random sample)")
    ap.add_argument("--gpus", default=",".join(GPUS), help="comma-separated opbench_fp8 folders to refit (the "
                    "others keep efficiency.py's constants; all are scored)")
    args = ap.parse_args()
    unknown = [g for g in args.gpus.split(",") if g not in GPUS]
    if unknown:
        ap.error(f"--gpus: unknown opbench_fp8 folder(s) {', '.join(unknown)} (known: {', '.join(GPUS)})")
    report = fit(args.maxiter, args.max_rows, tuple(args.gpus.split(",")))
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
