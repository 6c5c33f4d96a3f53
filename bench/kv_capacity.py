"""The KV-cache sizing (serving_config.kv_capacity, what `simulate` serves from) against public vLLM start-up logs
→ results/kv_capacity.json.

vLLM sizes its KV cache once at start-up: gpu_memory_utilization x the memory CUDA reports, less the weights, the
activation peak of its profile run and the workspaces and CUDA graphs it counts. Where the cache binds (a large
model on few GPUs, long prompts, many users) the simulated TTFT follows this number, so it is checked here on the
start-up logs we found public with their settings stated. Validation only: nothing is fitted on these logs.

    python bench/kv_capacity.py --out results/kv_capacity.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from m2live.hardware import GIB, get_gpu  # noqa: E402
from m2live.serving_config import GPU_MEMORY_UTILIZATION, ServingConfig, kv_capacity  # noqa: E402
from m2live.shapes import ModelShape, get_model  # noqa: E402

# config.json fields m2live reads (Hugging Face: ByteDance-Seed/Seed-OSS-36B-Instruct, Qwen/Qwen2.5-14B-Instruct)
SEED_OSS_36B = ModelShape.from_config({
    "architectures": ["SeedOssForCausalLM"], "model_type": "llama", "hidden_size": 5120, "intermediate_size": 27648,
    "num_hidden_layers": 64, "num_attention_heads": 80, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 155136, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}, name="ByteDance-Seed/Seed-OSS-36B-Instruct")
QWEN25_14B = ModelShape.from_config({
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 13824,
    "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}, name="Qwen/Qwen2.5-14B-Instruct")

POINTS: list[dict] = [
    {
        "source": "public lab notes on GitHub ('Session 2' of a vLLM course's 01-baseline notes, 2026-10)",
        "vllm": "0.31.0", "model": get_model("meta-llama/Llama-3.1-8B"), "checkpoint": "meta-llama/Llama-3.1-8B-Instruct",
        "gpu": "NVIDIA A100-SXM4-80GB", "tp": 1, "precision": "bf16", "kv_bytes": 2,
        "utilization": 0.92, "utilization_stated": "the log: 'Desired GPU memory utilization is (0.92, 72.91 GiB)'",
        "max_num_batched_tokens": 2048, "max_num_seqs": 256,  # the API server's defaults on an A100
        "logged_kv_gib": 56.21, "logged_kv_tokens": 460496,
    },
    {
        "source": "public experiment notes on GitHub (Seed-OSS-36B-Instruct 128K serving profile, 2026-05-29)",
        "vllm": "not stated", "model": SEED_OSS_36B, "checkpoint": "ByteDance-Seed/Seed-OSS-36B-Instruct",
        "gpu": "NVIDIA A100-SXM4-80GB", "tp": 2, "precision": "bf16", "kv_bytes": 2,
        "utilization": 0.90, "utilization_stated": "the notes' configuration table",
        "max_num_batched_tokens": 8192, "max_num_seqs": 1,
        "logged_kv_gib": 35.99, "logged_kv_tokens": 294816,
    },
    {
        "source": "github.com server-sim (docs/example-runs/qwen2.5-14b-h100/README.md)",
        "vllm": "0.21.0", "model": QWEN25_14B, "checkpoint": "Qwen/Qwen2.5-14B-Instruct",
        "gpu": "NVIDIA H100 80GB HBM3", "tp": 1, "precision": "bf16", "kv_bytes": 2,
        "utilization": 0.90, "utilization_stated": "its serve command (--gpu-memory-utilization 0.90)",
        "max_num_batched_tokens": 8192, "max_num_seqs": 256,  # budget: the API server's default on an H100
        "logged_kv_gib": 41.43, "logged_kv_tokens": 226240,
    },
    {
        "source": "a public deployment guide on GitHub (LiteLLM on Kubernetes, 'Adding Models': Llama 3.3 70B on one "
                  "H100 with the vLLM Hopper recipe)",
        "vllm": "not stated", "model": get_model("meta-llama/Llama-3.1-70B"),
        "checkpoint": "nvidia/Llama-3.3-70B-Instruct-FP8 (Llama-3.1-70B's shapes)",
        "gpu": "NVIDIA H100 80GB HBM3", "tp": 1, "precision": "fp8", "kv_bytes": 1,  # --kv-cache-dtype fp8
        "utilization": None, "utilization_stated": "not stated (the default would leave less: see 'at_default')",
        "max_num_batched_tokens": 8192, "max_num_seqs": 8,
        "logged_kv_gib": 5.11, "logged_kv_tokens": 33504,
    },
]


def fit_gib(p: dict, utilization: float) -> tuple[float, int]:
    """(KV cache GiB, tokens) that ``simulate`` serves from at ``utilization`` (serving_config.kv_capacity)."""
    shard = replace(p["model"].sharded(p["tp"]), kv_dtype_bytes=p["kv_bytes"])
    fit = kv_capacity(get_gpu(p["gpu"]), shard, p["max_num_batched_tokens"], p["max_num_seqs"],
                      ServingConfig(concurrency=1, gpu_memory_utilization=utilization,
                                    # the log's release (its sampler's profile run); unstated: m2live's default
                                    vllm_version=None if p["vllm"] == "not stated" else p["vllm"]),
                      1, p["precision"])
    return max(0.0, fit.kv_bytes) / GIB, fit.kv_tokens


def run_point(p: dict) -> dict:
    out = {k: v for k, v in p.items() if k != "model"}
    out["model"] = p["model"].name
    if p["utilization"] is not None:
        gib, tokens = fit_gib(p, p["utilization"])
        out.update(fitted_kv_gib=round(gib, 2), fitted_kv_tokens=tokens,
                   error=round(gib / p["logged_kv_gib"] - 1.0, 4))
    else:  # the utilisation the logged cache implies, and what vLLM's default would have left
        gib, tokens = fit_gib(p, GPU_MEMORY_UTILIZATION)
        out["at_default"] = {"utilization": GPU_MEMORY_UTILIZATION, "fitted_kv_gib": round(gib, 2),
                             "fitted_kv_tokens": tokens}
        total = get_gpu(p["gpu"]).mem_bytes / GIB
        out["implied_utilization"] = round(GPU_MEMORY_UTILIZATION + (p["logged_kv_gib"] - gib) / total, 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/kv_capacity.json")
    args = ap.parse_args()
    points = [run_point(p) for p in POINTS]
    scored = [abs(p["error"]) for p in points if "error" in p]
    out = {"what": "m2live's KV-cache sizing against public vLLM start-up logs (settings stated); never fitted",
           "points": points,
           "summary": {"logs": len(scored), "mape": round(100 * sum(scored) / len(scored), 1),
                       "max_abs_error": round(100 * max(scored), 1)}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for p in points:
        tail = (f"fitted {p['fitted_kv_gib']:.2f} GiB ({100 * p['error']:+.1f} %)" if "error" in p else
                f"utilisation not stated: {p['at_default']['fitted_kv_gib']:.2f} GiB at the default, the log implies "
                f"{p['implied_utilization']}")
        print(f"{p['checkpoint']} on {p['tp']} x {p['gpu']}: logged {p['logged_kv_gib']:.2f} GiB, {tail}")
    print(f"MAPE {out['summary']['mape']} % over {out['summary']['logs']} logs; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
