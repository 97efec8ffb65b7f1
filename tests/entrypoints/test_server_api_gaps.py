"""End to end with the embedded SmolLM2-135M-Instruct: the Responses API through the official ``openai``
client (``responses.create`` and ``responses.stream``), and the API gaps a client found (legacy logprobs,
streamed text offsets, token-id tokens, content parts, custom roles, a template that raises).

Uses the session's ``tokenmill serve`` and one more, started with ``--chat-template`` (a template that refuses
system messages) and ``--return-tokens-as-token-ids``. Generations are a few greedy tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.conftest import REAL_SERVED_NAME, RealServer, serve_default_model
from tests.entrypoints.helpers import CHAT, COMPLETIONS

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done", "response.completed"]
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System messages are not supported by this template') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def client_for(server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server: RealServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def stream_chunks(server: RealServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = httpx.post(server.url + path, json={**body, "stream": True}, timeout=120)
    assert r.status_code == 200, r.text
    return [json.loads(e[len("data: "):]) for e in r.text.split("\n\n") if e.startswith("data: {")]


@pytest.fixture(scope="module")
def oai(real_server: RealServer) -> openai.OpenAI:
    return client_for(real_server)


@pytest.fixture(scope="module")
def template_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    path = tmp_path_factory.mktemp("template") / "no_system.jinja"
    path.write_text(NO_SYSTEM_TEMPLATE, encoding="utf-8")
    yield from serve_default_model(tmp_path_factory, ("--chat-template", str(path), "--return-tokens-as-token-ids"))


# ------------------------------------------------------------------------------------------ Responses API


def test_responses_create_equals_chat(oai: openai.OpenAI) -> None:
    chat = oai.chat.completions.create(model=REAL_SERVED_NAME, messages=MESSAGES, temperature=0, max_tokens=10)
    response = oai.responses.create(model=REAL_SERVED_NAME, input=QUESTION, temperature=0, max_output_tokens=10)
    assert "Paris" in response.output_text
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    # The same conversation as message items, with instructions: rendered as a system message.
    with_instructions = oai.responses.create(model=REAL_SERVED_NAME, input=MESSAGES, instructions="Answer briefly.",
                                             temperature=0, max_output_tokens=4)
    chat = oai.chat.completions.create(model=REAL_SERVED_NAME, temperature=0, max_tokens=4, messages=[
        {"role": "system", "content": "Answer briefly."}, *MESSAGES])
    assert with_instructions.output_text == chat.choices[0].message.content
    assert with_instructions.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_stream_equals_create(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": REAL_SERVED_NAME, "input": MESSAGES, "temperature": 0,
                              "max_output_tokens": 16}
    full = oai.responses.create(**kwargs)
    with oai.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = list(dict.fromkeys(e.type for e in events))
    assert kinds == STREAM_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == full.output_text and "Paris" in final.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full.output_text
    assert final.usage.output_tokens == full.usage.output_tokens


def test_responses_logprobs(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model=REAL_SERVED_NAME, input=QUESTION, temperature=0, max_output_tokens=4,
                             include=["message.output_text.logprobs"], top_logprobs=2)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens
    assert "".join(lp.token for lp in lps) == r.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob == pytest.approx(lp.logprob, abs=1e-4)
               for lp in lps)  # greedy: the sampled token is the best


def test_responses_refusals_name_the_field(oai: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    bad_schema = {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}
    # This server runs without --enable-auto-tool-choice: tools with tool_choice auto (the default) name the flags.
    for kwargs, param in (({"tools": [tool]}, "tool_choice"),
                          ({"text": {"format": bad_schema}}, "text.format.schema"),
                          ({"extra_body": {"structured_outputs": {"regex": "a"}}}, "structured_outputs"),
                          ({"previous_response_id": "resp_1"}, "previous_response_id"),
                          ({"temperature": 2.5}, "temperature")):
        with pytest.raises(openai.BadRequestError) as info:
            oai.responses.create(model=REAL_SERVED_NAME, input=QUESTION, **kwargs)
        assert info.value.param == param
        if param == "tool_choice":
            assert "--enable-auto-tool-choice" in str(info.value)


# ---------------------------------------------------------------------------------------------- API gaps


@pytest.mark.parametrize("body", [
    {"prompt": "The capital of France is", "stop": ["Paris."], "logprobs": 1, "max_tokens": 4},
    {"prompt": "Count: 1, 2, 3,", "stop": [" 7,"], "logprobs": 0, "max_tokens": 10},
    {"prompt": "日本の首都は", "logprobs": 0, "max_tokens": 8},
    {"prompt": "The capital of France is", "echo": True, "logprobs": 2, "max_tokens": 3},
], ids=["stop-string", "stop-string-held-back", "multibyte", "echo"])
def test_streamed_text_offsets_equal_whole(real_server: RealServer, body: dict[str, Any]) -> None:
    body = {**body, "temperature": 0}
    whole = post(real_server, COMPLETIONS, body)["choices"][0]
    chunks = stream_chunks(real_server, COMPLETIONS, body)
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "text_offset", "token_logprobs", "top_logprobs"):
        assert [v for p in parts for v in p[key]] == whole["logprobs"][key], key
    offsets = whole["logprobs"]["text_offset"]
    assert offsets == sorted(offsets)


def test_completion_logprobs_zero(real_server: RealServer, oai: openai.OpenAI) -> None:
    r = oai.completions.create(model=REAL_SERVED_NAME, prompt="The capital of France is", max_tokens=3,
                               temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]


def test_return_tokens_as_token_ids(real_server: RealServer) -> None:
    prompt = "The capital of France is"
    ids = post(real_server, "/tokenize", {"prompt": prompt})["tokens"]
    lp = post(real_server, COMPLETIONS, {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True,
                                         "logprobs": 1, "return_tokens_as_token_ids": True})["choices"][0]
    tokens = lp["logprobs"]["tokens"]
    assert tokens[:len(ids)] == [f"token_id:{t}" for t in ids]
    generated = [int(t.removeprefix("token_id:")) for t in tokens[len(ids):]]
    assert prompt + post(real_server, "/detokenize", {"tokens": generated})["prompt"] == lp["text"]
    chat = post(real_server, CHAT, {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "logprobs": True,
                                    "top_logprobs": 1, "return_tokens_as_token_ids": True})["choices"][0]
    content = chat["logprobs"]["content"]
    chat_ids = [int(e["token"].removeprefix("token_id:")) for e in content]
    assert post(real_server, "/detokenize", {"tokens": chat_ids})["prompt"] == chat["message"]["content"]
    assert all(e["top_logprobs"][0]["token"].startswith("token_id:") for e in content)


def test_content_parts_equal_the_string(real_server: RealServer) -> None:
    as_parts = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    bodies = [{"messages": m, "max_tokens": 4, "temperature": 0} for m in (MESSAGES, as_parts)]
    replies = [post(real_server, CHAT, b) for b in bodies]
    assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]
    assert replies[0]["usage"]["prompt_tokens"] == replies[1]["usage"]["prompt_tokens"]
    tokens = [post(real_server, "/tokenize", {"messages": m})["tokens"] for m in (MESSAGES, as_parts)]
    assert tokens[0] == tokens[1]


def test_custom_role_reaches_the_template(real_server: RealServer) -> None:
    messages = [{"role": "narrator", "content": "It was a dark night."}, *MESSAGES]
    tokens = post(real_server, "/tokenize", {"messages": messages})["tokens"]
    text = post(real_server, "/detokenize", {"tokens": tokens})["prompt"]
    assert "<|im_start|>narrator\nIt was a dark night.<|im_end|>" in text
    assert post(real_server, CHAT, {"messages": messages, "max_tokens": 2})["choices"][0]["message"]["content"]


def test_template_that_raises_is_a_400(template_server: RealServer) -> None:
    oai = client_for(template_server)
    system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=REAL_SERVED_NAME, messages=system, max_tokens=2)  # type: ignore[arg-type]
    assert info.value.param == "messages"
    assert "System messages are not supported by this template" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=REAL_SERVED_NAME, messages=system, max_tokens=2, stream=True)  # type: ignore[arg-type]
    assert info.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model=REAL_SERVED_NAME, input=QUESTION, instructions="Be brief.")
    assert info.value.param == "input" and "System messages are not supported" in info.value.message
    r = httpx.post(template_server.url + "/tokenize", json={"messages": system}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # Without a system message the same server answers.
    reply = oai.chat.completions.create(model=REAL_SERVED_NAME, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    assert reply.choices[0].message.content


def test_server_flag_return_tokens_as_token_ids(template_server: RealServer) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "logprobs": 0}
    tokens = post(template_server, COMPLETIONS, body)["choices"][0]["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens)
    tokens = post(template_server, COMPLETIONS, {**body, "return_tokens_as_token_ids": False})
    assert not any(t.startswith("token_id:") for t in tokens["choices"][0]["logprobs"]["tokens"])
