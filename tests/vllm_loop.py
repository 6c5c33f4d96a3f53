"""vLLM V1's own ``Scheduler``, driven without a model (``VllmLoop``): every scheduled request whose prompt is done
samples one token, finished requests are replaced at once (the closed loop) — what the serving simulator's
``Engine`` does. ``tests/test_simulate.py`` checks the simulator against it step for step; ``bench/scheduler_cost.py``
times it. Needs vLLM."""

from __future__ import annotations

import os

TINY = os.path.join(os.path.dirname(__file__), "..", "m2live", "data", "models", "tiny-llama")


class VllmLoop:
    def __init__(self, prompts: list[int], outputs: list[int], concurrency: int, budget: int, max_seqs: int,
                 blocks: int, block_size: int = 16, test_run: bool = False, prefix_caching: bool = True):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        mc = ModelConfig(model=TINY, skip_tokenizer_init=True, max_model_len=4096, dtype="bfloat16")
        sc = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=4096,
                             is_encoder_decoder=False, enable_chunked_prefill=True, async_scheduling=False)
        # prefix caching as vLLM runs by default (the random prompts share nothing: a preempted request's own
        # prefix and the benchmark's test run are the hits)
        caching = prefix_caching or test_run
        cc = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
        cc.num_gpu_blocks = blocks + 1  # + vLLM's null block
        vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        kv = KVCacheConfig(num_blocks=blocks + 1, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        self.s = Scheduler(vllm_config=vc, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(vc),
                           block_size=block_size, log_stats=False)
        self.hasher = None
        if caching:  # what EngineCore gives every request when prefix caching is on
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

            fn = get_hash_fn_by_name(cc.prefix_caching_hash_algo)
            init_none_hash(fn)
            self.hasher = get_request_block_hasher(block_size, fn)
        self.prompts, self.outputs = prompts, outputs
        self.sent = 0
        self.closed_loop = False
        if test_run:  # vllm bench serve's untimed test run: the first request's prompt, run to the end first
            self._add("test", 0)
            self.run()
        self.closed_loop = True
        for _ in range(min(concurrency, len(prompts))):
            self._send()

    def _add(self, rid: str, i: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.s.add_request(Request(rid, [1 + (i * 7 + j) % 4000 for j in range(self.prompts[i])],
                                   SamplingParams(max_tokens=self.outputs[i], ignore_eos=True), None,
                                   block_hasher=self.hasher))

    def _send(self) -> None:
        self._add(str(self.sent), self.sent)
        self.sent += 1

    def run(self, max_steps: int = 10_000) -> list[tuple[dict[int, int], set[int]]]:
        from vllm.v1.outputs import ModelRunnerOutput

        steps = []
        calls = 0
        while self.s.has_requests() and calls < max_steps:
            calls += 1
            out = self.s.schedule()
            ids = list(out.num_scheduled_tokens)
            if not ids:  # the step that only reports the last finished requests
                self.s.update_from_output(out, ModelRunnerOutput(req_ids=[], req_id_to_index={}))
                continue
            reqs = self.s.requests
            sampled = [[7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]
            steps.append(({r if r == "test" else int(r): n for r, n in out.num_scheduled_tokens.items()},
                          {int(r) for r in out.preempted_req_ids}))
            before = len(reqs)
            self.s.update_from_output(out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled))
            for _ in range(before - len(self.s.requests)):  # finished requests leave; the client sends the next
                if self.closed_loop and self.sent < len(self.prompts):
                    self._send()
        return steps
