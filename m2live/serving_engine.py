"""vLLM V1's scheduler over one closed-loop serving benchmark, step by step (``Engine``).

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
- prefix caching on (vLLM's default): a freed block keeps its contents until it is handed out again, and the free
  blocks form one queue (``v1/core/block_pool.py``) — new blocks come from its head; a request's full blocks go to
  its tail when it finishes or is preempted, last block first, and its partly filled block to its head. Random
  prompts share nothing, so the one hit is a preempted request's own prefix: re-admitted, it recomputes only what
  was handed out meanwhile (``get_computed_blocks``: whole blocks, at most all tokens but the last);
- decode CUDA graphs up to the capture size ``min(2 x max_num_seqs, 512)`` (1024 on Blackwell), never above
  the token budget: steps with at most that many tokens replay graphs (the predictor's host terms);
- async scheduling on GPUs (vLLM's default when ``async_scheduling`` is left unset — vllm/config/vllm.py of the
  0.32 build here turns it on unless an incompatible option is set; older releases ran without it, ``m2live
  simulate --async-scheduling off``: the host work of the next step overlaps the device's
  work on this one, so a step lasts the longer of the two; and a busy engine schedules step j + 1 as step j
  starts, so a request arriving during a step is seen one step later), off on the CPU backend.

The client (``Engine._send``): ``concurrency`` requests sent at once, each finished request replaced by the next
at once; the first request's prompt prefix may be in the prefix cache already (``first_cached`` tokens: the
benchmark's untimed test run sent that prompt before); a request needs ``frontend_s`` between client and engine
each way and ``frontend_service_s`` + ``tokenize_s_per_token`` x its prompt of the API server's serial work, so
a burst reaches the engine spread out. Runs of pure-decode steps between events (an
arrival, a finish, a KV block shortage) are advanced in one go (``Engine._decode_run``): their times are the
timer's at ``SEGMENT_SAMPLES`` points along the run, interpolated.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .serving_config import BLOCK_SIZE, SimulationError

SEGMENT_SAMPLES = 9  # predictions along a run of pure-decode steps (interpolated in between)


@dataclass
class EngineStats:
    """What the engine counts while it runs (the step summary of ``serving_metrics``)."""

    steps: int = 0
    prefill_steps: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0  # tokens a re-admitted preempted request found still in the prefix cache
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
    """vLLM V1's scheduler over one closed-loop benchmark (the module docstring gives the rules)."""

    def __init__(self, timer: Callable[[tuple, int, int], float], prompts: np.ndarray, outputs: np.ndarray,
                 concurrency: int, max_num_batched_tokens: int, max_num_seqs: int, kv_blocks: int,
                 block_size: int = BLOCK_SIZE, long_prefill_token_threshold: int = 0, frontend_s: float = 0.0,
                 frontend_service_s: float = 0.0, fast_forward: bool = True, async_scheduling: bool = False,
                 first_cached: int = 0, tokenize_s_per_token: float = 0.0, send_at: np.ndarray | None = None,
                 prefix_caching: bool = True):
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
        # the free-block queue as runs of blocks, head first: [owner, count]; owner -1 for blocks nobody will hit
        # again, else the preempted request whose prefix they hold (its cached blocks, ``cached``, all in one run)
        self.prefix_caching = prefix_caching
        self.queue: deque[list[int]] = deque([[-1, kv_blocks]]) if kv_blocks > 0 else deque()
        self.thr = long_prefill_token_threshold
        self.d = frontend_s
        self.service = frontend_service_s
        self.tokenize = tokenize_s_per_token  # the API server's serial tokenisation, per prompt token
        # an open loop (vllm bench serve --request-rate R): request i is sent no earlier than send_at[i], and
        # no more than ``concurrency`` are in flight (--max-concurrency); None: each as soon as a slot is free
        self.send_at = None if send_at is None else np.asarray(send_at, dtype=float)
        self._frontend_free = 0.0  # when the API server is done with the requests handed to it so far
        self.async_scheduling = async_scheduling
        self.last_start = 0.0  # start of the step running now (async: when the next step was scheduled)
        self.fast_forward = fast_forward
        n = self.n
        self.computed = np.zeros(n, dtype=np.int64)
        if n and first_cached > 0:  # the first request's prompt prefix found in the prefix cache
            self.computed[0] = min(int(first_cached), int(self.prompt[0]) - 1)
        self.outputs = np.zeros(n, dtype=np.int64)
        self.blocks = np.zeros(n, dtype=np.int64)
        self.cached = np.zeros(n, dtype=np.int64)  # a preempted request's blocks still in the prefix cache
        self.t_send = np.full(n, np.nan)
        self.t_first = np.full(n, np.nan)
        self.t_fin = np.full(n, np.nan)
        self.t_last = np.full(n, np.nan)  # each request's latest token
        # inter-token latencies as the benchmark's client sees them (every gap between a request's successive
        # tokens), kept as (gap, how many tokens had it): a run of pure-decode steps adds one gap per step
        self.itl_gaps = array("d")
        self.itl_counts = array("d")
        self.itl_by_request: list[list[float]] | None = None  # each request's gaps in order, when asked for
        # tokens the client receives in each whole second after the first request was sent (the benchmark's "peak
        # output token throughput" is the busiest one): {second: tokens}
        self.tokens_by_second: dict[int, float] = {}
        self.running: list[int] = []  # admission order
        self.waiting: deque[int] = deque()
        self.arrivals: list[tuple[float, int]] = []  # (engine arrival time, request) heap
        self.sent = 0
        self.done = 0
        self.t = 0.0
        self.st = EngineStats()
        self.trace: list[dict] | None = None  # per-step records when asked for (tests)
        self._empty = 0  # consecutive steps that scheduled nothing

    # client
    def _send(self, t: float) -> None:
        if self.sent < self.n:
            i = self.sent
            self.sent += 1
            if self.send_at is not None:
                t = max(t, float(self.send_at[i]))
            self.t_send[i] = t
            # the API server handles requests one at a time (its fixed work, then the prompt's tokenisation on its
            # one tokenizer thread): a burst reaches the engine spread out, and an idle engine starts a step with
            # the first one alone
            self._frontend_free = (max(self._frontend_free, t + self.d) + self.service
                                   + self.tokenize * float(self.prompt[i]))
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

    # the free-block queue (prefix caching)
    def _alloc(self, n: int) -> None:
        """Hand out ``n`` free blocks from the queue's head (BlockPool.get_new_blocks): a preempted request whose
        blocks they were loses them from its cached prefix (last blocks first, as they were queued)."""
        if n <= 0:
            return
        self.free -= n
        q = self.queue
        while n > 0:
            seg = q[0]
            take = min(n, seg[1])
            seg[1] -= take
            n -= take
            if seg[0] >= 0:
                self.cached[seg[0]] -= take
            if seg[1] == 0:
                q.popleft()

    def _release(self, i: int, owner: int) -> None:
        """Request ``i``'s blocks back to the queue (BlockPool.free_blocks): its full blocks, hashed, to the tail
        (``owner``: the request that may hit them again, or -1), its partly filled one to the head."""
        b = int(self.blocks[i])
        self.free += b
        self.blocks[i] = 0
        if not self.prefix_caching:
            owner = -1
        full = min(b, int(self.computed[i]) // self.bs)
        if b - full:
            if self.queue and self.queue[0][0] < 0:
                self.queue[0][1] += b - full
            else:
                self.queue.appendleft([-1, b - full])
        if full:
            if owner < 0 and self.queue and self.queue[-1][0] < 0:
                self.queue[-1][1] += full
            else:
                self.queue.append([owner, full])
            if owner >= 0:
                self.cached[owner] = full

    def _hit(self, i: int) -> int:
        """Re-admitting request ``i``: the blocks of its prefix still cached leave the queue (BlockPool.touch); the
        tokens they hold count as computed. (They are whole blocks of computed tokens, so never more than vLLM's
        longest hit, all the request's tokens but the last.)"""
        hits = int(self.cached[i])
        if hits <= 0:
            return 0
        self.queue = deque(seg for seg in self.queue if seg[0] != i)
        self.cached[i] = 0
        self.free -= hits
        self.blocks[i] = hits
        self.computed[i] = hits * self.bs
        self.st.prefix_hit_tokens += hits * self.bs
        return hits

    def _finish(self, i: int, t: float) -> None:
        self.t_fin[i] = t
        self._release(i, -1)
        self.done += 1
        self._send(t + self.d)

    def _preempt(self, i: int) -> None:
        self._release(i, i)
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
                self._alloc(total)
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
                # scheduler_reserve_full_isl: the whole prompt must fit (a cached prefix's blocks are free blocks
                # until it is hit, so they count on both sides)
                if self._blocks_for(full) > self.free:
                    self.st.kv_blocked_steps += 1
                    break
                self.waiting.popleft()
                self._hit(i)
                k1 = min(full - int(self.computed[i]), budget)
                if 0 < thr < k1:
                    k1 = thr
                want1 = self._blocks_for(int(self.computed[i]) + k1) - int(self.blocks[i])
                self.running.append(i)
                self._alloc(want1)
                self.blocks[i] += want1
                ids.append(i)
                toks.append(k1)
                budget -= k1
        if self.waiting:
            self.st.waiting_steps += 1
        return np.array(ids, dtype=np.int64), np.array(toks, dtype=np.int64)

    def _schedule_running_with_preemption(self, ra: np.ndarray, k: np.ndarray, want: np.ndarray,
                                          budget: int, ids: list[int], toks: list[int]) -> tuple[int, bool]:
        """vLLM's running loop when the blocks run out: each running request in order takes its blocks; one that
        cannot preempts the most recently admitted running request (itself last) until it fits — each victim to
        the waiting queue's front, its blocks to the free-block queue before the next allocation."""
        end = len(ra)
        q = 0
        preempted = False
        while q < end:
            w = int(want[q])
            while w > self.free and end - 1 > q:
                end -= 1
                self._preempt(int(ra[end]))
                preempted = True
            if w > self.free:  # not even with every later request preempted: this one goes too
                end = q
                self._preempt(int(ra[q]))
                preempted = True
                break
            self._alloc(w)
            self.blocks[ra[q]] += w
            if k[q] > 0:
                ids.append(int(ra[q]))
                toks.append(int(k[q]))
                budget -= int(k[q])
            q += 1
        del self.running[end:]
        return budget, preempted

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
        self._add_tokens(math.floor(self.t + self.d - self.t_origin), float(len(sampled)))
        later = sampled[self.outputs[sampled] > 1]
        self._itl(later, self.t - self.t_last[later])
        self.t_last[sampled] = self.t
        for i in sampled[self.outputs[sampled] >= self.out_len[sampled]].tolist():
            self.running.remove(i)
            self._finish(i, self.t)
        if self.trace is not None:
            self.trace.append({"t": self.t, "sched": list(zip(ids.tolist(), toks.tolist(), strict=True)),
                               "prefills": pre, "decodes": n_dec, "free_blocks": self.free,
                               "running": list(self.running), "waiting": list(self.waiting)})
        return True

    @property
    def t_origin(self) -> float:
        """When the first request was sent (requests go out in order): the benchmark's seconds count from it."""
        return float(self.t_send[0])

    def _add_tokens(self, second: int, count: float) -> None:
        """``count`` tokens reach the client in whole ``second`` since the first request was sent."""
        self.tokens_by_second[second] = self.tokens_by_second.get(second, 0.0) + count

    def _count_tokens(self, times: np.ndarray, count: float) -> None:
        """``count`` tokens reach the client at each engine time in ``times`` (ascending; + the frontend's way back),
        bucketed by whole seconds as the benchmark buckets them."""
        secs = np.floor(times + self.d - self.t_origin).astype(np.int64)
        first = int(secs[0])  # a run of steps spans few seconds
        for k, n in enumerate(np.bincount(secs - first)):
            if n:
                self._add_tokens(first + k, count * float(n))

    def _itl(self, ids: np.ndarray, gaps: np.ndarray, rest: np.ndarray | None = None) -> None:
        """Requests ``ids`` each get their gap in ``gaps`` since their last token, then (a run of decode steps) every
        one of them the gaps ``rest``: kept as (gap, tokens that had it), and request by request when asked for."""
        buf = [(gaps, 1.0)] + ([(rest, float(len(ids)))] if rest is not None else [])
        for g, count in buf:
            if len(g):
                self.itl_gaps.frombytes(np.ascontiguousarray(g, dtype=np.float64).tobytes())
                self.itl_counts.frombytes(np.full(len(g), count).tobytes())
        if self.itl_by_request is not None:
            tail = [] if rest is None else rest.tolist()
            for i, g in zip(ids.tolist(), gaps.tolist(), strict=True):
                self.itl_by_request[i] += [g, *tail]

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
        self._itl(ra, ends[0] - self.t_last[ra], dts[1:k])  # each one's gap since its last token, then the steps
        self._count_tokens(ends[:k], float(B))
        self.t_last[ra] = self.t
        newb = (self.computed[ra] + self.bs - 1) // self.bs
        self._alloc(int(newb.sum()) - held)
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
