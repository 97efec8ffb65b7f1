"""Scheduler policies and limits with a fake model runner (no model).

``priority`` (lower value first, ties by arrival; preemption takes the lowest priority),
``long_prefill_token_threshold``, ``max_num_seqs``, aborts at every stage of a request's life, and the
prefix-cache statistics (one lookup counted per admission).
"""

from __future__ import annotations

import itertools

import pytest

from tests.core.test_scheduler import check_invariants, fake_run
from tests.core.test_scheduler import make_scheduler as scheduler_for
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.messages import EngineCoreOutputs
from tokenmill.sampling_params import SamplingParams

_ids = itertools.count()
_clock = itertools.count(1)


def make_scheduler(*, budget: int = 64, **kwargs) -> Scheduler:
    """test_scheduler's scheduler, with a 64-token budget unless told."""
    return scheduler_for(budget=budget, **kwargs)


def make_request(prompt: list[int] | range, max_tokens: int = 4, priority: int = 0, rid: str | None = None) -> Request:
    """A greedy request; arrival times strictly increase in creation order."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(
        rid or f"r{next(_ids)}",
        list(prompt),
        params,
        eos_token_id=None,
        max_tokens=max_tokens,
        arrival_time=float(next(_clock)),
        priority=priority,
    )


def step(sched: Scheduler) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    so = sched.schedule()
    assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= sched.max_num_seqs
    out = sched.update_from_output(so, fake_run(sched, so))
    check_invariants(sched)
    return so, out


def run_to_end(sched: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    steps = []
    while sched.has_unfinished_requests():
        steps.append(step(sched)[0])
        assert len(steps) < max_steps, "scheduler made no progress"
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    return steps


def admission_order(steps: list[SchedulerOutput]) -> list[str]:
    order: list[str] = []
    for so in steps:
        order += [r.req_id for r in so.scheduled_new_reqs if r.req_id not in order]
    return order


def all_free(sched: Scheduler) -> bool:
    pool = sched.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks


# -- priority -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_order(policy: str) -> None:
    s = make_scheduler(policy=policy, max_num_seqs=1)
    reqs = [make_request([1, 2, 3], max_tokens=2, priority=p, rid=f"p{p}-{i}") for i, p in enumerate([3, 1, 2, 1])]
    for r in reqs:
        s.add_request(r)
    order = admission_order(run_to_end(s))
    if policy == "priority":
        assert order == ["p1-1", "p1-3", "p2-2", "p3-0"]  # lower value first, ties by arrival
    else:
        assert order == [r.request_id for r in reqs]  # priority ignored


def test_late_high_priority_request_jumps_the_queue() -> None:
    s = make_scheduler(policy="priority", max_num_seqs=1)
    for i in range(3):
        s.add_request(make_request([1, 2, 3], max_tokens=3, priority=5, rid=f"low{i}"))
    steps = [step(s)[0]]  # low0 admitted
    s.add_request(make_request([4, 5], max_tokens=3, priority=0, rid="urgent"))
    steps += run_to_end(s)
    assert admission_order(steps) == ["low0", "urgent", "low1", "low2"]


def first_victim(policy: str, priorities: list[int]) -> str:
    """Three 4-token requests in a 6-block cache (block size 4): all are admitted, each grows to a second
    block, then the next block boundary forces a preemption. Returns the first request preempted."""
    s = make_scheduler(policy=policy, num_blocks=6, block_size=4, budget=64)
    for i, p in enumerate(priorities):
        s.add_request(make_request([10 + i] * 4, max_tokens=12, priority=p, rid=f"{'abc'[i]}{p}"))
    victims: list[str] = []
    original = s._preempt

    def record(request: Request) -> None:
        victims.append(request.request_id)
        original(request)

    s._preempt = record  # type: ignore[method-assign]
    run_to_end(s)
    assert victims, "the cache was meant to be too small for all three"
    return victims[0]


def test_preemption_takes_the_lowest_priority() -> None:
    # a (priority 1), b (priority 9), c (priority 0, newest)
    assert first_victim("priority", [1, 9, 0]) == "b9"
    assert first_victim("fcfs", [1, 9, 0]) == "c0"  # FCFS: the newest


def test_high_priority_request_admitted_later_is_not_preempted_for_a_lower_one() -> None:
    """A high-priority request admitted after a low-priority one must not preempt itself when it runs out of
    blocks while the low-priority one still holds some (the running queue is kept in priority order)."""
    s = make_scheduler(policy="priority", num_blocks=4, block_size=4, budget=64)
    low = make_request([20] * 4, max_tokens=12, priority=5, rid="low")
    s.add_request(low)
    step(s)
    high = make_request([30] * 6, max_tokens=10, priority=0, rid="high")
    s.add_request(high)
    run_to_end(s)
    assert high.num_preemptions == 0
    assert low.num_preemptions >= 1
    assert low.num_output_tokens == 12 and high.num_output_tokens == 10


# -- limits ---------------------------------------------------------------------------------------------


def test_long_prefill_token_threshold_caps_every_chunk() -> None:
    s = make_scheduler(threshold=8, budget=64)
    a = make_request(range(1, 31), max_tokens=3)  # 30 prompt tokens
    b = make_request(range(40, 52), max_tokens=3)  # 12 prompt tokens
    s.add_request(a)
    s.add_request(b)
    steps = run_to_end(s)
    chunks_a = [so.num_scheduled_tokens[a.request_id] for so in steps if a.request_id in so.num_scheduled_tokens]
    chunks_b = [so.num_scheduled_tokens[b.request_id] for so in steps if b.request_id in so.num_scheduled_tokens]
    assert chunks_a == [8, 8, 8, 6, 1, 1]  # capped prefill chunks, then one token per decode
    assert chunks_b == [8, 4, 1, 1]
    assert steps[0].num_scheduled_tokens == {a.request_id: 8, b.request_id: 8}  # both admitted in step 1


def test_long_prefill_threshold_applies_to_the_uncached_tail() -> None:
    s = make_scheduler(threshold=8, budget=64)
    prefix = list(range(1, 25))  # 6 blocks of 4
    s.add_request(make_request(prefix + [99], max_tokens=1))
    run_to_end(s)
    b = make_request(prefix + [50, 51, 52, 53, 54, 55, 56, 57, 58, 59], max_tokens=1)
    s.add_request(b)
    steps = run_to_end(s)
    assert b.num_cached_tokens == 24
    assert [so.num_scheduled_tokens[b.request_id] for so in steps] == [8, 2]


def test_max_num_seqs_bounds_running_and_admits_as_requests_finish() -> None:
    s = make_scheduler(max_num_seqs=2, budget=100)
    reqs = [make_request([1, 2, 3], max_tokens=m) for m in (2, 5, 3, 1)]
    for r in reqs:
        s.add_request(r)
    steps = []
    while s.has_unfinished_requests():
        so, out = step(s)
        steps.append(so)
        assert len(s.running) <= 2 and len(so.num_scheduled_tokens) <= 2
    ids = [r.request_id for r in reqs]
    scheduled = [sorted(so.num_scheduled_tokens) for so in steps]
    # reqs[0] finishes after step 2, so reqs[2] is admitted in step 3; reqs[3] waits for a free seat again.
    assert scheduled[0] == sorted(ids[:2]) and scheduled[1] == sorted(ids[:2])
    assert scheduled[2] == sorted([ids[1], ids[2]])
    assert ids[3] not in scheduled[2]
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
    assert all_free(s)


# -- aborts ---------------------------------------------------------------------------------------------


def _to_stage(s: Scheduler, r: Request, stage: str) -> None:
    if stage == "waiting":
        return
    if stage == "mid-prefill":
        step(s)
        assert 0 < r.num_computed_tokens < r.num_prompt_tokens
    elif stage == "decoding":
        while r.num_output_tokens < 2:
            step(s)
        assert r.status == RequestStatus.RUNNING


@pytest.mark.parametrize("stage", ["waiting", "mid-prefill", "decoding"])
def test_abort_at_any_stage_frees_everything(stage: str) -> None:
    s = make_scheduler(budget=8, num_blocks=32)
    other = make_request(range(100, 110), max_tokens=6)  # shares nothing; keeps running afterwards
    r = make_request(range(1, 20), max_tokens=10)
    s.add_request(r)
    s.add_request(other)
    _to_stage(s, r, stage)
    sent = stage != "waiting"
    s.abort_requests([r.request_id])
    check_invariants(s)
    assert r.status == RequestStatus.FINISHED_ABORTED
    assert r.request_id not in s.requests and r.request_id not in s.kv_cache_manager.req_to_blocks
    so, _ = step(s)
    assert r.request_id not in so.num_scheduled_tokens
    # The worker hears about the abort only if it ever got the request.
    assert (r.request_id in so.finished_req_ids) == sent
    run_to_end(s)
    assert other.num_output_tokens == 6
    s.abort_requests([r.request_id, other.request_id, "unknown"])  # finished or unknown: no-op
    assert all_free(s)


def test_abort_of_a_preempted_request() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    reqs = [make_request([10 + i] * 4, max_tokens=12) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    for _ in range(50):
        step(s)
        preempted = [r for r in reqs if r.status == RequestStatus.PREEMPTED]
        if preempted:
            break
    else:
        pytest.fail("expected a preemption")
    victim = preempted[0]
    assert victim in s.waiting
    s.abort_requests([victim.request_id])
    assert victim not in s.waiting and victim.status == RequestStatus.FINISHED_ABORTED
    run_to_end(s)
    assert all(r.num_output_tokens == 12 for r in reqs if r is not victim)


def test_abort_between_schedule_and_update() -> None:
    """An abort that lands while a step is in flight: the step's sample for it is dropped."""
    s = make_scheduler()
    a = make_request(range(1, 9), max_tokens=4)
    b = make_request(range(1, 9), max_tokens=4)  # shares a's cached blocks
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    runner_output = fake_run(s, so)
    s.abort_requests([a.request_id])
    out = s.update_from_output(so, runner_output)
    check_invariants(s)
    assert [o.request_id for o in out.outputs] == [b.request_id]
    run_to_end(s)
    assert b.num_output_tokens == 4


