"""vLLM objects → m2live objects: SchedulerOutput → Step, scheduler → QueueView, VllmConfig → EngineInfo; and
the one write back: an admission decision → the scheduler's per-step budget (``set_budget``).

Written against vLLM 0.32.0's V1 scheduler (``vllm/v1/core/sched/scheduler.py``): after ``schedule()`` each
scheduled request's ``num_computed_tokens`` already includes this step's tokens, so the context before the step
is ``num_computed_tokens − scheduled``; a request is prefilling while that context is short of its prompt
(also true for recompute after preemption) or when it computes several tokens at once.
"""

from __future__ import annotations

import itertools
from typing import Any

from m2live.live import EngineInfo
from m2live.quantization import WeightFormat, weight_format
from m2live.shapes import ModelShape, ModelShapeError
from m2live.step import Step


def step_from_output(scheduler: Any, output: Any) -> Step:
    """The Step that ``output`` (a SchedulerOutput, after ``schedule()``) runs: per request (new, context before)
    and whether it is a prefill chunk."""
    return step_and_ids(scheduler, output)[0]


def step_and_ids(scheduler: Any, output: Any) -> tuple[Step, list[str]]:
    """``step_from_output`` plus the request id of each sequence (same order)."""
    requests = scheduler.requests
    seqs: list[tuple[int, int]] = []
    flags: list[bool] = []
    ids: list[str] = []
    for rid, n in output.num_scheduled_tokens.items():
        if n <= 0:
            continue
        req = requests.get(rid)
        if req is None:
            continue
        ctx = req.num_computed_tokens - n
        if ctx < 0:
            ctx = 0
        seqs.append((n, ctx))
        flags.append(n > 1 or ctx < req.num_prompt_tokens)
        ids.append(rid)
    return Step.trusted(tuple(seqs), tuple(flags)), ids


def queue_view(scheduler: Any):
    """The scheduler's state just before ``schedule()`` as ``m2live.admission.QueueView``."""
    from m2live.admission import QueueView

    decode_contexts: list[int] = []
    partial_prefills: list[tuple[int, int]] = []
    for req in scheduler.running:
        computed = req.num_computed_tokens
        if computed < req.num_prompt_tokens:  # mid-prefill: the rest of the prompt
            partial_prefills.append((req.num_prompt_tokens - computed, computed))
        elif req.num_tokens - computed > 1:  # recompute after preemption: prompt + outputs so far
            partial_prefills.append((req.num_tokens - computed, computed))
        else:  # decodes one token (async scheduling may already count it in flight)
            decode_contexts.append(computed)
    limits = getattr(scheduler, "_m2live_limits", None)
    if limits is None:
        limits = (scheduler.max_num_scheduled_tokens, scheduler.max_num_active_reqs)
    # no step admits more than max_num_seqs requests: the head of the queue is all the controller can use, and
    # walking a long queue on every step would cost O(queue) under overload
    waiting = [max(1, req.num_tokens - req.num_computed_tokens)
               for req in itertools.islice(scheduler.waiting, int(limits[1]))]
    return QueueView(decode_contexts=decode_contexts, partial_prefills=partial_prefills,
                     waiting_prompts=waiting, max_num_batched_tokens=int(limits[0]),
                     max_num_seqs=int(limits[1]))


def set_budget(scheduler: Any, budget: tuple[int, int]) -> None:
    """Make ``scheduler``'s next ``schedule()`` use ``budget`` (tokens, running requests): vLLM 0.32 reads
    ``max_num_scheduled_tokens`` and ``max_num_active_reqs`` afresh on every call."""
    scheduler.max_num_scheduled_tokens, scheduler.max_num_active_reqs = int(budget[0]), int(budget[1])


def engine_info(vllm_config: Any) -> EngineInfo:
    """Model shape (vLLM's own hf_config: no download), model name, TP, data-parallel index, device, limits."""
    mc = vllm_config.model_config
    name = str(getattr(mc, "served_model_name", None) or getattr(mc, "model", "") or "")
    if isinstance(getattr(mc, "served_model_name", None), (list, tuple)):
        name = str(mc.served_model_name[0])
    shape = None
    weights = WeightFormat()
    try:
        hf = mc.hf_config
        cfg = hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
        weights = weight_format(cfg.get("quantization_config"), getattr(mc, "quantization", None))
        if "architectures" not in cfg or not cfg["architectures"]:
            cfg["architectures"] = list(getattr(hf, "architectures", None) or [])
        shape = ModelShape.from_config(cfg, name=name or "model")
        dtype = str(getattr(mc, "dtype", "bfloat16"))
        if "float32" in dtype:
            shape = ModelShape(**{**shape.__dict__, "dtype_bytes": 4})
    except (ModelShapeError, AttributeError, TypeError, ValueError):
        shape = None
    pc = vllm_config.parallel_config
    index = getattr(pc, "data_parallel_index", None)
    if index is None:
        index = getattr(pc, "data_parallel_rank", 0) or 0
    try:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type or "cpu")
    except Exception:  # noqa: BLE001
        device = "cpu"
    sc = vllm_config.scheduler_config
    return EngineInfo(model_shape=shape, model_name=name, tp=int(getattr(pc, "tensor_parallel_size", 1) or 1),
                      engine_index=int(index), device=device,
                      local_rank=int(getattr(pc, "data_parallel_rank_local", None) or 0),
                      max_num_batched_tokens=int(sc.max_num_batched_tokens), max_num_seqs=int(sc.max_num_seqs),
                      allreduce_fusion=allreduce_fusion(vllm_config), weights=weights,
                      kv_cache_dtype=str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")))


def allreduce_fusion(vllm_config: Any) -> bool | None:
    """The engine's all-reduce + RMSNorm fusion switch (``compilation_config.pass_config.fuse_allreduce_rms``,
    ``enable_fi_allreduce_fusion`` before vLLM 0.12), resolved by its optimization level; None where this vLLM
    has neither."""
    pc = getattr(getattr(vllm_config, "compilation_config", None), "pass_config", None)
    for name in ("fuse_allreduce_rms", "enable_fi_allreduce_fusion"):
        v = getattr(pc, name, None)
        if isinstance(v, bool):
            return v
    return None
