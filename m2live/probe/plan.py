"""What the probe measures: the GEMM cells (op x M, in a seeded random order), the representative engine steps,
and the timings of each mode (full, quick, dry run). Pure: no torch, no device."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..shapes import ModelShape, get_model
from ..step import Step

SCHEMA = "m2live.probe/1"
LLAMA_8B = "meta-llama/Llama-3.1-8B"

M_FULL = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
M_QUICK = (1, 16, 64, 256, 1024, 4096, 16384)
M_DRY = (1, 16, 64)

# The dry run's stand-in model: Llama-shaped (GQA 2:1, gated MLP), small enough for a CPU in seconds.
DRY_MODEL = ModelShape("probe-dry-run-tiny", hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2,
                       head_dim=64, vocab=512)
DRY_GPU = "NVIDIA H100 80GB HBM3"  # predictions in a dry run are for this catalog GPU unless --gpu says otherwise


@dataclass(frozen=True)
class StepSpec:
    """One representative engine step: prefill chunks ``(new, ctx)`` plus ``decode_batch`` decodes at one
    context (a uniform context keeps the torch decode attention one batched call)."""

    name: str
    prefills: tuple[tuple[int, int], ...] = ()
    decode_batch: int = 0
    decode_ctx: int = 0

    def step(self) -> Step:
        return Step.build(list(self.prefills), [self.decode_ctx] * self.decode_batch)

    @property
    def kind(self) -> str:
        if self.prefills and self.decode_batch:
            return "mixed"
        return "prefill" if self.prefills else "decode"

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV cache the step needs (all sequences, after the step)."""
        return sum(n + c for n, c in self.prefills) + self.decode_batch * (self.decode_ctx + 1)

    @property
    def max_position(self) -> int:
        return max([n + c for n, c in self.prefills] + [self.decode_ctx + 1])


STEPS_GPU: tuple[StepSpec, ...] = (
    StepSpec("decode 1x1024", (), 1, 1024),
    StepSpec("decode 16x1024", (), 16, 1024),
    StepSpec("decode 64x2048", (), 64, 2048),
    StepSpec("decode 128x1024", (), 128, 1024),
    StepSpec("decode 256x512", (), 256, 512),
    StepSpec("prefill 512 + decode 32x1024", ((512, 0),), 32, 1024),
    StepSpec("prefill 2048 + decode 64x1024", ((2048, 0),), 64, 1024),
    StepSpec("chunk 1024@2048 + decode 16x2048", ((1024, 2048),), 16, 2048),
    StepSpec("prefill 4096", ((4096, 0),)),
    StepSpec("prefill 2x2048", ((2048, 0), (2048, 0))),
)
STEPS_DRY: tuple[StepSpec, ...] = (
    StepSpec("decode 4x32", (), 4, 32),
    StepSpec("prefill 16 + decode 2x32", ((16, 0),), 2, 32),
    StepSpec("chunk 8@16 + decode 1x16", ((8, 16),), 1, 16),
    StepSpec("prefill 32", ((32, 0),)),
)


@dataclass(frozen=True)
class ProbePlan:
    mode: str  # "full" | "quick" | "dry-run"
    model: ModelShape  # the model whose GEMMs and steps are measured (full layer count)
    ms: tuple[int, ...]
    repeats: int  # times each GEMM cell is measured (each repeat in its own random position)
    warmup_s: float
    sustain_s: float  # back-to-back replays per cell; the clock/time are read over the second half
    cooldown_s: float  # idle before each cell, so each starts from a similar power/thermal state
    target_rep_s: float  # GPU time of one timed repetition (a graph of calls)
    max_calls: int  # calls per repetition at most
    step_layers: int
    steps: tuple[StepSpec, ...]
    step_modes: tuple[str, ...]  # "graph" and/or "eager"
    step_min_s: float
    step_min_reps: int
    step_cooldown_s: float
    sampler_period_s: float
    step_profile_reps: int  # eager forwards per step profiled per operator (kernels.py); 0: not profiled
    time_limit_s: float | None
    seed: int = 0
    l2_ring_factor: float = 4.0  # weight copies per op span at least this many L2 sizes
    memory_cap_gb: float = 40.0
    # rough per-item overheads for the duration estimate (graph capture, allocation, first-call heuristics)
    cell_overhead_s: float = 0.2
    step_overhead_s: float = 0.8

    @property
    def gemm_ops(self) -> dict[str, tuple[int, int]]:
        return self.model.gemms()

    @property
    def cell_s(self) -> float:
        """Estimated wall-clock of one GEMM cell."""
        return self.cell_overhead_s + self.cooldown_s + self.warmup_s + self.sustain_s

    @property
    def step_s(self) -> float:
        """Estimated wall-clock of one engine step (all its modes, and its per-operator profile)."""
        profile = self.step_overhead_s if self.step_profile_reps else 0.0
        return self.step_cooldown_s + len(self.step_modes) * (self.step_overhead_s + self.step_min_s) + profile

    def estimate_s(self) -> float:
        """Wall-clock estimate of the measuring (start-up excluded), from the plan's own timings."""
        return len(self.gemm_ops) * len(self.ms) * self.repeats * self.cell_s + len(self.steps) * self.step_s


