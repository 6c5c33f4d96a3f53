"""The weights' format a served model runs with, as the predictor prices it: bf16, or vLLM's W8A8 fp8 linear layers.

``weight_format(quant_config, method)`` reads a checkpoint's ``quantization_config`` (HF config.json) and the
engine's quantization method (vLLM's ``ModelConfig.quantization``; ``--quantization``) and says which precision
the four projections' GEMMs run at and how their inputs are scaled:

- fp8, static input scales — checkpoints quantised with calibrated per-tensor activation scales: ``quant_method``
  ``fp8`` with ``activation_scheme: static``, ``modelopt`` with ``quant_algo: FP8`` (NVIDIA's FP8 checkpoints),
  ``compressed-tensors`` whose groups hold 8-bit float weights and inputs with ``dynamic: false``;
- fp8, dynamic input scales (a max reduction over each projection's input every step before quantising it):
  ``fp8`` with ``activation_scheme: dynamic`` (its default), ``fbgemm_fp8``, ``compressed-tensors`` 8-bit float
  inputs with ``dynamic: true`` (RedHat's FP8-dynamic checkpoints), and vLLM's online quantisation of a bf16
  checkpoint (``--quantization fp8`` / ``fp8_per_tensor``);
- anything else quantised (int4 / int8 weights, MXFP4, NVFP4, ...) is a kernel family m2live has no constants
  for: it is priced as bf16 weights, and ``why`` says so.

``model_weights(model)``: the same from a model as the commands take it (a checkpoint's config.json — or, for
ModelOpt exports before 0.31, the ``hf_quant_config.json`` beside it, as vLLM reads it — or its Hugging Face id's
"FP8"): ``predict``, ``simulate`` and ``rank`` use it when ``--precision`` is not given; ``model_kv_cache_dtype``
resolves their ``--kv-cache-dtype auto`` as vLLM 0.32 does (a ModelOpt checkpoint that names an fp8 KV cache
runs one).

numpy-free and vLLM-free: the plugin's adapter hands in what vLLM resolved.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

# vLLM's online fp8 quantisation of a bf16 checkpoint (``--quantization``; fp8_per_tensor is 0.32's name for it)
ONLINE_FP8 = frozenset({"fp8", "fp8_per_tensor"})


@dataclass(frozen=True)
class WeightFormat:
    precision: str = "bf16"  # "bf16" or "fp8" (W8A8: e4m3 weights and activations)
    act_scale: str = "static"  # fp8: "static" (the checkpoint's input scales) or "dynamic" (per step)
    why: str = "unquantised"  # one line: what the config said

    @property
    def label(self) -> str:
        return f"fp8 ({self.act_scale} input scales)" if self.precision == "fp8" else self.precision


def weight_format(quant_config: dict | None, method: str | None = None) -> WeightFormat:
    """The format of the linear layers' weights under a checkpoint's ``quantization_config`` and the engine's
    quantization ``method`` (None / "": none)."""
    qc = quant_config if isinstance(quant_config, dict) else {}
    qm = str(qc.get("quant_method") or method or "").strip().lower()
    if not qm:
        return WeightFormat()
    if not qc and qm in ONLINE_FP8:
        return WeightFormat("fp8", "dynamic", f"vLLM's online {qm} quantisation of bf16 weights")
    if qm == "fp8":
        scheme = str(qc.get("activation_scheme") or "dynamic").lower()
        block = " (per-block weight scales priced as per-tensor)" if qc.get("weight_block_size") else ""
        return WeightFormat("fp8", "static" if scheme == "static" else "dynamic",
                            f"fp8 checkpoint, {scheme} activation scales{block}")
    if qm == "fbgemm_fp8":
        return WeightFormat("fp8", "dynamic", "fbgemm_fp8 checkpoint (dynamic per-token input scales)")
    if qm == "modelopt":
        algo = str(qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo") or "").upper()
        if algo == "FP8":
            return WeightFormat("fp8", "static", "modelopt FP8 checkpoint (static input scales)")
        return _unmodelled(f"modelopt {algo or 'unknown algorithm'}")
    if qm == "compressed-tensors":
        return _compressed_tensors(qc)
    return _unmodelled(qm)


def _compressed_tensors(qc: dict) -> WeightFormat:
    """fp8 when every quantised group holds 8-bit float weights and 8-bit float inputs."""
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    if not groups:
        return _unmodelled("compressed-tensors without config_groups")
    dynamic = set()
    for g in groups:
        w, a = g.get("weights") or {}, g.get("input_activations") or {}
        if not (_is_fp8(w) and _is_fp8(a)):
            what = f"{w.get('type', '?')}{w.get('num_bits', '?')} weights, " + (
                f"{a.get('type', '?')}{a.get('num_bits', '?')} inputs" if a else "16-bit inputs")
            return _unmodelled(f"compressed-tensors {what}")
        dynamic.add(bool(a.get("dynamic", False)))
    scale = "dynamic" if True in dynamic else "static"
    return WeightFormat("fp8", scale, f"compressed-tensors fp8 weights and inputs ({scale} input scales)")


def _is_fp8(args: dict) -> bool:
    return str(args.get("type", "")).lower() == "float" and int(args.get("num_bits") or 0) == 8


def _unmodelled(what: str) -> WeightFormat:
    return WeightFormat("bf16", "static", f"{what}: not modelled, priced as bf16 weights")


# the spellings of the two precisions a command or a batch file may use (torch's dtype names, vLLM's fp8 format
# and scheme)
# fp16 weights (vLLM's --dtype float16) are priced as bf16: the same two bytes a weight and, on every GPU in the
# catalog, the same dense tensor rate with fp32 accumulation (GpuSpec.fp16_tflops == bf16_tflops)
PRECISION_SPELLINGS = {"bfloat16": "bf16", "fp16": "bf16", "float16": "bf16", "half": "bf16", "float8": "fp8",
                       "fp8_e4m3": "fp8", "e4m3": "fp8", "w8a8": "fp8", "fp8-static": "fp8", "fp8_static": "fp8"}
DYNAMIC_FP8_SPELLINGS = frozenset({"fp8-dynamic", "fp8_dynamic"})  # fp8 with per-step input scales


def precision_of(text: str) -> str:
    """bf16 or fp8 from one of their spellings (fp16 is priced as bf16); ValueError for anything else."""
    s = str(text).strip().lower()
    p = "fp8" if s in DYNAMIC_FP8_SPELLINGS else PRECISION_SPELLINGS.get(s, s)
    if p not in ("bf16", "fp8"):
        raise ValueError(f"precision must be bf16 or fp8 (or fp16, priced as bf16; fp8-dynamic), got {s!r:.40}")
    return p


def precision_given(text: object) -> str | None:
    """A precision as written (a flag, a batch cell), checked (``precision_of``); None where blank or "auto": the
    checkpoint's own."""
    s = "" if text is None else str(text).strip()
    if not s or s.lower() == "auto":
        return None
    precision_of(s)
    return s


