"""The scheduler's structured-output path without a model: ``WAITING_FOR_GRAMMAR`` is passed over in queue order,
bitmasks go only to rows that sample, matchers advance and finish the request, and aborts, compile failures and
preemptions leak neither KV blocks nor matchers."""

from __future__ import annotations

import itertools
import random
import threading

import pytest

from tests.structured_output.helpers import EOS, allowed_tokens, make_config, make_manager, pick, text_of, tokenizer
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.messages import FinishReason
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured_output import resolve_structured_outputs

_ids = itertools.count()
CHOICES = ["alpha beta", "gamma", "delta epsilon zeta"]


def make_scheduler(**kw) -> Scheduler:
    config = make_config(**kw)
    return Scheduler(config, make_manager(config=config))


def request(prompt_len: int = 6, so: StructuredOutputsParams | None = None, max_tokens: int = 40,
            rid: str | None = None, offset: int = 0) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            structured_outputs=resolve_structured_outputs(so) if so is not None else None)
    prompt = [(i * 7 + 3 + offset) % 300 + 3 for i in range(prompt_len)]
    return Request(rid or f"r{next(_ids)}", prompt, params, eos_token_id=EOS, max_tokens=max_tokens)


def run(sched: Scheduler, so: SchedulerOutput, rng: random.Random, unconstrained: int = 7) -> ModelRunnerOutput:
    """A fake model: a constrained row samples an allowed token (EOS when allowed), others ``unconstrained``."""
    rows = {rid: i for i, rid in enumerate(so.structured_output_request_ids)}
    ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        req = sched.requests[rid]
        ids.append(rid)
        if req.num_computed_tokens < req.num_tokens:
            sampled.append([])
        elif rid in rows:
            assert so.grammar_bitmask is not None
            sampled.append([pick(allowed_tokens(so.grammar_bitmask[rows[rid]]), rng)])
        else:
            assert not req.use_structured_output, "a sampling constrained request got no bitmask row"
            sampled.append([unconstrained])
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled)


def drain(sched: Scheduler, seed: int = 0, max_steps: int = 2000) -> dict[str, list]:
    """Step until idle; returns every request's outputs (in order)."""
    rng = random.Random(seed)
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        so = sched.schedule()
        if so.is_empty:
            sched.structured_output_manager.wait_for_grammars(sched.requests_waiting_for_grammar(), 0.05)
        for out in sched.update_from_output(so, run(sched, so, rng)).outputs:
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("scheduler did not become idle")


def assert_nothing_leaked(sched: Scheduler) -> None:
    pool = sched.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sched.structured_output_manager.num_live_requests == 0
    assert not sched.requests


