"""``m2live probe --calibrate``: measure this GPU's calibration plan and fit its calibration, in one go.

For each kind the plan (``m2live calibrate plan``, default budgets) is measured the way opbench measured its
tables, so the fit sees the rows it was designed for:
- GEMMs: ``torch.nn.functional.linear`` (bf16) captured in a CUDA graph of back-to-back calls that run six
  copies of the weight in turn (the collector's copies, ``OpModel.BENCH_COPIES``: a weight comes back from L2
  only when the six copies fit in it, which is what the model assumes of an opbench row), 3 warm-up replays,
  then the mean of 6 timed replays (CUDA events) per call — short bursts, no L2 flush;
- attention: vLLM's own FlashAttention (``flash_attn_varlen_func`` on a paged KV cache of 64-token blocks, with
  the KV-cache write ``reshape_and_cache_flash`` in front, as vLLM runs it) where vLLM is importable; otherwise
  attention is skipped and the output says so. Shapes whose buffers would not fit in free memory are skipped;
- fp8 GEMMs (GPUs with fp8 tensor cores, where vLLM is importable): vLLM's fp8 linear layer as
  ``CutlassFP8ScaledMMLinearKernel`` runs it on a bf16 input — ``scaled_fp8_quant`` (dynamic per-tensor scale)
  then ``cutlass_scaled_mm`` on e4m3 weights with a per-tensor scale, bf16 out — timed like the bf16 GEMMs (six
  weight copies). Without vLLM they are skipped: torch's own fp8 matmul is cuBLASLt's, not the CUTLASS kernels
  vLLM serves with, whose constants these rows calibrate.
The tables go to DIR (``gemm_bf16.csv``, ``prefill_attention_bf16.csv``, ``decode_attention_bf16.csv``,
``gemm_fp8.csv``: the opbench layout) and ``calibrate.fit`` writes ``DIR/calibration.json``.

``holdout_s`` > 0 then checks the calibration on shapes it never saw: further shapes of the same grid (accuracy
region, shapes every opbench GPU has, not in the plan; a fixed random order, so a run cut short by the time
still samples every regime) measured the same way for that many seconds into ``DIR/holdout/``, and the MAPE of
the architecture's constants (zero-shot) and of the calibration on them. ``DIR/summary.json`` records the run.

``--dry-run`` runs the whole pipeline on the CPU: the same plan (for the dry-run GPU), each shape shrunk to a tiny
one and timed with ``perf_counter``, torch's SDPA standing in for vLLM's attention. The numbers mean nothing; the
pipeline (plan -> tables -> fit -> calibration file) is what it exercises (a bf16 linear stands in for the fp8 one).
"""

from __future__ import annotations

import csv
import functools
import inspect
import itertools
import json
import math
import os
import shutil
import statistics
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import calibrate as cal
from ..calibration_file import read_rows
from ..device_spec import catalog_or_device, is_derived
from ..hardware import GpuSpec, get_gpu, in_catalog, spec_to_dict
from ..operators import OpModel
from ..telemetry import ClockSampler, NvmlClockSource, ReplayClockSource, TelemetryError
from .device import Interrupted, ProbeError, _Device, load_torch, one_line, sigterm_interrupts
from .env import _nvml_info, dry_run_readings
from .plan import DRY_GPU
from .score import clock_stats

CAL_FILE = "calibration.json"
SUMMARY_FILE = "summary.json"
GPU_SPEC_FILE = "gpu.json"  # a GPU outside the catalog: its spec as read from the device (m2live gpus --json row)
HOLDOUT_DIR = "holdout"
WARMUP, REPLAYS = 3, 6  # opbench's timing: 3 warm-up replays, then the mean of 6
WEIGHT_COPIES = OpModel.BENCH_COPIES  # one call per copy in each replay
BLOCK = 64  # vLLM KV-cache block size of the opbench attention rows
MEM_SHARE = 0.6  # skip a shape whose buffers need more than this share of free device memory
DRY_CAP = 32  # dry run: every dimension shrunk to at most this
FAILS_IN_A_ROW = 5  # a kind whose shapes fail this many times running stops (the library refuses them all)