# -- prefix-cache statistics ----------------------------------------------------------------------------


def test_prefix_cache_lookup_counted_once_per_admission() -> None:
    """A request that waits for blocks over several steps is looked up each step, but counted once."""
    s = make_scheduler(num_blocks=5, block_size=4, budget=64)
    shared = list(range(1, 9))  # 2 blocks
    first = make_request(shared + [50, 51, 52, 53], max_tokens=8)  # 12 -> 20 tokens: all 5 blocks at the end
    s.add_request(first)
    _, out = step(s)
    assert out.scheduler_stats is not None
    queries, hits, waited = out.scheduler_stats.prefix_cache_queries, out.scheduler_stats.prefix_cache_hits, 0
    waiter = make_request(shared + list(range(60, 68)), max_tokens=1)  # 2 blocks shared + 2 new: must wait
    s.add_request(waiter)
    while s.has_unfinished_requests():
        so, out = step(s)
        if waiter.status == RequestStatus.WAITING:
            waited += 1
        assert out.scheduler_stats is not None
        queries += out.scheduler_stats.prefix_cache_queries
        hits += out.scheduler_stats.prefix_cache_hits
    assert waited >= 2, "the second request was meant to wait for blocks"
    stats = s.make_stats()
    queries += stats.prefix_cache_queries
    hits += stats.prefix_cache_hits
    assert (queries, hits) == (12 + 16, 8)
    assert waiter.num_cached_tokens == 8


def test_no_prefix_cache_stats_without_caching_or_with_prompt_logprobs() -> None:
    s = make_scheduler(caching=False)
    s.add_request(make_request(range(1, 10)))
    run_to_end(s)
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)

    s = make_scheduler()
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    s.add_request(Request("plp", list(range(1, 10)), params, eos_token_id=None, max_tokens=2))
    run_to_end(s)
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
