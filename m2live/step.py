"""One engine step: the work a vLLM scheduler hands the model runner.

A step is a list of sequences, each contributing ``new`` tokens on top of ``ctx`` tokens already in its KV
cache. A sequence with one new token and a non-empty cache is a decode; anything else is a prefill chunk
(a first chunk has ``ctx == 0``; a later chunk of a chunked prefill has ``ctx > 0``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .limits import CONTEXT_TOKENS, NEW_TOKENS, STEP_SEQS

_MAX_NEW, _MAX_CTX = int(NEW_TOKENS.hi), int(CONTEXT_TOKENS.hi)


class StepError(ValueError):
    """A step description that cannot be a real engine step (negative, zero or non-integer counts)."""


def _count(value: object, what: str, minimum: int, maximum: int = _MAX_CTX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise StepError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise StepError(f"{what} must be >= {minimum}, got {value}")
    if value > maximum:
        shown = value if value < 1e15 else f"{float(value):.3g}"
        raise StepError(f"{what} must be <= {maximum} (m2live.limits), got {shown}")
    return value


@dataclass(frozen=True)
class Step:
    """The batch of one engine step.

    ``seqs``: ``(new_tokens, tokens_already_in_kv_cache)`` per sequence.
    ``prefill``: optional per-sequence flags; when given they override the shape rule (vLLM knows a
    one-token final prefill chunk is still a prefill).
    """

    seqs: tuple[tuple[int, int], ...]
    prefill: tuple[bool, ...] | None = field(default=None)

    def __init__(self, seqs, prefill=None) -> None:
        clean = []
        for i, item in enumerate(seqs):
            try:
                new, ctx = item
            except (TypeError, ValueError):
                raise StepError(f"sequence {i}: expected (new_tokens, context), got {item!r}") from None
            if (type(new) is not int or type(ctx) is not int or new < 1 or ctx < 0 or new > _MAX_NEW
                    or ctx > _MAX_CTX):  # slow path: say why
                new = _count(new, f"sequence {i} new tokens", 1, _MAX_NEW)
                ctx = _count(ctx, f"sequence {i} context", 0)
            clean.append((new, ctx))
        object.__setattr__(self, "seqs", tuple(clean))
        if prefill is not None:
            flags = tuple(bool(f) for f in prefill)
            if len(flags) != len(clean):
                raise StepError(f"prefill flags: {len(flags)} given for {len(clean)} sequences")
            object.__setattr__(self, "prefill", flags)
        else:
            object.__setattr__(self, "prefill", None)
            flags = tuple(new > 1 or ctx == 0 for new, ctx in clean)
        self._split(flags)

    def _split(self, flags: tuple[bool, ...]) -> None:
        """Split once into prefill / decode views: the predictor reads these on every call."""
        seqs = self.seqs
        object.__setattr__(self, "_pre", [s for s, f in zip(seqs, flags, strict=True) if f])
        object.__setattr__(self, "_dec", [ctx for (_, ctx), f in zip(seqs, flags, strict=True) if not f])
        object.__setattr__(self, "_tokens", sum(n for n, _ in seqs))

    @classmethod
    def trusted(cls, seqs: tuple[tuple[int, int], ...], prefill: tuple[bool, ...]) -> Step:
        """A step from counts that are already valid (vLLM's own scheduler counters), without re-checking
        every sequence: this runs on every engine step. Everything else goes through ``Step(...)``."""
        self = object.__new__(cls)
        object.__setattr__(self, "seqs", seqs)
        object.__setattr__(self, "prefill", prefill)
        self._split(prefill)
        return self

    # --- constructors -------------------------------------------------------------------------------
    @classmethod
    def build(cls, prefills=(), decodes=()) -> Step:
        """``prefills``: iterable of (chunk_len, ctx) or chunk_len; ``decodes``: iterable of context lengths."""
        seqs: list[tuple[int, int]] = []
        flags: list[bool] = []
        for p in prefills:
            chunk, ctx = (p, 0) if isinstance(p, int) else p
            seqs.append((chunk, ctx))
            flags.append(True)
        for ctx in decodes:
            seqs.append((1, _count(ctx, "decode context", 1)))
            flags.append(False)
        return cls(seqs, prefill=flags)

    @classmethod
    def from_counts(
        cls, prefill_tokens: int, prefill_kv_tokens: int, decode_reqs: int, decode_kv_tokens: int
    ) -> Step:
        """From the aggregate per-step fields upstream vLLM work uses (one prefill chunk, even decodes)."""
        prefill_tokens = _count(prefill_tokens, "prefill tokens", 0, _MAX_NEW)
        prefill_kv_tokens = _count(prefill_kv_tokens, "prefill KV tokens", 0)
        decode_reqs = _count(decode_reqs, "decode requests", 0, int(STEP_SEQS.hi))
        decode_kv_tokens = _count(decode_kv_tokens, "decode KV tokens", 0)
        prefills = [(prefill_tokens, prefill_kv_tokens)] if prefill_tokens else []
        decodes = []
        if decode_reqs:
            base, extra = divmod(decode_kv_tokens, decode_reqs)
            decodes = [max(1, base + (1 if i < extra else 0)) for i in range(decode_reqs)]
        return cls.build(prefills, decodes)

    # --- views --------------------------------------------------------------------------------------
    def is_prefill(self, i: int) -> bool:
        if self.prefill is not None:
            return self.prefill[i]
        new, ctx = self.seqs[i]
        return new > 1 or ctx == 0

    @property
    def prefill_seqs(self) -> list[tuple[int, int]]:
        """(chunk, context) of each prefill sequence."""
        return self._pre  # type: ignore[attr-defined]

    @property
    def decode_contexts(self) -> list[int]:
        """Context (tokens already cached) of each decoding sequence."""
        return self._dec  # type: ignore[attr-defined]

    @property
    def num_tokens(self) -> int:
        return self._tokens  # type: ignore[attr-defined]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, _ in self.prefill_seqs)

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode_contexts)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def counts(self) -> dict[str, int]:
        """The four aggregate fields (prefill tokens, prefill KV tokens, decode requests, decode KV tokens)."""
        pre = self.prefill_seqs
        dec = self.decode_contexts
        return {
            "prefill_tokens": sum(n for n, _ in pre),
            "prefill_kv_tokens": sum(c for _, c in pre),
            "decode_reqs": len(dec),
            "decode_kv_tokens": sum(dec),
        }

    def __len__(self) -> int:
        return len(self.seqs)
