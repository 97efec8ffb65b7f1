"""SamplingParams through the offline API on the tiny Llama: ``n > 1`` with seeds, greedy fan-out, and token ids
checked against the vocabulary (front end and engine-core backstop)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine.engine_fakes import byte_level_tokenizer, make_config
from tests.engine.tiny_model import tiny_llama_with_tokenizer
from tokenmill.engine.core import EngineCore
from tokenmill.engine.input_processor import InputProcessor, RequestInput
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams, SamplingParamsError

PROMPT = [1, 17, 42, 99, 250, 7, 8, 9]
OTHER = [1, 300, 301, 302]


@pytest.fixture(scope="module")
def tok() -> Any:
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model_dir = tiny_llama_with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("tiny_llm") / "model")
    return LLM(model_dir, dtype="float32", block_size=4, num_gpu_blocks_override=256)


def token_ids(output: RequestOutput) -> list[list[int]]:
    return [list(c.token_ids) for c in output.outputs]


# -- n > 1 ----------------------------------------------------------------------------------------------


def test_n_with_seed_is_reproducible_and_the_samples_differ(llm: LLM) -> None:
    params = SamplingParams(n=3, seed=1234, temperature=1.0, max_tokens=10, ignore_eos=True)
    [first] = llm.generate(PROMPT, params, use_tqdm=False)
    samples = token_ids(first)
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert all(len(s) == 10 for s in samples)
    assert len({tuple(s) for s in samples}) == 3, "the 3 samples of one request must differ"

    # Same request again, alone and in a batch with other (seeded and unseeded) requests: same 3 samples.
    [again] = llm.generate(PROMPT, params, use_tqdm=False)
    assert token_ids(again) == samples
    batch = llm.generate(
        [OTHER, PROMPT, OTHER],
        [SamplingParams(n=2, temperature=1.0, max_tokens=5), params, SamplingParams(seed=7, max_tokens=12)],
        use_tqdm=False,
    )
    assert token_ids(batch[1]) == samples

    # A different seed gives different samples.
    [other_seed] = llm.generate(PROMPT, SamplingParams(n=3, seed=4321, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert token_ids(other_seed) != samples


def test_n_with_greedy_gives_identical_outputs(llm: LLM) -> None:
    [single] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    [fan] = llm.generate(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert token_ids(fan) == token_ids(single) * 3
    assert len({c.text for c in fan.outputs}) == 1


# -- token ids against the vocabulary -------------------------------------------------------------------

# make_config() has a 400-token vocabulary.
OUT_OF_VOCAB = [
    pytest.param(dict(logit_bias={5: 1.0, 400: 2.0}), "logit_bias", id="logit_bias"),
    pytest.param(dict(logit_bias={"1000": 2.0}), "logit_bias", id="logit_bias-json-key"),
    pytest.param(dict(allowed_token_ids=[5, 400]), "allowed_token_ids", id="allowed_token_ids"),
    pytest.param(dict(stop_token_ids=[3, 10**6]), "stop_token_ids", id="stop_token_ids"),
    pytest.param(dict(bad_words_token_ids=[[5], [6, 400]]), "bad_words_token_ids", id="bad_words_token_ids"),
]


@pytest.mark.parametrize(("kwargs", "param"), OUT_OF_VOCAB)
def test_input_processor_rejects_token_ids_outside_the_vocabulary(tok: Any, kwargs: dict[str, Any], param: str) -> None:
    ip = InputProcessor(make_config().model_config, tok)
    with pytest.raises(SamplingParamsError) as info:
        ip.process(RequestInput(request_id="r", prompt=[5, 6], params=SamplingParams(**kwargs)))
    assert isinstance(info.value, InvalidRequestError)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}: token id ") and "0..399" in str(info.value)


def test_input_processor_accepts_the_last_token_id(tok: Any) -> None:
    ip = InputProcessor(make_config().model_config, tok)
    params = SamplingParams(
        logit_bias={399: 1.0}, allowed_token_ids=[0, 399], stop_token_ids=[399], bad_words_token_ids=[[399]]
    )
    processed = ip.process(RequestInput(request_id="r", prompt=[5, 6], params=params))
    assert processed.params.allowed_token_ids == [0, 399]


def test_llm_rejects_out_of_vocab_ids_and_keeps_serving(llm: LLM) -> None:
    vocab = llm.llm_engine.model_config.vocab_size
    assert vocab == 512
    for kwargs, param in [
        (dict(logit_bias={vocab: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[vocab]), "allowed_token_ids"),
        (dict(stop_token_ids=[vocab + 5]), "stop_token_ids"),
        (dict(bad_words_token_ids=[[3, vocab]]), "bad_words_token_ids"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            llm.generate([PROMPT, OTHER], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
        assert info.value.param == param
        assert not llm.llm_engine.has_unfinished_requests()
    # The last id is valid: a request allowed only that token generates only that token.
    [out] = llm.generate(PROMPT, SamplingParams(allowed_token_ids=[vocab - 1], max_tokens=3), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == [vocab - 1] * 3


def test_engine_core_backstop_rejects_out_of_vocab_ids(llm: LLM) -> None:
    core: EngineCore = llm.llm_engine.engine_core.engine_core
    vocab = core.config.model_config.vocab_size
    for kwargs, param in [
        (dict(logit_bias={vocab: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[vocab]), "allowed_token_ids"),
        (dict(stop_token_ids=[vocab]), "stop_token_ids"),
        (dict(bad_words_token_ids=[[vocab]]), "bad_words_token_ids"),
    ]:
        with pytest.raises(SamplingParamsError) as info:
            core.add_request(EngineCoreRequest("bypass", PROMPT, SamplingParams(max_tokens=2, **kwargs)))
        assert info.value.param == param
        assert not core.has_unfinished_requests()


def test_tokenized_bad_words_outside_the_model_vocabulary(tok: Any) -> None:
    """A tokenizer larger than the model: a bad word whose ids the model cannot produce is an error."""
    small = make_config(vocab_size=300).model_config
    # A word whose own tokenization (as InputProcessor does it: stripped) needs an id the model lacks. Chosen
    # by checking, not by vocabulary order: the trained merges and get_vocab()'s order vary between processes.
    by_id = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    words = (tok.convert_tokens_to_string([t]).strip() for t, i in by_id if i >= 300 and not t.startswith("<"))
    word = next(w for w in words if w and max(tok.encode(w, add_special_tokens=False)) >= 300)
    ip = InputProcessor(small, tok)
    with pytest.raises(SamplingParamsError) as info:
        ip.process(RequestInput(request_id="r", prompt=[5, 6], params=SamplingParams(bad_words=[word])))
    assert info.value.param == "bad_words"
