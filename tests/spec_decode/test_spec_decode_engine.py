"""Speculative decoding end to end on tiny random Llamas: the output is the non-speculative engine's, token for
token (greedy, and seeded sampling with n-gram drafts), with penalties, logprobs, stop tokens and max_tokens
inside a draft, prefix caching, preemption and aborts; no KV block leaks and prefix-cache hashes cover only
verified tokens (checked after every step)."""

from __future__ import annotations

import pytest

from tests.spec_decode.engine_utils import NGRAM, make_core, run
from tokenmill.sampling_params import SamplingParams

REPEAT = [5, 6, 7, 8, 9, 10, 11, 12] * 5  # copying context: n-gram lookup proposes from it
PROMPTS = {
    "plain": REPEAT,
    "counting": list(range(20, 70)),
    "loop": [100, 101, 102] * 9,
    "short": [3, 4],
}


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 30), ignore_eos=True, **kw)


def mixed_requests() -> list[tuple[str, list[int], SamplingParams]]:
    return [
        ("plain", PROMPTS["plain"], greedy()),
        ("penalties", PROMPTS["counting"], greedy(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)),
        ("logprobs", PROMPTS["loop"], greedy(logprobs=2, max_tokens=25)),
        ("min_tokens", PROMPTS["short"], greedy(min_tokens=12, stop_token_ids=[7, 100, 101], max_tokens=31)),
        ("bad_words", PROMPTS["loop"], greedy(bad_words_token_ids=[[102, 100]], max_tokens=17)),
    ]


def seeded_requests() -> list[tuple[str, list[int], SamplingParams]]:
    return [
        (f"seeded-{i}", p, SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=100 + i, max_tokens=24,
                                          ignore_eos=True))
        for i, p in enumerate(PROMPTS.values())
    ]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str):
    return run(make_core(tiny_llama_dir), mixed_requests() + seeded_requests())


def assert_same_logprobs(a, b) -> None:
    assert len(a) == len(b)
    for (ids_a, lps_a, rank_a), (ids_b, lps_b, rank_b) in zip(a, b):
        assert ids_a == ids_b and rank_a == rank_b
        assert lps_a == pytest.approx(lps_b, abs=1e-4)


def test_ngram_output_is_identical(tiny_llama_dir, reference) -> None:
    res = run(make_core(tiny_llama_dir, NGRAM), mixed_requests() + seeded_requests())
    assert res.tokens == reference.tokens
    for rid in res.tokens:
        assert res.finish_reason(rid) == reference.finish_reason(rid)
    assert_same_logprobs(res.logprobs("logprobs"), reference.logprobs("logprobs"))
    assert res.spec.num_draft_tokens > 0 and res.spec.num_accepted_tokens > 0
    assert res.steps < reference.steps  # accepted drafts save steps


@pytest.mark.parametrize("draft", ["other", "self"])
def test_draft_model_greedy_output_is_identical(tiny_llama_dir, tiny_draft_dir, reference, draft) -> None:
    model = tiny_draft_dir if draft == "other" else tiny_llama_dir
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    res = run(make_core(tiny_llama_dir, spec), mixed_requests())
    assert res.tokens == {rid: reference.tokens[rid] for rid in res.tokens}
    assert_same_logprobs(res.logprobs("logprobs"), reference.logprobs("logprobs"))
    assert res.spec.num_draft_tokens > 0
    if draft == "self":
        # the target as its own draft: every greedy draft of a request without logit processing (the draft
        # drafts from raw logits; penalties, bad words and min_tokens apply only in verification) is the
        # target's own next token
        plain = [(rid, p, greedy(max_tokens=29)) for rid, p in PROMPTS.items()]
        res = run(make_core(tiny_llama_dir, spec), plain)
        assert res.spec.acceptance_rate == 1.0
        assert res.spec.mean_acceptance_length == 4.0
        assert res.steps == 1 + 28 // 4