Say = Callable[[str], None]
Measured = tuple[dict[str, str], float, float | None]  # (planned row, seconds per call, median SM clock MHz)


class _Timer:
    """opbench's timing of one op on the probe's device (``_Device``: CUDA-graph capture, event timing)."""

    def __init__(self, torch: Any, cuda: bool):
        self.torch, self.cuda = torch, cuda
        self.dev = _Device(torch, cuda)

    def per_call(self, fn: Callable[[], Any], calls: int) -> float:
        """Seconds per call of ``fn``: ``calls`` back-to-back calls per replay (a CUDA graph on a GPU), WARMUP
        replays, then the mean of REPLAYS."""

        def body() -> None:
            for _ in range(calls):
                fn()

        body()  # first call: library heuristics, workspaces
        replay = self.dev.graph(body) if self.cuda else body
        for _ in range(WARMUP if self.cuda else 0):
            replay()
        self.dev.sync()
        total = sum(self.dev.time_once(replay) for _ in range(REPLAYS))
        del replay  # releases the graph's memory before the next shape
        return total / REPLAYS / calls

    def free_bytes(self) -> float:
        if not self.cuda:
            return float("inf")
        free, _ = self.torch.cuda.mem_get_info()
        return float(free)


def _attention(torch: Any, dry_run: bool, spec: GpuSpec | None = None) -> tuple[Callable | None, str]:
    """(attention call, what it is) — vLLM's kernel, torch SDPA in a dry run, or None with the reason."""
    if dry_run:
        return None, "torch SDPA stand-in (dry run)"
    if spec is not None and spec.kernel_family == "blackwell":
        # rows of another kernel would calibrate the wrong constants: vLLM serves these GPUs with FlashInfer
        return None, (f"attention skipped: vLLM serves {spec.name}'s attention with FlashInfer's TRT-LLM kernels, "
                      f"which this probe does not time (its FlashAttention rows would calibrate another kernel)")
    try:
        from vllm import _custom_ops as ops  # noqa: F401 - the KV-cache write
        try:
            from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
        except Exception:  # noqa: BLE001 - older layouts
            from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001
        return None, f"attention skipped: vLLM's FlashAttention is not importable ({e.__class__.__name__}: {e})"
    version = _fa_version()
    if version is None or not _takes(flash_attn_varlen_func, "fa_version"):
        return flash_attn_varlen_func, "vllm flash_attn_varlen_func + reshape_and_cache_flash (paged, block 64)"
    # the FlashAttention generation vLLM's own backend runs on this GPU (FA3 on Hopper): the interface defaults to
    # FA2 when it is not named, which is not the kernel vLLM serves with
    return (functools.partial(flash_attn_varlen_func, fa_version=version),
            f"vllm flash_attn_varlen_func FA{version} + reshape_and_cache_flash (paged, block 64)")


