"""Public square bf16 matmul figures against m2live's GEMM forecast — validation only, never fitted on.

The figures are the public table of the ``torch-performance-test-data`` project (GitHub zzc0721, its database.md
and the per-size results posted in its issues #160 and #161): for each contributed GPU, ``torch.mm`` of two
n x n bf16 matrices for n = 1024, 2048, 4096, 8192, 10240, each run as 6 warm-up calls and then 30 timed calls
back to back (wall time around the 30 and a synchronize), the table keeping the best size. They cover four GPUs
the opbench calibration never measured — the H200, B200, L40S and RTX PRO 6000 Blackwell Server Edition, the
ones accuracy is checked on from outside — with every call long enough for the board's power limiter to act:
what this section checks is the clock model (burst start, the limiter's fast loop, the one-second average) and
the tensor ceilings on those GPUs.

m2live prices each figure as the same burst from an idle board: the power model's mean clock over calls 6-36
(``SQUARE_WINDOW``), weights streamed cold (square operands of 32-200 MB each, no loop over copies). A "best of"
figure is compared with m2live's best of n = 4096, 8192 and 10240: at 1024 and 2048 an eager ``torch.mm`` loop
in a container is bound by its host (one Workstation entry ran 1024^3 at 52 TF, 41 us a call), so those two
sizes say nothing about the GPU and are left out.

Caveats: one contributor's board, cooling and driver per row (the two Workstation entries differ by 13 %); torch
and CUDA versions differ from row to row; GeForce boards run well above their rated boost clock under tensor load
(a 5090's 242 TF is 1.16x its dense peak at the rated 2407 MHz), which the catalog's rated boost does not
describe — those rows are reported apart.
"""

from __future__ import annotations

from accuracy_mamf import mamf_prediction

SQUARE_WINDOW = (6, 36)  # 6 warm-up + 30 timed torch.mm calls of one size, back to back
SQUARE_SIZES = (4096, 8192, 10240)  # the sizes a "best of" figure is predicted over (see the module text)
SQUARE_SOURCE = ("torch-performance-test-data (GitHub zzc0721): database.md and issues #160, #161 — torch.mm of "
                 "n x n bf16 matrices, 6 warm-up + 30 timed calls, n in 1024..10240, the best size kept")
OUTSIDE = ("NVIDIA H200", "NVIDIA B200", "NVIDIA L40S", "NVIDIA RTX PRO 6000 Blackwell Server Edition")
CALIBRATION = ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3")
# (catalog name, n or 0 for the best of the sizes, measured TFLOP/s, where it is from)
SQUARE_ROWS: tuple[tuple[str, int, float, str], ...] = (
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 4096, 399.93, "issue #161, torch 2.7.0+cu128"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 8192, 417.34, "issue #161, torch 2.7.0+cu128"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 10240, 387.01, "issue #161, torch 2.7.0+cu128"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 0, 409.42, "database.md, docker"),
    ("NVIDIA L40S", 0, 269.15, "database.md, docker"),
    ("NVIDIA H200", 0, 790.29, "database.md, docker"),
    ("NVIDIA B200", 0, 1696.03, "database.md, GCP a4-highgpu-8g, torch 2.8.0"),
    ("NVIDIA H100 80GB HBM3", 0, 789.24, "database.md, docker, torch 2.8.0, CUDA 12.6"),
    ("NVIDIA H100 80GB HBM3", 0, 783.66, "database.md, physical machine"),
    ("NVIDIA A100-SXM4-80GB", 0, 264.53, "database.md, docker, torch 2.8.0, CUDA 12.8"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 4096, 368.43, "issue #160, torch 2.7.0+cu128"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 8192, 350.31, "issue #160, torch 2.7.0+cu128"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 10240, 333.93, "issue #160, torch 2.7.0+cu128"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 0, 417.98, "database.md, physical machine, torch 2.8.0"),
    ("NVIDIA H20", 0, 141.86, "database.md, docker, torch 2.8.0, CUDA 12.8"),
    ("NVIDIA GeForce RTX 5090", 0, 236.03, "database.md, cloud instance, torch 2.8.0"),
    ("NVIDIA GeForce RTX 5090", 0, 242.18, "database.md, physical machine, torch 2.7.1+cu128"),
    ("NVIDIA GeForce RTX 4090", 0, 170.06, "database.md, physical machine, torch 2.4.0"),
    ("NVIDIA GeForce RTX 4090", 0, 173.31, "database.md, physical machine, torch 2.4.1"),
)


def square_prediction(gpu: str, n: int) -> dict:
    """m2live for one row: n^3 at that size, or the best of SQUARE_SIZES for a best-of row (n = 0)."""
    preds = [(size, mamf_prediction(gpu, "bf16", size, size, size, SQUARE_WINDOW)) for size in
             ((n,) if n else SQUARE_SIZES)]
    size, best = max(preds, key=lambda p: p[1]["tflops"])
    return {**best, "n": size}


def _group(gpu: str) -> str:
    if gpu in OUTSIDE:
        return "checked_from_outside"
    if gpu in CALIBRATION:
        return "calibration_gpus"
    return "geforce" if "GeForce" in gpu else "other"


def score_square() -> dict:
    """Every row: measured and predicted TFLOP/s, the signed error and the burst clock; MAPE per group."""
    rows = []
    for gpu, n, meas, note in SQUARE_ROWS:
        p = square_prediction(gpu, n)
        rows.append({"gpu": gpu, "n": n or f"best of {', '.join(map(str, SQUARE_SIZES))}",
                     "predicted_best_n": p["n"], "measured_tflops": meas,
                     "predicted_tflops": round(p["tflops"], 1),
                     "error_pct": round(100.0 * (p["tflops"] - meas) / meas, 2),
                     "burst_f_clk": round(p["f_clk"], 3), "burst_sm_mhz": round(p["sm_mhz"]),
                     "bound": p["bound"], "group": _group(gpu), "note": note})
    out: dict = {"source": SQUARE_SOURCE, "timed_calls_of_burst": SQUARE_WINDOW, "rows": rows}
    for group in ("checked_from_outside", "calibration_gpus", "other", "geforce"):
        errs = [abs(r["error_pct"]) for r in rows if r["group"] == group]
        out[f"mape_{group}"] = round(sum(errs) / len(errs), 2)
    return out
