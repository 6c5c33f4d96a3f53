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

numpy-free and vLLM-free: the plugin's adapter hands in what vLLM resolved; ``simulate`` can read a config.json.
"""

from __future__ import annotations

from dataclasses import dataclass

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