def _takes(fn: Callable, keyword: str) -> bool:
    """Whether ``fn`` accepts ``keyword`` (named, or through ``**kwargs``); True where its signature is hidden."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in params)


def _fa_version() -> int | None:
    """The FlashAttention version vLLM's FlashAttention backend picks here (``fa_utils.get_flash_attn_version``,
    whose arguments differ across releases), or None where it cannot say."""
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    except Exception:  # noqa: BLE001 - older layouts: the interface's own default
        return None
    for kwargs in ({"head_size": 128}, {}):
        try:
            v = get_flash_attn_version(**kwargs)
        except TypeError:
            continue
        except Exception:  # noqa: BLE001
            return None
        return int(v) if isinstance(v, int) else None
    return None


def _fp8_linear(torch: Any, spec: GpuSpec, dry_run: bool) -> tuple[Any, str]:
    """(vLLM's custom ops for its fp8 linear layer, what it is) — None with the reason where it cannot run."""
    if dry_run:
        return None, "bf16 F.linear stand-in (dry run)"
    if not spec.has_fp8:
        return None, f"fp8 GEMMs skipped: {spec.name} has no fp8 tensor cores"
    try:
        from vllm import _custom_ops as ops

        major, minor = torch.cuda.get_device_capability()
        if not ops.cutlass_scaled_mm_supports_fp8(10 * major + minor):
            return None, f"fp8 GEMMs skipped: vLLM's cutlass_scaled_mm has no fp8 kernel for sm_{major}{minor}"
    except Exception as e:  # noqa: BLE001 - vLLM absent or built without its CUDA ops
        return None, f"fp8 GEMMs skipped: vLLM's cutlass_scaled_mm is not importable ({e.__class__.__name__}: {e})"
    return ops, "vllm scaled_fp8_quant (dynamic per-tensor) + cutlass_scaled_mm (CutlassFP8ScaledMMLinearKernel)"


def _measure_gemm(torch: Any, timer: _Timer, dev: Any, row: dict[str, str], dry: bool,
                  fp8_ops: Any = None) -> float | None:
    """Seconds per call of one GEMM shape: bf16 ``F.linear``, or (``fp8_ops``: vLLM's custom ops) vLLM's fp8
    linear layer on a bf16 input, its quantisation included."""
    m, n, k = (int(row[c]) for c in ("m", "n", "k"))
    if dry:
        m, n, k = (min(v, DRY_CAP) for v in (m, n, k))
    # the weight copies (bf16: 2 B each; fp8: 1 B each, quantised one at a time from a bf16 one), input, output
    weights = (2.0 * WEIGHT_COPIES if fp8_ops is None else WEIGHT_COPIES + 2.0) * n * k
    if 2.0 * (m * k + m * n) + weights > MEM_SHARE * timer.free_bytes():
        return None
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    if fp8_ops is None:
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(WEIGHT_COPIES)]
        F = torch.nn.functional
        copies = itertools.cycle(ws)  # in turn: the WEIGHT_COPIES calls of a replay read each copy once
        return timer.per_call(lambda: F.linear(x, next(copies)), WEIGHT_COPIES)  # the buffers go on return
    # e4m3 weights with a per-tensor scale, stored (n, k) and passed transposed (column-major), as vLLM's
    # Fp8LinearMethod leaves them for cutlass_scaled_mm
    quant = [fp8_ops.scaled_fp8_quant(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02, None)
             for _ in range(WEIGHT_COPIES)]
    copies8 = itertools.cycle([(q.t(), s) for q, s in quant])

    def call() -> Any:
        wq, ws_ = next(copies8)
        xq, xs = fp8_ops.scaled_fp8_quant(x, None)  # the input's dynamic per-tensor quantisation
        return fp8_ops.cutlass_scaled_mm(xq, wq, scale_a=xs, scale_b=ws_, out_dtype=torch.bfloat16)

    return timer.per_call(call, WEIGHT_COPIES)


