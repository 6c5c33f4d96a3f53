"""Per-operator tables (the opbench schema): read, predict every row, score against measured latencies.

Kinds, inferred from the columns (never from ``latency_ms``, which is optional):
- ``gemm``            columns m, n, k                       Y[m,n] = X[m,k] @ W[n,k]^T, bf16 (``*_fp8.csv``: vLLM's
                                                            fp8 linear layer, input quantisation included)
- ``prefill_attention`` attention columns with step == 0     batch_size sequences of isl tokens, causal, empty cache
- ``decode_attention``  attention columns with step >= 1     batch_size sequences of 1 token over step cached
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .efficiency import ATTN_BENCH_WINDOW, GEMM_BENCH_WINDOW, ArchConstants
from .hardware import get_gpu
from .limits import positive_float  # noqa: F401  (re-exported: the CLI's number rule)
from .predictor import OpModel

if TYPE_CHECKING:
    from .calibration_file import Calibration, Calibrations

GEMM_COLS = ("m", "n", "k")
ATTN_COLS = ("batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim", "step")


class TableError(ValueError):
    """A malformed per-operator table (missing columns, non-numeric or out-of-range cells)."""


@dataclass
class Table:
    path: str
    header: list[str]
    rows: list[dict[str, str]]
    kinds: list[str]  # per row
    dtype: str = "bf16"  # GEMM precision: "fp8" for vLLM's W8A8 linear layers (a *_fp8.csv file or --dtype fp8)


def table_dtype(path: str | os.PathLike) -> str:
    """The precision a table's file name says: ``*_fp8.csv`` → fp8 (opbench_fp8), anything else bf16."""
    return "fp8" if Path(path).stem.lower().endswith("_fp8") else "bf16"


MAX_DIM = 2**31 - 1  # cuBLAS and the attention kernels take their sizes as 32-bit ints


def _int_cell(row: dict[str, str], col: str, lineno: int, path: str, minimum: int) -> int:
    raw = (row.get(col) or "").strip()
    try:
        v = float(raw)
    except ValueError:
        raise TableError(f"{path}:{lineno}: column {col!r} is not a number ({raw!r})") from None
    if not math.isfinite(v) or not v.is_integer():
        raise TableError(f"{path}:{lineno}: column {col!r} must be an integer, got {raw!r}")
    if v < minimum:
        raise TableError(f"{path}:{lineno}: column {col!r} must be >= {minimum}, got {raw!r}")
    if v > MAX_DIM:
        raise TableError(f"{path}:{lineno}: column {col!r} must be <= {MAX_DIM} (the kernels' 32-bit sizes), "
                         f"got {raw!r}")
    return int(v)


def check_csv_shape(path: str, header: list[str], rows: list[dict], error: type[ValueError]) -> None:
    """A CSV whose header names a column twice, or a row with more cells than the header has columns, would be
    read wrongly (a later cell silently wins; extra cells dropped): ``error`` naming the file (and row)."""
    dup = sorted({c for c in header if header.count(c) > 1})
    if dup:
        raise error(f"{path}: column(s) {', '.join(map(repr, dup))} named more than once in the header")
    for i, r in enumerate(rows, start=2):
        extra = r.get(None)  # csv.DictReader keeps a row's cells past the header under the key None
        if extra:
            raise error(f"{path}:{i}: {len(extra)} more cell(s) than the header's {len(header)} columns")