def test_stop_token_and_max_tokens_inside_a_draft(tiny_llama_dir) -> None:
    """Nothing is emitted after a stop token or past max_tokens, even when the draft ran further."""
    base = run(make_core(tiny_llama_dir), [("a", REPEAT, greedy(max_tokens=40))]).tokens["a"]
    stop_at = next(i for i in range(6, 40) if base[i] not in base[:i])
    requests = [("stop", REPEAT, greedy(max_tokens=40, stop_token_ids=[base[stop_at]])),
                ("len", REPEAT, greedy(max_tokens=stop_at + 2))]
    for spec in (NGRAM, {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 4}):
        res = run(make_core(tiny_llama_dir, spec), requests)
        assert res.tokens["stop"] == base[: stop_at + 1]
        assert res.finish_reason("stop").name == "STOP"
        assert res.tokens["len"] == base[: stop_at + 2]
        assert res.finish_reason("len").name == "LENGTH"


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_prefix_caching_and_preemption(tiny_llama_dir, method) -> None:
    """A KV cache too small for the batch (preemptions) and shared prefixes (cache hits): same tokens as a
    roomy engine without prefix caching or speculation."""
    shared = REPEAT[:24]
    requests = [(f"r{i}", shared + [200 + i, 201 + i, 5, 6, 7], greedy(max_tokens=28)) for i in range(5)]
    expected = run(make_core(tiny_llama_dir, enable_prefix_caching=False), requests)
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": tiny_llama_dir,
                                            "num_speculative_tokens": 3}
    res = run(make_core(tiny_llama_dir, spec, num_gpu_blocks_override=40, max_num_batched_tokens=48), requests)
    assert res.tokens == expected.tokens
    assert res.num_preemptions > 0 and res.prefix_cache_hits > 0
    assert res.spec.num_accepted_tokens > 0


def test_aborts_mid_speculation_free_everything(tiny_llama_dir) -> None:
    requests = [(f"r{i}", REPEAT, greedy(max_tokens=40)) for i in range(3)]
    res = run(make_core(tiny_llama_dir, NGRAM), requests, abort_after={"r0": 5, "r2": 11})
    assert len(res.tokens["r1"]) == 40
    assert 5 <= len(res.tokens["r0"]) < 40 and 11 <= len(res.tokens["r2"]) < 40


def test_n_greater_than_one_through_llm(tiny_llama_dir, tmp_path) -> None:
    from tests.engine.tiny_model import tiny_llama_with_tokenizer
    from tokenmill.entrypoints.llm import LLM

    model = tiny_llama_with_tokenizer(tiny_llama_dir, tmp_path / "m")
    prompts = [REPEAT, PROMPTS["loop"]]
    params = [SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=20, ignore_eos=True),
              SamplingParams(n=2, temperature=0.0, max_tokens=20, ignore_eos=True)]

    def texts(**kw) -> list[list[list[int]]]:
        llm = LLM(model=model, dtype="float32", num_gpu_blocks_override=128, block_size=4, **kw)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [[list(c.token_ids) for c in o.outputs] for o in outs]
        finally:
            llm.llm_engine.shutdown()

    plain = texts()
    spec = texts(speculative_config=NGRAM)
    assert spec == plain
    assert len(plain[0]) == 3 and len(plain[1]) == 2


def test_token_budget_shorter_than_the_drafts(tiny_llama_dir) -> None:
    """With a budget of 6 tokens for 3 speculating requests, drafts are cut (never the budget exceeded)."""
    from tests.engine.tiny_model import ScheduleRecorder

    requests = [(f"r{i}", REPEAT[i:], greedy(max_tokens=24)) for i in range(3)]
    expected = run(make_core(tiny_llama_dir), requests)
    core = make_core(tiny_llama_dir, NGRAM, max_num_batched_tokens=6)
    rec = ScheduleRecorder(core.scheduler)
    res = run(core, requests)
    assert res.tokens == expected.tokens
    assert all(s.total_num_scheduled_tokens <= 6 for s in rec.steps)
    cut = [len(d) for s in rec.steps for d in s.scheduled_spec_decode_tokens.values()]
    assert cut and min(cut) < 4 and max(cut) == 4
