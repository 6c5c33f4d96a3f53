"""`m2live simulate` against vLLM serving runs published by others → results/public_serving.json.

A sanity check, never a fit: each point is a public `vllm bench serve`-style run on a GPU (the source, its date and
vLLM version, what it states and what we had to assume), simulated with the same model, GPU, TP, lengths and
concurrency from datasheets alone. The sources state medians or rounded figures where m2live reports means, and
their hosts and vLLM versions differ from the ones m2live's host terms describe, so read the errors as a
direction, not a score. Points whose setup a source leaves too open (unknown lengths that matter, a client that
saturates) are not used.

    python bench/public_serving.py --out results/public_serving.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from m2live.serving_config import ServingConfig  # noqa: E402
from m2live.shapes import ModelShape, get_model  # noqa: E402
from m2live.simulate import simulate  # noqa: E402

# the two small Qwen models of these runs are presets (m2live.shapes.PRESETS: their config.json shapes)
QWEN25_05B = replace(get_model("Qwen/Qwen2.5-0.5B"), name="Qwen/Qwen2.5-0.5B-Instruct")  # the runs' checkpoint
QWEN3_06B = get_model("Qwen/Qwen3-0.6B")

POINTS: list[dict] = [
    {
        "source": "https://ai.wmx.dev/benchmarks (serving/raw-vllm concurrency sweep)",
        "setup": "1x NVIDIA L4 on a GCP g2-standard-4 (4 vCPUs), vLLM v0.23.0 (V1), Qwen2.5-0.5B-Instruct bf16, "
                 "--gpu-memory-utilization 0.6 --max-model-len 8192; vllm bench serve, 256 in / 128 out, "
                 "--ignore-eos, closed loop at fixed --max-concurrency",
        "stated": "ITL p50 and TTFT p50 (ms) per concurrency",
        "gpu": "NVIDIA L4", "model": QWEN25_05B, "tp": 1, "precision": "bf16", "isl": 256, "osl": 128,
        "vllm": "0.23", "statistic": "median", "per_token": "itl", "gpu_memory_utilization": 0.6,
        "runs": [  # (concurrency, ITL p50, TTFT p50)
            (1, 5.1, 27.0), (2, 5.2, 37.8), (4, 5.3, 50.1), (8, 5.5, 60.9), (16, 6.0, 103.8), (32, 7.1, 135.3),
        ],
    },
    {
        "source": "https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/ (2026-05-16); the workload read "
                  "from github.com/yobitelcomm/bench (plugins/llm-inference: chatbot-short.yaml, datasets.py; "
                  "harness client.py)",
        "setup": "1x H100-80GB-HBM3, vLLM 0.21.0 (server flags not stated: defaults), Llama-3.1-8B-Instruct fp16, "
                 "profile llm.inference.chatbot-short: streaming chat completions through LiteLLM, ten built-in "
                 "questions of 10-20 words sent round-robin (about 53 prompt tokens with Llama 3.1's chat template "
                 "and its system header; simulated as 53 uncached tokens — repeats hit vLLM's prefix cache, which "
                 "shortens a 53-token prefill step by under 0.3 ms here), max_tokens 128 without ignore-EOS "
                 "(simulated as 128), temperature 0, closed loop 120 s per concurrency after 3 warm-up requests",
        "stated": "ttft_p50 and tpot_p50 (ms) at concurrency 1 and 4; concurrency 16 and 64 not used (throughput "
                  "falls from 16 to 64 while TPOT grows 4x: a saturated client)",
        "gpu": "NVIDIA H100 80GB HBM3", "model": "meta-llama/Llama-3.1-8B", "tp": 1, "precision": "bf16",
        "isl": 53, "osl": 128, "vllm": "0.21", "statistic": "median",
        "runs": [(1, 6.48, 13.98), (4, 6.59, 22.75)],
    },
    {
        "source": "https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on",
        "setup": "1x NVIDIA A100 40GB (SXM4, Lambda), vLLM 0.23.0, Llama-3.1-8B-Instruct bf16, vllm serve "
                 "defaults; vllm bench serve random 1024 in / 128 out, --ignore-eos, --max-concurrency 1",
        "stated": "decode at one request 'about 75 tokens/sec' (TPOT ~13.3 ms); the rest of the sweep is not in "
                  "the text we hold",
        "gpu": "NVIDIA A100-SXM4-40GB", "model": "meta-llama/Llama-3.1-8B", "tp": 1, "precision": "bf16",
        "isl": 1024, "osl": 128, "vllm": "0.23",
        "runs": [(1, 1000.0 / 75.0, None)],
    },
    {
        "source": "public lab notes on GitHub ('Session 2' / 'Session 3' of a vLLM course's 01-baseline notes, "
                  "2026-10; repository not named by the index that found them)",
        "setup": "1x NVIDIA A100-SXM4-80GB, docker vllm/vllm-openai:v0.31.0, meta-llama/Llama-3.1-8B-Instruct bf16, "
                 "server defaults (its start-up log: gpu_memory_utilization 0.92, 56.21 GiB of KV cache); one "
                 "streaming chat completion with curl on the same host, a 2,065-token prompt (template included), "
                 "64 output tokens forced with min_tokens, prefix cache missed (the first of three runs)",
        "stated": "first chunk at 0.182 s; first content chunk to [DONE] 0.72 s for 64 tokens (TPOT 0.72 / 63 = "
                  "11.43 ms; the notes round it to 11.5 ms/token)",
        "gpu": "NVIDIA A100-SXM4-80GB", "model": "meta-llama/Llama-3.1-8B", "tp": 1, "precision": "bf16",
        "isl": 2065, "osl": 64, "vllm": "0.31", "num_prompts": 1,
        "runs": [(1, 720.0 / 63, 182.0)],
    },
    {
        "source": "https://github.com/gpustack/gpustack docs/performance-lab/qwen3-8b/h100-latency.md (the "
                  "'vLLM' result of its step 1, the baseline)",
        "setup": "1x NVIDIA H100 SXM (as stated), vLLM v0.11.0, `vllm serve Qwen/Qwen3-8B` (bf16, defaults); "
                 "vllm bench serve --backend openai-chat --endpoint /v1/chat/completions, ShareGPT, 100 prompts, "
                 "--max-concurrency 4 (closed loop). ShareGPT's lengths vary: simulated at the run's means, "
                 "23,260 input tokens / 100 = 233 plus Qwen3's chat template around a one-message prompt (9 "
                 "tokens), and 22,061 generated / 100 = 221 out (the dataset's own lengths, EOS allowed)",
        "stated": "mean TPOT 7.38 ms (median 7.40), mean TTFT 64.00 ms (median 60.26); SGLang on the same "
                  "machine and client: TTFT 27.70 ms",
        "gpu": "NVIDIA H100 80GB HBM3", "model": "Qwen/Qwen3-8B", "tp": 1, "precision": "bf16",
        "isl": 242, "osl": 221, "vllm": "0.11", "num_prompts": 100,
        "runs": [(4, 7.38, 64.00)],
    },
    *({
        "source": "https://github.com/vllm-project/vllm/pull/20759 (baseline rows, 2025-07)",
        "setup": "4x NVIDIA B200 (TP 4), vLLM V1 of mid-2025 (before async scheduling was on by default), "
                 "Llama-3.1-70B-Instruct bf16, --no-enable-prefix-caching; vllm bench serve sonnet (550 in incl. "
                 f"a 200-token prefix, 150 out) at {qps:g} request/s for 60 s ({60 * qps:g} prompts, Poisson, no "
                 "concurrency cap) — simulated as that open loop (until 2026-12-07 only the 1/s row, as 200 "
                 "prompts; one request in flight before 2026-12-05: TPOT 9.76, TTFT 30.3 ms)",
        "stated": f"mean TPOT {tpot} ms, mean TTFT {ttft} ms at QPS {qps:g}",
        "gpu": "NVIDIA B200", "model": "meta-llama/Llama-3.1-70B", "tp": 4, "precision": "bf16",
        # main of July 2025, between 0.9.2 and 0.10.0 (the two differ in none of the defaults simulated): no async
        # scheduling (on by default from 0.14) nor all-reduce + RMSNorm fusion (from 0.16), the token budget of the
        # >= 70 GiB tier (8192), graphs up to 512, gpu_memory_utilization 0.9 — m2live.vllm_release's rules
        "isl": 550, "osl": 150, "vllm": "0.10",
        "request_rate": qps, "num_prompts": 60 * qps, "prefix_caching": False,  # its sonnet prompts share 200 tokens
        "runs": [(60 * qps, tpot, ttft)],
    } for qps, tpot, ttft in ((1, 12.88, 45.02), (5, 14.12, 48.57), (10, 17.67, 55.48))),
    {
        "source": "https://github.com/ovg-project/kvcached/pull/331 (benchmarks/bench_layout/H100_results.md, "
                  "config A 'vanilla')",
        "setup": "1x NVIDIA H100 80GB HBM3, vLLM 0.19.0, Qwen3-0.6B bf16, --gpu-memory-utilization 0.5 "
                 "--max-model-len 2048; vllm bench serve random 512 in / 128 out, 500 prompts at --request-rate "
                 "inf (all 500 sent at once: a closed loop of 500 with 500 prompts), means of 3 seeds",
        "stated": "94.91 req/s, mean TTFT 2905 ms, mean TPOT 5.45 ms",
        "gpu": "NVIDIA H100 80GB HBM3", "model": QWEN3_06B, "tp": 1, "precision": "bf16", "isl": 512, "osl": 128,
        "vllm": "0.19", "num_prompts": 500, "gpu_memory_utilization": 0.5,
        # outside what the simulator models: the API server's own work bounds this run (see docs/serving.md, "not modelled:
        # the API server's work per streamed token"); reported, and kept out of the in-scope summary
        "scope": "API-server bound",
        "runs": [(500, 5.45, 2905.0)],
    },
    {
        "source": "https://github.com/ovg-project/kvcached/pull/331 (benchmarks/bench_layout/H100_results.md, "
                  "config F 'vanilla')",
        "setup": "the same server and workload as the row above (1x NVIDIA H100 80GB HBM3, vLLM 0.19.0, Qwen3-0.6B "
                 "bf16, --gpu-memory-utilization 0.5, random 512 in / 128 out, 500 prompts) sent at --request-rate "
                 "16 (Poisson): light load, about five requests in flight; means of 3 seeds",
        "stated": "15.87 req/s, mean TTFT 38.9 ms, mean TPOT 2.39 ms; its result files (sweep_results/F_vanilla_r16."
                  "seed{42,99,7}.json, vllm bench serve --save-result): median ITL 2.03 / 2.05 / 2.03 ms, p99 ITL 12.69 / "
                  "12.80 / 12.76 ms, median TTFT 36.0 / 35.6 / 35.9 ms",
        "gpu": "NVIDIA H100 80GB HBM3", "model": QWEN3_06B, "tp": 1, "precision": "bf16", "isl": 512, "osl": 128,
        "vllm": "0.19", "num_prompts": 500, "gpu_memory_utilization": 0.5, "request_rate": 16.0,
        "runs": [(500, 2.39, 38.9)],
        # reported beside the run, not scored: the means of the three seeds' files
        "measured_itl_ms": {"median": 2.04, "p99": 12.75}, "measured_median_ttft_ms": 35.8,
    },
]


def run_point(p: dict) -> dict:
    rows = []
    for c, tpot, ttft in p["runs"]:
        cfg = ServingConfig(concurrency=c,  # the server's switches: its stated release's defaults (vllm_release)
                            num_prompts=p.get("num_prompts"), request_rate=p.get("request_rate"),
                            prefix_caching=p.get("prefix_caching", True), vllm_version=p["vllm"],
                            **({"gpu_memory_utilization": p["gpu_memory_utilization"]}
                               if "gpu_memory_utilization" in p else {}))
        r = simulate(p["model"], p["gpu"], p["tp"], p["isl"], p["osl"], cfg, precision=p["precision"])
        # the statistic the source states: medians (p50) where it gives them, else the benchmark's means; of ITL
        # (every gap between a request's tokens) where it states that instead of TPOT (per request)
        median = p.get("statistic", "mean") == "median"
        itl = p.get("per_token") == "itl"
        sim_tpot = r.percentiles["itl_ms" if itl else "tpot_ms"]["median"] if median else (
            r.percentiles["itl_ms"]["mean"] if itl else r.tpot_ms)
        sim_ttft = r.percentiles["ttft_ms"]["median"] if median else r.ttft_ms
        row = {"concurrency": c, "statistic": "median" if median else "mean",
               **({"per_token_metric": "ITL"} if itl else {}),
               "measured_tpot_ms": round(tpot, 3),
               "simulated_tpot_ms": round(sim_tpot, 3), "tpot_error": round(sim_tpot / tpot - 1.0, 4)}
        if ttft is not None:
            row.update(measured_ttft_ms=ttft, simulated_ttft_ms=round(sim_ttft, 2),
                       ttft_error=round(sim_ttft / ttft - 1.0, 4))
        if "measured_itl_ms" in p:  # the source's ITL statistics, reported beside the scored figures
            row["itl_ms"] = {k: {"measured": v, "simulated": round(r.percentiles["itl_ms"][k], 3)}
                             for k, v in p["measured_itl_ms"].items()}
        if "measured_median_ttft_ms" in p:
            row["median_ttft_ms"] = {"measured": p["measured_median_ttft_ms"],
                                     "simulated": round(r.percentiles["ttft_ms"]["median"], 2)}
        rows.append(row)
    model = p["model"].name if isinstance(p["model"], ModelShape) else p["model"]
    return {"source": p["source"], "setup": p["setup"], "stated": p["stated"], "gpu": p["gpu"], "model": model,
            "tp": p["tp"], "precision": p["precision"], "isl": p["isl"], "osl": p["osl"], "vllm_version": p["vllm"],
            **({"scope": p["scope"]} if "scope" in p else {}),
            **({"request_rate": p["request_rate"]} if "request_rate" in p else {}), "runs": rows}


def summarize(points: list[dict]) -> dict:
    tpot = [abs(r["tpot_error"]) for p in points for r in p["runs"]]
    ttft = [abs(r["ttft_error"]) for p in points for r in p["runs"] if "ttft_error" in r]
    return {"tpot_runs": len(tpot), "tpot_mape": round(100 * sum(tpot) / len(tpot), 1),
            "tpot_within_15pct": sum(e <= 0.15 for e in tpot),
            "ttft_runs": len(ttft), "ttft_mape": round(100 * sum(ttft) / len(ttft), 1),
            "ttft_within_25pct": sum(e <= 0.25 for e in ttft)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/public_serving.json")
    args = ap.parse_args()
    points = [run_point(p) for p in POINTS]
    in_scope = [p for p in points if "scope" not in p]
    out = {
        "what": "m2live simulate (datasheets, no calibration) against published vLLM serving runs; never fitted",
        "points": points,
        "summary": summarize(in_scope),  # the runs inside what the simulator models
        "summary_all": summarize(points),  # ... and with the ones outside it (a point's "scope" says why)
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    t = Table(title="m2live simulate vs published vLLM runs (never fitted)")
    for col in ("GPU", "model", "TP", "in/out", "C", "TPOT meas.", "TPOT sim.", "err", "TTFT meas.", "TTFT sim.",
                "err"):
        t.add_column(col)
    for p in points:
        for r in p["runs"]:
            t.add_row(p["gpu"].replace("NVIDIA ", ""), p["model"].split("/")[-1], str(p["tp"]),
                      f"{p['isl']}/{p['osl']}", str(r["concurrency"]), f"{r['measured_tpot_ms']:.2f}",
                      f"{r['simulated_tpot_ms']:.2f}", f"{100 * r['tpot_error']:+.0f} %",
                      f"{r.get('measured_ttft_ms', '')}", f"{r.get('simulated_ttft_ms', '')}",
                      f"{100 * r['ttft_error']:+.0f} %" if "ttft_error" in r else "")
    Console().print(t)
    for key, what in (("summary", "in scope"), ("summary_all", "all")):
        sm = out[key]
        print(f"{what}: TPOT MAPE {sm['tpot_mape']} % ({sm['tpot_within_15pct']} of {sm['tpot_runs']} within 15 %), "
              f"TTFT MAPE {sm['ttft_mape']} % ({sm['ttft_within_25pct']} of {sm['ttft_runs']} within 25 %)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