def weights_for(precision: str | None, model: object, what: str = "--precision") -> WeightFormat:
    """The weights a command prices: ``precision`` when given (fp8 with static input scales, the checkpoints'
    usual), else what the model says of itself (``model_weights``)."""
    given = precision_given(precision)
    if given is None:
        return model_weights(model)
    p, s = precision_of(given), given.lower()
    if s in DYNAMIC_FP8_SPELLINGS:
        return WeightFormat(p, "dynamic", f"{what} fp8-dynamic")
    half = " (fp16, priced as bf16)" if s in ("fp16", "float16", "half") else ""
    return WeightFormat(p, "static", f"{what} {p}{half}")


# the quant_method vLLM 0.32 gives a ModelOpt export by its algorithm (model_arch_config_convertor)
MODELOPT_METHODS = {"FP8": "modelopt", "FP8_PER_CHANNEL_PER_TOKEN": "modelopt", "FP8_PB_WO": "modelopt",
                    "NVFP4": "modelopt_fp4"}


def _json_file(path: Path) -> object | None:
    """A JSON file's content; None where it is missing or unreadable."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError):
        return None


def checkpoint_quant_config(model: object) -> tuple[dict | None, str]:
    """A checkpoint's quantization config as vLLM 0.32 reads it (``transformers_utils/config.py``): config.json's
    ``quantization_config``, else the ``hf_quant_config.json`` beside it (ModelOpt before 0.31), with the
    ``quant_method`` vLLM gives a ModelOpt export that names its producer but no method
    (``model_arch_config_convertor``: "modelopt" for its FP8 algorithms). (None, "") for a model that is not a
    readable checkpoint on disk; else (the config or None, the file it came from)."""
    if not isinstance(model, (str, os.PathLike)):
        return None, ""
    path = Path(model) / "config.json" if Path(model).is_dir() else Path(model)
    cfg = _json_file(path)
    if cfg is None:
        return None, ""  # no file, or not JSON: get_model says what is wrong with it
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    where = path.name
    sidecar = path.parent / "hf_quant_config.json"
    if qc is None and sidecar.is_file():
        qc, where = _json_file(sidecar), sidecar.name
    if not isinstance(qc, dict):
        return None, path.name
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else {}
    producer = qc.get("producer") if isinstance(qc.get("producer"), dict) else {}
    algo = str(inner.get("quant_algo", "")).upper()
    if not qc.get("quant_method") and producer.get("name") == "modelopt" and algo in MODELOPT_METHODS:
        qc = {**qc, "quant_method": MODELOPT_METHODS[algo]}
    return qc, where


def model_weights(model: object) -> WeightFormat:
    """The weights' format a model given as the commands take it says of itself: a checkpoint on disk (its
    config.json, a path to it or to its directory) by its quantization config (``checkpoint_quant_config``); a
    Hugging Face id by its name — an "FP8" word is vLLM's fp8 (``-FP8-dynamic`` and Qwen's own ``-FP8``
    (``BLOCK_FP8_ORGS``): dynamic input scales; NVIDIA's and RedHat's plain ``-FP8``: static, calibrated ones); anything else (a preset, a ModelShape) bf16."""
    if not isinstance(model, (str, os.PathLike)):
        return WeightFormat()  # a ModelShape: shapes only
    s = str(model)
    qc, where = checkpoint_quant_config(model)
    if where:
        w = weight_format(qc)
        return replace(w, why=f"{where}: {w.why}") if qc else w
    words = set(re.split(r"[-_\s]", s.split("/")[-1].lower()))
    if "fp8" in words:
        org = s.split("/")[0].lower() if "/" in s else ""
        if org in BLOCK_FP8_ORGS:
            return WeightFormat("fp8", "dynamic", f"the checkpoint's name says FP8, and {s.split('/')[0]}'s FP8 "
                                "checkpoints scale inputs per step (128 x 128 weight blocks, priced as per-tensor)")
        scale = "dynamic" if "dynamic" in words else "static"
        return WeightFormat("fp8", scale, f"the checkpoint's name says FP8 ({scale} input scales)")
    return WeightFormat()


# Publishers whose own "-FP8" checkpoints are block-wise with dynamic input scales (config.json: quant_method fp8,
# activation_scheme dynamic, weight_block_size [128, 128]: Qwen's Qwen3 / Qwen3.5 FP8 releases), unlike NVIDIA's (modelopt) and RedHat's plain "-FP8" (static, calibrated input scales)
BLOCK_FP8_ORGS = frozenset({"qwen"})


# vLLM's --kv-cache-dtype values -> bytes per cache element ("auto": the model's dtype, None here)
KV_CACHE_BYTES: dict[str, int | None] = {"auto": None, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
                                         "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


# the commands' --kv-cache-dtype help: what "auto" resolves to (model_kv_cache_dtype)
KV_AUTO_HELP = ("vLLM's --kv-cache-dtype: auto (default: the model's dtype, or fp8 where a checkpoint directory's "
                "ModelOpt quantization config names an fp8 KV cache, as vLLM resolves it) or fp8")


def kv_cache_dtype_of(kv_cache_dtype: str | None) -> str:
    """A vLLM ``kv_cache_dtype`` as ``KV_CACHE_BYTES`` spells it (None or blank: "auto"); ValueError for a value
    vLLM's CUDA backend does not take."""
    key = str(kv_cache_dtype or "auto").strip().lower() or "auto"
    if key not in KV_CACHE_BYTES:
        raise ValueError(f"kv cache dtype must be one of {', '.join(KV_CACHE_BYTES)}, got {kv_cache_dtype!r}")
    return key