def make_plan(quick: bool = False, dry_run: bool = False, seed: int = 0,
              time_limit_s: float | None = None) -> ProbePlan:
    """The measurement plan for a mode. ``time_limit_s`` None → the mode's default (quick: 330 s)."""
    if dry_run:
        return ProbePlan(
            mode="dry-run", model=DRY_MODEL, ms=M_DRY, repeats=1, warmup_s=0.005, sustain_s=0.03,
            cooldown_s=0.0, target_rep_s=0.002, max_calls=8, step_layers=DRY_MODEL.layers, steps=STEPS_DRY,
            step_modes=("eager",), step_min_s=0.02, step_min_reps=3, step_cooldown_s=0.0,
            sampler_period_s=0.005, step_profile_reps=3, time_limit_s=time_limit_s, seed=seed, cell_overhead_s=0.02,
            step_overhead_s=0.05,
        )
    model = get_model(LLAMA_8B)
    if quick:
        return ProbePlan(
            mode="quick", model=model, ms=M_QUICK, repeats=1, warmup_s=0.1, sustain_s=1.5, cooldown_s=0.5,
            target_rep_s=0.005, max_calls=512, step_layers=8, steps=STEPS_GPU, step_modes=("graph", "eager"),
            step_min_s=0.4, step_min_reps=5, step_cooldown_s=0.3, sampler_period_s=0.02, step_profile_reps=5,
            time_limit_s=330.0 if time_limit_s is None else time_limit_s, seed=seed,
        )
    return ProbePlan(
        mode="full", model=model, ms=M_FULL, repeats=2, warmup_s=0.2, sustain_s=2.0, cooldown_s=1.5,
        target_rep_s=0.005, max_calls=512, step_layers=model.layers, steps=STEPS_GPU,
        step_modes=("graph", "eager"), step_min_s=1.0, step_min_reps=5, step_cooldown_s=0.5,
        sampler_period_s=0.02, step_profile_reps=5, time_limit_s=time_limit_s, seed=seed,
    )


def gemm_order(plan: ProbePlan) -> list[tuple[str, int, int]]:
    """(op, M, repeat) in a random order (seeded): a clock that depends on history cannot fake a curve."""
    cells = [(op, m, r) for r in range(plan.repeats) for op in plan.gemm_ops for m in plan.ms]
    random.Random(plan.seed).shuffle(cells)
    return cells


def step_order(plan: ProbePlan) -> list[StepSpec]:
    """The plan's steps in a random order (seeded, independently of the GEMM order)."""
    order = list(plan.steps)
    random.Random(plan.seed + 1).shuffle(order)
    return order


def ring_copies(weight_bytes: int, l2_bytes: float, factor: float = 4.0) -> int:
    """Copies of a weight to cycle through so that a re-read always misses L2 (at least 2)."""
    if weight_bytes <= 0:
        return 2
    return max(2, math.ceil(factor * max(0.0, l2_bytes) / weight_bytes))


def step_memory_gb(plan: ProbePlan, spec: StepSpec) -> float:
    """Device memory the step phase needs for ``spec``: the decoder's bf16 weights (layers, embedding, LM head)
    and the step's KV cache."""
    m = plan.model
    kv_per_token = 2 * plan.step_layers * m.kv_heads * m.head_dim * 2
    weights = plan.step_layers * m.layer_weight_bytes() + 2 * m.vocab * m.hidden * 2
    return (weights + spec.kv_tokens * kv_per_token) / 1e9
