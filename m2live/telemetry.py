"""Clock telemetry: where the live f_clk comes from.

A ``ClockSource`` reads one sample (SM clock, max clock, power, power limit, clock-event reasons, temperature).
Sources: NVML (``nvidia-ml-py``, imported lazily), Linux cpufreq (CPU-only machines), a fixed clock, and a
replay of recorded readings (tests). A ``ClockSampler`` polls a source on its own daemon thread every
``period_s``; the engine's hot path only calls ``latest()``, which returns the cached reading and its age and
never blocks on the device.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .limits import digits


class TelemetryError(RuntimeError):
    """A clock source that cannot be opened or read."""


@dataclass(frozen=True)
class ClockReading:
    t: float  # time.monotonic() of the sample
    sm_mhz: float  # current SM clock
    max_mhz: float  # max/boost SM clock (NVML max clock)
    power_w: float | None = None
    power_limit_w: float | None = None  # enforced power limit
    event_reasons: int | None = None  # NVML clock event / throttle reasons bitmask
    temperature_c: float | None = None

    @property
    def ratio(self) -> float:
        """sm_mhz / max_mhz (1.0 = boost)."""
        return self.sm_mhz / self.max_mhz if self.max_mhz > 0 else 1.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ClockReading:
        try:
            return cls(
                t=float(d.get("t", 0.0)), sm_mhz=float(d["sm_mhz"]), max_mhz=float(d["max_mhz"]),
                power_w=_opt_float(d.get("power_w")), power_limit_w=_opt_float(d.get("power_limit_w")),
                event_reasons=None if d.get("event_reasons") is None else int(d["event_reasons"]),
                temperature_c=_opt_float(d.get("temperature_c")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TelemetryError(f"bad clock reading {d!r}: {e}") from None


def _opt_float(v) -> float | None:
    return None if v is None else float(v)


@runtime_checkable
class ClockSource(Protocol):
    name: str

    def read(self) -> ClockReading: ...

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------------------
class NvmlClockSource:
    """SM clock, max clock, power, enforced power limit, clock-event reasons and temperature via NVML."""

    name = "nvml"

    def __init__(self, index: int = 0):
        try:
            import pynvml  # nvidia-ml-py
        except Exception as e:  # noqa: BLE001 - any import failure means "no NVML"
            raise TelemetryError(f"nvidia-ml-py not importable: {e}") from None
        self._nv = pynvml
        try:
            pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001
            raise TelemetryError(f"NVML init failed: {e}") from None
        try:
            count = pynvml.nvmlDeviceGetCount()
            if index < 0 or index >= count:
                raise TelemetryError(f"GPU index {index} out of range ({count} devices)")
            self._h = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(self._h)
            self.device_name = name.decode() if isinstance(name, bytes) else str(name)
            self._max = float(pynvml.nvmlDeviceGetMaxClockInfo(self._h, pynvml.NVML_CLOCK_SM))
        except TelemetryError:
            self._shutdown()
            raise
        except Exception as e:  # noqa: BLE001
            self._shutdown()
            raise TelemetryError(f"NVML device {index} unreadable: {e}") from None
        self._reasons_fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        self._instant: bool | None = None  # NVML's instantaneous power field: None not tried yet

    def _opt(self, fn, *args):
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - optional fields (not supported on every board)
            return None

    def _power_mw(self) -> float | None:
        """Board power, mW: NVML's instantaneous field where the driver has it — nvmlDeviceGetPowerUsage is a
        one-second average on Ampere (but GA100) and newer, which lags a step or a short burst — else that."""
        nv = self._nv
        fid = getattr(nv, "NVML_FI_DEV_POWER_INSTANT", None)
        if fid is not None and self._instant is not False:
            try:
                v = nv.nvmlDeviceGetFieldValues(self._h, [fid])[0]
                if v.nvmlReturn == getattr(nv, "NVML_SUCCESS", 0):
                    member = {nv.NVML_VALUE_TYPE_DOUBLE: "dVal", nv.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
                              nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal"}.get(v.valueType, "uiVal")
                    mw = float(getattr(v.value, member))
                    if 0 < mw < 1e7:  # a board's watts, in mW
                        self._instant = True
                        return mw
            except Exception:  # noqa: BLE001 - an older driver or binding: the averaged reading
                pass
            if self._instant is None:
                self._instant = False  # never had it: stop asking
        return self._opt(nv.nvmlDeviceGetPowerUsage, self._h)

    def read(self) -> ClockReading:
        nv = self._nv
        try:
            sm = float(nv.nvmlDeviceGetClockInfo(self._h, nv.NVML_CLOCK_SM))
        except Exception as e:  # noqa: BLE001
            raise TelemetryError(f"NVML clock read failed: {e}") from None
        p = self._power_mw()
        pl = self._opt(nv.nvmlDeviceGetEnforcedPowerLimit, self._h)
        reasons = self._opt(self._reasons_fn, self._h) if self._reasons_fn else None
        temp = self._opt(nv.nvmlDeviceGetTemperature, self._h, nv.NVML_TEMPERATURE_GPU)
        return ClockReading(
            t=time.monotonic(), sm_mhz=sm, max_mhz=self._max,
            power_w=None if p is None else p / 1000.0, power_limit_w=None if pl is None else pl / 1000.0,
            event_reasons=None if reasons is None else int(reasons),
            temperature_c=None if temp is None else float(temp),
        )

    def _shutdown(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        self._shutdown()


class CpufreqClockSource:
    """Mean current frequency of the CPUs from Linux cpufreq (``/sys/devices/system/cpu/cpu*/cpufreq``)."""

    name = "cpufreq"

    def __init__(self, root: str = "/sys"):
        base = Path(root) / "devices" / "system" / "cpu"
        self._cur: list[Path] = []
        maxes: list[float] = []
        for d in sorted(base.glob("cpu[0-9]*/cpufreq")):
            cur = d / "scaling_cur_freq"
            mx = d / "cpuinfo_max_freq"
            if cur.is_file() and mx.is_file():
                try:
                    maxes.append(float(mx.read_text().strip()) / 1000.0)
                    float(cur.read_text().strip())
                except (OSError, ValueError):
                    continue
                self._cur.append(cur)
        if not self._cur:
            raise TelemetryError(f"no readable cpufreq under {base}")
        self._max = max(maxes)

    def read(self) -> ClockReading:
        vals = []
        for p in self._cur:
            try:
                vals.append(float(p.read_text().strip()) / 1000.0)
            except (OSError, ValueError):
                continue
        if not vals:
            raise TelemetryError("cpufreq became unreadable")
        return ClockReading(t=time.monotonic(), sm_mhz=sum(vals) / len(vals), max_mhz=self._max)

    def close(self) -> None:
        pass


class FixedClockSource:
    """A constant clock (no telemetry available, or a forced value)."""

    name = "fixed"

    def __init__(self, mhz: float, max_mhz: float):
        if not (mhz > 0 and max_mhz > 0):
            raise TelemetryError(f"fixed clock needs positive MHz, got {mhz} / {max_mhz}")
        self.mhz = float(mhz)
        self.max_mhz = float(max_mhz)

    def read(self) -> ClockReading:
        return ClockReading(t=time.monotonic(), sm_mhz=self.mhz, max_mhz=self.max_mhz)

    def close(self) -> None:
        pass


class ReplayClockSource:
    """Plays back recorded readings (a sequence, or a JSONL file of ``ClockReading`` dicts) one per read.

    Each returned reading carries the current monotonic time. With ``loop=False`` the last reading repeats
    once the recording is exhausted.
    """

    name = "replay"

    def __init__(self, readings: Sequence[ClockReading] | str | os.PathLike, loop: bool = True):
        if isinstance(readings, (str, os.PathLike)):
            items: list[ClockReading] = []
            try:
                text = Path(readings).read_text()
            except OSError as e:
                raise TelemetryError(f"cannot read clock recording {readings}: {e}") from None
            for i, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    items.append(ClockReading.from_dict(json.loads(line)))
                except (json.JSONDecodeError, AttributeError) as e:
                    raise TelemetryError(f"{readings}:{i}: not a clock reading ({e})") from None
        else:
            items = list(readings)
        if not items:
            raise TelemetryError("replay source needs at least one reading")
        self._items = items
        self._loop = loop
        self._i = 0
        self._lock = threading.Lock()

    def read(self) -> ClockReading:
        with self._lock:
            r = self._items[self._i]
            if self._i + 1 < len(self._items):
                self._i += 1
            elif self._loop:
                self._i = 0
        return ClockReading(t=time.monotonic(), sm_mhz=r.sm_mhz, max_mhz=r.max_mhz, power_w=r.power_w,
                            power_limit_w=r.power_limit_w, event_reasons=r.event_reasons,
                            temperature_c=r.temperature_c)

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------------
class ClockSampler:
    """Polls a source every ``period_s`` on a daemon thread; ``latest()`` never touches the device.

    ``history`` > 0 keeps that many past readings for ``between()`` (the probe uses it).
    """

    def __init__(self, source: ClockSource, period_s: float = 0.02, history: int = 0):
        if not (0.001 <= period_s <= 10.0):
            raise ValueError(f"sampling period must be within 1 ms .. 10 s, got {period_s} s")
        self.source = source
        self.period_s = float(period_s)
        self.errors = 0
        self.reads = 0
        self._latest: ClockReading | None = None
        self._hist: deque[ClockReading] | None = deque(maxlen=history) if history > 0 else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hist_lock = threading.Lock()

    def _sample_once(self) -> None:
        try:
            r = self.source.read()
        except Exception:  # noqa: BLE001 - a failing device is counted, never raised
            self.errors += 1
            return
        self.reads += 1
        self._latest = r  # atomic reference swap: readers never lock
        if self._hist is not None:
            with self._hist_lock:
                self._hist.append(r)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self._sample_once()
            self._stop.wait(max(0.0, self.period_s - (time.monotonic() - t0)))

    def start(self) -> ClockSampler:
        if self._thread is not None:
            return self
        self._sample_once()  # a first value before anyone asks
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"m2live-clock-{self.source.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None:
            t.join(timeout=max(1.0, 5 * self.period_s))
        self._thread = None

    def latest(self) -> tuple[ClockReading | None, float]:
        r = self._latest
        if r is None:
            return None, float("inf")
        return r, max(0.0, time.monotonic() - r.t)

    def between(self, t0: float, t1: float) -> list[ClockReading]:
        if self._hist is None:
            return []
        with self._hist_lock:
            return [r for r in self._hist if t0 <= r.t <= t1]

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


@dataclass(frozen=True)
class ClockChoice:
    """What ``choose_clock_source`` found: the source (None: none of those allowed opened), one line saying
    which and why, and why each source tried before it did not open (``{"nvml": "NVML init failed: ..."}``)."""

    source: ClockSource | None
    why: str
    failed: dict[str, str]


CLOCK_ORDER = ("nvml", "cpufreq", "fixed")


def choose_clock_source(order: Sequence[str] = CLOCK_ORDER, gpu_index: int = 0) -> ClockChoice:
    """The first of ``order`` that opens: ``nvml`` (GPU ``gpu_index``), ``cpufreq``, ``fixed`` (the nominal CPU
    clock of /proc/cpuinfo). The one place that decides where a live clock comes from: the plugin asks for
    ``("nvml",)`` on a GPU and ``("cpufreq",)`` on the CPU device (a fixed clock there would only hide the
    forecast), ``open_best_source`` for all three."""
    failed: dict[str, str] = {}
    for kind in order:
        try:
            if kind == "nvml":
                nv = NvmlClockSource(gpu_index)
                return ClockChoice(nv, f"nvml: {nv.device_name} (GPU {gpu_index})", failed)
            if kind == "cpufreq":
                src: ClockSource = CpufreqClockSource()
            elif kind == "fixed":
                mhz = cpuinfo_mhz() or 1000.0
                src = FixedClockSource(mhz, mhz)
            else:
                raise ValueError(f"unknown clock source {kind!r} (known: {', '.join(CLOCK_ORDER)})")
        except TelemetryError as e:
            failed[kind] = str(e)
            continue
        return ClockChoice(src, f"{kind}: " + "; ".join(_reasons(failed)) if failed else kind, failed)
    return ClockChoice(None, "; ".join(_reasons(failed)), failed)


def _reasons(failed: dict[str, str]) -> list[str]:
    return [f"{kind} unavailable ({why})" for kind, why in failed.items()]


def open_best_source(gpu_index: int = 0) -> tuple[ClockSource, str]:
    """NVML → cpufreq → fixed (never fails). The second item says which one and why (one line)."""
    c = choose_clock_source(CLOCK_ORDER, gpu_index)
    if c.source is None:  # cannot happen: the fixed clock always opens
        raise TelemetryError(c.why)
    return c.source, c.why


def cpuinfo_mhz() -> float | None:
    """The nominal CPU clock from /proc/cpuinfo (first 'cpu MHz' line), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return float(line.split(":", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@contextmanager
def nvml_session() -> Iterator[Any]:
    """pynvml, initialised, and shut down again on leaving; TelemetryError (one line) when it cannot be imported
    or initialised."""
    try:
        import pynvml  # nvidia-ml-py
    except Exception as e:  # noqa: BLE001 - any import failure means "no NVML"
        raise TelemetryError(f"nvidia-ml-py not importable: {e.__class__.__name__}: {e}") from None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001
        raise TelemetryError(f"NVML init failed: {e}") from None
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def nvml_opt(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or None where the board does not answer (an NVML query some boards lack)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - optional on some boards
        return None


def nvml_str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def nvml_device_name(index: int) -> str:
    """The name NVML gives device ``index`` (all the plugin needs to find a catalog GPU); TelemetryError, one
    line, when NVML cannot say."""
    with nvml_session() as pynvml:
        try:
            return nvml_str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index)))
        except Exception as e:  # noqa: BLE001
            raise TelemetryError(f"NVML device {index} unreadable: {e}") from None


