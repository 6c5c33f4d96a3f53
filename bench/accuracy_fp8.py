"""fp8 GEMM accuracy → the ``fp8`` section of results/accuracy.json (bench/accuracy.py calls ``score_fp8``).

vLLM's fp8 linear layer (CutlassFP8ScaledMMLinearKernel: e4m3 weights and activations, per-tensor scales, bf16
out, the bf16 input quantised first) on ../shared/data/opbench_fp8 (H100 80GB HBM3, B300 SXM6 AC). Per GPU, on
the region the bf16 targets are stated on (N,K in [1024, 16384], every M) and on all rows: MAPE with the fp8
constants fitted on that GPU (in-sample, efficiency.FP8_GEMM_FIT, bench/fit_fp8.py), with those fitted on the
other GPU (leave-one-GPU-out: the held-out GPU keeps only its datasheet and kernel facts), and the
constant-efficiency roofline max(FLOPs/(0.75·P_fp8), bytes/(0.75·BW)) as a baseline.

    .venv/bin/python bench/accuracy_fp8.py          # prints the section
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dataclasses import replace  # noqa: E402

from m2live.efficiency import ARCH_FP8, FITTED_GROUPS, FP8_KERNEL_FITTED, transfer_fp8  # noqa: E402
from m2live.hardware import get_gpu  # noqa: E402
from m2live.validate import RowPredictor, in_core_region, measured, read_table  # noqa: E402

OPBENCH_FP8 = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "opbench_fp8"
FOLDERS = {"h100_sxm": "hopper", "b300_sxm": "blackwell"}
OTHER = {"hopper": "blackwell", "blackwell": "hopper"}
M_BANDS = ((1, 1), (2, 16), (17, 128), (129, 512), (513, 2048), (2049, 1 << 30))


def baseline_ms(gpu_name: str, m: int, n: int, k: int) -> float:
    """Constant-efficiency roofline at the fp8 datasheet peak: 1 B per input and weight element, 2 B out."""
    g = get_gpu(gpu_name)
    return max(2.0 * m * n * k / (0.75 * g.peak_flops("fp8")), (m * k + n * k + 2 * m * n) / (0.75 * g.mem_bw)) * 1e3


def _stats(pred: np.ndarray, meas: np.ndarray) -> dict:
    e = (pred - meas) / meas
    return {"mape": round(100 * float(np.mean(np.abs(e))), 2), "median_ape": round(100 * float(np.median(np.abs(e))), 2),
            "bias": round(100 * float(np.mean(e)), 2)}


def score_fp8() -> dict:
    out: dict = {"data": "../shared/data/opbench_fp8 gemm_fp8.csv (vLLM CutlassFP8ScaledMMLinearKernel, W8A8 "
                         "per-tensor, bf16 out; the collector's rows include the input quantisation)",
                 "region": "N,K in [1024, 16384], every M", "fitted_on": {}, "gpus": {}}
    for folder, arch in FOLDERS.items():
        table = read_table(OPBENCH_FP8 / folder / "gemm_fp8.csv")
        assert table.dtype == "fp8"
        gpu = table.rows[0]["device"]
        meas = np.array(measured(table))
        core = np.array([in_core_region("gemm", r) for r in table.rows]) & np.isfinite(meas)
        m = np.array([int(r["m"]) for r in table.rows])
        ins = np.array(RowPredictor().predict_table(table))
        loo_c = transfer_fp8(ARCH_FP8[arch], ARCH_FP8[OTHER[arch]])
        loo = np.array(RowPredictor(fp8_constants={arch: loo_c}).predict_table(table))
        base = np.array([baseline_ms(gpu, int(r["m"]), int(r["n"]), int(r["k"])) for r in table.rows])
        entry = {"rows": int(core.sum()), "rows_all": len(table.rows), "constants_from_for_loo": OTHER[arch]}
        for name, sel in (("core", core), ("all", np.isfinite(meas))):
            entry[name] = {"in_sample": _stats(ins[sel], meas[sel]), "leave_one_gpu_out": _stats(loo[sel], meas[sel]),
                           "baseline_eta0.75": _stats(base[sel], meas[sel])}
        # which fitted number does not transfer: LOO with that one constant taken from the held-out GPU itself
        rows = [table.rows[i] for i in np.flatnonzero(core)]
        sub = type(table)(table.path, table.header, rows, ["gemm"] * len(rows), "fp8")
        entry["loo_with_own"] = {
            n: _stats(np.array(RowPredictor(fp8_constants={arch: replace(loo_c, **{n: getattr(ARCH_FP8[arch], n)})})
                               .predict_table(sub)), meas[core])["mape"]
            for n in FITTED_GROUPS["fp8_gemm"] if n not in FP8_KERNEL_FITTED}  # those stay the GPU's own already
        entry["core_by_m"] = {f"{lo}-{hi if hi < 1 << 30 else 'max'}": _stats(ins[core & (m >= lo) & (m <= hi)],
                                                                           meas[core & (m >= lo) & (m <= hi)])
                              for lo, hi in M_BANDS}
        out["gpus"][gpu] = entry
        out["fitted_on"][arch] = ARCH_FP8[arch].fitted_on
    return out


def main() -> int:
    res = score_fp8()
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