def read_table(path: str | os.PathLike, dtype: str | None = None) -> Table:
    """``dtype`` None: from the file name (``table_dtype``)."""
    p = str(path)
    try:
        with open(p, newline="", encoding="utf-8-sig") as f:  # a byte-order mark is not a column name
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            rows = list(reader)
    except UnicodeDecodeError:
        raise TableError(f"{p}: not a text CSV file") from None
    except csv.Error as e:
        raise TableError(f"{p}: malformed CSV ({e})") from None
    if not header:
        raise TableError(f"{p}: empty file (no header row)")
    check_csv_shape(p, header, rows, TableError)
    if all(c in header for c in GEMM_COLS):
        kinds = ["gemm"] * len(rows)
    elif all(c in header for c in ATTN_COLS):
        kinds = []
        for i, r in enumerate(rows, start=2):
            step = _int_cell(r, "step", i, p, 0)
            kinds.append("prefill_attention" if step == 0 else "decode_attention")
    else:
        missing_g = [c for c in GEMM_COLS if c not in header]
        missing_a = [c for c in ATTN_COLS if c not in header]
        raise TableError(
            f"{p}: cannot tell the operator kind: a GEMM table needs columns {', '.join(GEMM_COLS)} "
            f"(missing {', '.join(missing_g)}); an attention table needs {', '.join(ATTN_COLS)} "
            f"(missing {', '.join(missing_a)})"
        )
    dtype = dtype or table_dtype(p)
    if dtype not in ("bf16", "fp8"):
        raise TableError(f"{p}: unknown precision {dtype!r} (bf16 or fp8)")
    if dtype == "fp8" and kinds and kinds[0] != "gemm":
        raise TableError(f"{p}: an fp8 table holds GEMMs (m, n, k): vLLM keeps attention in bf16")
    return Table(p, header, rows, kinds, dtype)


Clock = Callable[[float, float], float]  # (FLOPs, seconds at boost) -> f_clk


def gemm_ms(om: OpModel, m: int, n: int, k: int, clock: Clock, l2_warm: bool = True) -> float:
    """One GEMM row in ms: timed at boost, then at the clock the row's work and duration give."""
    t0 = om.gemm(m, n, k, 1.0, l2_warm=l2_warm)
    f = clock(2.0 * m * n * k, t0.t)
    return (t0 if f == 1.0 else om.gemm(m, n, k, f, l2_warm=l2_warm)).t * 1e3


def prefill_ms(om: OpModel, b: int, isl: int, h: int, kv: int, d: int, clock: Clock) -> float:
    """One prefill-attention row in ms (``b`` causal sequences of ``isl`` tokens), clocked like ``gemm_ms``."""
    seqs = [(isl, 0)] * b
    t0 = om.prefill_attention(seqs, h, kv, d, 1.0)
    f = clock(4.0 * h * d * b * isl * (isl + 1) / 2.0, t0.t)
    return (t0 if f == 1.0 else om.prefill_attention(seqs, h, kv, d, f)).t * 1e3