def tokens_of(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def block_compilation(sched: Scheduler) -> threading.Event:
    """Make compilations wait for the returned event."""
    release = threading.Event()
    manager = sched.structured_output_manager
    original = manager._create_grammar

    def slow(params):
        release.wait(10)
        return original(params)

    manager._create_grammar = slow  # type: ignore[method-assign]
    return release


def test_waiting_for_grammar_is_passed_over_and_keeps_its_place() -> None:
    sched = make_scheduler()
    release = block_compilation(sched)
    constrained = request(so=StructuredOutputsParams(choice=CHOICES))
    plain = request(max_tokens=3)
    sched.add_request(constrained)
    sched.add_request(plain)
    assert constrained.status == RequestStatus.WAITING_FOR_GRAMMAR
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == [plain.request_id]
    assert list(sched.waiting) == [constrained]
    assert so.grammar_bitmask is None
    first = sched.update_from_output(so, run(sched, so, random.Random(0))).outputs
    release.set()
    outputs = drain(sched)
    assert tokens_of(first + outputs[plain.request_id]) == [7, 7, 7]
    assert text_of(tokens_of(outputs[constrained.request_id])) in CHOICES
    assert outputs[constrained.request_id][-1].finish_reason == FinishReason.STOP
    assert_nothing_leaked(sched)


def test_bitmask_rows_only_for_requests_that_sample() -> None:
    sched = make_scheduler(budget=8)  # a 20-token prompt takes three steps
    req = request(prompt_len=20, so=StructuredOutputsParams(choice=CHOICES))
    sched.add_request(req)
    sched.structured_output_manager.wait_for_grammars([req], 10)
    seen = []
    rng = random.Random(0)
    while sched.has_unfinished_requests():
        so = sched.schedule()
        seen.append((so.num_scheduled_tokens.get(req.request_id), list(so.structured_output_request_ids)))
        if so.grammar_bitmask is not None:
            first = allowed_tokens(so.grammar_bitmask[0])
            assert EOS not in first or req.num_output_tokens > 0
        sched.update_from_output(so, run(sched, so, rng))
    prefill = [ids for n, ids in seen[:3]]
    assert prefill == [[], [], [req.request_id]]  # partial chunks get no row; the last chunk samples
    assert all(ids == [req.request_id] for _, ids in seen[3:])
    assert_nothing_leaked(sched)


def test_mixed_batch_rows_follow_batch_order() -> None:
    sched = make_scheduler()
    regs = [request(so=StructuredOutputsParams(regex=r"[a-c]{4}")) for _ in range(2)]
    plain = [request(max_tokens=5) for _ in range(2)]
    for r in (plain[0], regs[0], plain[1], regs[1]):
        sched.add_request(r)
    outputs = drain(sched)
    for r in regs:
        text = text_of(tokens_of(outputs[r.request_id]))
        assert len(text) == 4 and set(text) <= set("abc"), text
    for r in plain:
        assert tokens_of(outputs[r.request_id]) == [7] * 5
    assert_nothing_leaked(sched)


def test_abort_while_compiling_and_while_running() -> None:
    sched = make_scheduler()
    release = block_compilation(sched)
    waiting = request(so=StructuredOutputsParams(json_object=True))
    sched.add_request(waiting)
    assert sched.schedule().is_empty
    sched.abort_requests([waiting.request_id])
    release.set()
    running = request(so=StructuredOutputsParams(regex=r"[a-z]{30}"))
    sched.add_request(running)
    sched.structured_output_manager.wait_for_grammars([running], 10)
    rng = random.Random(0)
    for _ in range(5):
        so = sched.schedule()
        sched.update_from_output(so, run(sched, so, rng))
    assert running.num_output_tokens > 0 and not running.is_finished
    sched.abort_requests([running.request_id])
    assert running.structured_output_request.grammar is None  # matcher dropped
    assert_nothing_leaked(sched)


def test_grammar_that_fails_to_compile_fails_only_its_request() -> None:
    sched = make_scheduler()
    manager = sched.structured_output_manager

    def broken(params):
        raise RuntimeError("boom in the compiler")

    manager._create_grammar = broken  # type: ignore[method-assign]
    bad = request(so=StructuredOutputsParams(regex="a+"))
    good = request(max_tokens=2)
    sched.add_request(bad)
    sched.add_request(good)
    outputs = drain(sched)
    (failure,) = outputs[bad.request_id]
    assert failure.finish_reason == FinishReason.ERROR and "boom in the compiler" in failure.error
    assert tokens_of(outputs[good.request_id]) == [7, 7]
    assert_nothing_leaked(sched)


def test_preempted_constrained_requests_resume_with_their_matcher() -> None:
    # 10 blocks of 4 tokens for three requests of 8 + 25 tokens (9 blocks each): someone is preempted.
    sched = make_scheduler(num_blocks=10, budget=16)
    so = StructuredOutputsParams(regex=r"[a-z]{24}")
    reqs = [request(prompt_len=8, so=so, max_tokens=30, offset=50 * i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    outputs = drain(sched, seed=1)
    assert sum(r.num_preemptions for r in reqs) > 0
    for r in reqs:
        text = text_of(tokens_of(outputs[r.request_id]))
        assert len(text) == 24 and text.isalpha(), text
    assert_nothing_leaked(sched)


def test_rejected_token_fails_the_request_with_a_message() -> None:
    sched = make_scheduler()
    req = request(so=StructuredOutputsParams(regex="abc"))
    sched.add_request(req)
    sched.structured_output_manager.wait_for_grammars([req], 10)
    so = sched.schedule()
    bad = tokenizer().encode("z", add_special_tokens=False)[0]
    out = sched.update_from_output(so, ModelRunnerOutput(req_ids=[req.request_id], sampled_token_ids=[[bad]]))
    (o,) = out.outputs
    assert o.finish_reason == FinishReason.ERROR and "not allowed by the grammar" in o.error
    assert_nothing_leaked(sched)


@pytest.mark.parametrize("policy_priority", [False, True])
def test_skipped_requests_keep_queue_order(policy_priority: bool) -> None:
    config = make_config(max_num_seqs=1)
    if policy_priority:
        config.scheduler_config.policy = "priority"
    sched = Scheduler(config, make_manager(config=config))
    release = block_compilation(sched)
    a = request(so=StructuredOutputsParams(choice=["x"]))
    b = request(so=StructuredOutputsParams(choice=["y"]))
    c = request(max_tokens=1)
    for r in (a, b, c):
        sched.add_request(r)
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == [c.request_id]
    assert list(sched.waiting) == [a, b]
    sched.update_from_output(so, run(sched, so, random.Random(0)))
    release.set()
    drain(sched)
    assert_nothing_leaked(sched)