def _measure_attention(torch: Any, timer: _Timer, dev: Any, kind: str, row: dict[str, str], fa: Callable | None,
                       dry: bool) -> float | None:
    b, isl, h, kv, d, step = (int(row[c]) for c in cal.SHAPE_COLS[kind])
    q_len, ctx = (isl, isl) if kind == "prefill" else (1, step + 1)
    bf16 = torch.bfloat16
    if dry or fa is None:
        b, q_len, ctx, h, kv = (min(v, DRY_CAP) for v in (b, q_len, ctx, h, kv))
        kv = max(1, min(kv, h))
        h -= h % kv
        q = torch.randn(b, h, q_len, d, dtype=bf16)
        k = torch.randn(b, h, ctx, d, dtype=bf16)
        v = torch.randn(b, h, ctx, d, dtype=bf16)
        F = torch.nn.functional
        return timer.per_call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=kind == "prefill"), 1)
    from vllm import _custom_ops as ops

    blocks_per_seq = -(-ctx // BLOCK)
    nblocks = b * blocks_per_seq
    tokens = b * q_len
    need = 2.0 * (2 * nblocks * BLOCK * kv * d + tokens * (2 * h + 2 * kv) * d)
    if need > MEM_SHARE * timer.free_bytes():
        return None
    k_cache = torch.zeros(nblocks, BLOCK, kv, d, device=dev, dtype=bf16)
    v_cache = torch.zeros_like(k_cache)
    q = torch.randn(tokens, h, d, device=dev, dtype=bf16)
    k_new = torch.randn(tokens, kv, d, device=dev, dtype=bf16)
    v_new = torch.randn(tokens, kv, d, device=dev, dtype=bf16)
    out = torch.empty_like(q)
    block_table = torch.arange(nblocks, device=dev, dtype=torch.int32).view(b, blocks_per_seq)
    # the new tokens' slots: positions ctx - q_len .. ctx - 1 of each sequence
    pos = torch.arange(ctx - q_len, ctx, device=dev, dtype=torch.int64)
    slots = (torch.arange(b, device=dev, dtype=torch.int64)[:, None] * blocks_per_seq * BLOCK + pos[None, :]).reshape(-1)
    cu_q = torch.arange(0, (b + 1) * q_len, q_len, device=dev, dtype=torch.int32)
    seqused = torch.full((b,), ctx, device=dev, dtype=torch.int32)
    scale = torch.ones((), device=dev, dtype=torch.float32)

    def call() -> None:
        ops.reshape_and_cache_flash(k_new, v_new, k_cache, v_cache, slots, "auto", scale, scale)
        fa(q, k_cache, v_cache, max_seqlen_q=q_len, cu_seqlens_q=cu_q, max_seqlen_k=ctx, seqused_k=seqused,
           softmax_scale=1.0 / math.sqrt(d), causal=True, block_table=block_table, out=out)

    return timer.per_call(call, 1)


def _open(dry_run: bool, gpu: str | None) -> tuple[Any, GpuSpec, Any]:
    """(torch, the catalog GPU calibrated, the torch device measured on)."""
    torch = load_torch(dry_run)
    if dry_run:
        return torch, get_gpu(gpu or DRY_GPU), torch.device("cpu")
    try:  # a GPU outside the catalog: its terms read from the device (device_spec); NVML only then
        name = gpu or torch.cuda.get_device_name()
        try:
            spec = get_gpu(name)
        except KeyError:
            if gpu:
                raise
            spec = catalog_or_device(name, _nvml_info(torch)["nvml_index"])
    except (KeyError, ValueError) as e:
        raise ProbeError(f"{e}; pass --gpu with the catalog name to calibrate") from None
    return torch, spec, torch.device("cuda", torch.cuda.current_device())


CLOCK_PERIOD_S = 0.005  # a GEMM row's timed replays last a few ms: sample often enough to see them


def _clock(torch: Any, spec: GpuSpec, dry_run: bool, seconds: float) -> tuple[ClockSampler | None, str]:
    """A started SM-clock sampler (NVML; the dry run's replayed droop) and what it reads; None when NVML is not
    there (the calibration needs no clock; the summary then says why it has none)."""
    try:
        source = (ReplayClockSource(dry_run_readings(spec)) if dry_run
                  else NvmlClockSource(_nvml_info(torch)["nvml_index"]))
    except (ProbeError, TelemetryError) as e:
        return None, f"no clock: {one_line(e)}"
    history = int(seconds / CLOCK_PERIOD_S) + 1000
    return ClockSampler(source, period_s=CLOCK_PERIOD_S, history=history).start(), (
        "replayed synthetic droop (dry run)" if dry_run else "NVML SM clock")


class _Kind:
    """Measures one kind's planned rows (those the time left allows) on one device."""

    def __init__(self, torch: Any, timer: _Timer, dev: Any, fa: Callable | None, dry_run: bool, say: Say,
                 attn_what: str, sampler: ClockSampler | None = None, fp8: tuple[Any, str] = (None, "")):
        self.torch, self.timer, self.dev, self.fa, self.dry_run, self.say = torch, timer, dev, fa, dry_run, say
        self.attn_what, self.sampler = attn_what, sampler
        self.fp8_ops, self.fp8_what = fp8  # vLLM's fp8 linear ops (None: skipped; the dry run's stand-in)
        self.failed: dict[str, int] = {}  # kind -> failures so far (the first is said in full, the rest counted)

    def can_measure(self, kind: str) -> bool:
        """Whether this run measures ``kind`` (vLLM's attention and fp8 kernels need vLLM; the dry run stands in)."""
        if self.dry_run or kind == "gemm":
            return True
        return self.fp8_ops is not None if kind == "gemm_fp8" else self.fa is not None

    def skipped_why(self, kind: str) -> str:
        return self.fp8_what if kind == "gemm_fp8" else self.attn_what

    def clocks(self, spans: list[tuple[float, float]]) -> list[float | None]:
        """Each (start, end) span's median SM clock (the last reading before its end when none fell inside),
        from one read of the sampler's history after the measuring is done."""
        if self.sampler is None or not spans:
            return [None] * len(spans)
        rs = self.sampler.between(spans[0][0] - 1.0, spans[-1][1])
        ts = [r.t for r in rs]
        out: list[float | None] = []
        for a, b in spans:
            i, j = bisect_left(ts, a), bisect_right(ts, b)
            inside = rs[i:j] or rs[max(0, j - 1):j]
            out.append(float(statistics.median(r.sm_mhz for r in inside)) if inside else None)
        return out

    def window(self, t0: float, t1: float, got: list[Measured]) -> dict:
        """The clock over a whole kind's measurement: clock_stats, and each measured row's median clock."""
        if self.sampler is None:
            return {"samples": 0}
        return {**clock_stats(self.sampler.between(t0, t1)), "row_mhz": [g[2] for g in got]}

    def vllm_part(self, kind: str) -> Any:
        """The vLLM kernel a kind's rows were measured with (None: torch's own, or vLLM absent)."""
        if kind == "gemm":
            return None
        return self.fp8_ops if kind == "gemm_fp8" else self.fa

    def source(self, kind: str) -> str:
        """The kernel_source column of this kind's rows."""
        return {"gemm": "torch.nn.functional.linear", "gemm_fp8": self.fp8_what}.get(kind, self.attn_what)

    def one(self, kind: str, r: dict[str, str]) -> float | None:
        """Seconds per call of one planned row; None when it was not measured (too big, refused)."""
        try:
            if kind in cal.GEMM_KINDS:
                fp8 = self.fp8_ops if kind == "gemm_fp8" else None
                t = _measure_gemm(self.torch, self.timer, self.dev, r, self.dry_run, fp8)
            else:
                t = _measure_attention(self.torch, self.timer, self.dev, kind, r, self.fa, self.dry_run)
        except Exception as e:  # noqa: BLE001 - one shape the library refuses does not stop the rest
            n = self.failed[kind] = self.failed.get(kind, 0) + 1
            if n == 1:
                self.say(f"{kind} {dict((c, r[c]) for c in cal.SHAPE_COLS[kind])}: not measured ({one_line(e)})")
            return None
        return t if t is not None and t > 0 and math.isfinite(t) else None

    def all(self, kind: str, rows: list[dict[str, str]], deadline: float) -> list[Measured]:
        """(row, seconds, median SM clock) of every row measured before ``deadline`` (time.monotonic())."""
        got, spans = [], []
        failed_before = failed = self.failed.get(kind, 0)
        in_a_row = 0  # shapes the library refused since the last it ran
        for r in rows:
            t0 = time.monotonic()
            if t0 > deadline:
                break
            if in_a_row >= FAILS_IN_A_ROW:
                self.say(f"{kind}: stopped after {FAILS_IN_A_ROW} shapes failed in a row")
                break
            t = self.one(kind, r)
            in_a_row = in_a_row + 1 if self.failed.get(kind, 0) > failed else 0
            failed = self.failed.get(kind, 0)
            if t is not None:
                got.append((r, t))
                spans.append((t0, time.monotonic()))
        if self.failed.get(kind, 0) - failed_before > 1:
            self.say(f"{kind}: {self.failed[kind] - failed_before} shapes not measured (the first said why)")
        if self.timer.cuda:
            try:
                self.torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001 - a broken context: keep what was measured
                self.say(f"{kind}: releasing the cached memory failed ({one_line(e)})")
        return [(r, t, mhz) for (r, t), mhz in zip(got, self.clocks(spans), strict=True)]


def _fit(out_dir: Path, spec: GpuSpec, summary: dict, say: Say) -> cal.Calibration:
    """Fit the calibration on the tables written, save it beside them, say how much it helped."""
    c = cal.fit(out_dir, spec.name)
    c.save(out_dir / CAL_FILE)
    summary["calibration"] = str(out_dir / CAL_FILE)
    summary["residual"] = c.residual
    say(f"wrote {out_dir / CAL_FILE} after {summary['measure_s']:.0f} s of measurement: " + "; ".join(
        f"{k} MAPE {v['mape_prior']:.1f}% -> {v['mape_fitted']:.1f}% on its {c.rows[k]} rows"
        for k, v in c.residual.items()))
    return c


def holdout_rows(kind: str, planned: list[dict[str, str]], seed: int = 0) -> list[dict[str, str]]:
    """The grid's shapes of ``kind`` (accuracy region, shapes every opbench GPU has) that the plan does not
    measure, in a fixed random order."""
    taken = {cal.shape_key(kind, r) for r in planned}
    rows = [r for r in cal.grid_rows(kind, region=True, common=True) if cal.shape_key(kind, r) not in taken]
    order = np.random.default_rng(seed).permutation(len(rows))
    return [rows[i] for i in order]


def _holdout(measure: _Kind, spec: GpuSpec, kinds: list[str], c: cal.Calibration, out_dir: Path, holdout_s: float,
             summary: dict, say: Say) -> None:
    """Measure shapes the plan left out for ``holdout_s`` seconds (shared by the kinds measured), write them to
    DIR/holdout/ and score the prior and the calibration on them."""
    hdir = out_dir / HOLDOUT_DIR
    hdir.mkdir(exist_ok=True)
    deadline = time.monotonic() + holdout_s
    share = holdout_s / max(1, len(kinds))
    for i, kind in enumerate(kinds):
        rows = holdout_rows(kind, cal.plan(spec.name, kind))
        last = i + 1 == len(kinds)  # the last kind also gets what the others left
        t0 = time.monotonic()
        got = measure.all(kind, rows, deadline if last else min(deadline, time.monotonic() + share))
        summary["clock"]["holdout"][kind] = measure.window(t0, time.monotonic(), got)
        path = hdir / cal.FILES[kind]
        if len(got) < cal.MIN_ROWS:
            say(f"holdout {kind}: {len(got)} shapes measured, too few to score")
            continue
        _write_table(path, kind, spec.name, got, measure.source(kind), _vllm_version(measure.vllm_part(kind)))
    try:
        held = read_rows(hdir, spec)
    except cal.CalibrationError as e:
        say(f"holdout: nothing to score ({e})")
        return
    report = {}
    for kind in kinds:
        sub = [r for r in held if r.kind == kind]
        if sub:
            report[kind] = {"rows": len(sub), "mape_zero_shot": round(cal.score(None, spec.name, sub), 3),
                            "mape_calibrated": round(cal.score(c, spec.name, sub), 3)}
            say(f"holdout {kind}: {len(sub)} shapes the plan left out: MAPE zero-shot "
                f"{report[kind]['mape_zero_shot']:.1f}% -> calibrated {report[kind]['mape_calibrated']:.1f}%"
                + _clock_note(summary["clock"]["holdout"].get(kind, {})))
    summary["holdout"] = report


def run_calibrate(out: str | os.PathLike | None, *, dry_run: bool = False, gpu: str | None = None,
                  say: Say = print, time_limit_s: float = 110.0, holdout_s: float = 0.0, seed: int = 0) -> dict:
    """Measure the plan, write the tables and the calibration into ``out`` (and, for ``holdout_s`` seconds,
    shapes outside the plan to check it on); returns the summary, also written to ``out/summary.json``."""
    if not holdout_s >= 0 or not math.isfinite(holdout_s):
        raise ProbeError(f"--holdout must be a non-negative number of seconds, got {holdout_s}")
    torch, spec, dev = _open(dry_run, gpu)
    out_dir = Path(out) if out else Path("results") / "calibration" / spec.name.replace(" ", "_")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        moved = _move_earlier_run(out_dir)
    except OSError as e:
        raise ProbeError(f"cannot write {out_dir}: {one_line(e)}") from None
    if moved:  # the fit reads every table in the folder: an earlier run's would be fitted as if measured now
        say(f"an earlier run's files in {out_dir} moved to {moved}")
    timer = _Timer(torch, not dry_run)
    fa, attn_what = _attention(torch, dry_run, spec)
    fp8 = _fp8_linear(torch, spec, dry_run)
    say(f"calibrating {spec.name}{' (dry run on the CPU: tiny shapes, perf_counter)' if dry_run else ''}; "
        f"attention: {attn_what}; fp8: {fp8[1]}")
    if not in_catalog(spec):  # a GPU read from its device: its spec beside the tables, for later processes
        spec_file = out_dir / GPU_SPEC_FILE
        try:
            spec_file.write_text(json.dumps([spec_to_dict(spec)], indent=2) + "\n")
        except OSError as e:
            raise ProbeError(f"cannot write {spec_file}: {one_line(e)}") from None
        how = "read from the device" if is_derived(spec) else "as given"
        say(f"{spec.name} is not in the catalog: its spec ({how}) is in {spec_file} (give it as --gpu {spec_file} "
            "to calibrate fit, validate or any command)")
    t0 = time.monotonic()
    summary: dict = {"gpu": spec.name, "device_name": torch.cuda.get_device_name() if not dry_run else "cpu",
                     "dry_run": dry_run, "torch": torch.__version__, "attention": attn_what, "fp8_gemm": fp8[1],
                     "gemm_timing": (f"{'perf_counter, no graph' if dry_run else 'CUDA graph, CUDA events'}, "
                                     f"{WEIGHT_COPIES} weight copies in turn, {0 if dry_run else WARMUP} warm-up "
                                     f"replays, mean of {REPLAYS}"),
                     "measured": {}, "skipped": {}, "out_dir": str(out_dir)}
    torch.manual_seed(seed)
    sampler, clock_what = _clock(torch, spec, dry_run, time_limit_s + holdout_s + 60.0)
    summary["clock"] = {"source": clock_what, "plan": {}, "holdout": {}}
    measure = _Kind(torch, timer, dev, fa, dry_run, say, attn_what, sampler, fp8)
    try:
        with sigterm_interrupts():
            _calibrate(measure, spec, out_dir, t0, time_limit_s, holdout_s, summary, say)
    except Interrupted:
        summary["error"] = "interrupted by SIGTERM"
        raise ProbeError(f"interrupted by SIGTERM: what was measured is in {out_dir}") from None
    except BaseException as e:
        summary["error"] = one_line(e)
        raise
    finally:
        if sampler is not None:
            sampler.stop()
            sampler.source.close()
        try:
            (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        except OSError as e:  # never in place of the error that ended the run
            say(f"could not write {out_dir / SUMMARY_FILE}: {one_line(e)}")
    return summary


def _calibrate(measure: _Kind, spec: GpuSpec, out_dir: Path, t0: float, time_limit_s: float, holdout_s: float,
               summary: dict, say: Say) -> None:
    """The plan measured kind by kind, the tables written, the calibration fitted (and checked on the holdout)."""
    kinds = []
    for kind in cal.kinds_for(spec.name):  # (no fp8 plan without fp8 tensor cores: summary's fp8_gemm says so)
        if not measure.can_measure(kind):
            say(f"{kind}: skipped ({measure.skipped_why(kind)})")
            continue
        rows = cal.plan(spec.name, kind)
        t_kind = time.monotonic()
        got = measure.all(kind, rows, t0 + time_limit_s)
        summary["clock"]["plan"][kind] = measure.window(t_kind, time.monotonic(), got)
        skipped = len(rows) - len(got)
        summary["measured"][kind], summary["skipped"][kind] = len(got), skipped
        say(f"{kind}: {len(got)} of {len(rows)} planned shapes measured" + (f", {skipped} skipped" if skipped else "")
            + _clock_note(summary["clock"]["plan"][kind]))
        if got:
            kinds.append(kind)
            _write_table(out_dir / cal.FILES[kind], kind, spec.name, got, measure.source(kind),
                         _vllm_version(measure.vllm_part(kind)))
    summary["measure_s"] = round(time.monotonic() - t0, 1)
    c = _fit(out_dir, spec, summary, say)
    if holdout_s > 0:
        t1 = time.monotonic()
        _holdout(measure, spec, kinds, c, out_dir, holdout_s, summary, say)
        summary["holdout_s"] = round(time.monotonic() - t1, 1)


def _move_earlier_run(out_dir: Path) -> Path | None:
    """Move the files an earlier run left in ``out_dir`` (tables, calibration, summary, holdout tables) into a
    folder beside it, ``<out_dir>.earlier-<UTC time>/`` (beside, not inside: ``validate`` reads a folder's tables
    recursively), so nothing is lost and none of them is fitted or scored as this run's; the folder they went to,
    or None when there were none."""
    names = [*cal.FILES.values(), CAL_FILE, SUMMARY_FILE, GPU_SPEC_FILE]
    found = [out_dir / n for n in names if (out_dir / n).exists()]
    found += [out_dir / HOLDOUT_DIR / n for n in cal.FILES.values() if (out_dir / HOLDOUT_DIR / n).exists()]
    if not found:
        return None
    here = out_dir.resolve()
    dest = here.with_name(here.name + time.strftime(".earlier-%Y%m%dT%H%M%SZ", time.gmtime()))
    while dest.exists():
        dest = dest.with_name(dest.name + "+")
    for f in found:
        target = dest / f.relative_to(out_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(f), str(target))
    return dest


def _clock_note(stats: dict) -> str:
    """'; SM clock median 1980 MHz (1410-1980), sw_power_cap' for a say() line; '' without samples."""
    if not stats.get("samples"):
        return ""
    names = ", ".join(stats.get("event_reason_names") or [])
    return (f"; SM clock median {stats['clock_mhz']:.0f} MHz ({stats['clock_min_mhz']:.0f}-"
            f"{stats['clock_max_mhz']:.0f}){f', {names}' if names else ''}")


def _vllm_version(vllm_part: Any) -> str:
    """vLLM's version where one of its kernels was measured (``vllm_part``: its attention call or custom ops)."""
    if vllm_part is None:
        return ""
    import vllm

    return str(getattr(vllm, "__version__", ""))


def _write_table(path: Path, kind: str, device: str, got: list[Measured], source: str, version: str) -> None:
    cols = ["device", "vllm_version", "kernel_source", *cal.SHAPE_COLS[kind], "latency_ms"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, lineterminator="\n")
        w.writeheader()
        for r, t, _ in got:
            w.writerow({"device": device, "vllm_version": version, "kernel_source": source,
                        **{c: r[c] for c in cal.SHAPE_COLS[kind]}, "latency_ms": f"{t * 1e3:.6g}"})
