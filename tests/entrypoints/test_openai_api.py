"""The OpenAI server's logic against a fake engine: response shapes, SSE format, errors, auth, disconnects."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from tokenmill.entrypoints.openai.api_server import build_app
from tokenmill.entrypoints.openai.errors import param_from_loc
from tokenmill.errors import EngineGenerateError, InvalidRequestError
from tokenmill.sampling_params import RequestOutputKind

from tests.entrypoints.fake_engine import REPLY, SERVED_NAME, FakeAsyncLLM, server_args

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 64, "temperature": 0}
    body.update(overrides)
    return body


def sse_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the framing on the way."""
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    payloads = []
    for event in events:
        assert event.startswith("data: "), event
        assert "\n" not in event
        payloads.append(event[len("data: "):])
    return payloads


def assert_error(response: Any, status: int, param: str | None, type_: str = "invalid_request_error") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_
    assert error["param"] == param
    assert error["message"]
    return error


# ----------------------------------------------------------------------------------------------- chat


def test_chat_non_stream(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    r = client.post(CHAT, json=chat_body())
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == SERVED_NAME
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"] == {"role": "assistant", "content": REPLY}
    assert choice["finish_reason"] == "stop"
    prompt_len = len(fake_engine.calls[0].prompt)
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": len(REPLY),
                             "total_tokens": prompt_len + len(REPLY),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert fake_engine.calls[0].params.output_kind == RequestOutputKind.FINAL_ONLY


def test_chat_template_applied_and_tokenized(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert client.post(CHAT, json=chat_body(messages=messages)).status_code == 200
    prompt = fake_engine.calls[0].prompt
    assert isinstance(prompt, list)
    assert "".join(map(chr, prompt)) == "<|system|>Be brief.\n<|user|>a\nb\n<|assistant|>"


def test_chat_add_generation_prompt_false(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    client.post(CHAT, json=chat_body(add_generation_prompt=False))
    assert "".join(map(chr, fake_engine.calls[0].prompt)) == "<|user|>Hi\n"


def test_chat_sampling_params_defaults_and_extras(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}]}  # model omitted: the served model
    assert client.post(CHAT, json=body).status_code == 200
    p = fake_engine.calls[0].params
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0 and p.n == 1
    assert p.max_tokens == fake_engine.max_model_len - len(fake_engine.calls[0].prompt)
    extras = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2, "stop_token_ids": [7],
              "stop": "x", "ignore_eos": True, "seed": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
              "top_p": 0.9, "include_stop_str_in_output": True, "skip_special_tokens": False,
              "max_completion_tokens": 10}
    assert client.post(CHAT, json=chat_body(**extras)).status_code == 200
    p = fake_engine.calls[1].params
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens) == (5, 0.1, 1.2, 2)
    assert (p.stop_token_ids, p.stop, p.ignore_eos, p.seed) == ([7], ["x"], True, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.top_p, p.max_tokens) == (0.5, -0.5, 0.9, 10)
    assert p.include_stop_str_in_output and not p.skip_special_tokens


def test_chat_stream_sse_format(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    r = client.post(CHAT, json=chat_body(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    payloads = sse_events(r.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == SERVED_NAME for c in chunks)
    first, *middle, finish, usage = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None
    assert all(c["choices"][0]["finish_reason"] is None and set(c["choices"][0]["delta"]) == {"content"}
               for c in middle)
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == REPLY
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == []
    prompt_len = len(fake_engine.calls[0].prompt)
    assert usage["usage"]["prompt_tokens"] == prompt_len
    assert usage["usage"]["completion_tokens"] == len(REPLY)
    assert usage["usage"]["total_tokens"] == prompt_len + len(REPLY)
    assert fake_engine.calls[0].params.output_kind == RequestOutputKind.DELTA


def test_chat_stream_without_usage(client: TestClient) -> None:
    r = client.post(CHAT, json=chat_body(stream=True))
    chunks = [json.loads(p) for p in sse_events(r.text)[:-1]]
    assert all(c["choices"] for c in chunks)
    assert all(c.get("usage") is None for c in chunks)


def test_chat_stream_n2_each_choice_framed(client: TestClient) -> None:
    r = client.post(CHAT, json=chat_body(stream=True, n=2, max_tokens=5))
    chunks = [json.loads(p) for p in sse_events(r.text)[:-1]]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == ["length"]
        assert "".join(m["delta"].get("content", "") for m in mine) == REPLY[:5]


def test_openai_client_stream_equals_non_stream(fake_app: Any) -> None:
    with TestClient(fake_app) as http:
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
        full = oai.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}],
                                           temperature=0, max_tokens=12)
        stream = oai.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}],
                                             temperature=0, max_tokens=12, stream=True,
                                             stream_options={"include_usage": True})
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content == REPLY[:12]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 12
    assert full.choices[0].finish_reason == "length"


