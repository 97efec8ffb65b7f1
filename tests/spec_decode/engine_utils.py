"""Running an EngineCore to completion with checks that hold with or without speculation."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.block_pool import hash_block_tokens
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreOutput, EngineCoreRequest
from tokenmill.engine_args import EngineArgs
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.metrics import SpecDecodingStats

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@dataclass
class RunResult:
    tokens: dict[str, list[int]]
    outputs: dict[str, list[EngineCoreOutput]]
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    num_preemptions: int = 0
    prefix_cache_hits: int = 0
    steps: int = 0

    def logprobs(self, rid: str) -> list:
        return [lp for o in self.outputs[rid] for lp in (o.new_logprobs or [])]

    def finish_reason(self, rid: str):
        return self.outputs[rid][-1].finish_reason


def make_core(model: str, spec: dict | None = None, **kwargs) -> EngineCore:
    kwargs.setdefault("num_gpu_blocks_override", 256)
    kwargs.setdefault("block_size", 4)
    return EngineCore(EngineArgs(model=model, dtype="float32", speculative_config=spec, **kwargs).create_engine_config())


def check_hashes(core: EngineCore) -> None:
    """Prefix-cache hashes of running requests cover verified tokens only, and are the hashes of those tokens."""
    sched = core.scheduler
    kvm = sched.kv_cache_manager
    bs = kvm.block_size
    for request in sched.running:
        assert len(request.block_hashes) * bs <= request.num_tokens
        assert kvm.num_cached_blocks.get(request.request_id, 0) * bs <= request.num_tokens
        parent = None
        for i, h in enumerate(request.block_hashes):
            parent = hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs],
                                       request.block_hash_extra_keys)
            assert h == parent


def run(core: EngineCore, requests: list[tuple[str, list[int], SamplingParams]], abort_after: dict[str, int] | None = None) -> RunResult:
    """Add the requests together, step until idle (checking hashes each step) and check no KV block leaked."""
    for rid, prompt, params in requests:
        core.add_request(EngineCoreRequest(rid, prompt, params, eos_token_id=2))
    result = RunResult({rid: [] for rid, _, _ in requests}, {rid: [] for rid, _, _ in requests})
    result.spec = SpecDecodingStats.new(core.scheduler.num_spec_tokens)
    while core.has_unfinished_requests():
        out = core.step()
        result.steps += 1
        assert result.steps < 5000
        for o in out.outputs:
            result.outputs[o.request_id].append(o)
            result.tokens[o.request_id] += o.new_token_ids
        stats = out.scheduler_stats
        if stats is not None:
            result.num_preemptions += stats.num_preemptions
            result.prefix_cache_hits += stats.prefix_cache_hits
            if stats.spec_decoding_stats is not None:
                result.spec.add(stats.spec_decoding_stats)
        check_hashes(core)
        for rid, n in (abort_after or {}).items():
            if len(result.tokens[rid]) >= n:
                core.abort_requests([rid])
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks, "KV blocks leaked"
    return result
