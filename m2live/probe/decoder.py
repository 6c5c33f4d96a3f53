"""The probe's whole-step workload: a Llama-shaped decoder in plain torch (random bf16 weights, contiguous KV
cache, SDPA attention), built on a ``_Device``. torch comes from the device, never from an import here."""

from __future__ import annotations

from typing import Any

from ..shapes import ModelShape
from .device import _Device
from .kernels import Scope, no_scopes
from .plan import StepSpec


class TorchDecoder:
    """A Llama-style decoder in plain torch: RMSNorm, fused qkv, RoPE, GQA attention with SDPA over a contiguous
    KV cache, o, RMSNorm, fused gate_up, SiLU*up, down, residual adds; final norm + LM head on the sampled
    tokens. Weights are random bf16 (timing does not depend on their values)."""

    def __init__(self, dev: _Device, shape: ModelShape, layers: int, max_pos: int, seed: int = 0):
        torch = dev.torch
        self.dev, self.torch, self.shape, self.layers = dev, torch, shape, layers
        self.F = torch.nn.functional
        h, d = shape.hidden, shape.head_dim
        self.h, self.hq, self.kv, self.d = h, shape.heads, shape.kv_heads, d
        self.group = shape.heads // shape.kv_heads
        g = torch.Generator(device=dev.device).manual_seed(seed)

        def w(*size: int) -> Any:
            return (torch.randn(*size, generator=g, device=dev.device, dtype=dev.dtype) * 0.02)

        qkv_n, o_k = shape.gemms()["qkv"][0], shape.heads * d
        self.w = [
            {"ln1": torch.ones(h, device=dev.device, dtype=dev.dtype), "qkv": w(qkv_n, h), "o": w(h, o_k),
             "ln2": torch.ones(h, device=dev.device, dtype=dev.dtype),
             "gate_up": w(2 * shape.intermediate, h), "down": w(h, shape.intermediate)}
            for _ in range(layers)
        ]
        self.emb = w(shape.vocab, h)
        self.lm = self.emb if shape.tied_embeddings else w(shape.vocab, h)
        self.norm = torch.ones(h, device=dev.device, dtype=dev.dtype)
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev.device, dtype=torch.float32) / d))
        ang = torch.outer(torch.arange(max_pos, device=dev.device, dtype=torch.float32), inv)
        self.cos, self.sin = ang.cos().to(dev.dtype), ang.sin().to(dev.dtype)
        try:
            from torch.nn.attention.bias import causal_lower_right
            self.causal_lower_right = causal_lower_right
        except ImportError:  # older torch: an explicit boolean mask does the same
            self.causal_lower_right = None

    def rms(self, x: Any, weight: Any) -> Any:
        F = self.F
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), weight, 1e-5)
        xf = x.float()
        return (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * weight

    def rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = self.d // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    # ---- inputs for one step -------------------------------------------------------------------------
    def inputs(self, spec: StepSpec, seed: int = 0) -> dict[str, Any]:
        """Token ids, positions, KV caches (random past), sampled-token rows: fixed tensors, so the step can
        be captured in a CUDA graph."""
        torch, dev = self.torch, self.dev
        g = torch.Generator(device=dev.device).manual_seed(seed)
        pos: list[int] = []
        sample: list[int] = []
        for n, c in spec.prefills:
            pos += range(c, c + n)
            sample.append(len(pos) - 1)
        b, ctx = spec.decode_batch, spec.decode_ctx
        pos += [ctx] * b
        sample += range(len(pos) - b, len(pos))
        T = len(pos)

        def cache(batch: int, length: int) -> Any:
            return torch.randn(batch, self.kv, length, self.d, generator=g, device=dev.device, dtype=dev.dtype)

        layers = []
        for _ in range(self.layers):
            pre = [(cache(1, n + c), cache(1, n + c)) for n, c in spec.prefills]
            dec = (cache(b, ctx + 1), cache(b, ctx + 1)) if b else None
            layers.append({"pre": pre, "dec": dec})
        positions = torch.tensor(pos, device=dev.device, dtype=torch.long)
        return {
            "spec": spec, "T": T,
            "ids": torch.randint(0, self.shape.vocab, (T,), generator=g, device=dev.device),
            "cos": self.cos[positions].unsqueeze(1), "sin": self.sin[positions].unsqueeze(1),
            "sample": torch.tensor(sample, device=dev.device, dtype=torch.long),
            "layers": layers,
        }

    # ---- forward ---------------------------------------------------------------------------------------
    def _attention(self, q: Any, k: Any, v: Any, lay: dict, spec: StepSpec, scope: Scope = no_scopes) -> Any:
        outs = []
        if spec.prefills:
            with scope("attn_prefill"):
                outs = self._prefill_attention(q, k, v, lay, spec)
        if spec.decode_batch:
            with scope("attn_decode"):
                outs.append(self._decode_attention(q, k, v, lay, spec))
        if len(outs) == 1:
            return outs[0]
        with scope("light"):  # the mixed step's outputs joined (a copy vLLM's attention writes in place)
            return self.torch.cat(outs, dim=0)

    def _prefill_attention(self, q: Any, k: Any, v: Any, lay: dict, spec: StepSpec) -> list[Any]:
        F, torch = self.F, self.torch
        hq, d, G = self.hq, self.d, self.group
        outs = []
        off = 0
        for (n, c), (kc, vc) in zip(spec.prefills, lay["pre"], strict=True):
            kc[0, :, c:c + n].copy_(k[off:off + n].transpose(0, 1))  # KV-cache write
            vc[0, :, c:c + n].copy_(v[off:off + n].transpose(0, 1))
            qj = q[off:off + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            # KV heads repeated to the query heads (a copy of ~(n+c)*H*D*4 bytes, <1 % of the attention) so that
            # every torch version dispatches plain MHA FlashAttention; causal aligned bottom-right over the cache
            kx, vx = kc.repeat_interleave(G, dim=1), vc.repeat_interleave(G, dim=1)
            if c == 0:
                o = F.scaled_dot_product_attention(qj, kx, vx, is_causal=True)
            elif self.causal_lower_right is not None:
                o = F.scaled_dot_product_attention(qj, kx, vx, attn_mask=self.causal_lower_right(n, n + c))
            else:
                mask = torch.ones(n, n + c, device=q.device, dtype=torch.bool).tril(diagonal=c)
                o = F.scaled_dot_product_attention(qj, kx, vx, attn_mask=mask)
            outs.append(o[0].transpose(0, 1).reshape(n, hq * d))
            off += n
        return outs

    def _decode_attention(self, q: Any, k: Any, v: Any, lay: dict, spec: StepSpec) -> Any:
        b, ctx = spec.decode_batch, spec.decode_ctx
        off = sum(n for n, _ in spec.prefills)  # the decode tokens follow the prefill chunks
        kd, vd = lay["dec"]
        kd[:, :, ctx].copy_(k[off:off + b])  # KV-cache write of the new token
        vd[:, :, ctx].copy_(v[off:off + b])
        # GQA for one query token: the G query heads of a KV head act as G query rows against its cache
        qd = q[off:off + b].reshape(b, self.kv, self.group, self.d)
        o = self.F.scaled_dot_product_attention(qd, kd, vd)
        return o.reshape(b, self.hq * self.d)

    def forward(self, inp: dict, scope: Scope = no_scopes) -> Any:
        """One step. ``scope(name)`` wraps each operator (named as ``Predictor``'s ops: qkv, o, gate_up, down,
        lm_head, attn_prefill, attn_decode, light) for the profiler (``kernels.scopes``); none by default."""
        F = self.F
        spec: StepSpec = inp["spec"]
        T, hq, kvh, d = inp["T"], self.hq, self.kv, self.d
        with scope("light"):
            x = F.embedding(inp["ids"], self.emb)
        for w, lay in zip(self.w, inp["layers"], strict=True):
            with scope("light"):
                h = self.rms(x, w["ln1"])
            with scope("qkv"):
                qkv = F.linear(h, w["qkv"])
            with scope("light"):
                q = self.rope(qkv[:, : hq * d].view(T, hq, d), inp["cos"], inp["sin"])
                k = self.rope(qkv[:, hq * d:(hq + kvh) * d].view(T, kvh, d), inp["cos"], inp["sin"])
                v = qkv[:, (hq + kvh) * d:].view(T, kvh, d)
            a = self._attention(q, k, v, lay, spec, scope)
            with scope("o"):
                y = F.linear(a, w["o"])
            with scope("light"):
                x = x + y
                h = self.rms(x, w["ln2"])
            with scope("gate_up"):
                gate, up = F.linear(h, w["gate_up"]).chunk(2, dim=-1)
            with scope("light"):
                h = F.silu(gate) * up
            with scope("down"):
                y = F.linear(h, w["down"])
            with scope("light"):
                x = x + y
        with scope("light"):
            xs = self.rms(x.index_select(0, inp["sample"]), self.norm)
        with scope("lm_head"):
            return F.linear(xs, self.lm)
