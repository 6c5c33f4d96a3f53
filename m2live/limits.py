"""Bounds on every number a person or a remote peer can hand m2live, in one place.

Each ``Bound`` says what the number is, its unit and its closed range; ``check`` tests a value that is already a
number (a config field, a control message), ``parse`` reads user text through ``positive_float``'s
rule (finite, named in the one-line error) and then checks the range. The ranges are generous (they are there
to stop nonsense, overflow and unbounded memory, not to second-guess a real deployment); where a number comes
from somewhere, the comment says where.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def digits(s: str) -> bool:
    """Whether ``s`` is a non-empty run of ASCII digits 0-9 (``str.isdigit`` also takes '²' and other scripts'
    digits, which ``int`` then refuses)."""
    return s.isascii() and s.isdigit()


def positive_float(raw: str, what: str, error: type[ValueError] = ValueError) -> float:
    """A finite number > 0 from user text, else ``error`` with one line naming ``what``."""
    try:
        v = float(raw)
    except (TypeError, ValueError):
        raise error(f"{what} is not a number ({raw!r})") from None
    if not (v > 0 and math.isfinite(v)):
        raise error(f"{what} must be a positive number, got {raw!r}")
    return v


@dataclass(frozen=True)
class Bound:
    """A closed range ``[lo, hi]`` for one kind of number; ``integer``: whole numbers only."""

    unit: str
    lo: float
    hi: float
    integer: bool = False

    def describe(self) -> str:
        lo = f"{self.lo:g}" if not self.integer else f"{int(self.lo)}"
        hi = f"{self.hi:g}" if not self.integer else f"{int(self.hi)}"
        return f"{lo} .. {hi}{' ' + self.unit if self.unit else ''}"

    def check(self, value: object, what: str, error: type[ValueError] = ValueError) -> float | int:
        """``value`` itself if it is a number (not a bool) within the range, else ``error`` (one line)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise error(f"{what} must be a number in {self.describe()}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise error(f"{what} must be finite, got {value!r}")
        if self.integer and isinstance(value, float):
            if not value.is_integer():
                raise error(f"{what} must be a whole number in {self.describe()}, got {value!r}")
            value = int(value)
        if not (self.lo <= value <= self.hi):
            shown = value if abs(value) < 1e15 else (
                f"{float(value):.3g}" if isinstance(value, float) or abs(value) < 1e300
                else f"a {len(str(abs(value)))}-digit {'negative ' if value < 0 else ''}number")
            raise error(f"{what} must be within {self.describe()}, got {shown}")
        return value

    def parse(self, text: object, what: str, error: type[ValueError] = ValueError) -> float | int:
        """A number from user text (``'1410'``, ``'1e3'``); out of range, non-finite or not a number → ``error``."""
        s = str(text).strip()
        if len(s) > 40:  # a 400-digit number: say so before Python builds it
            raise error(f"{what} must be a number in {self.describe()}, got {s[:20]}... ({len(s)} characters)")
        if self.integer:
            try:
                return self.check(int(s), what, error)
            except ValueError:
                pass  # '1e3', '512.0': through the float rule below
        if self.lo > 0:  # the CLI's rule for positive numbers, then the range
            return self.check(positive_float(s, what, error), what, error)
        try:
            v = float(s)
        except (TypeError, ValueError, OverflowError):
            raise error(f"{what} is not a number ({s[:40]!r})") from None
        return self.check(v, what, error)


# --- engine steps (m2live predict, Step, the planner) -------------------------------------------------------
# The longest context an open model serves today is 10 M tokens (Llama 4 Scout, model card, April 2025).
CONTEXT_TOKENS = Bound("tokens", 0, 10_485_760, integer=True)
NEW_TOKENS = Bound("tokens", 1, 10_485_760, integer=True)  # one sequence's new tokens in one step
STEP_TOKENS = Bound("tokens", 1, 16_777_216, integer=True)  # all new tokens of one step (16 Mi)
# sequences in one step: vLLM's max_num_seqs defaults to 256-1024; 65 536 still builds in milliseconds
STEP_SEQS = Bound("sequences", 1, 65_536, integer=True)
TP = Bound("GPUs", 1, 1024, integer=True)  # tensor-parallel size

# --- clocks and rates -----------------------------------------------------------------------------------------
CLOCK_MHZ = Bound("MHz", 1.0, 10_000.0)  # SM / core clock; GPUs boost below 3 GHz, CPUs below 6.5 GHz
RATE_RPS = Bound("requests/s", 1e-6, 1e6)  # arrival rate of a workload

# --- a GPU described in a JSON file (hardware.load_spec_file): physical ranges with room past any GPU shipped
GPU_SMS = Bound("SMs", 1, 1024, integer=True)  # streaming multiprocessors (B200: 148, RTX PRO 6000: 188)
GPU_TFLOPS = Bound("TFLOP/s", 0.01, 1e5)  # a dense tensor peak (B300 fp8: 4,500)
MEM_BW_GBS = Bound("GB/s", 1.0, 1e5)  # DRAM bandwidth (B200: 8,000)
MEM_GB = Bound("GB", 2.0, 1e4)  # device memory (B300: 288; no serving GPU has under 2 GB)
MEM_TOTAL_MIB = Bound("MiB", 512.0, 1e7)  # the driver's memory total (B300: 275,040); checked against MEM_GB too
L2_MB = Bound("MiB", 0.0625, 4096.0)  # L2 cache (B200: 126.5)
TDP_W = Bound("W", 5.0, 5000.0)  # board power limit (GB300: 1,400)
LINK_GBS = Bound("GB/s", 0.1, 1e5)  # per-direction interconnect (NVLink5: 900)
SPEC_FILE_MAX_BYTES = 1 << 20  # a GPU spec file (one row of `m2live gpus --json`: ~1 KB)

# --- serving simulation priors a user may set (m2live simulate) --------------------------------------------------
FRONTEND_MS = Bound("ms", 0.0, 60_000.0)  # client <-> engine path, each way: a minute at most
TOKENIZE_US = Bound("us", 0.0, 10_000.0)  # the API server's tokenising, per prompt token
KV_CACHE_GIB = Bound("GiB", 0.0, 1_048_576.0)  # a KV cache of at most 1 PiB (a GPU's memory caps it further)
GOODPUT_MS = Bound("ms", 0.0, 1e9)  # a --goodput SLO (vllm bench serve: any value >= 0); 1e9 ms is 11.6 days
PERCENTILE = Bound("", 0.0, 100.0)  # a --metric-percentiles entry (numpy's range)

# --- the live plugin (M2LIVE_*, MQTT control) -----------------------------------------------------------------
SLO_MS = Bound("ms", 1.0, 600_000.0)  # per-step latency SLO: 1 ms .. 10 minutes
SLO_MARGIN = Bound("", 0.0, 0.95)  # fraction of the SLO kept free
SAMPLE_MS = Bound("ms", 1.0, 10_000.0)  # clock sampling period
PORT = Bound("", 1, 65_535, integer=True)  # TCP port
GPU_INDEX = Bound("", 0, 4095, integer=True)  # NVML device index
QUEUE_SIZE = Bound("records", 1, 1_048_576, integer=True)  # each bounded queue (record thread, trace, MQTT)
RESIDUAL_WINDOW = Bound("steps", 8, 100_000, integer=True)  # rolling window of the residual tracker
WARMUP_STEPS = Bound("steps", 0, 1_000_000_000, integer=True)  # `m2live report --warmup`

# --- MQTT control messages: checked on the raw bytes before any JSON parsing -----------------------------------
CONTROL_MAX_BYTES = 1024  # a control message is one small flat object ({"slo_ms": 40, "admission": true})
CONTROL_MAX_DEPTH = 2  # nesting of [ / { (the object itself is depth 1)
