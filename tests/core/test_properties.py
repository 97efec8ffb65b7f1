"""Property tests (hypothesis) of BlockPool, KVCacheManager and Scheduler with a fake model runner.

Random arrivals, prompt lengths (over a tiny alphabet, so prefixes are shared and the prefix cache hits),
max_tokens, stop tokens, aborts, tiny caches that force preemption, and random budgets / max_num_seqs /
block sizes. After every step the block accounting and the step limits must hold; once arrivals stop, every
request must finish (or have been aborted) and every block must be free.
"""

from __future__ import annotations

import itertools
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.test_scheduler import make_scheduler
from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_manager import KVCacheManager, cdiv
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

EOS = 2
# TOKENMILL_HYPOTHESIS_EXAMPLES raises the example count for a longer bug hunt.
SETTINGS = settings(
    max_examples=int(os.environ.get("TOKENMILL_HYPOTHESIS_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def check_pool(pool: BlockPool, owners: dict[int, int]) -> None:
    """Free queue, ref counts and the hash map agree with who owns which block."""
    free = list(pool.free_block_queue)
    free_ids = [b.block_id for b in free]
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    for b in pool.blocks:
        assert b.ref_cnt == owners.get(b.block_id, 0), b
        assert (b.block_id in set(free_ids)) == (b.ref_cnt == 0), f"{b} free/owned mismatch"
    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h


def check_manager(kv: KVCacheManager) -> None:
    owners: dict[int, int] = {}
    for blocks in kv.req_to_blocks.values():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), "a request holds the same block twice"
        for i in ids:
            owners[i] = owners.get(i, 0) + 1
    check_pool(kv.block_pool, owners)


def fake_run(sched: Scheduler, so: SchedulerOutput, tokens: list[int]) -> ModelRunnerOutput:
    """Like the real runner: a request samples when the step reaches the end of its known tokens."""
    ids, sampled = [], []
    for i, (rid, _) in enumerate(so.num_scheduled_tokens.items()):
        req = sched.requests[rid]
        ids.append(rid)
        sampled.append([tokens[i % len(tokens)]] if req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled)


def step_and_check(sched: Scheduler, tokens: list[int]) -> SchedulerOutput:
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= sched.max_num_seqs
    assert len(sched.running) <= sched.max_num_seqs
    kv = sched.kv_cache_manager
    for rid in so.num_scheduled_tokens:
        req = sched.requests[rid]
        assert req.status == RequestStatus.RUNNING
        assert req.num_computed_tokens <= req.num_tokens
        assert len(kv.req_to_blocks[rid]) * kv.block_size >= req.num_computed_tokens
    check_manager(kv)
    out = sched.update_from_output(so, fake_run(sched, so, tokens))
    for o in out.outputs:
        assert o.new_token_ids
    check_manager(kv)
    for req in sched.running:
        assert req.request_id in kv.req_to_blocks
    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert req.request_id not in kv.req_to_blocks or not kv.req_to_blocks[req.request_id]
    return so


@st.composite
def scheduler_configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = 48
    num_blocks = draw(st.integers(cdiv(12, block_size), cdiv(80, block_size)))
    budget = draw(st.integers(1, 40))
    return dict(
        block_size=block_size,
        num_blocks=num_blocks,
        budget=budget,
        max_num_seqs=draw(st.integers(1, 6)),
        caching=draw(st.booleans()),
        threshold=draw(st.sampled_from([0, 0, 3, 16])),
        max_model_len=max_model_len,
        policy=draw(st.sampled_from(["fcfs", "fcfs", "priority"])),
    )


request_specs = st.fixed_dictionaries(
    dict(
        prompt=st.lists(st.integers(3, 5), min_size=1, max_size=30),
        max_tokens=st.integers(1, 16),
        stop_on_eos=st.booleans(),
        min_tokens=st.integers(0, 2),
        priority=st.integers(0, 2),
        prompt_logprobs=st.sampled_from([None, None, 1]),
    )
)

events = st.lists(
    st.tuples(st.lists(request_specs, max_size=2), st.booleans(), st.integers(0, 10**6)), min_size=1, max_size=25
)


@SETTINGS
@given(cfg=scheduler_configs(), evs=events, tokens=st.lists(st.sampled_from([2, 3, 4, 7]), min_size=1, max_size=5))
def test_scheduler_invariants_and_liveness(cfg, evs, tokens):
    sched = make_scheduler(**cfg)
    counter = itertools.count()
    live: dict[str, Request] = {}
    aborted: set[str] = set()
    for new_specs, do_abort, pick in evs:
        for spec in new_specs:
            mt = max(spec["max_tokens"], spec["min_tokens"])
            params = SamplingParams(
                temperature=0,
                max_tokens=mt,
                min_tokens=spec["min_tokens"],
                ignore_eos=not spec["stop_on_eos"],
                stop_token_ids=[7],
                prompt_logprobs=spec["prompt_logprobs"],
            )
            req = Request(
                f"r{next(counter)}", spec["prompt"], params, eos_token_id=EOS, max_tokens=mt, priority=spec["priority"]
            )
            try:
                sched.add_request(req)
            except InvalidRequestError:
                continue  # can never fit in this tiny cache / context: rejected up front
            live[req.request_id] = req
        if do_abort and live:
            victim = sorted(live)[pick % len(live)]
            if not live[victim].is_finished:
                sched.abort_requests([victim])
                aborted.add(victim)
        step_and_check(sched, tokens)

    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        step_and_check(sched, tokens)
    assert not sched.has_unfinished_requests(), f"no progress: running={sched.running} waiting={list(sched.waiting)}"
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert not sched.kv_cache_manager.req_to_blocks
    assert not sched.requests
    for rid, req in live.items():
        assert req.is_finished
        if rid in aborted:
            continue
        assert req.num_output_tokens <= req.max_tokens
        if req.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            assert req.num_output_tokens == req.max_tokens or req.num_tokens >= sched.max_model_len
        else:
            assert req.status == RequestStatus.FINISHED_STOPPED
            assert req.num_output_tokens >= req.sampling_params.min_tokens


@SETTINGS
@given(
    num_blocks=st.integers(1, 12),
    ops=st.lists(st.tuples(st.sampled_from(["get", "free", "cache", "touch"]), st.integers(0, 10**6)), max_size=60),
)
def test_block_pool_ref_counts(num_blocks, ops):
    """Random get / free / cache / touch: ref counts and the free queue always agree with the owners."""
    pool = BlockPool(num_blocks, enable_caching=True)
    held: list[list] = []  # one list of blocks per "owner"
    for op, x in ops:
        if op == "get":
            n = x % (num_blocks + 2)
            if n > pool.get_num_free_blocks():
                try:
                    pool.get_new_blocks(n)
                except ValueError:
                    pass
                else:
                    raise AssertionError("got more blocks than free")
            else:
                held.append(pool.get_new_blocks(n))
        elif op == "free" and held:
            pool.free_blocks(reversed(held.pop(x % len(held))))
        elif op == "cache" and held and held[x % len(held)]:
            blocks = held[x % len(held)]
            pool.cache_full_block(blocks[x % len(blocks)], bytes([x % 5]) * 16)
        elif op == "touch":
            cached = pool.get_cached_block(bytes([x % 5]) * 16)
            if cached is not None:
                pool.touch([cached])
                held.append([cached])
        owners: dict[int, int] = {}
        for blocks in held:
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        check_pool(pool, owners)
    while held:
        pool.free_blocks(held.pop())
    assert pool.get_num_free_blocks() == num_blocks


@SETTINGS
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(4, 24),
    reqs=st.lists(st.lists(st.integers(3, 4), min_size=1, max_size=20), min_size=1, max_size=6),
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=6),
)
def test_kv_cache_manager_alloc_free(block_size, num_blocks, reqs, chunks):
    """Allocate each request chunk by chunk (with prefix-cache hits) and free them in turn: nothing leaks."""
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
    params = SamplingParams(temperature=0, max_tokens=1)
    active: list[Request] = []
    for i, prompt in enumerate(reqs):
        req = Request(f"q{i}", prompt, params, eos_token_id=None, max_tokens=1)
        hits, num_hit = kv.get_computed_blocks(req)
        assert num_hit % block_size == 0 and num_hit < req.num_tokens
        first = min(chunks[i % len(chunks)], req.num_tokens - num_hit)
        if kv.allocate_slots(req, first, hits, num_hit) is None:
            check_manager(kv)
            continue
        req.num_computed_tokens = num_hit + first
        active.append(req)
        check_manager(kv)
        while req.num_computed_tokens < req.num_tokens:
            n = min(chunks[(i + req.num_computed_tokens) % len(chunks)], req.num_tokens - req.num_computed_tokens)
            if kv.allocate_slots(req, n) is None:
                break
            req.num_computed_tokens += n
            assert len(kv.req_to_blocks[req.request_id]) == cdiv(req.num_computed_tokens, block_size)
            check_manager(kv)
        if len(active) > 2:
            kv.free(active.pop(0))
            check_manager(kv)
    for req in active:
        kv.free(req)
    check_manager(kv)
    assert kv.block_pool.get_num_free_blocks() == num_blocks