class RowPredictor:
    """Predicts table rows; one OpModel per GPU name."""

    def __init__(self, gpu: str | None = None, clock: str | float = "power", l2_warm: bool = True,
                 constants: dict[str, ArchConstants] | None = None,
                 calibration: Calibration | Calibrations | None = None,
                 fp8_constants: dict[str, ArchConstants] | None = None):
        self.gpu_override = gpu
        # GPUs' own constants (m2live calibrate), one per GPU; refuses rows of a GPU with none
        self.calibrations: Calibrations | None = None
        if calibration is not None:
            from .calibration_file import Calibrations as Several

            self.calibrations = calibration if isinstance(calibration, Several) else Several([calibration])
        self.constants = constants or {}  # kernel family -> constants override (leave-one-GPU-out checks)
        self.clock = clock
        self.l2_warm = l2_warm
        self._models: dict[tuple[str, str], OpModel] = {}
        self.fp8_constants = fp8_constants or {}  # kernel family -> fp8 GEMM constants (leave-one-GPU-out)
        if gpu is not None:
            get_gpu(gpu)  # fail early on an unknown name

    def model_for(self, name: str, dtype: str = "bf16") -> OpModel:
        m = self._models.get((name, dtype))
        if m is None:
            gpu = get_gpu(name)
            c = (self.fp8_constants if dtype == "fp8" else self.constants).get(gpu.kernel_family)
            cal = self.calibrations.for_gpu(gpu) if self.calibrations is not None else None
            try:
                if cal is not None:
                    c = cal.arch_constants("fp8" if dtype == "fp8" else "bf16")
                m = self._models[(name, dtype)] = OpModel(gpu, dtype=dtype, constants=c)
            except ValueError as e:  # fp8 on a GPU without fp8 tensor cores (GpuSpec.require_fp8)
                raise TableError(str(e)) from None
        return m

    def _f_clk(self, om: OpModel, flops: float, t_boost: float, window: tuple[int, int] = GEMM_BENCH_WINDOW
               ) -> float:
        """The clock of one row: 'power' (default) the power model over the collector's timed ``window`` of its
        burst of calls, 'forecast' the sustained (serving) clock, 'boost', or an SM clock in MHz."""
        if isinstance(self.clock, (int, float)):
            return float(self.clock) / om.gpu.boost_mhz
        if self.clock == "power":
            return om.burst_clock(flops, t_boost, window)
        if self.clock == "forecast":
            return om.clock_ratio(flops, t_boost)
        return 1.0

    def predict_row(self, kind: str, row: dict[str, str], lineno: int, path: str, dtype: str = "bf16") -> float:
        """Predicted latency in milliseconds (``dtype`` fp8: vLLM's fp8 linear layer, input quantisation included)."""
        name = self.gpu_override or (row.get("device") or "").strip()
        if not name:
            raise TableError(f"{path}:{lineno}: no GPU: pass --gpu or give a 'device' column")
        om = self.model_for(name, dtype)
        if kind == "gemm":
            m, n, k = (_int_cell(row, c, lineno, path, 1) for c in GEMM_COLS)
            return gemm_ms(om, m, n, k, lambda fl, t: self._f_clk(om, fl, t), self.l2_warm)
        b = _int_cell(row, "batch_size", lineno, path, 1)
        isl = _int_cell(row, "isl", lineno, path, 1)
        h = _int_cell(row, "num_heads", lineno, path, 1)
        kv = _int_cell(row, "num_key_value_heads", lineno, path, 1)
        d = _int_cell(row, "head_dim", lineno, path, 1)
        step = _int_cell(row, "step", lineno, path, 0)
        if h % kv:
            raise TableError(f"{path}:{lineno}: num_heads {h} is not a multiple of num_key_value_heads {kv}")
        if kind == "prefill_attention":
            return prefill_ms(om, b, isl, h, kv, d, lambda fl, t: self._f_clk(om, fl, t, ATTN_BENCH_WINDOW))
        return om.decode_attention(b * step, b, h, kv, d, self._f_clk(om, 0.0, 1.0), l2_warm=self.l2_warm).t * 1e3

    def predict_table(self, table: Table) -> list[float]:
        return [self.predict_row(kind, row, i, table.path, table.dtype)
                for i, (kind, row) in enumerate(zip(table.kinds, table.rows, strict=True), start=2)]


UNMEASURED = ("", "nan")  # latency_ms cells (lower-cased) of a shape not measured

# A measured operator latency outside this (one nanosecond to ~3 hours) is a broken cell, not a measurement
LATENCY_MS_RANGE = (1e-6, 1e7)


def measured(table: Table) -> list[float] | None:
    """Each row's latency_ms; NaN for a shape the table holds but did not measure (a blank cell or NaN: what a
    collector writes for a shape that failed, and pandas for a missing value), which every score leaves out. A cell
    that is no number, or no latency (not positive, outside LATENCY_MS_RANGE), is an error. None: no column."""
    if "latency_ms" not in table.header:
        return None
    out = []
    lo, hi = LATENCY_MS_RANGE
    for i, r in enumerate(table.rows, start=2):
        where = f"{table.path}:{i}: column 'latency_ms'"
        raw = (r.get("latency_ms") or "").strip()
        if raw.lower() in UNMEASURED:
            out.append(math.nan)
            continue
        v = positive_float(raw, where, TableError)
        if not lo <= v <= hi:
            raise TableError(f"{where}: {v:g} ms is outside any measured operator ({lo:g} to {hi:g} ms)")
        out.append(v)
    return out


