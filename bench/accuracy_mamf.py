"""Public "maximum achievable matmul FLOPS" (MAMF) figures against m2live's GEMM forecast — validation only.

The figures are the public MAMF comparison table of Stas Bekman's *Machine Learning Engineering* book
(compute/accelerator/README.md, mamf-finder.py v2): for each accelerator the best mean TFLOP/s over 100 timed
``torch.matmul`` calls after 50 warm-up calls, among a brute-force search of shapes, with the L2 reset between
calls. Those shapes are large (0.1-1 ms a call), so a measurement is a burst of ~150 calls of the same GEMM
from an idle board: m2live prices it at its own clock for that burst (``OpModel.burst_clock`` over calls 50-150,
the power model's burst headroom) and weights streamed cold (no L2 re-reads). Two of these GPUs, the H200 and
the B200, are GPUs m2live never fitted; the others' constants were fitted on opbench, never on these rows.

Caveats, so the figures are read for what they are: a MAMF is the *best* shape of a noisy search (a maximum of
many measurements is biased upward by a few per cent against a prediction of one shape); the fp8 rows are
``torch._scaled_mm`` (cuBLASLt), while m2live's fp8 constants describe vLLM's CUTLASS scaled-mm, so they are
shown as a cross-check of the fp8 peak, not of the kernel; the torch/CUDA versions differ from row to row.
"""

from __future__ import annotations

from m2live.operators import OpModel

MAMF_WINDOW = (50, 150)  # 50 warm-up + 100 timed calls of one shape, back to back: the timed ones
MAMF_SOURCE = ("Machine Learning Engineering (S. Bekman), compute/accelerator/README.md, 'Maximum Achievable "
               "Matmul FLOPS comparison table' (mamf-finder.py v2: mean of 100 calls after 50 warm-up, L2 reset)")
# (catalog name, dtype, M, N, K, measured TFLOP/s, the table's note)
MAMF_ROWS: tuple[tuple[str, str, int, int, int, float, str], ...] = (
    ("NVIDIA A100-SXM4-80GB", "bf16", 1024, 10240, 5120, 271.2, "torch 2.6.0+cu126"),
    ("NVIDIA A100 80GB PCIe", "bf16", 2048, 5120, 6144, 252.9, "torch 2.5.1+cu124"),
    ("NVIDIA H100 80GB HBM3", "bf16", 2048, 2048, 13312, 794.5, "torch 2.7.0+cu126; 'H200 is the same'"),
    ("NVIDIA H200", "bf16", 2048, 2048, 13312, 794.5, "the table's H100 row: 'H200 is the same'"),
    ("NVIDIA GH200 144G HBM3e", "bf16", 1024, 15360, 4096, 828.6, "torch 2.6.0+cu126, 900 W 141 GB HBM3e"),
    ("NVIDIA B200", "bf16", 1792, 16128, 3072, 1745.0, "torch 2.7.1+cu128"),
    ("NVIDIA B300 SXM6 AC", "bf16", 12288, 18432, 1024, 1769.0, "torch 2.9.1+cu130"),
    ("NVIDIA H100 80GB HBM3", "fp8", 1024, 9216, 14336, 1402.6, "torch 2.7.0+cu126, cuBLASLt scaled-mm"),
    ("NVIDIA H200", "fp8", 1280, 4096, 12032, 1453.4, "torch 2.7.1+cu128, cuBLASLt scaled-mm"),
    ("NVIDIA GH200 144G HBM3e", "fp8", 1024, 14336, 14336, 1535.0, "torch 2.6.0+cu126, cuBLASLt scaled-mm"),
    ("NVIDIA B200", "fp8", 15360, 4096, 3072, 3432.5, "torch 2.7.1+cu128, cuBLASLt scaled-mm"),
    ("NVIDIA B300 SXM6 AC", "fp8", 3072, 6144, 7168, 3353.3, "torch 2.9.1+cu130, cuBLASLt scaled-mm"),
)


def mamf_prediction(gpu: str, dtype: str, m: int, n: int, k: int,
                    window: tuple[int, int] = MAMF_WINDOW) -> dict:
    """m2live's TFLOP/s for one back-to-back matmul measurement from an idle board (a MAMF one by default): the
    GEMM (fp8: the scaled-mm alone, no input quantisation) at the power model's mean clock over the timed calls
    of the burst (``window``: calls before the timed ones, calls at their end), weights from DRAM."""
    om = OpModel(gpu, dtype)
    flops = 2.0 * m * n * k
    t_boost = om.gemm(m, n, k, 1.0, quantize=False).t
    f = om.burst_clock(flops, t_boost, window)
    op = om.gemm(m, n, k, f, quantize=False)
    return {"tflops": flops / op.t / 1e12, "f_clk": f, "sm_mhz": f * om.gpu.boost_mhz, "bound": op.bound,
            "fitted_on": om.c.fitted_on, "borrowed_from": om.c.borrowed_from}


def score_mamf() -> dict:
    """Every MAMF row: measured and predicted TFLOP/s, the signed error, the burst clock; MAPE per dtype."""
    rows = []
    for gpu, dtype, m, n, k, meas, note in MAMF_ROWS:
        p = mamf_prediction(gpu, dtype, m, n, k)
        rows.append({"gpu": gpu, "dtype": dtype, "m": m, "n": n, "k": k, "measured_tflops": meas,
                     "predicted_tflops": round(p["tflops"], 1),
                     "error_pct": round(100.0 * (p["tflops"] - meas) / meas, 2),
                     "burst_f_clk": round(p["f_clk"], 3), "burst_sm_mhz": round(p["sm_mhz"]),
                     "constants": p["fitted_on"], "note": note})
    out: dict = {"source": MAMF_SOURCE, "timed_calls_of_burst": MAMF_WINDOW, "rows": rows}
    for dtype in ("bf16", "fp8"):
        errs = [abs(r["error_pct"]) for r in rows if r["dtype"] == dtype]
        out[f"mape_{dtype}"] = round(sum(errs) / len(errs), 2)
    return out
