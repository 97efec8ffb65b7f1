"""InputProcessor validation, and LLMEngine / LLM end to end over an in-process fake EngineCore."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.engine.engine_fakes import REJECT_TOKEN, EchoEngineCore, byte_level_tokenizer, make_config
from tokenmill.config import CacheConfig
from tokenmill.engine.input_processor import InputProcessor, ProcessedRequest, RequestInput
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams


def _process(ip: InputProcessor, request_id: str, prompt: Any, params: SamplingParams, **options: Any
             ) -> ProcessedRequest:
    return ip.process(RequestInput(request_id=request_id, prompt=prompt, params=params, **options))


CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tok() -> Any:
    return byte_level_tokenizer()


@pytest.fixture
def llm(tok: Any) -> LLM:
    return LLM.from_llm_engine(LLMEngine(make_config(), tokenizer=tok, engine_core_cls=EchoEngineCore))


def core_of(llm: LLM) -> EchoEngineCore:
    return llm.llm_engine.engine_core.engine_core


# -- InputProcessor --------------------------------------------------------------------------------------


def test_input_validation(tok: Any) -> None:
    ip = InputProcessor(make_config(max_model_len=32).model_config, tok)
    cases = [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([5, 400], SamplingParams(), "prompt"),  # vocab is 400
        ([5, -1], SamplingParams(), "prompt"),
        ([5] * 32, SamplingParams(max_tokens=None), "prompt"),
        ([5] * 10, SamplingParams(max_tokens=23), "max_tokens"),
        ("x\ud800", SamplingParams(), "prompt"),
    ]
    for prompt, params, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            _process(ip, "r", prompt, params)
        assert info.value.param == param, prompt
    with pytest.raises(InvalidRequestError) as info:
        _process(ip, "r", "", SamplingParams(), prompt_param="messages")
    assert info.value.param == "messages"
    with pytest.raises(InvalidRequestError) as info:
        _process(ip, "r", [5], SamplingParams(stop=["x"], detokenize=False))
    assert info.value.param == "stop"


def test_input_resolution(tok: Any) -> None:
    config = make_config(max_model_len=32)
    config.model_config.hf_config = SimpleNamespace(vocab_size=400, eos_token_id=[2, 3])
    ip = InputProcessor(config.model_config, tok)
    processed = _process(ip, "r", [5] * 10, SamplingParams(max_tokens=None, n=3, seed=10), arrival_time=1.5)
    assert processed.params.max_tokens == 22
    assert [r.request_id for r in processed.engine_requests] == ["0_r", "1_r", "2_r"]
    assert [r.sampling_params.seed for r in processed.engine_requests] == [10, 11, 12]
    assert all(r.sampling_params.n == 1 for r in processed.engine_requests)
    first = processed.engine_requests[0]
    assert first.eos_token_id == 2 and first.sampling_params.stop_token_ids == [3] and first.arrival_time == 1.5
    single = _process(ip, "s", [5], SamplingParams(ignore_eos=True)).engine_requests
    assert [r.request_id for r in single] == ["s"] and single[0].sampling_params.stop_token_ids == []


def test_kv_cache_capacity(tok: Any) -> None:
    config = make_config(max_model_len=256)
    ip = InputProcessor(config.model_config, tok, CacheConfig(block_size=16, num_gpu_blocks=4))  # 64 tokens
    assert _process(ip, "r", [5] * 10, SamplingParams(max_tokens=None)).params.max_tokens == 54
    with pytest.raises(InvalidRequestError) as info:
        _process(ip, "r", [5] * 10, SamplingParams(max_tokens=60))
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as info:
        _process(ip, "r", [5] * 64, SamplingParams(max_tokens=None))
    assert info.value.param == "prompt"


# -- LLMEngine / LLM -------------------------------------------------------------------------------------


def test_generate_keeps_order_and_accepts_all_prompt_forms(llm: LLM, tok: Any) -> None:
    ids = tok.encode("fox", add_special_tokens=False)
    outs = llm.generate(
        ["Hello world", ids, {"prompt": "naïve 🎉"}, {"prompt_token_ids": [5, 6]}],
        SamplingParams(max_tokens=64, ignore_eos=True),
        use_tqdm=False,
    )
    assert outs[0].prompt == "Hello world" and outs[1].prompt is None
    assert [len(o.outputs[0].token_ids) for o in outs] == [64] * 4
    assert outs[2].outputs[0].text.startswith("naïve 🎉naïve 🎉")
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    single = llm.generate(ids, SamplingParams(max_tokens=len(ids)), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].text == "fox"


def test_generate_per_prompt_params_n_and_stop(llm: LLM) -> None:
    outs = llm.generate(
        ["The end. STOP here.", "abc"],
        [SamplingParams(max_tokens=50, stop=["STOP"], n=2), SamplingParams(max_tokens=2)],
        use_tqdm=True,
    )
    assert [c.text for c in outs[0].outputs] == ["The end. ", "The end. "]
    assert outs[1].outputs[0].finish_reason == "length"
    assert sorted(core_of(llm).aborted) == ["0_0", "1_0"]  # stop strings freed the engine-core requests
    assert not core_of(llm).has_unfinished_requests()
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_bad_prompt_in_batch_aborts_the_batch(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", ""], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="rejected by the fake"):
        llm.generate([[5, 6], [REJECT_TOKEN, 5]], use_tqdm=False)
    assert not core_of(llm).has_unfinished_requests()
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate("ok", SamplingParams(max_tokens=1), use_tqdm=False)[0].finished


def test_chat(llm: LLM) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    outs = llm.chat(messages, SamplingParams(max_tokens=3), use_tqdm=False, chat_template=CHAT_TEMPLATE)
    assert outs[0].prompt == "<user>hi\n<assistant>"
    two = llm.chat([messages, messages], use_tqdm=False, chat_template=CHAT_TEMPLATE)
    assert len(two) == 2
    with pytest.raises(ValueError, match="chat template"):
        llm.chat(messages, use_tqdm=False)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(messages, use_tqdm=False, chat_template=CHAT_TEMPLATE, continue_final_message=True)


def test_llm_engine_step_api(tok: Any) -> None:
    engine = LLMEngine(make_config(), tokenizer=tok, engine_core_cls=EchoEngineCore)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequestError, match="already in flight"):
        engine.add_request("a", [5], SamplingParams())
    outs = engine.step()
    assert {o.request_id for o in outs} == {"a", "b"}
    engine.abort_request("b")
    assert engine.engine_core.engine_core.aborted == ["b"]
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].request_id == "a" and outs[0].outputs[0].token_ids == [5, 6, 7]
    assert engine.get_stats().num_running_reqs == 0
    assert engine.step() == []


def test_unknown_llm_kwargs() -> None:
    with pytest.raises(TypeError, match="max_model_len"):
        LLM(model="x", max_model_length=5)


def test_bad_words_are_tokenized(tok: Any) -> None:
    ip = InputProcessor(make_config().model_config, tok)
    params = _process(ip, "r", [5], SamplingParams(bad_words=["fox"], bad_words_token_ids=[[7]])).params
    fox, space_fox = tok.encode("fox", add_special_tokens=False), tok.encode(" fox", add_special_tokens=False)
    assert params.bad_words_token_ids == [[7], fox, space_fox]



def test_step_log_writes_one_line_per_step_with_tokens(tmp_path, monkeypatch) -> None:
    from tokenmill.engine.step_log import ENV, StepLog

    monkeypatch.delenv(ENV, raising=False)
    assert StepLog().file is None
    monkeypatch.setenv(ENV, str(tmp_path / "steps"))
    log = StepLog()
    out = SimpleNamespace(is_empty=False, num_scheduled_tokens={"a": 1, "b": 7, "c": 1}, total_num_scheduled_tokens=9)
    log.record(0.0, out)  # type: ignore[arg-type]
    log.record(1.0, SimpleNamespace(is_empty=True, num_scheduled_tokens={}, total_num_scheduled_tokens=0))  # type: ignore[arg-type]
    lines = next(tmp_path.iterdir()).read_text().splitlines()
    assert len(lines) == 1
    start, ms, tokens, reqs, prefills = lines[0].split()
    assert (float(start), int(tokens), int(reqs), int(prefills)) == (0.0, 9, 3, 1) and float(ms) > 0
