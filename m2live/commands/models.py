"""List the model presets: the shapes m2live prices (from each model's config.json) and the names that reach them."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from ..shapes import PRESET_ALIASES, PRESETS, ModelShape


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="one object per preset in config.json's field names (a file of one of them, as config.json "
                        "in a directory, is a model every --model takes)")


def as_config(m: ModelShape) -> dict:
    """The preset in the fields of a Hugging Face config.json that ModelShape.from_config reads back to it."""
    model_type, arch = (("qwen3", "Qwen3ForCausalLM") if m.qk_norm else ("qwen2", "Qwen2ForCausalLM") if m.qkv_bias
                        else ("mistral", "MistralForCausalLM") if "mistral" in m.name.lower()
                        else ("llama", "LlamaForCausalLM"))
    return {
        "name": m.name,
        "architectures": [arch], "model_type": model_type,
        "hidden_size": m.hidden, "intermediate_size": m.intermediate, "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim,
        "vocab_size": m.vocab, "tie_word_embeddings": m.tied_embeddings,
        "max_position_embeddings": m.max_context, "torch_dtype": "bfloat16",
        "parameters_b": round(m.param_count() / 1e9, 2),
    }


def run(args: argparse.Namespace) -> int:
    aliases: dict[str, list[str]] = {}
    for alias, target in PRESET_ALIASES.items():
        aliases.setdefault(target, []).append(alias)
    if args.json:
        print(json.dumps([as_config(m) for m in PRESETS.values()], indent=2))
        return 0
    t = Table(title="m2live model presets (config.json shapes; an instruct tune or fp8 checkpoint of one, e.g. "
                    "RedHatAI/Meta-Llama-3.1-70B-Instruct-FP8, resolves to it; any dense decoder's config.json works)")
    for col in ("preset", "params B", "layers", "hidden", "FFN", "heads / KV", "head dim", "vocab", "context",
                "also"):
        t.add_column(col)
    for m in PRESETS.values():
        extras = [w for w, on in (("tied LM head", m.tied_embeddings), ("qkv bias", m.qkv_bias),
                                  ("q/k norm", m.qk_norm)) if on]
        t.add_row(m.name, f"{m.param_count() / 1e9:.2f}", str(m.layers), str(m.hidden), str(m.intermediate),
                  f"{m.heads} / {m.kv_heads}", str(m.head_dim), str(m.vocab),
                  "-" if m.max_context is None else str(m.max_context),
                  ", ".join([*aliases.get(m.name, []), *extras]))
    Console(width=200).print(t)
    return 0
