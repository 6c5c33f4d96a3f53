"""What a GPU calibration fits: the constants, how far each may move, and predicting rows with a candidate set.

The kinds of measured rows (``KINDS``, their opbench files and shape columns), the constants each kind's rows
see (``CALIBRATED``; the few plainly the GPU's own, ``PRIMARY``), each constant's prior spread, bounds and
parameterisation (``Params``: theta <-> log theta), and ``predict_rows``: a row's latency under a candidate set
of constants, by the same code path as ``m2live ops``. The plan (``calibration_plan``), the fit
(``calibrate``) and the files (``calibration_file``) all build on this module.

numpy only: the core package imports without scipy, torch or vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np

from .efficiency import ArchConstants, in_use
from .hardware import GpuSpec
from .validate import ATTN_COLS, GEMM_COLS, RowPredictor

# gemm_fp8: vLLM's W8A8 fp8 linear layer (CUTLASS scaled-mm, the input's quantisation included: opbench_fp8's
# gemm_fp8.csv), fitted on its own constants (efficiency.ARCH_FP8) — a kernel library apart from cuBLAS's bf16.
KINDS = ("gemm", "prefill", "decode", "gemm_fp8")
TABLE_KIND = {"gemm": "gemm", "prefill_attention": "prefill", "decode_attention": "decode"}  # validate's -> ours
ROW_KIND = {**{v: k for k, v in TABLE_KIND.items()}, "gemm_fp8": "gemm"}  # ours -> validate's
DTYPE = {"gemm": "bf16", "prefill": "bf16", "decode": "bf16", "gemm_fp8": "fp8"}  # the constants a kind's rows see
FILES = {"gemm": "gemm_bf16.csv", "prefill": "prefill_attention_bf16.csv", "decode": "decode_attention_bf16.csv",
         "gemm_fp8": "gemm_fp8.csv"}
SHAPE_COLS = {"gemm": GEMM_COLS, "prefill": ATTN_COLS, "decode": ATTN_COLS, "gemm_fp8": GEMM_COLS}
GEMM_KINDS = ("gemm", "gemm_fp8")


def row_kind(table_kind: str, dtype: str) -> str:
    """Our kind of a table row: validate's kind, and fp8 for an fp8 table's GEMMs."""
    return "gemm_fp8" if dtype == "fp8" else TABLE_KIND[table_kind]

# The constants a calibration fits, by the rows that see them. Every name is a field of ArchConstants (checked
# below); a constant shared by two kinds (the attention floor) is fitted on both kinds' rows together.
CALIBRATED: dict[str, tuple[str, ...]] = {
    "gemm": ("eta_tc", "i_crit", "k0", "t_kernel", "eta_mem", "t_ramp", "overlap", "k_split", "t_fixup",
             "limiter_headroom", "l2_bytes_per_clk"),
    "prefill": ("t_attn", "t_attn_over", "eta_attn", "k0_attn", "block_cost", "t_cache_cta"),
    "decode": ("t_attn", "t_attn_over", "eta_attn_mem", "item_cost", "cta_bw", "t_split", "t_merge", "t_relayout",
               "t_ramp_kv", "l2_kv_bytes_per_clk", "item_overlap", "t_sched", "t_qrow"),
    # the fp8 GEMM group as bench/fit_fp8.py fits it (efficiency.FITTED_GROUPS["fp8_gemm"]): CUTLASS's ceiling,
    # feed, latency, streaming and K-block floor, and the input quantisation's per-row cost and per-SM stream —
    # not the fitted kernel facts (efficiency.FP8_KERNEL_FITTED: Hopper's ragged-M cost), which a GPU takes from
    # its family as it takes its tiles.
    # The board's and the L2's constants (limiter_headroom, l2_bytes_per_clk) are the GPU's, not the kernels':
    # the bf16 GEMM rows pin them and the fp8 constants take them from there (CARRIED_TO_FP8)
    "gemm_fp8": ("eta_tc", "i_crit", "k0", "t_kernel", "eta_mem", "t_ramp", "overlap", "t_kiter", "q_row",
                 "q_sm_bw"),
}
# The few constants that are most plainly this GPU's own rather than its kernel library's (tensor ceiling, DRAM
# efficiency and its ramp, kernel latency, the rate its L2 serves re-read weights at; the attention call's floor
# and fixed part, the attention kernels' tensor and streaming efficiency): a fit may move only these when
# cross-validation says the rest overfit. The L2 rate is borrowed from the B300 by every family and decides
# ~18 % of the grid's GEMM rows on a 96-128 MB L2 in front of GDDR (L40S, RTX PRO 6000: six copies of a weight up
# to 16-21 MB stay in L2, 1.3-1.8 x faster than DRAM on 7 of the default plan's 32 shapes), none on the
# calibration GPUs' HBM: where no row re-reads from L2 the ridge keeps its prior.
PRIMARY: dict[str, tuple[str, ...]] = {
    "gemm": ("eta_tc", "t_kernel", "eta_mem", "t_ramp", "l2_bytes_per_clk"),
    "prefill": ("t_attn", "t_attn_over", "eta_attn"),
    "decode": ("t_attn", "t_attn_over", "eta_attn_mem", "cta_bw"),
    "gemm_fp8": ("eta_tc", "t_kernel", "eta_mem", "t_ramp", "q_sm_bw"),
}
_FIELDS = {f.name for f in fields(ArchConstants)}
for _kind, _names in CALIBRATED.items():
    for _n in (*_names, *PRIMARY[_kind]):
        if _n not in _FIELDS:
            raise ImportError(f"CALIBRATED/PRIMARY[{_kind!r}] names {_n!r}, not an ArchConstants field")
ALL_CALIBRATED = tuple(dict.fromkeys(n for k, names in CALIBRATED.items() if DTYPE[k] == "bf16" for n in names))
FP8_CALIBRATED = CALIBRATED["gemm_fp8"]
# What a bf16 calibration tells the fp8 constants (no fp8 row needed): the power limiter's fast loop and the rate
# the L2 re-serves a weight at are the board's and the chip's, whatever kernel runs ("same"); the DRAM streaming
# efficiency is the GPU's memory times its kernels' streaming, so the bf16 fit's ratio to its prior — this GPU's
# memory against its family's calibration GPU's — scales the fp8 one ("ratio"). On the opbench GPUs from
# another family's constants (zero-shot, bf16 calibrated on the default plan, no fp8 row): H100 fp8 GEMMs
# 9.22 -> 7.96 %, B300 7.21 -> 6.77 % (the board and L2 alone: 8.81 / 7.19 %); in-sample priors unmoved.
CARRIED_TO_FP8: dict[str, str] = {"limiter_headroom": "same", "l2_bytes_per_clk": "same", "eta_mem": "ratio"}


def carry_to_fp8(fp8: ArchConstants, bf16_prior: ArchConstants, bf16_fitted: dict[str, float]) -> ArchConstants:
    """``fp8`` (a GPU's fp8 GEMM constants) with what the bf16 calibration ``bf16_fitted`` (over ``bf16_prior``)
    says of the GPU itself (``CARRIED_TO_FP8``)."""
    upd: dict[str, float] = {}
    for n, how in CARRIED_TO_FP8.items():
        if n not in bf16_fitted:
            continue
        v = float(bf16_fitted[n])
        v = v if how == "same" else float(getattr(fp8, n)) * v / float(getattr(bf16_prior, n))
        lo, hi = BOUNDS.get(n, (v, v))  # a ratio carried past a bound stays on it (0.2 -> Blackwell's fp8 0.174)
        upd[n] = min(max(v, lo), hi)
    return replace(fp8, **upd) if upd else fp8

# How far the rows may move each constant from its prior, and how hard the ridge pulls it back. Constants are
# fitted as log(theta) (positive, multiplicative errors) unless named in LINEAR (a prior of 0 is a valid value).
# SIGMA: one prior standard deviation (in log units; in the constant's own units for LINEAR ones).
# t_split / t_merge / t_relayout / t_fixup / t_sched / t_qrow are linear: a prior of 0 is a kernel path the prior's
# kernels never take, which another GPU's kernels may (a zero-shot prior borrowed from Hopper for an FA2 GPU; FA3's
# tile scheduler and packed query rows for a Hopper GPU on Blackwell's constants, which have neither)
LINEAR: frozenset[str] = frozenset({"t_split", "t_merge", "t_relayout", "t_fixup", "t_sched", "t_qrow"})
SIGMA_DEFAULT = 0.5
SIGMA: dict[str, float] = {"eta_tc": 0.2, "eta_mem": 0.15, "eta_attn": 0.2, "eta_attn_mem": 0.15, "overlap": 0.3,
                           "t_ramp": 0.7, "k_split": 0.7, "t_split": 4e-6, "t_merge": 1e-7, "t_relayout": 4e-6,
                           "t_fixup": 1e-6, "limiter_headroom": 0.3,
                           # FA3's scheduler round and packed query row: about their H100 values (0.46 us, 26 ns)
                           "t_sched": 5e-7, "t_qrow": 2.5e-8}
BOUNDS_REL = (0.1, 10.0)  # theta within [prior * lo, prior * hi] unless in BOUNDS
BOUNDS: dict[str, tuple[float, float]] = {"eta_tc": (0.2, 1.3), "eta_mem": (0.2, 1.1), "eta_attn": (0.1, 1.3),
                                          "eta_attn_mem": (0.1, 1.1), "overlap": (1.1, 12.0),
                                          "item_overlap": (1.0, 12.0),
                                          "k_split": (128.0, 8192.0), "t_split": (0.0, 4e-5),
                                          "t_merge": (0.0, 1e-6), "t_relayout": (0.0, 4e-5),
                                          "t_fixup": (0.0, 1e-5), "t_sched": (0.0, 5e-6),
                                          "t_qrow": (0.0, 2.5e-7),
                                          # the limiter's fast loop: from holding the TDP to no second stage
                                          "limiter_headroom": (1.0, 2.0)}
# What a calibration file may hold at all (a fitted value: this widened to its prior, as the fit widens it;
# ``calibration_file`` refuses values outside, so a
# corrupted or hand-edited file cannot overflow the model): the fit's own BOUNDS where it has them, else by kind —
# times at most a second, per-CTA and per-SM rates at most 1e14 B/s, bytes per SM clock at most 1e4, the rest
# (feeds, K lengths, overlaps) at most 1e6.
TIME_LIKE = frozenset({"item_cost", "block_cost", "q_row"})


# Constants whose 0 stands for another constant's value, not for none: l2_kv_bytes_per_clk 0 is the GEMV's L2 rate,
# l2_bytes_per_clk (OpModel.l2_time). A fit starts such a constant from the value it stands for (calibrate.
# fit_constants), so a file may record a prior of 0 with a fitted value
ZERO_MEANS_OTHER: dict[str, str] = {"l2_kv_bytes_per_clk": "l2_bytes_per_clk"}


def plausible_range(name: str) -> tuple[float, float]:
    """(lo, hi) that any value of the constant ``name`` lies in: the fit's own BOUNDS, which it clips to, both
    ends included; else (0, hi], 0 included only for a LINEAR constant or one whose 0 stands for another's value
    (``in_plausible_range``)."""
    if name in BOUNDS:
        return BOUNDS[name]
    if name.startswith("t_") or name in TIME_LIKE:
        return 0.0, 1.0
    if name in ("cta_bw", "q_sm_bw"):
        return 0.0, 1e14
    if name.endswith("_per_clk"):
        return 0.0, 1e4
    return 0.0, 1e6


PLAUSIBLE_RTOL = 1e-9  # a value this close to an end of its range is on it (a file written by an older fit)


def range_for(name: str, prior: float | None = None) -> tuple[float, float]:
    """``plausible_range`` widened to take in ``prior``, as the fit widens a constant's bounds (``Params``)."""
    lo, hi = plausible_range(name)
    if prior is not None and math.isfinite(prior):
        lo, hi = min(lo, prior), max(hi, prior)
    return lo, hi


def in_plausible_range(name: str, x: float, prior: float | None = None) -> bool:
    """Whether ``x`` is a value of ``name`` that some fit from ``prior`` could give (``range_for``); within
    PLAUSIBLE_RTOL of an end counts as on it."""
    lo, hi = range_for(name, prior)
    if not (math.isfinite(x) and x <= hi * (1 + PLAUSIBLE_RTOL)):
        return False
    return x >= lo * (1 - PLAUSIBLE_RTOL) if (lo > 0 or name in LINEAR or name in ZERO_MEANS_OTHER) else x > lo


# Piecewise-constant in the loss (a library heuristic's threshold): chosen on a grid around the prior, not by LM.
DISCRETE: dict[str, tuple[float, ...]] = {"k_split": (256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072)}
RESID_SCALE = 0.03  # log-latency residual that counts as "one unit" in the robust loss (soft-L1 knee)


class CalibrationError(ValueError):
    """Bad calibration input or file: one line for the user."""


# ---- predicting rows with a candidate set of constants ------------------------------------------------------
@dataclass
class Row:
    kind: str  # gemm | prefill | decode | gemm_fp8
    cells: dict[str, str]  # shape columns (and device) as in the table
    ms: float = float("nan")  # measured latency; nan for a plan row


def predict_rows(gpu: GpuSpec, c: ArchConstants, rows: Sequence[Row]) -> np.ndarray:
    """Predicted ms of each row with constants ``c`` — the same code path as ``m2live ops``. The rows are of one
    precision (bf16 kinds, or gemm_fp8), and ``c`` that precision's constants."""
    dtypes = {DTYPE[r.kind] for r in rows}
    if len(dtypes) > 1:
        raise ValueError("predict_rows: bf16 and fp8 rows take different constants; predict them apart")
    fam = {gpu.kernel_family: c}
    rp = RowPredictor(gpu.name, constants=fam, fp8_constants=fam)
    return np.array([rp.predict_row(ROW_KIND[r.kind], r.cells, i, "calibration", DTYPE[r.kind])
                     for i, r in enumerate(rows)])


def active(names: Iterable[str], prior: ArchConstants) -> list[str]:
    """Constants worth fitting: a log-fitted constant whose prior is 0 is a path this architecture's kernels never
    take, so it stays 0; and one that only a kernel path the GPU's own kernel facts never take prices (FA2's
    relayout on Hopper, the in-kernel split-K fix-up on the A100: ``efficiency.in_use``) is not fitted at all."""
    return [n for n in dict.fromkeys(names) if (n in LINEAR or getattr(prior, n) > 0) and in_use(prior, n)]


class Params:
    """theta <-> x (log theta, or theta for LINEAR constants) with bounds and the ridge's prior."""

    def __init__(self, names: list[str], prior: ArchConstants, strength: float = 1.0):
        self.names = names
        self.prior = prior
        p = np.array([float(getattr(prior, n)) for n in names])
        self.x0 = np.array([v if n in LINEAR else math.log(v) for n, v in zip(names, p, strict=True)])
        self.sigma = np.array([SIGMA.get(n, SIGMA_DEFAULT) for n in names]) / math.sqrt(strength)
        # numeric-derivative steps: 0.002 in log units, 1/250 of a prior deviation for LINEAR constants
        self.step = np.array([SIGMA.get(n, SIGMA_DEFAULT) / 250 if n in LINEAR else 2e-3 for n in names])
        lo, hi = [], []
        self.bounds = []  # (lo, hi) of each constant in its own units: a value out of exp() lands inside them
        for n, v in zip(names, p, strict=True):
            a, b = BOUNDS.get(n, (v * BOUNDS_REL[0], v * BOUNDS_REL[1]))
            a, b = min(a, v), max(b, v)  # the prior is always inside its bounds
            self.bounds.append((a, b))
            if n in LINEAR:
                lo.append(a)
                hi.append(b)
            else:
                lo.append(math.log(max(a, 1e-30)))
                hi.append(math.log(b))
        self.lo, self.hi = np.array(lo), np.array(hi)

    def clip(self, x: np.ndarray) -> np.ndarray:
        return np.minimum(np.maximum(x, self.lo), self.hi)

    def values(self, x: np.ndarray) -> dict[str, float]:
        # exp(log(b)) can come out a rounding step past b: clamped, so a constant fitted onto a bound is the bound
        # (a calibration file refuses what no fit gives: in_plausible_range)
        return {n: min(max(float(v if n in LINEAR else math.exp(v)), a), b)
                for n, v, (a, b) in zip(self.names, x, self.bounds, strict=True)}

    def constants(self, x: np.ndarray, base: ArchConstants | None = None) -> ArchConstants:
        return replace(base or self.prior, **self.values(x))

