"""Prefix caching end to end on the tiny Llama: cache hits skip work and never change the output.

The second of two requests sharing a 200-token prefix must compute only its tail (counted from the
scheduler's output), produce exactly the greedy tokens of an engine without prefix caching, and report the
cached prompt tokens (``EngineCoreOutput`` / ``RequestOutput.num_cached_tokens``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny_model import PREFIX_200, ScheduleRecorder, tiny_llama_with_tokenizer
from tests.models.test_llama_correctness import step_until_idle as run
from tests.models.test_llama_correctness import tokens
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.engine_args import EngineArgs
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

MAX_TOKENS = 8
PROMPT_A = PREFIX_200 + [7, 8, 9, 10, 11]  # 205 tokens
PROMPT_B = PREFIX_200 + [300, 301, 302, 303, 304, 305, 306]  # 207 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

# (block_size, max_num_batched_tokens, tokens of the 200-token prefix that fill whole blocks)
LAYOUTS = [(16, 2048, 192), (8, 64, 200)]
LAYOUT_IDS = ["bs16-one-step-prefill", "bs8-chunked"]


def make_core(model_dir: str, block_size: int, budget: int, caching: bool = True) -> EngineCore:
    args = EngineArgs(
        model=model_dir,
        dtype="float32",
        block_size=block_size,
        max_num_batched_tokens=budget,
        num_gpu_blocks_override=128,
        enable_prefix_caching=caching,
    )
    return EngineCore(args.create_engine_config())


def request(rid: str, prompt: list[int], params: SamplingParams = GREEDY, **kw: object) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, params, eos_token_id=None, **kw)


@pytest.fixture(scope="module")
def uncached_tokens(tiny_llama_dir: str) -> dict[str, list[int]]:
    """Greedy outputs of A and B from an engine with prefix caching off (the reference)."""
    core = make_core(tiny_llama_dir, 16, 2048, caching=False)
    outs = run(core, [request("a", PROMPT_A), request("b", PROMPT_B)])
    assert all(o.num_cached_tokens == 0 for o in outs["b"])
    return {"a": tokens(outs["a"]), "b": tokens(outs["b"])}


@pytest.mark.parametrize(("block_size", "budget", "hit"), LAYOUTS, ids=LAYOUT_IDS)
def test_second_request_computes_only_its_tail(tiny_llama_dir, uncached_tokens, block_size, budget, hit):
    core = make_core(tiny_llama_dir, block_size, budget)
    rec = ScheduleRecorder(core.scheduler)
    outs_a = run(core, [request("a", PROMPT_A)])
    assert tokens(outs_a["a"]) == uncached_tokens["a"]
    assert sum(rec.scheduled_tokens("a")) == len(PROMPT_A) + MAX_TOKENS - 1  # nothing cached the first time
    assert outs_a["a"][0].num_cached_tokens == 0

    rec.clear()
    outs = run(core, [request("b", PROMPT_B)])
    computed = rec.scheduled_tokens("b")
    # The prefill covers only the uncached tail; then one token per decode step.
    assert computed[0] == len(PROMPT_B) - hit
    assert sum(computed) == len(PROMPT_B) - hit + MAX_TOKENS - 1
    assert rec.steps[0].scheduled_new_reqs[0].num_computed_tokens == hit
    assert outs["b"][0].num_cached_tokens == hit
    assert tokens(outs["b"]) == uncached_tokens["b"]


def test_prefix_cache_stats_count_each_admission_once(tiny_llama_dir):
    core = make_core(tiny_llama_dir, 16, 2048)
    queries = hits = 0
    for rid, prompt in (("a", PROMPT_A), ("b", PROMPT_B)):
        core.add_request(request(rid, prompt))
        while core.has_unfinished_requests():
            stats = core.step().scheduler_stats
            assert stats is not None
            queries += stats.prefix_cache_queries
            hits += stats.prefix_cache_hits
    assert (queries, hits) == (len(PROMPT_A) + len(PROMPT_B), 192)


@pytest.mark.parametrize(("block_size", "budget", "hit"), LAYOUTS, ids=LAYOUT_IDS)
def test_concurrent_requests_share_the_prefix(tiny_llama_dir, uncached_tokens, block_size, budget, hit):
    """Blocks are cached as soon as they are scheduled, so B hits A's prefix even when both arrive together
    (in the same step as A computes it, or after A's chunked prefill); the output is still exact."""
    core = make_core(tiny_llama_dir, block_size, budget)
    rec = ScheduleRecorder(core.scheduler)
    outs = run(core, [request("a", PROMPT_A), request("b", PROMPT_B)])
    assert outs["b"][0].num_cached_tokens == hit
    assert sum(rec.scheduled_tokens("b")) == len(PROMPT_B) - hit + MAX_TOKENS - 1
    assert tokens(outs["a"]) == uncached_tokens["a"]
    assert tokens(outs["b"]) == uncached_tokens["b"]


def test_prompt_logprobs_cache_salt_and_reset_skip_the_cache(tiny_llama_dir, uncached_tokens):
    core = make_core(tiny_llama_dir, 16, 2048)
    rec = ScheduleRecorder(core.scheduler)
    run(core, [request("a", PROMPT_A)])

    # prompt_logprobs need every prompt position's logits: no cache read (the output is unchanged).
    with_plp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=1)
    outs = run(core, [request("plp", PROMPT_B, with_plp)])
    assert rec.scheduled_tokens("plp")[0] == len(PROMPT_B)
    assert outs["plp"][0].num_cached_tokens == 0
    assert len(outs["plp"][0].prompt_logprobs or []) == len(PROMPT_B) - 1
    assert tokens(outs["plp"]) == uncached_tokens["b"]

    # A cache salt separates otherwise equal prefixes; requests with the same salt share.
    outs = run(core, [request("salted", PROMPT_B, cache_salt="tenant-1")])
    assert outs["salted"][0].num_cached_tokens == 0
    outs = run(core, [request("salted-2", PROMPT_A, cache_salt="tenant-1")])
    assert outs["salted-2"][0].num_cached_tokens == 192
    assert tokens(outs["salted-2"]) == uncached_tokens["a"]

    # After a reset nothing hits.
    assert core.reset_prefix_cache()
    outs = run(core, [request("after-reset", PROMPT_B)])
    assert outs["after-reset"][0].num_cached_tokens == 0
    assert tokens(outs["after-reset"]) == uncached_tokens["b"]


def test_llm_reports_cached_tokens_and_same_output(tiny_llama_dir, uncached_tokens, tmp_path: Path):
    model_dir = tiny_llama_with_tokenizer(tiny_llama_dir, tmp_path / "model")
    llm = LLM(model_dir, dtype="float32", block_size=16, num_gpu_blocks_override=128)
    rec = ScheduleRecorder(llm.llm_engine.engine_core.engine_core.scheduler)
    [first] = llm.generate([PROMPT_A], GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert list(first.outputs[0].token_ids) == uncached_tokens["a"]

    rec.clear()
    [second] = llm.generate([PROMPT_B], GREEDY, use_tqdm=False)
    assert second.num_cached_tokens == 192
    assert list(second.outputs[0].token_ids) == uncached_tokens["b"]
    assert sum(rec.scheduled_tokens(second.request_id)) == len(PROMPT_B) - 192 + MAX_TOKENS - 1

    # n > 1: the children share the prompt, the later ones hit the first one's blocks.
    [fan] = llm.generate([PROMPT_B], SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                         use_tqdm=False)
    assert fan.num_cached_tokens == 192
    assert [list(c.token_ids) for c in fan.outputs] == [uncached_tokens["b"]] * 3
