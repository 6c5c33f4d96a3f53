"""Model shapes: a Llama-style decoder (GQA, gated MLP, tied or untied LM head; Qwen3's per-head q/k RMSNorm and
explicit head_dim) from a HF config or a preset."""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from .hardware import norm_name

# A config.json dimension (hidden size, heads, layers, vocabulary, ...) past this is a broken file, not a model: the
# largest published decoders are ~50k wide with ~250k-entry vocabularies (2**24 = 16.8 M)
MAX_DIM = 1 << 24


class ModelShapeError(ValueError):
    """A config that is not a usable decoder shape (missing fields, wrong types, not a decoder, bad TP)."""


# Architectures we know are Llama-style decoders: RMSNorm, RoPE, GQA attention, gated-SiLU MLP.
DECODER_ARCHS = {
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
    "GemmaForCausalLM", "Phi3ForCausalLM", "InternLM2ForCausalLM", "GraniteForCausalLM", "CohereForCausalLM",
    "Olmo2ForCausalLM", "OlmoForCausalLM", "StableLmForCausalLM",
}
# HF ``model_type`` values whose layers are that dense decoder (a config naming another one is refused: mixture-
# of-experts, state-space and multi-latent-attention models have other operators). Qwen3 adds a per-head
# RMSNorm on q and k before RoPE and states head_dim explicitly (Qwen3-32B: 64 x 128 = 8192 != hidden 5120).
DENSE_MODEL_TYPES = {
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "internlm2", "granite", "cohere", "olmo",
    "olmo2", "stablelm",
}
# StarCoder2's MLP is not gated (c_fc -> GELU -> c_proj: one up projection of intermediate_size, not two), so the
# gated shape would price its up projection twice: refused, as other layer kinds are (until 2026-12-07 it was taken)
UNGATED_MODEL_TYPES = {"starcoder2", "gpt_bigcode", "gpt2", "gpt_neox", "falcon", "bloom", "opt", "phi", "gptj",
                       "mpt", "gpt_neo", "codegen"}
UNGATED_ARCHS = {"Starcoder2ForCausalLM", "GPTBigCodeForCausalLM", "GPTNeoXForCausalLM", "FalconForCausalLM",
                 "BloomForCausalLM", "OPTForCausalLM", "PhiForCausalLM", "GPTJForCausalLM", "MptForCausalLM",
                 "GPTNeoForCausalLM", "CodeGenForCausalLM"}
