"""A CPU "GPU": lets the live loop predict on machines with no GPU (laptops, CI, vLLM-CPU).

Its peak FLOP/s and memory bandwidth come from a short microbenchmark at start-up (torch when importable, else
numpy; at most ~2 s), cached per machine in ``~/.cache/m2live/cpu_device.json`` (``$XDG_CACHE_HOME`` is
honoured). The spec is registered in the hardware catalog under the name ``cpu``; the efficiency constants for
arch ``cpu`` live in ``efficiency.py`` and the online residual correction does the rest.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path

from .hardware import GpuSpec, register
from .telemetry import cpuinfo_mhz

CACHE_VERSION = 1


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "m2live" / "cpu_device.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _threads() -> int:
    try:
        import torch

        return int(torch.get_num_threads())
    except Exception:  # noqa: BLE001 - torch is optional
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_key() -> str:
    """What the cached benchmark is valid for: host, CPU model, usable threads, torch presence."""
    try:
        import torch

        tv = torch.__version__
    except Exception:  # noqa: BLE001
        tv = "none"
    return f"{socket.gethostname()}|{_cpu_model()}|threads={_threads()}|torch={tv}|v{CACHE_VERSION}"


def _timed(fn, budget_s: float, min_reps: int = 2) -> float:
    """Median-free best-of timing: run fn repeatedly for about budget_s and return the fastest run (s)."""
    fn()  # warm-up (allocations, thread pool)
    best = float("inf")
    t_end = time.perf_counter() + budget_s
    reps = 0
    while reps < min_reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
        if reps > 10000:
            break
    return best


def microbenchmark(budget_s: float = 1.6) -> dict[str, float]:
    """Measure dense bf16 (or fp32 with numpy) matmul FLOP/s and streaming copy bandwidth."""
    half = budget_s / 2
    try:
        import torch

        n = 1024
        a = torch.randn(n, n).to(torch.bfloat16)
        b = torch.randn(n, n).to(torch.bfloat16)
        t_mm = _timed(lambda: torch.mm(a, b), half)
        flops = 2.0 * n**3 / t_mm
        src = torch.empty(32 * 1024 * 1024, dtype=torch.float32).fill_(1.0)  # 128 MiB
        dst = torch.empty_like(src)
        t_cp = _timed(lambda: dst.copy_(src), half)
        nbytes = 2.0 * src.numel() * 4
        kind = "torch bf16 mm 1024^3, fp32 copy 128 MiB"
    except Exception:  # noqa: BLE001 - no torch: numpy
        import numpy as np

        n = 512
        a = np.random.rand(n, n).astype(np.float32)
        b = np.random.rand(n, n).astype(np.float32)
        t_mm = _timed(lambda: a @ b, half)
        flops = 2.0 * n**3 / t_mm
        src = np.ones(16 * 1024 * 1024, dtype=np.float32)
        dst = np.empty_like(src)
        t_cp = _timed(lambda: np.copyto(dst, src), half)
        nbytes = 2.0 * src.nbytes
        kind = "numpy fp32 matmul 512^3, copy 64 MiB"
    return {"flops": flops, "bw": nbytes / t_cp, "kind": kind}


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


def spec_from_measurement(m: dict[str, float]) -> GpuSpec:
    mhz = _max_mhz()
    tflops = m["flops"] / 1e12
    return GpuSpec(
        name="cpu", arch="cpu", compute_capability=(0, 0), sms=max(1, _threads()),
        base_mhz=mhz, boost_mhz=mhz, bf16_tflops=tflops, fp16_tflops=tflops, fp8_tflops=None,
        tflops_at_mhz=mhz, mem_bw_gbs=m["bw"] / 1e9, mem_gb=_mem_gb(), l2_mb=_l2_mb(), tdp_w=0.0,
        interconnect="none", interconnect_gbs=m["bw"] / 1e9,
        source=f"microbenchmark on {_cpu_model()} ({m.get('kind', '')}, {_threads()} threads)",
        aliases=("cpu-device",),
    )


def cpu_device(refresh: bool = False, budget_s: float = 1.6) -> GpuSpec:
    """The CPU device spec (cached per machine), registered in the catalog as ``cpu``."""
    path = cache_path()
    key = machine_key()
    m: dict | None = None
    if not refresh:
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key and data["flops"] > 0 and data["bw"] > 0:
                m = data
        except (OSError, ValueError, KeyError, TypeError):
            m = None
    if m is None:
        m = microbenchmark(budget_s)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({**m, "key": key, "measured_at": time.time()}, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home: measure again next time
    return register(spec_from_measurement(m))
