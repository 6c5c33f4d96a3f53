"""vLLM serving at a fixed concurrency, simulated step by step: TTFT, TPOT and throughput.

What is simulated is what ``vllm.benchmarks.serve`` measures against an OpenAI server: a closed loop of
``concurrency`` requests in flight (``--max-concurrency C --request-rate inf``: all C sent at once, each
finished request replaced by the next at once), ``num_prompts`` requests in all (default 10 x C, the
convention of public serving sweeps), each with a fixed or listed prompt and output length (ignore-EOS), no
prefix-cache hits. The benchmark's metrics are means over all requests, cold start included:

- TTFT = first token seen by the client - request sent;
- TPOT = (latency - TTFT) / (output tokens - 1) per request;
- output tokens/s = all output tokens / (last request done - first sent).

The engine is vLLM V1's ``Scheduler.schedule()`` (vllm 0.32/0.33, ``v1/core/sched/scheduler.py``) with the
API server's defaults (``engine/arg_utils.py:get_batch_defaults``, ``config/scheduler.py``):

- chunked prefill on; ``long_prefill_token_threshold`` 0 (no cap); one token budget
  ``max_num_batched_tokens`` per step, ``max_num_seqs`` requests running at most;
- running requests first, in order (decodes and partial prefills alike, each takes
  ``min(tokens it still needs, budget left)``), then waiting requests first-come-first-served (preempted ones
  at the front), each admitted only if its *whole* prompt fits in the free KV blocks
  (``scheduler_reserve_full_isl``) and chunked to the budget left; no admission in a step that preempted;
- KV cache in blocks of 16 tokens, allocated as tokens are scheduled; when a running request cannot get its
  blocks the most recently admitted running request is preempted (recompute: its blocks are freed and it
  re-prefills prompt + generated tokens when re-admitted; its first token keeps its time);
- decode CUDA graphs up to the capture size ``min(2 x max_num_seqs, 512)`` (1024 on Blackwell), never above
  the token budget: steps with at most that many tokens replay graphs (the predictor's host terms);
- async scheduling on GPUs (vLLM's default since 0.11: the host work of the next step overlaps the device's
  work on this one, so a step lasts the longer of the two; and a busy engine schedules step j + 1 as step j
  starts, so a request arriving during a step is seen one step later), off on the CPU backend.

Every step is timed by ``Predictor`` (forecast clock by default); a request needs ``frontend_s`` between client
and engine each way (HTTP, output streaming) and ``frontend_service_s`` of the API server's serial work
(parsing, tokenisation): a burst of requests reaches the engine spread out, and an idle engine starts its
next step with the first arrival alone — which is what desynchronises a closed loop of equal requests. Runs of pure-decode steps between events (an
arrival, a finish, a KV block shortage) are advanced in one go: their times are the predictor's at a few
points along the run (decode steps differ only in context), interpolated — so a configuration costs
milliseconds to a few tenths of a second, not one prediction per token.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .hardware import GpuSpec, get_gpu
from .predictor import HostConstants, Prediction, Predictor
from .shapes import ModelShape, get_model
from .step import Step

GIB = 1024**3
BLOCK_SIZE = 16  # vLLM's default KV-cache block size on CUDA (CacheConfig.DEFAULT_BLOCK_SIZE)
CPU_BLOCK_SIZE = 128  # ... on the CPU backend (platforms/cpu.py)
DEFAULT_PROMPTS_PER_CONCURRENCY = 10  # num_prompts = 10 x C (e.g. InferenceMAX's sweeps)
FRONTEND_S = 1e-3  # prior: client <-> engine one way (HTTP, streaming) per request
FRONTEND_SERVICE_S = 1e-3  # prior: the API server's serial work per request (parse, tokenise, hand to the engine)
SEGMENT_SAMPLES = 9  # predictions along a run of pure-decode steps (interpolated in between)


class SimulationError(ValueError):
    """A serving configuration that cannot run (weights do not fit, bad counts)."""


# ---- vLLM's defaults ----------------------------------------------------------------------------------------
def vllm_batch_defaults(gpu: GpuSpec, tp: int = 1) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of vLLM's OpenAI server on this device
    (``EngineArgs.get_batch_defaults``, usage context OPENAI_API_SERVER): >= 160 GiB of device memory
    16384 / 1024; >= 70 GiB and not an A100 8192 / 1024; other GPUs 2048 / 256; the CPU backend
    2048 x world size / 128 x world size."""
    if gpu.arch == "cpu":
        return 2048 * tp, 128 * tp
    gib = gpu.mem_bytes / GIB
    if gib >= 160:
        return 16384, 1024
    if gib >= 70 and "a100" not in gpu.name.lower():
        return 8192, 1024
    return 2048, 256