def nvml_device_info(uuid: str = "", index: int = 0) -> dict:
    """One NVML device's identity and limits: the device whose UUID contains ``uuid`` (CUDA's; indices differ
    when CUDA_VISIBLE_DEVICES reorders them), else the first CUDA_VISIBLE_DEVICES entry that is an index, else
    ``index``. Keys: nvml_index, name, uuid, driver, max_sm_mhz, max_mem_mhz, power_limit_w,
    default_power_limit_w (None where the board does not say). NVML is shut down again before it returns."""
    with nvml_session() as pynvml:
        try:
            count = pynvml.nvmlDeviceGetCount()
            found = [i for i in range(count) if uuid and uuid in nvml_str(
                nvml_opt(pynvml.nvmlDeviceGetUUID, pynvml.nvmlDeviceGetHandleByIndex(i)) or "")]
            if found:
                index = found[0]
            else:
                vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
                index = int(vis) if digits(vis) and int(vis) < count else index
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            pl = nvml_opt(pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
            pdl = nvml_opt(pynvml.nvmlDeviceGetPowerManagementDefaultLimit, h)
            return {
                "nvml_index": index, "name": nvml_str(pynvml.nvmlDeviceGetName(h)),
                "uuid": nvml_str(nvml_opt(pynvml.nvmlDeviceGetUUID, h) or ""),
                "driver": nvml_str(nvml_opt(pynvml.nvmlSystemGetDriverVersion) or ""),
                "max_sm_mhz": nvml_opt(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM),
                "max_mem_mhz": nvml_opt(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM),
                "power_limit_w": None if pl is None else pl / 1000.0,
                "default_power_limit_w": None if pdl is None else pdl / 1000.0,
            }
        except Exception as e:  # noqa: BLE001
            raise TelemetryError(f"NVML device {index} unreadable: {e}") from None
