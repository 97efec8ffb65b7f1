"""Structured outputs through the real engine on the tiny random Llama (float32): the bitmask path gives the
tokens transformers gives under the same grammar mask; in a mixed batch every row gets exactly its solo tokens;
n > 1 with seeds, logprobs, prefix caching, preemption and aborts work, and nothing (KV blocks, matchers) leaks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from tests.engine.tiny_model import tiny_llama_with_tokenizer
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams as SO

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "ok": {"type": "boolean"},
                   "kind": {"enum": ["cat", "dog", "bird"]}},
    "required": ["id", "ok", "kind"],
}
REGEX = r"[a-f]{3}-[0-9]{2}"
PROMPTS = ["Hello world, this is", "The quick brown fox", "Numbers 0123", "naïve café"]


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_llama_with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("tiny_so") / "model")


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32")


def core_of(llm: LLM) -> EngineCore:
    return llm.llm_engine.engine_core.engine_core


def assert_idle_and_clean(llm: LLM) -> None:
    core = core_of(llm)
    assert not core.has_unfinished_requests()
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert core.structured_output_manager.num_live_requests == 0


def greedy(so: SO | None, max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so, **kw)


def ids(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


def hf_constrained_greedy(model_dir: str, prompt_ids: list[int], so: SO, max_new_tokens: int) -> list[int]:
    """transformers' greedy generate with xgrammar's mask applied by a logits processor (the reference)."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[2]))
    compiled = (compiler.compile_json_schema(json.dumps(so.json), any_whitespace=not so.disable_any_whitespace)
                if so.json else compiler.compile_regex(so.regex))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    class Mask(LogitsProcessor):
        def __init__(self) -> None:
            self.start = len(prompt_ids)

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if input_ids.shape[1] > self.start:
                assert matcher.accept_token(int(input_ids[0, -1]))
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(scores, bitmask.to(scores.device))
            return scores

    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         logits_processor=LogitsProcessorList([Mask()]), eos_token_id=2, pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


# Compact JSON: with free whitespace the random model sits near ties between "," and " " that float rounding
# (tokenmill's kernels against transformers') can flip after a few dozen tokens.
@pytest.mark.parametrize("so", [SO(json=SCHEMA, disable_any_whitespace=True), SO(regex=REGEX)], ids=["json", "regex"])
def test_bitmask_path_matches_transformers_under_the_same_mask(llm: LLM, model_dir: str, so: SO) -> None:
    prompt = llm.get_tokenizer().encode(PROMPTS[0])
    [out] = llm.generate([prompt], greedy(so, 40), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_constrained_greedy(model_dir, prompt, so, 40)
    assert_idle_and_clean(llm)


def test_outputs_satisfy_their_constraints(llm: LLM) -> None:
    sos = [SO(json=SCHEMA, disable_any_whitespace=True), SO(regex=REGEX), SO(choice=["red", "green", "blue"]),
           SO(grammar='root ::= "(" [0-9] ("," [0-9])* ")"'),
           SO(json=SCHEMA, backend="guidance", disable_any_whitespace=True)]
    outs = llm.generate(PROMPTS[:1] * len(sos), [greedy(so, 60) for so in sos], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(REGEX, texts[1])
    assert texts[2] in ("red", "green", "blue")
    assert re.fullmatch(r"\([0-9](,[0-9])*\)", texts[3])
    jsonschema.validate(json.loads(texts[4]), SCHEMA)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert_idle_and_clean(llm)


def test_mixed_batch_gives_every_row_its_solo_tokens(llm: LLM) -> None:
    params = [greedy(SO(json=SCHEMA)), greedy(None, 24, ignore_eos=True), greedy(SO(regex=REGEX)),
              greedy(None, 24, ignore_eos=True)]
    solo = [ids(llm.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(PROMPTS, params)]
    batched = ids(llm.generate(PROMPTS, params, use_tqdm=False))
    assert batched == solo
    assert len(solo[1]) == len(solo[3]) == 24
    assert_idle_and_clean(llm)


def test_n_and_seeds(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=30, structured_outputs=SO(regex=REGEX))
    first = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    again = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert ids(first) == ids(again)
    assert all(re.fullmatch(REGEX, c.text) for c in first[0].outputs)
    assert_idle_and_clean(llm)


def test_logprobs_are_over_the_constrained_distribution(llm: LLM) -> None:
    choices = ["alpha", "beta"]
    [out] = llm.generate(PROMPTS[:1], greedy(SO(choice=choices), 10, logprobs=5), use_tqdm=False)
    completion = out.outputs[0]
    tok = llm.get_tokenizer()
    first = completion.logprobs[0]
    finite = [t for t, lp in first.items() if lp.logprob > float("-inf")]
    assert finite and all(any(c.startswith(tok.decode([t])) for c in choices) for t in finite)
    total = sum(torch.tensor(lp.logprob).exp().item() for lp in first.values() if lp.logprob > float("-inf"))
    assert total == pytest.approx(1.0, abs=1e-4) or total < 1.0
    assert completion.text in choices


def test_prefix_caching_with_constraints(llm: LLM) -> None:
    prompt = llm.get_tokenizer().encode(PROMPTS[1] * 6)
    [a] = llm.generate([prompt], greedy(SO(json=SCHEMA)), use_tqdm=False)
    [b] = llm.generate([prompt], greedy(SO(json=SCHEMA)), use_tqdm=False)
    assert b.num_cached_tokens > 0
    assert ids([a]) == ids([b])
    assert_idle_and_clean(llm)


def test_invalid_constraint_is_refused_before_queueing(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="Unclosed") as info:
        llm.generate(PROMPTS[:1], greedy(SO(regex="[abc")), use_tqdm=False)
    assert info.value.param == "structured_outputs"
    core = core_of(llm)
    bad = SamplingParams(max_tokens=4, structured_outputs=SO(json={"type": "strin"}))
    with pytest.raises(InvalidRequestError) as info:
        core.add_request(EngineCoreRequest("direct", [5, 6, 7], bad))  # the engine core's own check
    assert info.value.param == "structured_outputs"
    assert_idle_and_clean(llm)
    assert ids(llm.generate(PROMPTS[:1], greedy(SO(regex=REGEX)), use_tqdm=False))  # still serving


def test_abort_mid_generation_frees_blocks_and_matchers(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("abort-me", PROMPTS[0], greedy(SO(regex="[a-z]{200}"), 250))
    engine.add_request("keep", PROMPTS[1], greedy(SO(regex=REGEX)))
    for _ in range(4):
        engine.step()
    core = core_of(llm)
    assert core.structured_output_manager.num_live_requests == 2
    engine.abort_request("abort-me")
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle_and_clean(llm)


def test_preemption_keeps_constrained_outputs(model_dir: str, llm: LLM) -> None:
    # 12 blocks of 16 tokens: four requests of ~6 prompt tokens + 150 letters (tens of tokens) cannot all stay
    # resident.
    small = LLM(model_dir, dtype="float32", block_size=16, num_gpu_blocks_override=12)
    core = core_of(small)
    preempted = []
    original = core.scheduler._preempt

    def record(request):
        preempted.append(request.request_id)
        original(request)

    core.scheduler._preempt = record  # type: ignore[method-assign]
    params = [greedy(SO(regex="[a-z]{150}"), 160) for _ in PROMPTS]
    got = ids(small.generate(PROMPTS, params, use_tqdm=False))
    assert preempted
    assert got == ids(llm.generate(PROMPTS, params, use_tqdm=False))  # the same requests with room to spare
    assert_idle_and_clean(small)