def cuda_graph_capture_max(gpu: GpuSpec, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Largest captured CUDA-graph batch (``VllmConfig._set_cudagraph_sizes``): min(2 x max_num_seqs, 512,
    or 1024 on compute capability 10.x), never above the token budget; 0 on the CPU backend (no graphs)."""
    if gpu.arch == "cpu":
        return 0
    ceiling = 1024 if gpu.compute_capability[0] == 10 else 512
    return min(2 * max_num_seqs, ceiling, max_num_batched_tokens)


@dataclass(frozen=True)
class ServingConfig:
    """One serving benchmark: the engine's limits and the client's closed loop."""

    concurrency: int
    num_prompts: int | None = None  # None: DEFAULT_PROMPTS_PER_CONCURRENCY x concurrency
    max_num_batched_tokens: int | None = None  # None: vLLM's API-server default for the device
    max_num_seqs: int | None = None  # None: vLLM's API-server default for the device
    block_size: int | None = None  # None: 16 on GPUs, 128 on the CPU backend
    long_prefill_token_threshold: int = 0  # vLLM default: no cap on one request's chunk
    gpu_memory_utilization: float = 0.9  # vLLM default
    reserve_bytes: float = 1.5 * GIB  # CUDA context, cuBLAS/NCCL workspaces, graphs (as the planner)
    async_scheduling: bool | None = None  # None: on for GPUs, off for the CPU backend (vLLM's defaults)
    clock: str = "forecast"  # "forecast" (power-cap model) | "boost"
    frontend_s: float = FRONTEND_S
    frontend_service_s: float = FRONTEND_SERVICE_S
    kv_tokens: int | None = None  # override the KV-cache capacity (tokens); None: from the memory fit

    def __post_init__(self) -> None:
        for name in ("concurrency", "num_prompts", "max_num_batched_tokens", "max_num_seqs", "block_size",
                     "kv_tokens"):
            v = getattr(self, name)
            if v is None and name != "concurrency":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SimulationError(f"{name} must be a positive integer, got {v!r}")
        if self.long_prefill_token_threshold < 0:
            raise SimulationError("long_prefill_token_threshold must be >= 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise SimulationError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.clock not in ("forecast", "boost"):
            raise SimulationError(f"clock must be 'forecast' or 'boost', got {self.clock!r}")
        for name in ("frontend_s", "frontend_service_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise SimulationError(f"{name} must be >= 0, got {v!r}")


@dataclass
class ServingResult:
    ttft_ms: float
    tpot_ms: float
    output_tokens_per_s: float
    requests: int
    duration_s: float
    mean_e2el_ms: float
    steady_output_tokens_per_s: float  # between the first wave's end and the last request sent
    assumptions: dict
    memory: dict
    steps: dict
    per_request: dict = field(default_factory=dict)  # arrays (ms) when asked for

    def to_dict(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms,
                "output_tokens_per_s": self.output_tokens_per_s, "requests": self.requests,
                "duration_s": self.duration_s, "mean_e2el_ms": self.mean_e2el_ms,
                "steady_output_tokens_per_s": self.steady_output_tokens_per_s,
                "assumptions": self.assumptions, "memory": self.memory, "steps": self.steps}


class BatchStep(Step):
    """A Step built from its prefill chunks and decode contexts directly (the simulator's steps hold up to
    ~1000 decodes; the predictor reads only the two lists and the counts): ``seqs`` is materialised on demand."""

    def __init__(self, prefills: list[tuple[int, int]], decodes: list[int]) -> None:  # noqa: D107
        object.__setattr__(self, "_pre", prefills)
        object.__setattr__(self, "_dec", decodes)
        object.__setattr__(self, "_tokens", sum(n for n, _ in prefills) + len(decodes))
        object.__setattr__(self, "prefill", None)

    @property
    def seqs(self) -> tuple[tuple[int, int], ...]:  # type: ignore[override]
        return tuple(self._pre) + tuple((1, c) for c in self._dec)  # type: ignore[attr-defined]

    def is_prefill(self, i: int) -> bool:
        return i < len(self._pre)  # type: ignore[attr-defined]

    @property
    def num_seqs(self) -> int:
        return len(self._pre) + len(self._dec)  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return self.num_seqs


# ---- step timing --------------------------------------------------------------------------------------------
class StepTimer:
    """Seconds per engine step from the predictor, cached per step shape (decode contexts enter the
    predictor only through their count and sum, prefill chunks one by one)."""

    def __init__(self, pred: Predictor, clock: str = "forecast", async_scheduling: bool = False,
                 correct: Callable[[Prediction, Step], float] | None = None):
        self.pred = pred
        self.clock = clock
        self.async_scheduling = async_scheduling
        self.correct = correct  # e.g. ResidualTracker.correct: a measured engine's calibrated step times
        self._cache: dict[tuple, float] = {}
        self.predictions = 0

    def step(self, prefills: Sequence[tuple[int, int]], n_dec: int, dec_ctx: int) -> Step:
        decs: list[int] = []
        if n_dec:
            base, extra = divmod(int(dec_ctx), n_dec)
            decs = [max(1, base + 1)] * extra + [max(1, base)] * (n_dec - extra)
        return BatchStep(list(prefills), decs)

    def __call__(self, prefills: tuple[tuple[int, int], ...], n_dec: int, dec_ctx: int) -> float:
        # decode contexts bucketed to 1/256 of their mean (< 0.5 % of the attention time): keeps the cache small
        q = max(1, (dec_ctx // max(1, n_dec)) // 256) * max(1, n_dec)
        key = (prefills, n_dec, dec_ctx // q)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = self.time(self.step(prefills, n_dec, (dec_ctx // q) * q + q // 2
                                                       if n_dec else 0))
        return t

    def time(self, step: Step) -> float:
        self.predictions += 1
        f = 1.0 if self.clock == "boost" else self.pred.forecast_f_clk(step)
        p = self.pred.predict_fast(step, f)
        if self.correct is not None:
            return self.correct(p, step)
        if not self.async_scheduling:
            return p.total_s
        device = p.total_s - p.ops["host"] - p.ops["sampling"]
        return max(device, p.ops["host"] + p.ops["sampling"])


# ---- the engine ---------------------------------------------------------------------------------------------
@dataclass
class _Stats:
    steps: int = 0
    prefill_steps: int = 0
    preemptions: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    time_s: float = 0.0
    prefill_time_s: float = 0.0
    max_running: int = 0
    waiting_steps: int = 0  # steps taken while a request waited for the engine
    kv_blocked_steps: int = 0  # ... because its prompt did not fit in the free KV blocks
    largest_decode_step: tuple = ()
    largest_mixed_step: tuple = ()


class Engine:
    """vLLM V1's scheduler over one closed-loop benchmark (see the module docstring for the rules)."""

    def __init__(self, timer: Callable[[tuple, int, int], float], prompts: np.ndarray, outputs: np.ndarray,
                 concurrency: int, max_num_batched_tokens: int, max_num_seqs: int, kv_blocks: int,
                 block_size: int = BLOCK_SIZE, long_prefill_token_threshold: int = 0, frontend_s: float = 0.0,
                 frontend_service_s: float = 0.0, fast_forward: bool = True, async_scheduling: bool = False):
        self.timer = timer
        self.n = len(prompts)
        self.prompt = np.asarray(prompts, dtype=np.int64)
        self.out_len = np.asarray(outputs, dtype=np.int64)
        self.C = concurrency
        self.budget = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.bs = block_size
        self.total_blocks = kv_blocks
        self.free = kv_blocks
        self.thr = long_prefill_token_threshold
        self.d = frontend_s
        self.service = frontend_service_s
        self._frontend_free = 0.0  # when the API server is done with the requests handed to it so far
        self.async_scheduling = async_scheduling
        self.last_start = 0.0  # start of the step running now (async: when the next step was scheduled)
        self.fast_forward = fast_forward
        n = self.n
        self.computed = np.zeros(n, dtype=np.int64)
        self.outputs = np.zeros(n, dtype=np.int64)
        self.blocks = np.zeros(n, dtype=np.int64)
        self.t_send = np.full(n, np.nan)
        self.t_first = np.full(n, np.nan)
        self.t_fin = np.full(n, np.nan)
        self.running: list[int] = []  # admission order
        self.waiting: deque[int] = deque()
        self.arrivals: list[tuple[float, int]] = []  # (engine arrival time, request) heap
        self.sent = 0
        self.done = 0
        self.t = 0.0
        self.st = _Stats()
        self.trace: list[dict] | None = None  # per-step records when asked for (tests)
        self._empty = 0  # consecutive steps that scheduled nothing

    # client
    def _send(self, t: float) -> None:
        if self.sent < self.n:
            i = self.sent
            self.sent += 1
            self.t_send[i] = t
            # the API server handles requests one at a time: a burst reaches the engine spread out, and an idle
            # engine starts a step with the first one alone
            self._frontend_free = max(self._frontend_free, t + self.d) + self.service
            heapq.heappush(self.arrivals, (self._frontend_free, i))

    def _arrive(self) -> None:
        """Requests the scheduler sees now. Under async scheduling a busy engine schedules step j + 1 as step j
        starts (EngineCore.step_with_batch_queue), so it sees only what had arrived by then: a request needs
        one step more to get in."""
        seen = self.last_start if (self.async_scheduling and self.running) else self.t
        while self.arrivals and self.arrivals[0][0] <= seen + 1e-12:
            self.waiting.append(heapq.heappop(self.arrivals)[1])

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def _finish(self, i: int, t: float) -> None:
        self.t_fin[i] = t
        self.free += int(self.blocks[i])
        self.blocks[i] = 0
        self.done += 1
        self._send(t + self.d)

    def _preempt(self, i: int) -> None:
        self.free += int(self.blocks[i])
        self.blocks[i] = 0
        self.computed[i] = 0
        self.waiting.appendleft(i)
        self.st.preemptions += 1

    # one step of Scheduler.schedule()
    def schedule(self) -> tuple[np.ndarray, np.ndarray]:
        """(requests, tokens) scheduled this step, in vLLM's order; updates KV blocks, running, waiting."""
        budget = self.budget
        eligible = len(self.running) + len(self.waiting)
        thr = self.thr if eligible > 1 else 0
        ids: list[int] = []
        toks: list[int] = []
        preempted = False
        if self.running:
            # running requests in order, each min(tokens it still needs, budget left): vectorised while every
            # one of them gets its KV blocks; the request-by-request loop below only when some must be preempted
            ra = np.fromiter(self.running, dtype=np.int64, count=len(self.running))
            comp = self.computed[ra]
            need = self.prompt[ra] + self.outputs[ra] - comp
            if thr > 0:
                need = np.minimum(need, thr)
            k = np.clip(budget - (np.cumsum(need) - need), 0, need)
            want = np.where(k > 0, (comp + k + self.bs - 1) // self.bs - self.blocks[ra], 0)
            total = int(want.sum())
            if total <= self.free:
                m = k > 0
                self.free -= total
                self.blocks[ra] += want
                ids = ra[m].tolist()
                toks = k[m].tolist()
                budget -= int(k.sum())
            else:
                budget, preempted = self._schedule_running_with_preemption(ra, k, want, budget, ids, toks)
        if not preempted:
            while budget > 0 and self.waiting and len(self.running) < self.max_seqs:
                i = self.waiting[0]
                full = int(self.prompt[i] + self.outputs[i])  # prompt (+ tokens generated before a preemption)
                k1 = min(full - int(self.computed[i]), budget)
                if 0 < thr < k1:
                    k1 = thr
                if self._blocks_for(full) > self.free:  # scheduler_reserve_full_isl: the whole prompt must fit
                    self.st.kv_blocked_steps += 1
                    break
                want1 = self._blocks_for(int(self.computed[i]) + k1)
                self.waiting.popleft()
                self.running.append(i)
                self.free -= want1
                self.blocks[i] = want1
                ids.append(i)
                toks.append(k1)
                budget -= k1
        if self.waiting:
            self.st.waiting_steps += 1
        return np.array(ids, dtype=np.int64), np.array(toks, dtype=np.int64)

    def _schedule_running_with_preemption(self, ra: np.ndarray, k: np.ndarray, want: np.ndarray,
                                          budget: int, ids: list[int], toks: list[int]) -> tuple[int, bool]:
        """vLLM's running loop when the blocks run out: a request that cannot get its blocks preempts the most
        recently admitted running request (itself last), until it fits. In closed form: the running requests
        before the first ``i`` whose blocks do not fit even with every request after it preempted are
        scheduled; ``i`` and everything after it are preempted (recompute), in order, to the front of the
        queue."""
        held = self.blocks[ra]
        cum = np.cumsum(want)
        tail = np.concatenate([np.cumsum(held[::-1])[::-1], [0]])  # blocks held by ra[p:], p = 0..n
        fits = cum <= self.free + tail[1:]
        p = len(ra) if fits.all() else int(np.argmin(fits))
        keep, victims = ra[:p], ra[p:].tolist()
        self.free -= int(want[:p].sum())  # the victims' blocks come back in _preempt
        self.blocks[keep] += want[:p]
        m = k[:p] > 0
        ids.extend(keep[m].tolist())
        toks.extend(k[:p][m].tolist())
        del self.running[p:]
        for i in reversed(victims):  # the newest first, as vLLM pops them; each goes to the queue's front
            self._preempt(i)
        return budget - int(k[:p].sum()), bool(victims)

    def _shape(self, ids: np.ndarray, toks: np.ndarray) -> tuple[tuple[tuple[int, int], ...], int, int]:
        comp = self.computed[ids]
        dec = (toks == 1) & (comp > 0) & (comp >= self.prompt[ids])
        pre = tuple(zip(toks[~dec].tolist(), comp[~dec].tolist(), strict=True))
        return pre, int(dec.sum()), int(comp[dec].sum())

    def step(self) -> bool:
        """One engine step (or a run of pure-decode steps); False when nothing is left to do."""
        self._arrive()
        if self.fast_forward and self._decode_run():
            return True
        ids, toks = self.schedule()
        if not len(ids):
            self._empty += 1
            if self.arrivals and not self.running and not self.waiting:
                self.t = max(self.t, self.arrivals[0][0])  # idle until the next request arrives
                return True
            if self.arrivals and self._empty > 2:
                self.t = max(self.t, self.arrivals[0][0])
                return True
            # a step that only preempted: the queue is admitted on the next one
            return self._empty <= 2
        self._empty = 0
        pre, n_dec, ctx = self._shape(ids, toks)
        dt = self.timer(pre, n_dec, ctx)
        self.last_start = self.t
        self.t += dt
        self._account(pre, n_dec, dt, 1)
        self.computed[ids] += toks
        sampled = ids[self.computed[ids] >= self.prompt[ids] + self.outputs[ids]]  # these sampled a token
        self.outputs[sampled] += 1
        first = sampled[self.outputs[sampled] == 1]
        self.t_first[first] = self.t
        for i in sampled[self.outputs[sampled] >= self.out_len[sampled]].tolist():
            self.running.remove(i)
            self._finish(i, self.t)
        if self.trace is not None:
            self.trace.append({"t": self.t, "sched": list(zip(ids.tolist(), toks.tolist(), strict=True)),
                               "prefills": pre, "decodes": n_dec, "free_blocks": self.free,
                               "running": list(self.running), "waiting": list(self.waiting)})
        return True

    def _account(self, pre: tuple, n_dec: int, dt: float, count: int) -> None:
        st = self.st
        st.steps += count
        st.time_s += dt
        ptok = sum(k for k, _ in pre)
        st.tokens += count * n_dec + ptok
        st.decode_tokens += count * n_dec
        st.prefill_tokens += ptok
        st.max_running = max(st.max_running, len(self.running))
        if pre:
            st.prefill_steps += 1
            st.prefill_time_s += dt
            if not st.largest_mixed_step or ptok + n_dec > sum(k for k, _ in st.largest_mixed_step[0]) + \
                    st.largest_mixed_step[1]:
                st.largest_mixed_step = (pre, n_dec)
        elif not st.largest_decode_step or n_dec > st.largest_decode_step[0]:
            st.largest_decode_step = (n_dec,)

    def _decode_run(self) -> bool:
        """Advance a run of >= 2 pure-decode steps at once, when nothing can change the batch before its end
        (every running request decodes, no request can be admitted, no arrival, no finish, no block shortage
        inside the run). Returns False (and does nothing) when the next step is not such a step."""
        run = self.running
        if not run or self.trace is not None:
            return False
        ra = np.fromiter(run, dtype=np.int64, count=len(run))
        comp = self.computed[ra]
        if np.any(comp < self.prompt[ra] + self.outputs[ra] - 1) or np.any(self.outputs[ra] == 0):
            return False  # a prefill (or a resumed recompute) is in progress
        B = len(run)
        if B > self.budget:
            return False
        if self.waiting:
            head = self.waiting[0]
            full = int(self.prompt[head] + self.outputs[head])
            if len(run) < self.max_seqs and self._blocks_for(full) <= self.free:
                return False  # the head of the queue gets in next step
        rem = self.out_len[ra] - self.outputs[ra]
        k = int(rem.min())  # the step that samples the first request's last token ends the run
        # block shortage: the first step j (1-based) whose allocation exceeds the cache
        held = int(self.blocks[ra].sum())

        def need(j: int) -> int:
            return int(((comp + j + self.bs - 1) // self.bs).sum())

        if need(k) - held > self.free:
            lo, hi = 1, k  # need(lo) fits (checked below), need(hi) does not
            if need(1) - held > self.free:
                return False
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if need(mid) - held <= self.free:
                    lo = mid
                else:
                    hi = mid
            k = lo
        if k < 2:
            return False
        s0 = int(comp.sum())
        js = np.arange(k)
        if k <= SEGMENT_SAMPLES:
            dts = np.array([self.timer((), B, s0 + j * B) for j in range(k)])
        else:
            pts = np.unique(np.linspace(0, k - 1, SEGMENT_SAMPLES).round().astype(np.int64))
            vals = np.array([self.timer((), B, s0 + int(j) * B) for j in pts])
            dts = np.interp(js, pts, vals)
        ends = self.t + np.cumsum(dts)
        if not self.waiting and self.arrivals:
            ta = self.arrivals[0][0]
            hit = int(np.searchsorted(ends, ta - 1e-12))  # first step ending at or after the arrival
            if self.async_scheduling and ta > self.t:
                hit += 1  # async: arriving during a step, it is seen one step later (see _arrive)
            if hit < k:
                k = max(1, hit + 1)
                if k < 2:
                    return False
                ends = ends[:k]
                dts = dts[:k]
        # apply the run
        self._account((), B, float(dts.sum()), k)
        self.last_start = float(ends[-2]) if k >= 2 else self.t
        self.t = float(ends[-1])
        self.computed[ra] += k
        self.outputs[ra] += k
        newb = (self.computed[ra] + self.bs - 1) // self.bs
        self.free -= int(newb.sum()) - held
        self.blocks[ra] = newb
        fin = [int(i) for i in ra[self.out_len[ra] - self.outputs[ra] <= 0]]
        for i in fin:
            self.running.remove(i)
            self._finish(i, self.t)
        if self.waiting:
            self.st.waiting_steps += k
        return True

    def run(self) -> None:
        for _ in range(min(self.C, self.n)):
            self._send(0.0)
        while self.done < self.n:
            if not self.step():
                break
        if self.done < self.n:  # pragma: no cover - a scheduler bug, not an input error
            raise SimulationError(f"simulation stalled with {self.n - self.done} requests unfinished")


# ---- memory -------------------------------------------------------------------------------------------------
def kv_capacity(gpu: GpuSpec, shard: ModelShape, max_tokens: int, max_seqs: int, cfg: ServingConfig,
                need_tokens: int, precision: str = "bf16") -> dict:
    """Weights, activations and the KV cache on one GPU (the planner's memory fit, vLLM's
    gpu_memory_utilization); raises when the weights alone do not fit."""
    from .planner import PlanConfig, memory_fit
    from .workload import WorkloadStats

    pc = PlanConfig(max_num_seqs=max_seqs, max_batched_tokens=max_tokens,
                    reserve_fraction=1.0 - cfg.gpu_memory_utilization if cfg.gpu_memory_utilization < 1 else 0.0,
                    reserve_bytes=cfg.reserve_bytes)
    pct = {"p50": float(need_tokens), "p90": float(need_tokens), "p99": float(need_tokens)}
    stats = WorkloadStats(0.0, 0.0, 0.0, 0.0, 0.0, pct, pct, pct)
    fit = memory_fit(gpu, shard, stats, pc, precision)
    if fit.weight_bytes > fit.total_bytes - fit.reserve_bytes:
        raise SimulationError(f"does not fit: {fit.reason}")
    out = fit.to_dict()
    out["fits"] = True
    out["reason"] = ""
    if fit.kv_tokens < need_tokens:
        out["note"] = (f"the KV cache holds {fit.kv_tokens} tokens, less than one request at full length "
                       f"({need_tokens}): requests wait or are preempted")
    return out


# ---- entry points -------------------------------------------------------------------------------------------
def make_predictor(gpu: GpuSpec | str, model: ModelShape | str, tp: int, precision: str = "bf16",
                   graph_max_tokens: int | None = None, host: HostConstants | None = None,
                   **kw) -> Predictor:
    base = host or HostConstants()
    if graph_max_tokens is not None:
        base = replace(base, graph_max_tokens=graph_max_tokens)
    return Predictor(gpu, model, tp=tp, dtype=precision, host=base, **kw)


def simulate(model: ModelShape | str, gpu: GpuSpec | str, tp: int, isl: int | Sequence[int],
             osl: int | Sequence[int], cfg: ServingConfig, precision: str = "bf16",
             predictor: Predictor | None = None, keep_requests: bool = False,
             correct: Callable[[Prediction, Step], float] | None = None) -> ServingResult:
    """Simulate ``vllm.benchmarks.serve`` at a fixed concurrency against one vLLM server (one model replica
    on ``tp`` GPUs). ``isl`` / ``osl``: one length for every request, or a list cycled over the requests.
    ``correct``: step seconds from the raw prediction and the step (a calibrated engine), instead of the
    predictor's own total."""
    spec = get_gpu(gpu)
    shape = get_model(model)
    if precision not in ("bf16", "fp8"):
        raise SimulationError(f"precision must be bf16 or fp8, got {precision!r}")
    if tp > 1 and spec.interconnect == "none":
        raise SimulationError(f"{spec.name} has no GPU interconnect for TP={tp}")
    d_tok, d_seqs = vllm_batch_defaults(spec, tp)
    max_tokens = cfg.max_num_batched_tokens or d_tok
    max_seqs = cfg.max_num_seqs or d_seqs
    graphs = cuda_graph_capture_max(spec, max_seqs, max_tokens)
    async_sched = cfg.async_scheduling if cfg.async_scheduling is not None else spec.arch != "cpu"
    pred = predictor or make_predictor(spec, shape, tp, precision, graph_max_tokens=graphs)
    n = cfg.num_prompts or DEFAULT_PROMPTS_PER_CONCURRENCY * cfg.concurrency
    prompts = _lengths(isl, n, "isl")
    outputs = _lengths(osl, n, "osl")
    longest = int((prompts + outputs).max())
    mem = kv_capacity(spec, pred.model, max_tokens, max_seqs, cfg, longest, precision)
    kv_tokens = cfg.kv_tokens if cfg.kv_tokens is not None else int(mem["kv_tokens"])
    bs = cfg.block_size or (CPU_BLOCK_SIZE if spec.arch == "cpu" else BLOCK_SIZE)
    blocks = kv_tokens // bs - 1  # vLLM keeps one block aside (the null block)
    if blocks < -(-longest // bs):
        raise SimulationError(f"the KV cache ({kv_tokens} tokens) cannot hold one request at full length "
                              f"({longest} tokens): vLLM refuses to start with a max_model_len that long")
    timer = StepTimer(pred, cfg.clock, async_sched, correct)
    eng = Engine(timer, prompts, outputs, cfg.concurrency, max_tokens, max_seqs, blocks, bs,
                 cfg.long_prefill_token_threshold, cfg.frontend_s, cfg.frontend_service_s,
                 async_scheduling=async_sched)
    eng.run()
    return _result(eng, timer, cfg, spec, tp, precision, max_tokens, max_seqs, graphs, async_sched, mem,
                   kv_tokens, bs, keep_requests)


def _lengths(x: int | Sequence[int], n: int, what: str) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(x))
    if arr.size == 0 or not np.issubdtype(arr.dtype, np.integer) or (arr < 1).any():
        raise SimulationError(f"{what} must be positive integers")
    return np.resize(arr.astype(np.int64), n)


def _result(eng: Engine, timer: StepTimer, cfg: ServingConfig, spec: GpuSpec, tp: int, precision: str,
            max_tokens: int, max_seqs: int, graphs: int, async_sched: bool, mem: dict, kv_tokens: int,
            bs: int, keep: bool) -> ServingResult:
    d = cfg.frontend_s
    ttft = eng.t_first + d - eng.t_send
    e2el = eng.t_fin + d - eng.t_send
    multi = eng.out_len > 1
    tpot = np.where(multi, (eng.t_fin - eng.t_first) / np.maximum(1, eng.out_len - 1), np.nan)
    duration = float(np.nanmax(eng.t_fin) + d)
    # steady state: from the end of the first wave (the C-th finish) to the last request sent (the drain after
    # it runs with fewer requests in flight); what a long-running server at this concurrency delivers
    steady = float(eng.out_len.sum()) / duration
    if eng.n > eng.C:
        t_a = float(np.sort(eng.t_fin)[eng.C - 1])
        t_b = float(np.nanmax(eng.t_send))
        inside = (eng.t_fin > t_a) & (eng.t_fin <= t_b)
        if t_b > t_a and inside.sum() >= max(2, eng.C // 2):
            steady = float(eng.out_len[inside].sum()) / (t_b - t_a)
    st = eng.st
    steps = {
        "steps": st.steps, "prefill_steps": st.prefill_steps, "decode_only_steps": st.steps - st.prefill_steps,
        "mean_tokens_per_step": st.tokens / max(1, st.steps),
        "mean_decodes_per_step": st.decode_tokens / max(1, st.steps),
        "prefill_token_share": st.prefill_tokens / max(1, st.tokens),
        "prefill_step_time_share": st.prefill_time_s / st.time_s if st.time_s > 0 else 0.0,
        "mean_step_ms": 1e3 * st.time_s / max(1, st.steps),
        "max_running": st.max_running, "preemptions": st.preemptions,
        "steps_with_requests_waiting": st.waiting_steps, "kv_blocked_admissions": st.kv_blocked_steps,
        "predictions": timer.predictions,
    }
    steps["bounds"] = _bounds(timer, st)
    res = ServingResult(
        ttft_ms=1e3 * float(np.nanmean(ttft)), tpot_ms=1e3 * float(np.nanmean(tpot)) if multi.any() else 0.0,
        output_tokens_per_s=float(eng.out_len.sum()) / duration, requests=eng.n, duration_s=duration,
        mean_e2el_ms=1e3 * float(np.nanmean(e2el)), steady_output_tokens_per_s=steady,
        assumptions={
            "engine": "vLLM V1 Scheduler (0.32/0.33), OpenAI API server defaults",
            "gpu": spec.name, "tp": tp, "precision": precision, "concurrency": cfg.concurrency,
            "num_prompts": eng.n, "max_num_batched_tokens": max_tokens, "max_num_seqs": max_seqs,
            "chunked_prefill": True, "long_prefill_token_threshold": cfg.long_prefill_token_threshold,
            "block_size": bs, "kv_cache_tokens": kv_tokens,
            "gpu_memory_utilization": cfg.gpu_memory_utilization, "cuda_graph_max_batch": graphs,
            "async_scheduling": async_sched, "prefix_caching_hits": False, "preemption": "recompute",
            "clock": cfg.clock, "frontend_ms_each_way": 1e3 * d,
            "frontend_service_ms_per_request": 1e3 * cfg.frontend_service_s,
        },
        memory=mem, steps=steps)
    if keep:
        res.per_request = {"ttft_ms": 1e3 * ttft, "tpot_ms": 1e3 * tpot, "e2el_ms": 1e3 * e2el}
    return res


def _bounds(timer: StepTimer, st: _Stats) -> dict:
    """What bounds the largest pure-decode step and the largest mixed step (share of step time)."""
    from .planner import bound_shares, dominant_bound

    out = {}
    if st.largest_decode_step:
        n = st.largest_decode_step[0]
        p = timer.pred.predict(timer.step((), n, n * 512), f_clk=1.0 if timer.clock == "boost" else None)
        sh = bound_shares(p)
        out["decode"] = {"decodes": n, "bound": dominant_bound(sh), "shares": sh}
    if st.largest_mixed_step:
        pre, n = st.largest_mixed_step
        p = timer.pred.predict(timer.step(pre, n, n * 512), f_clk=1.0 if timer.clock == "boost" else None)
        sh = bound_shares(p)
        out["mixed"] = {"prefill_tokens": sum(k for k, _ in pre), "decodes": n, "bound": dominant_bound(sh),
                        "shares": sh}
    return out