def test_chat_logprobs(client: TestClient) -> None:
    r = client.post(CHAT, json=chat_body(max_tokens=3, logprobs=True, top_logprobs=2))
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == list(REPLY[:3])
    assert content[0]["logprob"] == -0.25
    assert content[0]["bytes"] == list(b"P")
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["P", "a"]
    r = client.post(CHAT, json=chat_body(max_tokens=3, logprobs=True, stream=True))
    chunks = [json.loads(p) for p in sse_events(r.text)[:-1]]
    streamed = [c["choices"][0]["logprobs"]["content"] for c in chunks if c["choices"][0].get("logprobs")]
    assert [e[0]["token"] for e in streamed] == list(REPLY[:3])


def test_chat_echo_continues_assistant_message(client: TestClient) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, "}]
    r = client.post(CHAT, json=chat_body(messages=messages, echo=True, max_tokens=5,
                                         add_generation_prompt=False, continue_final_message=True))
    assert r.json()["choices"][0]["message"]["content"] == "Well, " + REPLY[:5]


def test_chat_template_override(fake_engine: FakeAsyncLLM, tmp_path: Any) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    with TestClient(build_app(fake_engine, server_args(chat_template=str(path)))) as c:
        assert c.post(CHAT, json=chat_body()).status_code == 200
    assert "".join(map(chr, fake_engine.calls[0].prompt)) == "[Hi]"


# ---------------------------------------------------------------------------------------- completions


def test_completion_single_prompt(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    r = client.post(COMPLETIONS, json={"model": SERVED_NAME, "prompt": "The capital"})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": REPLY[:16], "logprobs": None, "finish_reason": "length",
                                "stop_reason": None}]
    assert fake_engine.calls[0].params.max_tokens == 16  # OpenAI's default for completions
    assert body["usage"]["prompt_tokens"] == len("The capital")
    assert body["usage"]["completion_tokens"] == 16


