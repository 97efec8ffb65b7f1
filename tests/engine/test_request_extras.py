"""Per-request engine options the server passes through, on the tiny Llama: ``cache_salt`` separates prefix-cache
blocks (through ``LLMEngine.add_request``, as ``AsyncLLM.generate`` passes it) and per-request logits
processors (``SamplingParams.logits_processors``) run in the model runner for their own request only."""

from __future__ import annotations

import pytest

from tests.engine.tiny_model import PREFIX_200, tiny_llama_with_tokenizer
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import LogitsProcessorSpec, SamplingParams

FIXTURES = "tests.entrypoints.logits_processor_fixtures"
PATTERN = r"tests\.entrypoints\.logits_processor_fixtures[:.].*"
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model_dir = tiny_llama_with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("tiny_extras") / "model")
    return LLM(model_dir, dtype="float32", block_size=16, num_gpu_blocks_override=128,
               logits_processor_pattern=PATTERN)


def run_one(llm: LLM, request_id: str, cache_salt: str | None) -> RequestOutput:
    engine = llm.llm_engine
    engine.add_request(request_id, PREFIX_200, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                       cache_salt=cache_salt)
    finished: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    [out] = finished
    return out


def test_cache_salt_separates_prefix_blocks(llm: LLM) -> None:
    full_blocks = (len(PREFIX_200) - 1) // 16 * 16
    assert run_one(llm, "a1", "tenant-a").num_cached_tokens == 0
    assert run_one(llm, "a2", "tenant-a").num_cached_tokens == full_blocks
    assert run_one(llm, "b1", "tenant-b").num_cached_tokens == 0  # same prompt, other salt: nothing shared
    assert run_one(llm, "n1", None).num_cached_tokens == 0
    assert run_one(llm, "b2", "tenant-b").num_cached_tokens == full_blocks


def test_request_logits_processors_act_on_their_own_request(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [alone] = llm.generate([[5, 6, 7]], plain, use_tqdm=False)
    forced = SamplingParams(temperature=0.8, seed=1, max_tokens=MAX_TOKENS, ignore_eos=True, logits_processors=[
        LogitsProcessorSpec(qualname=f"{FIXTURES}:only_token", args=[42])])
    echo = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logits_processors=[
        LogitsProcessorSpec(qualname=f"{FIXTURES}.after_prompt")])
    outs = llm.generate([[5, 6, 7], [9, 10], [11, 12, 13]], [plain, forced, echo], use_tqdm=False)
    assert list(outs[1].outputs[0].token_ids) == [42] * MAX_TOKENS
    assert list(outs[2].outputs[0].token_ids) == [13] * MAX_TOKENS
    assert list(outs[0].outputs[0].token_ids) == list(alone.outputs[0].token_ids)  # untouched beside them


def test_request_logits_processors_are_refused_before_running(llm: LLM) -> None:
    bad = SamplingParams(max_tokens=2, logits_processors=[LogitsProcessorSpec(qualname="os:getcwd")])
    with pytest.raises(InvalidRequestError, match="not allowed") as info:
        llm.generate([[5, 6]], bad, use_tqdm=False)
    assert info.value.param == "logits_processors"
    assert not llm.llm_engine.has_unfinished_requests()