def mape(pred: Iterable[float] | Iterable[tuple[float, float]], meas: Iterable[float] | None = None
         ) -> float | None:
    """Mean absolute percentage error, in %, of predictions against measurements: ``mape(pred, meas)`` (two
    sequences of equal length) or ``mape(pairs)`` ((predicted, measured) pairs). A pair whose measurement is not
    positive, or with a non-finite value (a cell that failed), is left out; None when no pair is left."""
    pairs = zip(pred, meas, strict=True) if meas is not None else pred
    errs = [abs(p - m) / m for p, m in pairs if m > 0 and math.isfinite(p) and math.isfinite(m)]
    return 100.0 * sum(errs) / len(errs) if errs else None


def in_core_region(kind: str, row: dict[str, str]) -> bool:
    """The region the accuracy targets are stated on: GEMMs with N,K in [1024, 16384]; attention head_dim 128."""
    if kind == "gemm":
        return 1024 <= int(row["n"]) <= 16384 and 1024 <= int(row["k"]) <= 16384
    return int(row["head_dim"]) == 128


def find_tables(directory: str | os.PathLike) -> list[Path]:
    d = Path(directory)
    if not d.exists():
        raise FileNotFoundError(f"no such directory: {directory}")
    if d.is_file():
        return [d]
    files = sorted(p for p in d.rglob("*.csv"))
    if not files:
        raise TableError(f"{directory}: no CSV files found")
    return files


def score_directory(directory: str | os.PathLike, gpu: str | None = None, clock: str | float = "power",
                    l2_warm: bool = True, calibration: Calibration | Calibrations | None = None,
                    dtype: str | None = None) -> list[dict]:
    """One entry per (file, kind, region): rows, MAPE, median APE, mean signed error; ``dtype`` None: each
    file's from its name (``*_fp8.csv`` → fp8)."""
    rp = RowPredictor(gpu, clock=clock, l2_warm=l2_warm, calibration=calibration)
    label = get_gpu(gpu).name if gpu else None  # (a spec file's GPU by its name, not the file's)
    results: list[dict] = []
    for path in find_tables(directory):
        table = read_table(path, dtype)
        meas = measured(table)
        if meas is None:
            raise TableError(f"{path}: no latency_ms column to validate against")
        if all(math.isnan(m) for m in meas):  # (true of a header only too)
            raise TableError(f"{path}: no measured rows to validate against (a header only, or every latency_ms "
                             "blank or NaN)")
        pred = rp.predict_table(table)
        # scored per device (a table may hold several GPUs' rows, each priced as its own), kind and region
        groups: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
        unmeasured: dict[tuple[str, str, str], int] = {}
        for kind, row, p, m in zip(table.kinds, table.rows, pred, meas, strict=True):
            dev = label or row.get("device", "")
            for key in (((dev, kind, "all"), (dev, kind, "core")) if in_core_region(kind, row)
                        else ((dev, kind, "all"),)):
                if math.isnan(m):  # a shape the table did not measure: left out, counted
                    unmeasured[key] = unmeasured.get(key, 0) + 1
                else:
                    groups.setdefault(key, []).append((p, m))
        for (device, kind, region), pm in sorted(groups.items()):
            ps, ms = zip(*pm, strict=True)
            apes = sorted(abs(p - m) / m * 100 for p, m in pm)
            results.append({
                "file": str(path), "gpu": device, "kind": kind, "dtype": table.dtype, "region": region,
                "rows": len(pm), "unmeasured": unmeasured.get((device, kind, region), 0),
                "mape": mape(ps, ms), "median_ape": apes[len(apes) // 2],
                "bias": 100.0 * sum((p - m) / m for p, m in pm) / len(pm),
            })
    return results
