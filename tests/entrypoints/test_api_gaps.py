"""The API gaps a client found, against the fake engine: request fields (ignored, refused, unrecognized),
custom chat roles and content parts, null content, the OpenAI temperature range, every bad logit_bias key
named, legacy logprobs with ``logprobs: 0``, ``return_tokens_as_token_ids``, ``truncate_prompt_tokens`` and
``priority``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tokenmill.entrypoints.openai.api_server import build_app
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest
from tokenmill.entrypoints.openai.request_fields import FieldPolicy, Refused, check_request_fields
from tokenmill.errors import InvalidRequestError

from tests.entrypoints.fake_engine import REPLY, FakeAsyncLLM, server_args
from tests.entrypoints.helpers import CHAT, COMPLETIONS, assert_error, sse_chunks

MESSAGES = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": 4, **fields}


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"prompt": "ab", "max_tokens": 4, **fields}


def prompt_text(engine: FakeAsyncLLM, i: int = -1) -> str:
    prompt = engine.calls[i].prompt
    assert isinstance(prompt, list)
    return "".join(map(chr, prompt))


# ------------------------------------------------------------------------------------------ request fields


def test_ignored_fields_are_accepted_and_change_nothing(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    assert client.post(CHAT, json=chat(seed=1)).status_code == 200
    ignored = {"metadata": {"a": "b"}, "store": True, "service_tier": "auto", "prompt_cache_key": "k",
               "safety_identifier": "u1", "user": "me", "prediction": {"type": "content", "content": "x"},
               "parallel_tool_calls": False, "prompt_cache_retention": "24h"}
    assert client.post(CHAT, json=chat(seed=1, **ignored)).status_code == 200
    assert fake_engine.calls[0].params == fake_engine.calls[1].params
    assert prompt_text(fake_engine, 0) == prompt_text(fake_engine, 1)
    assert client.post(COMPLETIONS, json=cmpl(metadata={"a": "b"}, store=False)).status_code == 200


def test_refused_fields_with_a_no_op_value_are_accepted(client: TestClient) -> None:
    no_ops = {"use_beam_search": False, "length_penalty": 1.0, "modalities": ["text"], "functions": [],
              "function_call": "none", "include_reasoning": True, "logits_processors": [], "return_token_ids": False}
    assert client.post(CHAT, json=chat(**no_ops)).status_code == 200
    assert client.post(COMPLETIONS, json=cmpl(use_beam_search=False, response_format={"type": "text"})).status_code == 200


def test_null_means_not_given_for_any_field(client: TestClient) -> None:
    assert client.post(CHAT, json=chat(no_such_field=None, audio=None, web_search_options=None)).status_code == 200


def test_every_offending_field_is_named(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    body = chat(guided_decoding_backend="xgrammar", use_beam_search=True, modalities=["text", "audio"], zzz=1)
    error = assert_error(client.post(CHAT, json=body), 400, "guided_decoding_backend")
    for name in ("guided_decoding_backend", "use_beam_search", "modalities", "zzz"):
        assert f"{name}:" in error["message"]
    assert "unrecognized" in error["message"]
    assert fake_engine.calls == []


@pytest.mark.parametrize(("field", "value"), [
    ("audio", {"voice": "alloy", "format": "mp3"}), ("reasoning_effort", "low"), ("verbosity", "low"),
    ("web_search_options", {}), ("functions", [{"name": "f"}]), ("request_id", "abc"),
    ("chat_template", "{{ 1 }}"), ("documents", [{"text": "x"}]), ("kv_transfer_params", {}),
])
def test_chat_fields_that_change_the_meaning_are_refused(client: TestClient, field: str, value: Any) -> None:
    error = assert_error(client.post(CHAT, json=chat(**{field: value})), 400, field)
    assert error["message"].startswith(f"{field}: ")


def test_cache_salt_reaches_the_engine(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    assert client.post(CHAT, json=chat(cache_salt="tenant-a")).status_code == 200
    assert client.post(COMPLETIONS, json=cmpl(cache_salt="tenant-b")).status_code == 200
    assert client.post("/v1/responses", json={"input": "Hi", "cache_salt": "tenant-c"}).status_code == 200
    assert client.post(CHAT, json=chat()).status_code == 200
    assert [call.cache_salt for call in fake_engine.calls] == ["tenant-a", "tenant-b", "tenant-c", None]
    for path, body in ((CHAT, chat(cache_salt="")), (COMPLETIONS, cmpl(cache_salt=5)),
                       ("/v1/responses", {"input": "Hi", "cache_salt": ""})):
        assert_error(client.post(path, json=body), 400, "cache_salt")
    assert len(fake_engine.calls) == 4


PROCESSOR = "tests.entrypoints.logits_processor_fixtures:only_token"


def test_logits_processors_need_the_server_pattern(client: TestClient) -> None:
    error = assert_error(client.post(CHAT, json=chat(logits_processors=[PROCESSOR])), 400, "logits_processors")
    assert "--logits-processor-pattern" in error["message"]


def test_logits_processors_allowed_by_pattern() -> None:
    engine = FakeAsyncLLM(logits_processor_pattern=r"tests\.entrypoints\.logits_processor_fixtures[:.].*")
    with TestClient(build_app(engine, server_args())) as c:
        constructor = {"qualname": PROCESSOR, "args": [65]}
        assert c.post(CHAT, json=chat(logits_processors=[constructor])).status_code == 200
        dotted = "tests.entrypoints.logits_processor_fixtures.after_prompt"
        assert c.post(COMPLETIONS, json=cmpl(logits_processors=[dotted])).status_code == 200
        specs = [call.params.logits_processors for call in engine.calls]
        assert [[(s.qualname, s.args) for s in spec or []] for spec in specs] == [[(PROCESSOR, [65])],
                                                                               [(dotted, None)]]
        for processors, words in (
            (["os:system"], "not allowed"),
            (["tests.entrypoints.logits_processor_fixtures:nope"], "could not be imported"),
            ([{"qualname": "tests.entrypoints.logits_processor_fixtures:failing_factory", "args": ["boom"]}],
             "boom"),
            ([PROCESSOR], "positional arguments"),  # the factory itself takes one argument
            ([{"qualname": ""}], None),
        ):
            error = assert_error(c.post(CHAT, json=chat(logits_processors=processors)), 400,
                                 "logits_processors" if words else "logits_processors.[0]")
            assert words is None or words in error["message"], error


def test_structured_output_fields_are_used_not_ignored(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    # Before structured outputs these were served unconstrained with a 200 (the field was silently ignored):
    # now each one constrains the output, and a bad one is a 400 naming it before anything is queued.
    for path, field, value in ((CHAT, "structured_outputs", {"json": {"type": "object"}}),
                               (COMPLETIONS, "structured_outputs", {"regex": "[0-9]+"}),
                               (COMPLETIONS, "guided_json", {"type": "object"}),
                               (CHAT, "guided_choice", ["yes", "no"])):
        body = chat(**{field: value}) if path == CHAT else cmpl(**{field: value})
        assert client.post(path, json=body).status_code == 200
        assert fake_engine.calls[-1].params.structured_outputs is not None
    calls = len(fake_engine.calls)
    for path, field, value, param in ((CHAT, "structured_outputs", {"regex": "[0-9"}, "structured_outputs"),
                                      (COMPLETIONS, "guided_json", {"type": "no-such-type"}, "guided_json"),
                                      (CHAT, "structured_outputs", {"jsn": {}}, "structured_outputs.jsn")):
        body = chat(**{field: value}) if path == CHAT else cmpl(**{field: value})
        assert_error(client.post(path, json=body), 400, param)
    assert len(fake_engine.calls) == calls


def test_field_policy_no_op_values_compare_types() -> None:
    class Model(ChatCompletionRequest):
        pass

    policy = FieldPolicy(refused={"flag": Refused("no", (True,))})
    assert check_request_fields(Model, {"messages": [], "flag": True}, policy) == {"messages": []}
    with pytest.raises(InvalidRequestError) as info:
        check_request_fields(Model, {"messages": [], "flag": 1}, policy)  # 1 == True, but not a boolean
    assert info.value.param == "flag"


def test_every_declared_field_is_documented_or_used() -> None:
    # Every field a request model declares, ignores or refuses is named in the docs (docs/serving.md, or the
    # page of the feature it belongs to); a new field must be documented too.
    import pathlib

    docs = "\n".join(p.read_text(encoding="utf-8") for p in sorted(pathlib.Path("docs").glob("*.md")))
    for model in (ChatCompletionRequest, CompletionRequest, ResponsesRequest):
        for name in model.model_fields:
            assert f"`{name}`" in docs, f"{model.__name__}.{name} is not documented in docs/serving.md"
        for name in [*model.field_policy.ignored, *model.field_policy.refused]:
            assert f"`{name}`" in docs, f"{model.__name__}'s policy for {name} is not documented in docs/serving.md"


# ------------------------------------------------------------------------------------------------ messages


def test_custom_roles_reach_the_template(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    messages = [{"role": "narrator", "content": "Once"}, {"role": "user", "content": "Hi"}]
    assert client.post(CHAT, json=chat(messages=messages)).status_code == 200
    assert prompt_text(fake_engine) == "<|narrator|>Once\n<|user|>Hi\n<|assistant|>"


def test_content_parts_equal_the_same_string(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    as_string = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]
    as_parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    for messages in (as_string, as_parts):
        assert client.post(CHAT, json=chat(messages=messages)).status_code == 200
    assert fake_engine.calls[0].prompt == fake_engine.calls[1].prompt
    tokens = [client.post("/tokenize", json={"messages": m}).json()["tokens"] for m in (as_string, as_parts)]
    assert tokens[0] == tokens[1] == fake_engine.calls[0].prompt


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool", "narrator"])
def test_null_content_is_refused_outside_assistant_turns(client: TestClient, role: str) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": role, "content": None}]
    error = assert_error(client.post(CHAT, json=chat(messages=messages)), 400, "messages.[1].content")
    assert repr(role) in error["message"]


def test_assistant_turn_without_content(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None,
                                                     "tool_calls": [{"id": "c1", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert client.post(CHAT, json=chat(messages=messages)).status_code == 200
    assert prompt_text(fake_engine) == "<|user|>Hi\n<|assistant|>\n<|tool|>42\n<|assistant|>"


# ------------------------------------------------------------------------------------------ sampling ranges


def test_temperature_openai_range(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    assert client.post(CHAT, json=chat(temperature=2)).status_code == 200
    assert client.post(COMPLETIONS, json=cmpl(temperature=0)).status_code == 200
    assert fake_engine.calls[0].params.temperature == 2.0
    error = assert_error(client.post(CHAT, json=chat(temperature=2.01)), 400, "temperature")
    assert "between 0 and 2" in error["message"]


def test_logit_bias_names_every_bad_key_and_value(client: TestClient) -> None:
    body = chat(logit_bias={"a": 1, "5": 2, "b c": 3, "7": 150, "8": -101})
    error = assert_error(client.post(CHAT, json=body), 400, "logit_bias")
    for part in ("'a'", "'b c'", "'7': 150", "'8': -101"):
        assert part in error["message"]
    assert "'5'" not in error["message"]


def test_out_of_vocabulary_ids_are_all_named(client: TestClient) -> None:
    error = assert_error(client.post(COMPLETIONS, json=cmpl(logit_bias={"1000": 1, "5": 1, "1234": 2})), 400,
                         "logit_bias")
    assert "1000" in error["message"] and "1234" in error["message"]
    error = assert_error(client.post(COMPLETIONS, json=cmpl(prompt=list(range(990, 1030)))), 400, "prompt")
    assert "1000, 1001" in error["message"] and "and 20 more" in error["message"]


# ---------------------------------------------------------------------------------------------- logprobs


def test_completion_logprobs_zero_gives_the_logprobs_object(client: TestClient) -> None:
    lp = client.post(COMPLETIONS, json=cmpl(logprobs=0)).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == list(REPLY[:4])
    assert lp["token_logprobs"] == [-0.25] * 4
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert lp["top_logprobs"] == [{ch: -0.25} for ch in REPLY[:4]]  # the actual token, as OpenAI's legacy API
    chunks = sse_chunks(client.post(COMPLETIONS, json=cmpl(logprobs=0, stream=True)).text)
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for s in streamed for t in s["top_logprobs"]] == lp["top_logprobs"]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]


def test_return_tokens_as_token_ids(client: TestClient) -> None:
    lp = client.post(COMPLETIONS, json=cmpl(logprobs=1, return_tokens_as_token_ids=True, echo=True)).json()
    lp = lp["choices"][0]["logprobs"]
    ids = [ord(c) for c in "ab" + REPLY[:4]]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert lp["top_logprobs"][2] == {f"token_id:{ord('P')}": -0.25}
    assert lp["text_offset"] == [0, 1, 2, 3, 4, 5]  # offsets count characters of the text, not of the labels
    content = client.post(CHAT, json=chat(logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)).json()
    first = content["choices"][0]["logprobs"]["content"][0]
    assert first["token"] == f"token_id:{ord('P')}"
    assert first["bytes"] == list(b"P")
    assert first["top_logprobs"][0]["token"] == f"token_id:{ord('P')}"
    chunks = sse_chunks(client.post(CHAT, json=chat(logprobs=True, stream=True, return_tokens_as_token_ids=True)).text)
    streamed = [e["token"] for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == [f"token_id:{ord(c)}" for c in REPLY[:4]]


def test_server_default_for_return_tokens_as_token_ids(fake_engine: FakeAsyncLLM) -> None:
    with TestClient(build_app(fake_engine, server_args(return_tokens_as_token_ids=True))) as c:
        lp = c.post(COMPLETIONS, json=cmpl(logprobs=0)).json()["choices"][0]["logprobs"]
        assert lp["tokens"][0] == f"token_id:{ord('P')}"
        lp = c.post(COMPLETIONS, json=cmpl(logprobs=0, return_tokens_as_token_ids=False)).json()
        assert lp["choices"][0]["logprobs"]["tokens"][0] == "P"


# ---------------------------------------------------------------------------------------- vLLM's extras


def test_truncate_prompt_tokens(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    r = client.post(COMPLETIONS, json=cmpl(prompt="abcdef", truncate_prompt_tokens=2, echo=True))
    assert fake_engine.calls[-1].prompt == [ord("e"), ord("f")]
    assert r.json()["choices"][0]["text"].startswith("ef" + REPLY[0])
    assert r.json()["usage"]["prompt_tokens"] == 2
    client.post(COMPLETIONS, json=cmpl(prompt="abc", truncate_prompt_tokens=-1))
    assert fake_engine.calls[-1].prompt == [ord(c) for c in "abc"]
    client.post(CHAT, json=chat(truncate_prompt_tokens=5))
    assert prompt_text(fake_engine) == "ant|>"


def test_priority_needs_the_priority_policy(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    assert client.post(CHAT, json=chat(priority=0)).status_code == 200
    error = assert_error(client.post(CHAT, json=chat(priority=3)), 400, "priority")
    assert "--scheduling-policy priority" in error["message"]
    fake_engine.engine_config = SimpleNamespace(model_config=fake_engine.model_config,
                                                scheduler_config=SimpleNamespace(policy="priority"))
    with TestClient(build_app(fake_engine, server_args())) as c:
        assert c.post(COMPLETIONS, json=cmpl(priority=-2)).status_code == 200
        assert c.post(CHAT, json=chat(priority=4)).status_code == 200
    assert [call.priority for call in fake_engine.calls] == [0, -2, 4]


# ------------------------------------------------------------------------------------------- text offsets


def test_text_offsets_follow_the_detokenized_text() -> None:
    from tokenmill.engine.detokenizer import TokenizerView
    from tokenmill.entrypoints.openai.logprobs import TextOffsets

    from tests.engine.engine_fakes import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    view = TokenizerView(tokenizer)
    text = "the 日本 cat 😀!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # the CJK characters and the emoji are split over byte tokens
    offsets = TextOffsets(view, (), 5, skip_special_tokens=True, spaces_between_special_tokens=True)
    got = [offsets.push(t) for t in ids]
    for i, offset in enumerate(got):
        prefix = tokenizer.decode(ids[:i])
        complete = prefix.rstrip("\ufffd")  # the characters finished before token i
        assert offset == 5 + len(complete), (i, prefix)
    assert got == sorted(got) and got[-1] < 5 + len(text)


def test_echo_offsets_skip_only_the_special_tokens_the_tokenizer_added() -> None:
    from tokenmill.engine.detokenizer import TokenizerView
    from tokenmill.entrypoints.openai.logprobs import echo_text_offsets

    from tests.engine.engine_fakes import metaspace_tokenizer

    tokenizer = metaspace_tokenizer()
    view = TokenizerView(tokenizer)
    bos = tokenizer.convert_tokens_to_ids("<s>")
    words = tokenizer.encode("the cat", add_special_tokens=False)
    # A BOS the tokenizer put in front takes no room in the echoed text.
    offsets = echo_text_offsets(view, [bos, *words], "the cat")
    assert offsets[:2] == [0, 0] and offsets[-1] == len("the cat") - len(tokenizer.decode(words[-1:]).strip())
    # A special token written in the text does.
    offsets = echo_text_offsets(view, [bos, *words], "<s>the cat")
    assert offsets[:2] == [0, 3]
