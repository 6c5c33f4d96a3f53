"""Workload specifications for the capacity planner: what requests look like, not how they are batched.

A workload is a prompt-length distribution, an output-length distribution and an optional arrival rate. It is
given as one of:

- a preset: ``chat``, ``summarisation`` (``summarization``), ``long-context``; a preset may be followed by
  overrides, e.g. ``chat,rate=4`` or ``long-context,output=fixed:200``;
- an explicit spec ``prompt=DIST,output=DIST[,rate=R]`` where DIST is one of
    ``N`` or ``fixed:N``              every request has N tokens
    ``uniform:LO:HI``                 integers uniform in [LO, HI]
    ``normal:MEAN:STD``               normal, rounded, clipped to >= 1
    ``lognormal:MEDIAN:SIGMA``        lognormal with the given median and log-space sigma (heavy right tail)
  and R is the arrival rate in requests per second (optional; with it the planner sizes a fleet);
- a recorded m2live trace: ``trace:PATH`` or the path of an existing ``.jsonl`` file. Each line is one engine
  step with at least ``num_prefill_tokens``, ``num_decode_tokens``, ``decode_kv_tokens`` (and optionally
  ``prefill_kv_tokens``). Mean prompt and output lengths are recovered from two measured aggregates (see
  ``from_trace``), and a sample of the recorded steps is kept so the planner can also replay them.

Lengths are tokens; every length is clipped to [1, MAX_LEN]. The preset numbers are stated assumptions about
typical traffic (ShareGPT-like chat with a system prompt, document summarisation, RAG/long-document QA), not
measurements: pass an explicit spec or a trace for your own traffic.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .limits import RATE_RPS
from .trace import JsonLineError, json_lines

MAX_LEN = 1_048_576
STATS_SAMPLES = 8192  # requests drawn to summarise a distribution (fixed seed: deterministic)
TRACE_REPLAY_STEPS = 512  # recorded steps kept for replay (evenly spaced)


class WorkloadError(ValueError):
    """A workload spec that cannot be parsed or describes impossible traffic."""


_NUM = r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"


def _num(text: str, what: str) -> float:
    if not re.fullmatch(_NUM, text.strip()):
        raise WorkloadError(f"{what}: {text!r} is not a non-negative number")
    v = float(text)
    if not math.isfinite(v):
        raise WorkloadError(f"{what}: {text!r} is not finite")
    return v


@dataclass(frozen=True)
class Dist:
    """A token-length distribution."""

    kind: str  # fixed | uniform | normal | lognormal
    a: float  # fixed: N; uniform: LO; normal: MEAN; lognormal: MEDIAN
    b: float = 0.0  # uniform: HI; normal: STD; lognormal: SIGMA

    KINDS = ("fixed", "uniform", "normal", "lognormal")

    @classmethod
    def parse(cls, text: str, what: str) -> Dist:
        t = text.strip().lower()
        parts = t.split(":")
        kind = parts[0]
        if len(parts) == 1 and re.fullmatch(_NUM, kind):
            kind, parts = "fixed", ["fixed", kind]
        if kind not in cls.KINDS:
            raise WorkloadError(f"{what}={text!r}: unknown distribution {kind!r}; use N, fixed:N, uniform:LO:HI, "
                                "normal:MEAN:STD or lognormal:MEDIAN:SIGMA")
        need = 2 if kind == "fixed" else 3
        if len(parts) != need:
            form = {"fixed": "fixed:N", "uniform": "uniform:LO:HI", "normal": "normal:MEAN:STD",
                    "lognormal": "lognormal:MEDIAN:SIGMA"}[kind]
            raise WorkloadError(f"{what}={text!r}: expected {form}")
        vals = [_num(p, f"{what}={text!r}") for p in parts[1:]]
        d = cls(kind, vals[0], vals[1] if len(vals) > 1 else 0.0)
        d._check(what, text)
        return d

    def _check(self, what: str, text: str) -> None:
        if not 1 <= self.a <= MAX_LEN:
            raise WorkloadError(f"{what}={text!r}: length must be in [1, {MAX_LEN}], got {self.a:g}")
        if self.kind == "uniform" and not self.a <= self.b <= MAX_LEN:
            raise WorkloadError(f"{what}={text!r}: need LO <= HI <= {MAX_LEN}")
        if self.kind == "normal" and self.b > 10 * self.a:
            raise WorkloadError(f"{what}={text!r}: STD larger than 10x the mean is not a length distribution")
        if self.kind == "lognormal" and not self.b <= 3.0:
            raise WorkloadError(f"{what}={text!r}: SIGMA must be in [0, 3]")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.integers(int(round(self.a)), int(round(self.b)) + 1, size=n).astype(float)
        elif self.kind == "normal":
            x = rng.normal(self.a, self.b, size=n)
        else:
            x = self.a * np.exp(rng.normal(0.0, self.b, size=n))
        return np.clip(np.rint(x), 1, MAX_LEN).astype(np.int64)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class WorkloadStats:
    """What the planner needs from a workload (token counts; per request unless said otherwise)."""

    mean_prompt: float
    mean_output: float
    prompt_attn: float  # E[p^2]/E[p]: the prompt length that gives the mean causal-attention work per token
    decode_ctx: float  # mean KV context of a decode token (token-weighted): E[d (p + (d-1)/2)] / E[d]
    prefill_per_decode: float  # prompt tokens to prefill per generated token: E[p] / E[d]
    prompt_p: dict[str, float]  # p50 / p90 / p99
    output_p: dict[str, float]
    total_p: dict[str, float]  # prompt + output (a request's final context)

    def to_dict(self) -> dict:
        return {
            "mean_prompt": self.mean_prompt, "mean_output": self.mean_output, "prompt_attn": self.prompt_attn,
            "decode_ctx": self.decode_ctx, "prefill_per_decode": self.prefill_per_decode,
            "prompt_percentiles": self.prompt_p, "output_percentiles": self.output_p,
            "total_percentiles": self.total_p,
        }


def _pcts(x: np.ndarray) -> dict[str, float]:
    q = np.percentile(x, [50, 90, 99])
    return {"p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2])}


@dataclass(frozen=True)
class TraceStep:
    """One recorded engine step, in the four aggregate fields."""

    prefill_tokens: int
    prefill_kv_tokens: int
    decode_reqs: int
    decode_kv_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    prompt: Dist
    output: Dist
    rate: float | None = None  # requests / s
    source: str = "spec"  # preset | spec | trace
    spec: str = ""
    trace_steps: tuple[TraceStep, ...] = field(default=(), repr=False)
    trace_info: dict | None = field(default=None, repr=False)

    def stats(self, n: int = STATS_SAMPLES, seed: int = 0) -> WorkloadStats:
        return _stats_cached(self.prompt, self.output, n, seed)

    def describe(self) -> str:
        r = f", rate={self.rate:g}/s" if self.rate else ""
        return f"{self.name}: prompt={self.prompt.describe()}, output={self.output.describe()}{r}"

    def to_dict(self) -> dict:
        d = {"name": self.name, "source": self.source, "spec": self.spec, "prompt": self.prompt.describe(),
             "output": self.output.describe(), "rate_rps": self.rate, "stats": self.stats().to_dict()}
        if self.trace_info is not None:
            d["trace"] = self.trace_info
        return d


_STATS: dict[tuple, WorkloadStats] = {}


def _stats_cached(prompt: Dist, output: Dist, n: int, seed: int) -> WorkloadStats:
    key = (prompt, output, n, seed)
    hit = _STATS.get(key)
    if hit is not None:
        return hit
    rng = np.random.default_rng(seed)
    p = prompt.sample(rng, n).astype(float)
    d = output.sample(rng, n).astype(float)
    st = WorkloadStats(
        mean_prompt=float(p.mean()),
        mean_output=float(d.mean()),
        prompt_attn=float((p * p).mean() / p.mean()),
        decode_ctx=float((d * (p + (d - 1) / 2)).sum() / d.sum()),
        prefill_per_decode=float(p.mean() / d.mean()),
        prompt_p=_pcts(p), output_p=_pcts(d), total_p=_pcts(p + d),
    )
    _STATS[key] = st
    return st


PRESETS: dict[str, tuple[str, str, str]] = {
    # name: (prompt, output, what it stands for)
    "chat": ("lognormal:600:0.9", "lognormal:220:0.7",
             "multi-turn chat with a system prompt: ~0.9k-token prompts, ~280-token answers (means)"),
    "summarisation": ("lognormal:3000:0.5", "lognormal:250:0.4",
                      "document summarisation: ~3.4k-token documents, short summaries"),
    "long-context": ("lognormal:32000:0.4", "lognormal:400:0.5",
                     "long-document QA / RAG over ~35k-token contexts, short answers"),
}
_ALIASES = {"chat": "chat", "summarisation": "summarisation", "summarization": "summarisation",
            "summary": "summarisation", "long-context": "long-context", "longcontext": "long-context",
            "long_context": "long-context", "long": "long-context"}


def preset(name: str) -> Workload:
    key = _ALIASES.get(name.strip().lower())
    if key is None:
        raise WorkloadError(f"unknown workload preset {name!r}; presets: {', '.join(PRESETS)}")
    p, o, _ = PRESETS[key]
    return Workload(key, Dist.parse(p, "prompt"), Dist.parse(o, "output"), source="preset", spec=key)


def parse_workload(text: str) -> Workload:
    """Parse a workload SPEC (see the module docstring)."""
    if not isinstance(text, str) or not text.strip():
        raise WorkloadError("empty workload spec; give a preset (chat, summarisation, long-context), "
                            "prompt=DIST,output=DIST[,rate=R], or trace:PATH")
    t = text.strip()
    if t.lower().startswith("trace:"):
        return from_trace(t[6:])
    if t.endswith((".jsonl", ".json")) or os.path.isfile(t):
        return from_trace(t)
    items = [s.strip() for s in t.split(",")]
    if any(not s for s in items):
        raise WorkloadError(f"workload spec {text!r}: empty item between commas")
    base: Workload | None = None
    if "=" not in items[0]:
        base = preset(items[0])
        items = items[1:]
    kv: dict[str, str] = {}
    for it in items:
        if "=" not in it:
            raise WorkloadError(f"workload spec {text!r}: {it!r} is not KEY=VALUE (keys: prompt, output, rate)")
        k, v = (s.strip() for s in it.split("=", 1))
        k = k.lower()
        if k not in ("prompt", "output", "rate"):
            raise WorkloadError(f"workload spec {text!r}: unknown key {k!r} (keys: prompt, output, rate)")
        if k in kv:
            raise WorkloadError(f"workload spec {text!r}: {k} given twice")
        kv[k] = v
    if base is None and not ("prompt" in kv and "output" in kv):
        raise WorkloadError(f"workload spec {text!r}: give both prompt=DIST and output=DIST (or a preset)")
    rate: float | None = None
    if "rate" in kv:
        rate = _num(kv["rate"], "rate")
        if rate <= 0:
            raise WorkloadError(f"rate must be positive requests/s, got {kv['rate']!r}")
        rate = float(RATE_RPS.check(rate, "rate", WorkloadError))
    if base is None:
        return Workload("custom", Dist.parse(kv["prompt"], "prompt"), Dist.parse(kv["output"], "output"),
                        rate=rate, source="spec", spec=t)
    return replace(
        base,
        prompt=Dist.parse(kv["prompt"], "prompt") if "prompt" in kv else base.prompt,
        output=Dist.parse(kv["output"], "output") if "output" in kv else base.output,
        rate=rate if rate is not None else base.rate,
        source="preset" if not kv else "spec", spec=t,
    )


_TRACE_REQUIRED = ("num_prefill_tokens", "num_decode_tokens", "decode_kv_tokens")


def _field(rec: dict, key: str, where: str, default: int | None = None) -> int:
    if key not in rec:
        if default is not None:
            return default
        raise WorkloadError(f"{where}: record has no {key!r} (need {', '.join(_TRACE_REQUIRED)})")
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
            or int(v) != v:
        raise WorkloadError(f"{where}: {key} must be a non-negative integer, got {v!r}")
    return int(v)


def read_trace(path: str | os.PathLike) -> list[TraceStep]:
    """The recorded steps with work in them; torn or garbled lines are skipped (``read_trace_counted``)."""
    return read_trace_counted(path)[0]


def read_trace_counted(path: str | os.PathLike) -> tuple[list[TraceStep], list[str]]:
    """(steps with work, one ``PATH:LINE: why`` per skipped line). A torn last line (a crash, a full disk) or a
    garbled one is skipped and counted rather than refusing the file; a file without a single usable step is a
    ``WorkloadError`` naming the first problem."""
    p = Path(str(path).strip())
    if not p.is_file():
        raise WorkloadError(f"trace {str(path)!r}: no such file")
    steps: list[TraceStep] = []
    skipped: list[str] = []
    try:
        lines = json_lines(p)
    except OSError as e:
        raise WorkloadError(f"trace {p}: not readable ({e.strerror or type(e).__name__})") from None
    for lineno, rec in lines:
        where = f"{p}:{lineno}"
        if isinstance(rec, JsonLineError):
            skipped.append(f"{where}: not a JSON record ({rec.why})")
            continue
        try:
            if not isinstance(rec, dict):
                raise WorkloadError(f"{where}: a trace line must hold a JSON object")
            pre = _field(rec, "num_prefill_tokens", where)
            dec = _field(rec, "num_decode_tokens", where)
            dkv = _field(rec, "decode_kv_tokens", where)
            pkv = _field(rec, "prefill_kv_tokens", where, default=0)
        except WorkloadError as e:
            skipped.append(str(e))
            continue
        if pre == 0 and dec == 0:
            continue  # an idle step carries no work
        steps.append(TraceStep(pre, pkv if pre else 0, dec, dkv if dec else 0))
    if not steps:
        more = f" ({len(skipped)} line(s) skipped; first {skipped[0]})" if skipped else ""
        raise WorkloadError(f"trace {p}: no steps with work in it{more}")
    return steps, skipped


def from_trace(path: str | os.PathLike) -> Workload:
    """A workload recovered from a recorded m2live trace.

    Two aggregates are measured exactly: r = prefill tokens / decode tokens, and the mean KV context of a decode
    token C. For requests with prompt P and output D decoding over contexts P .. P+D, r = P/D and C = P + D/2,
    so D = C / (r + 1/2) and P = r D. Their spread is not recoverable from step aggregates, so the lengths are
    fixed at those means; the recorded steps themselves are kept for replay.
    """
    steps, skipped = read_trace_counted(path)
    pre = sum(s.prefill_tokens for s in steps)
    dec = sum(s.decode_reqs for s in steps)
    if dec == 0:
        raise WorkloadError(f"trace {path}: no decode steps, cannot tell the output length")
    ctx = sum(s.decode_kv_tokens for s in steps) / dec
    r = pre / dec
    d = max(1.0, ctx / (r + 0.5))
    p = max(1.0, r * d)
    if len(steps) > TRACE_REPLAY_STEPS:
        idx = np.linspace(0, len(steps) - 1, TRACE_REPLAY_STEPS).round().astype(int)
        kept = tuple(steps[i] for i in idx)
    else:
        kept = tuple(steps)
    info = {"path": str(path), "steps": len(steps), "replay_steps": len(kept), "prefill_tokens": pre,
            "decode_tokens": dec, "mean_decode_context": ctx, "prefill_per_decode": r,
            "estimated_prompt": p, "estimated_output": d, "skipped_lines": len(skipped)}
    return Workload(f"trace:{Path(str(path)).name}", Dist("fixed", min(MAX_LEN, round(p))),
                    Dist("fixed", min(MAX_LEN, round(d))), source="trace", spec=str(path),
                    trace_steps=kept, trace_info=info)
