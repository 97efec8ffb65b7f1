"""Scheduler unit tests with a fake model runner (no model)."""

from __future__ import annotations

import itertools

import pytest

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

_ids = itertools.count()


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256, caching=True, threshold=0,
                   policy="fcfs") -> Scheduler:
    mc = ModelConfig(model="fake", tokenizer="fake", hf_config=None, max_model_len=max_model_len)
    cfg = EngineConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks, enable_prefix_caching=caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
            policy=policy,
        ),
    )
    return Scheduler(cfg)


def make_request(prompt, max_tokens=4, rid=None, **kw) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return Request(rid or f"r{next(_ids)}", list(prompt), params, eos_token_id=None, max_tokens=max_tokens)


def fake_run(sched: Scheduler, so: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """Samples `token` for every request whose scheduled tokens reach its end (like the real runner)."""
    ids, sampled = [], []
    for rid, n in so.num_scheduled_tokens.items():
        req = sched.requests[rid]
        ids.append(rid)
        sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled)


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    owners: dict[int, int] = {}
    for blocks in kv.req_to_blocks.values():
        for b in blocks:
            owners[b.block_id] = owners.get(b.block_id, 0) + 1
    free_ids = {b.block_id for b in pool.free_block_queue}
    for b in pool.blocks:
        assert b.ref_cnt == owners.get(b.block_id, 0), b
        assert (b.block_id in free_ids) == (b.ref_cnt == 0), b
    assert len(sched.running) <= sched.max_num_seqs


def step(sched: Scheduler):
    so = sched.schedule()
    assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    out = sched.update_from_output(so, fake_run(sched, so))
    check_invariants(sched)
    return so, out


def test_chunked_prefill_respects_budget_and_decodes_first():
    s = make_scheduler(budget=10)
    a = make_request(range(1, 26), max_tokens=3)
    s.add_request(a)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 10}
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 10}
    b = make_request(range(100, 120), max_tokens=3)
    s.add_request(b)
    so, out = step(s)
    # a finishes its prompt (5 tokens) and samples; b gets the rest of the budget
    assert so.num_scheduled_tokens == {a.request_id: 5, b.request_id: 5}
    assert [o.request_id for o in out.outputs] == [a.request_id]
    so, _ = step(s)
    assert so.num_scheduled_tokens[a.request_id] == 1  # decode before b's next chunk
    assert so.num_scheduled_tokens[b.request_id] == 9


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=2, budget=100)
    reqs = [make_request([1, 2, 3]) for _ in range(4)]
    for r in reqs:
        s.add_request(r)
    so, _ = step(s)
    assert len(so.num_scheduled_tokens) == 2


def test_finish_by_length_frees_blocks():
    s = make_scheduler()
    r = make_request([1, 2, 3, 4, 5], max_tokens=3)
    s.add_request(r)
    outputs = []
    while s.has_unfinished_requests():
        _, out = step(s)
        outputs += out.outputs
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sum(len(o.new_token_ids) for o in outputs) == 3
    assert str(outputs[-1].finish_reason) == "length"
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_preemption_when_blocks_run_out_and_resume():
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a = make_request(range(1, 9), max_tokens=8)  # 8 prompt tokens = 2 blocks, grows to 4
    b = make_request(range(20, 28), max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    preempted = 0
    steps = 0
    while s.has_unfinished_requests():
        so, out = step(s)
        preempted += sum(1 for r in (a, b) if r.status == RequestStatus.PREEMPTED)
        steps += 1
        assert steps < 100
    assert preempted > 0
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 6


def test_abort_frees_blocks_anywhere():
    s = make_scheduler(budget=4)
    a = make_request(range(1, 20), max_tokens=5)
    b = make_request(range(1, 20), max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.abort_requests([a.request_id, b.request_id, "unknown"])
    check_invariants(s)
    assert not s.has_unfinished_requests()
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 64
    so = s.schedule()
    assert {a.request_id} <= so.finished_req_ids


def test_prefix_cache_hit_computes_only_tail():
    s = make_scheduler(num_blocks=200, block_size=16, budget=512, max_model_len=1024)
    prefix = list(range(1000, 1200))
    a = make_request(prefix + [1, 2, 3], max_tokens=2)
    s.add_request(a)
    while s.has_unfinished_requests():
        step(s)
    b = make_request(prefix + [4, 5, 6, 7], max_tokens=2)
    s.add_request(b)
    so, _ = step(s)
    assert b.num_cached_tokens == 192  # 12 full blocks of 16 of the shared 200-token prefix
    assert so.num_scheduled_tokens[b.request_id] == 204 - 192


def test_full_hit_still_computes_one_token():
    s = make_scheduler(num_blocks=50, block_size=4, budget=64)
    p = list(range(1, 17))
    a = make_request(p, max_tokens=1)
    s.add_request(a)
    while s.has_unfinished_requests():
        step(s)
    b = make_request(p, max_tokens=1)
    s.add_request(b)
    so, _ = step(s)
    assert so.num_scheduled_tokens[b.request_id] == 4  # last block recomputed: at least one token must run
    assert b.num_cached_tokens == 12


def test_rejects_requests_that_can_never_fit():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(make_request(range(1, 10), max_tokens=20))
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(make_request(range(1, 70), max_tokens=1))
    assert e.value.param == "prompt"
    r = make_request([1, 2], max_tokens=2)
    s.add_request(r)
    with pytest.raises(InvalidRequestError):
        s.add_request(make_request([1, 2], rid=r.request_id))