def test_completion_prompt_list_token_ids_and_echo(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    r = client.post(COMPLETIONS, json={"prompt": ["ab", "cde"], "max_tokens": 2, "n": 2, "echo": True})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == ["ab" + REPLY[:2]] * 2 + ["cde" + REPLY[:2]] * 2
    assert r.json()["usage"]["prompt_tokens"] == 5 and r.json()["usage"]["completion_tokens"] == 8
    r = client.post(COMPLETIONS, json={"prompt": [104, 105], "max_tokens": 3, "echo": True})
    assert r.json()["choices"][0]["text"] == "hi" + REPLY[:3]
    assert fake_engine.calls[-1].prompt == [104, 105]
    r = client.post(COMPLETIONS, json={"prompt": [[104], [105, 106]], "max_tokens": 1})
    assert len(r.json()["choices"]) == 2


def test_completion_stream(client: TestClient) -> None:
    r = client.post(COMPLETIONS, json={"prompt": ["ab", "cd"], "max_tokens": 4, "stream": True,
                                       "stream_options": {"include_usage": True}})
    payloads = sse_events(r.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(m["text"] for m in mine) == REPLY[:4]
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_completion_logprobs(client: TestClient) -> None:
    r = client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 3, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == list(REPLY[:3])
    assert lp["token_logprobs"] == [-0.25] * 3
    assert lp["text_offset"] == [0, 1, 2]
    assert lp["top_logprobs"][0] == {"P": -0.25}


# --------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("content", [b"{not json", b"", b"   "])
def test_malformed_json(client: TestClient, content: bytes) -> None:
    r = client.post(CHAT, content=content, headers={"Content-Type": "application/json"})
    assert_error(r, 400, None)


@pytest.mark.parametrize("body", ["[1, 2]", '"text"', "42", "null"])
def test_body_not_an_object(client: TestClient, body: str) -> None:
    assert_error(client.post(CHAT, content=body), 400, None)
    assert_error(client.post(COMPLETIONS, content=body), 400, None)


def test_json_without_content_type_is_accepted(client: TestClient) -> None:
    r = client.post(CHAT, content=json.dumps(chat_body()), headers={"Content-Type": "text/plain"})
    assert r.status_code == 200


@pytest.mark.parametrize(("body", "param"), [
    ({"model": SERVED_NAME}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.[0].content"),
    (chat_body(temperature=-0.5), "temperature"),
    (chat_body(temperature="hot"), "temperature"),
    (chat_body(top_p=1.5), "top_p"),
    (chat_body(n=0), "n"),
    (chat_body(max_tokens=0), "max_tokens"),
    (chat_body(stop=[1, 2]), "stop"),
    (chat_body(stream_options={"include_usage": True}), "stream_options"),
    (chat_body(top_logprobs=2), "top_logprobs"),
    (chat_body(logprobs=True, top_logprobs=50), "top_logprobs"),
    (chat_body(logit_bias={"5": 10}), "logit_bias"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (chat_body(seed=2**70), "seed"),
])
def test_chat_bad_fields(client: TestClient, body: dict[str, Any], param: str) -> None:
    assert_error(client.post(CHAT, json=body), 400, param)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt"),
    ({"prompt": [5000]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": 12}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "max_tokens": 500}, "max_tokens"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
])
def test_completion_bad_fields(client: TestClient, body: dict[str, Any], param: str) -> None:
    assert_error(client.post(COMPLETIONS, json=body), 400, param)


def test_context_length_errors(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    error = assert_error(client.post(CHAT, json=chat_body(max_tokens=1000)), 400, "max_tokens")
    assert error["code"] == "context_length_exceeded"
    assert "maximum context length is 128 tokens" in error["message"]
    assert_error(client.post(CHAT, json=chat_body(max_tokens=None, max_completion_tokens=1000)), 400,
                 "max_completion_tokens")
    long = [{"role": "user", "content": "x" * 200}]
    assert_error(client.post(CHAT, json=chat_body(messages=long, max_tokens=None)), 400, "messages")
    assert_error(client.post(COMPLETIONS, json={"prompt": "x" * 200}), 400, "prompt")
    assert fake_engine.calls == []


def test_unknown_model(client: TestClient) -> None:
    error = assert_error(client.post(CHAT, json=chat_body(model="gpt-9")), 404, "model", "NotFoundError")
    assert error["code"] == "model_not_found"
    assert_error(client.post(COMPLETIONS, json={"model": "gpt-9", "prompt": "x"}), 404, "model",
                 "NotFoundError")
    assert_error(client.get("/v1/models/gpt-9"), 404, "model", "NotFoundError")


def test_template_error_is_400(fake_engine: FakeAsyncLLM) -> None:
    fake_engine.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with TestClient(build_app(fake_engine, server_args())) as c:
        error = assert_error(c.post(CHAT, json=chat_body()), 400, "messages")
    assert "roles must alternate" in error["message"]


def test_engine_invalid_request_maps_to_400(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    fake_engine.fail_with = InvalidRequestError("stop_token_ids: 9999999 not in vocabulary", param="stop_token_ids")
    assert_error(client.post(CHAT, json=chat_body()), 400, "stop_token_ids")
    # Streaming requests the engine rejects get a plain 400 too, not a stream.
    assert_error(client.post(CHAT, json=chat_body(stream=True)), 400, "stop_token_ids")
    assert_error(client.post(COMPLETIONS, json={"prompt": "x", "stream": True}), 400, "stop_token_ids")


def test_unexpected_error_is_500_without_internals(client: TestClient, fake_engine: FakeAsyncLLM,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    fake_engine.fail_with = RuntimeError("secret internal detail")
    with caplog.at_level(logging.ERROR):
        r = client.post(CHAT, json=chat_body())
    error = assert_error(r, 500, None, "server_error")
    assert "secret" not in r.text and error["message"] == "Internal server error."
    assert "secret internal detail" in caplog.text and "Traceback" in caplog.text
    assert client.get("/health").status_code == 200


def test_engine_generate_error_is_500(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    fake_engine.fail_with = EngineGenerateError("request failed in the engine")
    assert_error(client.post(CHAT, json=chat_body()), 500, None, "server_error")
    assert client.get("/health").status_code == 200


def test_engine_dead_non_stream(client: TestClient, fake_engine: FakeAsyncLLM, fake_app: Any) -> None:
    fake_engine.die_after = 2
    error = assert_error(client.post(CHAT, json=chat_body()), 500, None, "server_error")
    assert error["code"] == "engine_dead"
    assert fake_app.state.server_state.engine_dead
    assert_error(client.get("/health"), 503, None, "server_error")


def test_engine_dead_mid_stream(client: TestClient, fake_engine: FakeAsyncLLM, fake_app: Any) -> None:
    fake_engine.die_after = 3
    r = client.post(CHAT, json=chat_body(stream=True))
    assert r.status_code == 200
    payloads = sse_events(r.text)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])
    assert set(error) == {"error"} and error["error"]["type"] == "server_error"
    content = "".join(json.loads(p)["choices"][0]["delta"].get("content", "") for p in payloads[:-2])
    assert content == REPLY[:3]
    assert fake_app.state.server_state.engine_dead
    assert client.get("/health").status_code == 503


def test_health_follows_engine_errored(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    assert client.get("/health").status_code == 200
    fake_engine.dead = True
    assert client.get("/health").status_code == 503


def test_error_listener_called_once(fake_engine: FakeAsyncLLM) -> None:
    app = build_app(fake_engine, server_args())
    calls: list[int] = []
    app.state.server_state.add_engine_dead_listener(lambda: calls.append(1))
    fake_engine.dead = True
    with TestClient(app, raise_server_exceptions=False) as c:
        c.get("/health")
        c.post(CHAT, json=chat_body())
    assert calls == [1]


def test_param_from_loc() -> None:
    assert param_from_loc(("body", "messages", 0, "content")) == "messages.[0].content"
    assert param_from_loc(("stop", "list[str]", 0)) == "stop"
    assert param_from_loc(("prompt", "str")) == "prompt"
    assert param_from_loc(("body",)) is None


# ---------------------------------------------------------------------------------- auth, ids, models


def test_api_key(fake_engine: FakeAsyncLLM) -> None:
    with TestClient(build_app(fake_engine, server_args(api_key="sekret"))) as c:
        error = assert_error(c.post(CHAT, json=chat_body()), 401, None)
        assert error["code"] == "invalid_api_key"
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, None)
        assert_error(c.post(CHAT, content=b"{bad", headers={"Authorization": "Basic sekret"}), 401, None)
        ok = c.post(CHAT, json=chat_body(), headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/version").status_code == 200


def test_api_key_from_environment(fake_engine: FakeAsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_API_KEY", "envkey")
    with TestClient(build_app(fake_engine, server_args())) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer envkey"}).status_code == 200


def test_request_id_header(client: TestClient) -> None:
    r = client.post(CHAT, json=chat_body(), headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = client.post(CHAT, json=chat_body(stream=True), headers={"X-Request-Id": "s-1"})
    assert r.headers["x-request-id"] == "s-1"
    assert len(client.get("/health").headers["x-request-id"]) == 32
    assert client.post(CHAT, json={}, headers={"X-Request-Id": "e-1"}).headers["x-request-id"] == "e-1"


def test_models_and_version(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [SERVED_NAME]
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == 128
    assert client.get(f"/v1/models/{SERVED_NAME}").json()["id"] == SERVED_NAME
    assert client.get("/version").json()["version"]
    assert_error(client.get("/v1/nope"), 404, None, "NotFoundError")


# ---------------------------------------------------------------------------------------- disconnects


async def _call_asgi(app: Any, path: str, body: dict[str, Any], disconnect_after_chunks: int | None,
                     disconnect_after_s: float | None = None) -> list[dict[str, Any]]:
    """Drive the ASGI app by hand; the client "disconnects" after some body chunks or some time."""
    sent: list[dict[str, Any]] = []
    disconnect = asyncio.Event()
    request_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        if disconnect_after_s is not None:
            await asyncio.sleep(disconnect_after_s)
            disconnect.set()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if disconnect_after_chunks is not None and len(chunks) >= disconnect_after_chunks:
            disconnect.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
             "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 8000), "state": {}}
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stream_disconnect_aborts(fake_engine: FakeAsyncLLM, path: str) -> None:
    fake_engine.delay_s = 0.01
    app = build_app(fake_engine, server_args())
    body = {"stream": True, "max_tokens": 30, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    sent = asyncio.run(_call_asgi(app, path, body, disconnect_after_chunks=2))
    assert sent[0]["status"] == 200
    assert len(fake_engine.calls) == 1
    assert fake_engine.aborted == [fake_engine.calls[0].request_id]
    assert not fake_engine.active


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_non_stream_disconnect_aborts(fake_engine: FakeAsyncLLM, path: str) -> None:
    fake_engine.delay_s = 0.05
    app = build_app(fake_engine, server_args())
    body = {"max_tokens": 30, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    asyncio.run(_call_asgi(app, path, body, disconnect_after_chunks=None, disconnect_after_s=0.2))
    assert len(fake_engine.calls) == 1
    assert fake_engine.aborted == [fake_engine.calls[0].request_id]
    assert not fake_engine.active


def test_finished_requests_are_not_aborted(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    client.post(CHAT, json=chat_body())
    client.post(CHAT, json=chat_body(stream=True))
    client.post(COMPLETIONS, json={"prompt": ["a", "b"], "stream": True})
    assert len(fake_engine.calls) == 4
    assert fake_engine.aborted == [] and not fake_engine.active


def test_concurrent_requests(fake_engine: FakeAsyncLLM) -> None:
    import httpx

    fake_engine.delay_s = 0.001
    app = build_app(fake_engine, server_args())

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await asyncio.gather(*(c.post(CHAT, json=chat_body(stream=i % 2 == 0)) for i in range(8)))

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses)
    assert len({c.request_id for c in fake_engine.calls}) == 8
