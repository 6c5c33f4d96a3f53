"""Capacity planning: rank GPU SKUs and tensor-parallel layouts for a model and a workload, from datasheets.

For every GPU x TP layout:

1. **Memory fit** (``memory.py``): weights, the activation peak at the token budget and the KV cache in what the
   reserve leaves; the KV cache must hold one request of the workload's p99 length.
2. **Steady state under continuous batching with chunked prefill** (``layout.py``): B decodes plus the prefill
   share that keeps the batch full, timed by the Predictor (forecast clock by default).
3. **Search** (``layout.py``): B is limited by the KV cache, ``max_num_seqs`` and the token budget; with an SLO
   the largest B whose predicted step meets it (bisection), and the largest prefill chunk that rides along.
4. **Serving and bounds** (``ranking.py``): the operating point served through ``m2live.simulate`` (throughput,
   TTFT, TPOT); each op's time summed by what bound it (compute / memory / communication / host).
5. **Ranking** (``ranking.py``) by generated tokens/s per GPU, or per dollar when prices are given for every
   layout.

Decision quality scores the ranking machinery itself on measured per-operator tables (``decision.py``, with the
loaders ``opbench.py`` and ``vidur.py``): for GEMM-sum workloads made of Llama-like projection shapes it compares
the predicted and measured order of the GPUs (top-1 hit within 3 %, Spearman rho, regret of the predicted pick).
The ``m2live rank`` command's text parsing lives in ``m2live.commands.rank_args``.
"""

from __future__ import annotations

from .decision import (
    HIT_TOLERANCE,
    VALIDATION_MS,
    DecisionPoint,
    gemm_predictor,
    roofline_predictor,
    score_points,
    spearman,
)
from .layout import BOUND_CLASSES, LayoutModel, bound_shares, dominant_bound
from .memory import GIB, MemoryFit, PlanConfig, PlanError, activation_bytes, memory_fit
from .opbench import (
    GemmTable,
    GemmWorkload,
    load_gemm_tables,
    opbench_layout_points,
    projection_workloads,
    validate_opbench,
)
from .ranking import (
    SLO_SWEEP_MS,
    TRACE_REPLAY_MAX,
    LayoutResult,
    Ranking,
    evaluate_layout,
    rank,
    representative_steps,
    serving_point,
    trace_replay,
)
from .vidur import VIDUR_OPS, load_vidur_points, validate_vidur, vidur_folders

__all__ = [
    "BOUND_CLASSES", "GIB", "HIT_TOLERANCE", "SLO_SWEEP_MS", "TRACE_REPLAY_MAX", "VALIDATION_MS", "VIDUR_OPS",
    "DecisionPoint", "GemmTable", "GemmWorkload", "LayoutModel", "LayoutResult", "MemoryFit", "PlanConfig",
    "PlanError", "Ranking", "activation_bytes", "bound_shares", "dominant_bound", "evaluate_layout",
    "gemm_predictor", "load_gemm_tables", "load_vidur_points", "memory_fit", "opbench_layout_points",
    "projection_workloads", "rank", "representative_steps", "roofline_predictor",
    "score_points", "serving_point", "spearman", "trace_replay", "validate_opbench", "validate_vidur",
    "vidur_folders",
]