def kv_cache_bytes(kv_cache_dtype: str | None) -> int | None:
    """Bytes per KV-cache element of a vLLM ``kv_cache_dtype`` (None: "auto", the model's dtype)."""
    return KV_CACHE_BYTES[kv_cache_dtype_of(kv_cache_dtype)]


def checkpoint_kv_cache(quant_config: dict | None) -> str | None:
    """The KV-cache dtype a checkpoint's quantization config names, as vLLM 0.32 reads it
    (``utils/torch_utils.get_kv_cache_quant_algo_string``: ModelOpt exports only — ``kv_cache_scheme`` or
    ``kv_cache_quant_algo``, at the top or under ``quantization``): "fp8" for FP8 (or a static 8-bit float
    scheme); None where it names none, or one m2live does not price (NVFP4: the model's dtype is priced)."""
    qc = quant_config if isinstance(quant_config, dict) else {}
    if not str(qc.get("quant_method") or "").lower().startswith("modelopt"):
        return None
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = (inner.get("kv_cache_scheme") or qc.get("kv_cache_scheme") or inner.get("kv_cache_quant_algo")
            or qc.get("kv_cache_quant_algo"))
    if isinstance(algo, dict):
        algo = "fp8" if (algo.get("dynamic") is False and algo.get("num_bits") == 8
                         and str(algo.get("type", "")).lower() == "float") else None
    return "fp8" if isinstance(algo, str) and algo.strip().lower() == "fp8" else None


def model_kv_cache_dtype(kv_cache_dtype: str | None, model: object) -> tuple[str, str]:
    """The KV-cache dtype a command prices, and why: ``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``) unless it
    is "auto"; "auto" as vLLM 0.32 resolves it (``resolve_kv_cache_dtype_string``) — fp8 where the checkpoint on
    disk is a ModelOpt export that names an fp8 KV cache (NVIDIA's FP8 checkpoints may: vLLM then runs one without
    being asked), else the model's own dtype. A Hugging Face id alone says nothing of its KV cache: "auto"."""
    kv = kv_cache_dtype_of(kv_cache_dtype)
    if kv != "auto":
        return kv, f"--kv-cache-dtype {kv}"
    qc, where = checkpoint_quant_config(model)
    if checkpoint_kv_cache(qc) == "fp8":
        return "fp8", f"{where}: a ModelOpt checkpoint with an fp8 KV cache (vLLM's auto takes it)"
    return "auto", "the model's dtype"