# keys a mixture-of-experts config carries (Mixtral, Qwen2/3-MoE, DeepSeek, GPT-OSS, ...): its layers route each
# token to a few of many expert MLPs, which the dense shape does not price, whatever model_type or architectures say
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
QK_NORM_MODEL_TYPES = {"qwen3"}
# model types whose usual tokenizers add no BOS to a prompt (Qwen's: bos_token null; Granite's and StableLM's
# GPT-2 / NeoX-style ones); a tokenizer_config.json beside the config says for itself (add_bos_token)
NO_BOS_MODEL_TYPES = {"qwen2", "qwen3", "granite", "stablelm"}


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    dtype_bytes: int = 2  # bf16 weights and activations
    tp: int = 1  # tensor-parallel degree this shape is sharded for
    kv_dtype_bytes: int = 0  # bytes per KV-cache element; 0: dtype_bytes (vLLM's kv_cache_dtype "auto")
    # the longest request (prompt + output) vLLM serves it with: the config's context length as vLLM derives it
    # (``context_length``); a --max-model-len past it is refused at start-up. None: not stated
    max_context: int | None = None
    # tokens the model's tokenizer adds to every prompt (its BOS; ``num_special_tokens_to_add()``): vLLM's random
    # benchmark dataset samples a prompt's length less these and the server adds them back. 1 for Llama, Mistral
    # and Gemma tokenizers; Qwen2 and Qwen3 tokenizers add none
    prompt_special_tokens: int = 1
    # the attention window a config.json states and uses (Mistral 7B v0.1, Gemma 2's local layers, Phi-3): NOT priced
    # — m2live prices full attention and a full-length KV cache, an overestimate past the window (simulate says so)
    sliding_window: int | None = None

    # --- per-GPU (sharded) dimensions --------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def heads_per_gpu(self) -> int:
        return self.heads // self.tp

    @property
    def kv_heads_per_gpu(self) -> int:
        # vLLM replicates KV heads when tp > kv_heads
        return max(1, self.kv_heads // self.tp)

    def gemms(self) -> dict[str, tuple[int, int]]:
        """Per-layer projection GEMMs on one GPU as op -> (N, K); Y[M,N] = X[M,K] @ W[N,K]^T."""
        d, t = self.head_dim, self.tp
        return {
            "qkv": ((self.heads_per_gpu + 2 * self.kv_heads_per_gpu) * d, self.hidden),
            "o": (self.hidden, self.heads_per_gpu * d),
            "gate_up": (2 * self.intermediate // t, self.hidden),
            "down": (self.hidden, self.intermediate // t),
        }

    @property
    def lm_head(self) -> tuple[int, int]:
        """(N, K) of the LM head on one GPU (vocab-parallel)."""
        return (-(-self.vocab // self.tp), self.hidden)

    # --- sizes -------------------------------------------------------------------------------------
    def layer_weight_bytes(self, precision: str = "bf16") -> int:
        """The four projections' weights of one layer on one GPU: 1 byte each under fp8 (W8A8), else bf16."""
        return sum(n * k for n, k in self.gemms().values()) * (1 if precision == "fp8" else self.dtype_bytes)

    def weight_bytes(self, precision: str = "bf16") -> int:
        """Weights resident on one GPU: layers + embedding + (untied) LM head shard + norms. Under fp8 only the
        projections hold 1 byte per weight: vLLM keeps the embedding, the LM head and the norms in bf16."""
        emb = self.vocab * self.hidden * self.dtype_bytes // self.tp
        head = 0 if self.tied_embeddings else emb
        norms = (2 * self.layers + 1) * self.hidden * self.dtype_bytes
        if self.qk_norm:
            norms += 2 * self.layers * self.head_dim * self.dtype_bytes  # q_norm and k_norm: one head_dim each
        return self.layers * self.layer_weight_bytes(precision) + emb + head + norms

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token on one GPU, all layers (K and V)."""
        return 2 * self.layers * self.kv_heads_per_gpu * self.head_dim * (self.kv_dtype_bytes or self.dtype_bytes)

    def param_count(self) -> int:
        full = replace(self, tp=1)
        return full.weight_bytes() // self.dtype_bytes

    def sharded(self, tp: int) -> ModelShape:
        """The shape one GPU holds under tensor parallelism ``tp`` (column/row sharding as vLLM does)."""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ModelShapeError(f"tensor-parallel size must be a positive integer, got {tp!r}")
        if self.heads % tp:
            raise ModelShapeError(f"TP={tp} does not divide the {self.heads} attention heads of {self.name}")
        if self.kv_heads % tp and tp % self.kv_heads:
            raise ModelShapeError(f"TP={tp} neither divides nor is a multiple of the {self.kv_heads} KV heads")
        if self.intermediate % tp:
            raise ModelShapeError(f"TP={tp} does not divide the intermediate size {self.intermediate}")
        return replace(self, tp=tp)

    # --- construction ------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: dict, name: str = "custom") -> ModelShape:
        if not isinstance(cfg, dict):
            raise ModelShapeError("config.json must hold a JSON object")
        if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrappers keep the LM inside
            if not isinstance(cfg["text_config"], dict):
                raise ModelShapeError(f"{name}: text_config must be a JSON object, got {cfg['text_config']!r:.60}")
            cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ModelShapeError(f"{name}: architectures must be a list of class names, got {archs!r:.60}")
        model_type = cfg.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            raise ModelShapeError(f"{name}: model_type must be a string, got {model_type!r:.60}")
        if model_type is not None and model_type not in DENSE_MODEL_TYPES:
            why = " (its MLP is not gated)" if model_type in UNGATED_MODEL_TYPES else ""
            raise ModelShapeError(f"{name}: model_type {model_type!r} is not a supported dense decoder{why} (one of "
                                  f"{', '.join(sorted(DENSE_MODEL_TYPES))})")
        if any(a in UNGATED_ARCHS for a in archs):
            raise ModelShapeError(f"{name}: {next(a for a in archs if a in UNGATED_ARCHS)}'s MLP is not gated: m2live "
                                  "prices gated-MLP decoders (Llama, Mistral, Qwen, ...)")
        experts = [k for k in MOE_KEYS if cfg.get(k) not in (None, 0, 1, False)]
        if experts:
            raise ModelShapeError(f"{name}: a mixture-of-experts config ({experts[0]} = {cfg[experts[0]]!r:.20}): m2live "
                                  "prices dense decoders only")
        if cfg.get("is_encoder_decoder") or (archs and not any(a in DECODER_ARCHS or a.endswith("ForCausalLM")
                                                                for a in archs)):
            raise ModelShapeError(f"{name}: not a decoder-only causal LM (architectures={archs})")
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ModelShapeError(f"{name}: config is missing {', '.join(missing)}")

        def pos_int(key: str, value) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelShapeError(f"{name}: {key} must be a positive integer, got {value!r:.60}")
            if value > MAX_DIM:
                raise ModelShapeError(f"{name}: {key} {value:.3g} is past any model m2live prices (at most {MAX_DIM})")
            return value

        hidden = pos_int("hidden_size", cfg["hidden_size"])
        heads = pos_int("num_attention_heads", cfg["num_attention_heads"])
        kv = pos_int("num_key_value_heads", cfg.get("num_key_value_heads", heads))
        head_dim = cfg.get("head_dim") or (hidden // heads)
        head_dim = pos_int("head_dim", head_dim)
        if heads % kv:
            raise ModelShapeError(f"{name}: {heads} attention heads not a multiple of {kv} KV heads")
        return cls(
            name=name,
            hidden=hidden,
            intermediate=pos_int("intermediate_size", cfg["intermediate_size"]),
            layers=pos_int("num_hidden_layers", cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=kv,
            head_dim=head_dim,
            vocab=pos_int("vocab_size", cfg["vocab_size"]),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2's attention always has q/k/v biases (its config.json states no attention_bias)
            qkv_bias=bool(cfg.get("attention_bias", False)) or model_type == "qwen2" or "Qwen2ForCausalLM" in archs,
            qk_norm=model_type in QK_NORM_MODEL_TYPES or "Qwen3ForCausalLM" in archs,
            max_context=context_length(cfg),
            sliding_window=_used_window(cfg),
            prompt_special_tokens=0 if model_type in NO_BOS_MODEL_TYPES or any(
                a in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") for a in archs) else 1,
        )

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> ModelShape:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ModelShapeError(f"no config.json at {path}")
        try:
            cfg = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
            raise ModelShapeError(f"{p}: not readable JSON ({e.__class__.__name__}: {str(e)[:120]})") from None
        shape = cls.from_config(cfg, name=str(path))
        bos = _adds_bos(p.parent / "tokenizer_config.json")
        return shape if bos is None else replace(shape, prompt_special_tokens=int(bos))


def _adds_bos(path: Path) -> bool | None:
    """A tokenizer_config.json's ``add_bos_token`` (whether the tokenizer puts a BOS before every prompt); None
    where the file is absent, unreadable or does not say."""
    try:
        v = json.loads(path.read_text()).get("add_bos_token")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        return None
    return v if isinstance(v, bool) else None


MAX_CONTEXT = 1 << 40  # tokens: a stated context this long or longer is no limit (m2live's requests are < 2**30)
# config.json keys that state a context length, as vLLM 0.32 reads them (model_arch_config_convertor.py,
# derive_max_model_len_and_key): the smallest present counts, and Command-R's model_max_length wins when given
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE scalings whose config already states the scaled length (config/model.py, _get_and_verify_max_len); any other
# with a ``factor`` (linear, dynamic) multiplies it
ROPE_PRESCALED = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"})


def context_length(cfg: dict) -> int | None:
    """The longest sequence vLLM serves a config.json's model with (its derived max_model_len; a tokenizer
    config's model_max_length, which vLLM also reads, is not looked at): None where no key states one."""
    lengths = [v for k in CONTEXT_KEYS if isinstance(v := cfg.get(k), (int, float)) and not isinstance(v, bool)
               and v > 0]
    if not lengths:
        return None
    length = float(cfg["model_max_length"]) if cfg.get("model_max_length") in lengths else float(min(lengths))
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if isinstance(rope, dict) and "gemma3" not in str(cfg.get("model_type")):
        kind = rope.get("rope_type") or rope.get("type")
        factor = rope.get("factor")
        if kind not in ROPE_PRESCALED and isinstance(factor, (int, float)) and factor > 0:
            length *= factor
    # a length past anything servable (or not finite) limits nothing
    return int(length) if math.isfinite(length) and length < MAX_CONTEXT else None


def _used_window(cfg: dict) -> int | None:
    """The sliding window a config states and uses: ``sliding_window`` unless ``use_sliding_window`` is false (Qwen2
    and Qwen3 state a window they do not use) or the window covers the whole context."""
    w = cfg.get("sliding_window")
    if isinstance(w, bool) or not isinstance(w, int) or w <= 0 or cfg.get("use_sliding_window") is False:
        return None
    ctx = context_length(cfg)
    return None if ctx is not None and w >= ctx else w


# Presets (numbers from each model's published config.json on the Hugging Face hub; max_context its
# max_position_embeddings).
PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("meta-llama/Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128, 128256, max_context=131072),
        ModelShape("meta-llama/Llama-3.1-70B", 8192, 28672, 80, 64, 8, 128, 128256, max_context=131072),
        ModelShape("meta-llama/Llama-3.2-1B", 2048, 8192, 16, 32, 8, 64, 128256, tied_embeddings=True,
                   max_context=131072),
        ModelShape("meta-llama/Llama-2-7b-hf", 4096, 11008, 32, 32, 32, 128, 32000, max_context=4096),
        ModelShape("meta-llama/Meta-Llama-3-8B", 4096, 14336, 32, 32, 8, 128, 128256, max_context=8192),
        # the base model's 131072 (Qwen2.5-7B-Instruct's config.json states 32768: INSTRUCT_CONTEXT)
        ModelShape("Qwen/Qwen2.5-7B", 3584, 18944, 28, 28, 4, 128, 152064, qkv_bias=True, max_context=131072,
                   prompt_special_tokens=0),
        ModelShape("mistralai/Mistral-7B-v0.3", 4096, 14336, 32, 32, 8, 128, 32768, max_context=32768),
        # Qwen3 (config.json of Qwen/Qwen3-8B and Qwen/Qwen3-32B: head_dim 128 given explicitly, untied LM head)
        ModelShape("Qwen/Qwen3-8B", 4096, 12288, 36, 32, 8, 128, 151936, qk_norm=True, max_context=40960,
                   prompt_special_tokens=0),
        ModelShape("Qwen/Qwen3-32B", 5120, 25600, 64, 64, 8, 128, 151936, qk_norm=True, max_context=40960,
                   prompt_special_tokens=0),
        # more of the dense Llama / Qwen2.5 / Qwen3 families vLLM users serve (config.json of each Hugging Face id;
        # Qwen2.5 base models state 131072, their -Instruct tunes 32768; the 3B and 0.5B 32768 both)
        ModelShape("meta-llama/Llama-3.2-3B", 3072, 8192, 28, 24, 8, 128, 128256, tied_embeddings=True,
                   max_context=131072),
        ModelShape("meta-llama/Llama-3.1-405B", 16384, 53248, 126, 128, 8, 128, 128256, max_context=131072),
        ModelShape("Qwen/Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 64, 151936, qkv_bias=True, tied_embeddings=True,
                   max_context=32768, prompt_special_tokens=0),
        ModelShape("Qwen/Qwen2.5-3B", 2048, 11008, 36, 16, 2, 128, 151936, qkv_bias=True, tied_embeddings=True,
                   max_context=32768, prompt_special_tokens=0),
        ModelShape("Qwen/Qwen2.5-14B", 5120, 13824, 48, 40, 8, 128, 152064, qkv_bias=True, max_context=131072,
                   prompt_special_tokens=0),
        ModelShape("Qwen/Qwen2.5-32B", 5120, 27648, 64, 40, 8, 128, 152064, qkv_bias=True, max_context=131072,
                   prompt_special_tokens=0),
        ModelShape("Qwen/Qwen2.5-72B", 8192, 29568, 80, 64, 8, 128, 152064, qkv_bias=True, max_context=131072,
                   prompt_special_tokens=0),
        ModelShape("Qwen/Qwen3-0.6B", 1024, 3072, 28, 16, 8, 128, 151936, qk_norm=True, tied_embeddings=True,
                   max_context=40960, prompt_special_tokens=0),
        ModelShape("Qwen/Qwen3-4B", 2560, 9728, 36, 32, 8, 128, 151936, qk_norm=True, tied_embeddings=True,
                   max_context=40960, prompt_special_tokens=0),
        ModelShape("Qwen/Qwen3-14B", 5120, 17408, 40, 40, 8, 128, 151936, qk_norm=True, max_context=40960,
                   prompt_special_tokens=0),
    )
}


# Checkpoints of a preset's architecture under other names (same config.json shapes): Llama 3.3 70B is Llama 3.1
# 70B's architecture (hidden 8192, 80 layers, 64 / 8 heads, FFN 28672, vocabulary 128256 in both config.json files).
PRESET_ALIASES: dict[str, str] = {"Llama-3.3-70B": "meta-llama/Llama-3.1-70B"}
# Words of a Hugging Face id that name a fine-tune or an fp8 re-quantisation of the same architecture — the chat /
# instruct tunes, the base tag, Meta's older "Meta-Llama-3.1" spelling, fp8 checkpoints (RedHatAI / neuralmagic
# "-FP8", "-FP8-dynamic"; nvidia "-FP8"; Qwen "-FP8"): a checkpoint id reduced by them that names a preset is that
# preset's shapes. The weights' format is the commands' business (quantization.model_weights: --precision when
# given, else the config.json's quantization_config or the id's "FP8"). Int4 checkpoints (AWQ, GPTQ, ...) are not
# reduced: m2live has no int4.
CHECKPOINT_WORDS = frozenset({"instruct", "chat", "it", "base", "hf", "fp8", "dynamic", "meta"})


# Instruct tunes whose config.json states a shorter context than their base model's (the length vLLM refuses a
# --max-model-len past): Qwen2.5's -Instruct checkpoints state 32768 where the base models state 131072 (their
# config.json files; YaRN rope scaling, which the model card describes for longer inputs, raises it where a
# config.json adds it, and a config.json given as the model is read as it is)
INSTRUCT_CONTEXT: dict[str, int] = {f"Qwen/Qwen2.5-{b}B": 32768 for b in ("7", "14", "32", "72")}


@functools.cache
def _instruct_shape(preset: str) -> ModelShape:
    """The preset's shape with its instruct tune's context and name (one object per preset, as a preset is one)."""
    return replace(PRESETS[preset], name=f"{preset}-Instruct", max_context=INSTRUCT_CONTEXT[preset])


def _id_words(name: str) -> list[str]:
    """The words of a model id's last part (after the last slash), lower case."""
    return re.split(r"[-_\s]", name.split("/")[-1].lower())


def _arch_key(name: str) -> str:
    """A model id reduced to its architecture: the part after the last slash, without CHECKPOINT_WORDS."""
    return norm_name("".join(w for w in _id_words(name) if w not in CHECKPOINT_WORDS))


def _arch_index() -> dict[str, ModelShape]:
    """Architecture key -> preset, for the presets' own names and PRESET_ALIASES; two names of one key must be
    one preset."""
    index: dict[str, ModelShape] = {}
    for name, target in (*((n, n) for n in PRESETS), *PRESET_ALIASES.items()):
        key = _arch_key(name)
        if index.setdefault(key, PRESETS[target]) is not PRESETS[target]:
            raise ImportError(f"preset names {name!r} and {index[key].name!r} reduce to one architecture key")
    return index


_ARCH_INDEX = _arch_index()


def get_model(model: str | os.PathLike | ModelShape) -> ModelShape:
    """A preset name (full or the part after the slash, case-insensitive), a checkpoint of a preset's architecture
    (``meta-llama/Llama-3.1-70B-Instruct``, ``RedHatAI/Meta-Llama-3.1-70B-Instruct-FP8``, ``Qwen/Qwen3-32B-FP8``:
    CHECKPOINT_WORDS, PRESET_ALIASES), or a path to config.json / a model dir."""
    if isinstance(model, ModelShape):
        return model
    s = str(model)
    if os.path.exists(s):
        return ModelShape.from_path(s)
    key = _arch_key(s)
    shape = _ARCH_INDEX.get(key)
    if shape is not None:
        tuned = shape.name in INSTRUCT_CONTEXT and "instruct" in _id_words(s)
        return _instruct_shape(shape.name) if tuned else shape
    close = sorted(PRESETS, key=lambda n: -difflib.SequenceMatcher(None, key, _arch_key(n)).ratio())[:3]
    raise ModelShapeError(
        f"unknown model {s!r}: not a file or directory, and not a preset or a checkpoint of one (closest: "
        f"{', '.join(close)}; `m2live models` lists them all; a config.json of any dense decoder works)"
    )
