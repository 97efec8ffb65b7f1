"""Errors against the fake engine: the bad-input table (each followed by a request that succeeds), engine
failures, the body-size limit, and the error-object mapping."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tokenmill.entrypoints.openai.api_server import build_app
from tokenmill.entrypoints.openai.errors import param_from_loc
from tokenmill.errors import EngineGenerateError, InvalidRequestError

from tests.entrypoints.fake_engine import SERVED_NAME, VOCAB_SIZE, FakeAsyncLLM, server_args
from tests.entrypoints.helpers import CHAT, COMPLETIONS, BadInput, assert_error, bad_inputs

TABLE = bad_inputs(SERVED_NAME, VOCAB_SIZE, 128)
OK_BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@pytest.mark.parametrize("case", TABLE, ids=[c.id for c in TABLE])
def test_bad_input_table(client: TestClient, fake_engine: FakeAsyncLLM, case: BadInput) -> None:
    r = client.post(case.path, **case.request_kwargs())
    assert_error(r, case.status, case.param, case.type_)
    assert fake_engine.calls == []  # rejected before the engine ran
    assert not fake_engine.active
    ok = client.post(CHAT, json=OK_BODY)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    assert client.get("/health").status_code == 200


def test_json_without_content_type_is_accepted(client: TestClient) -> None:
    r = client.post(COMPLETIONS, content=b'{"prompt": "x", "max_tokens": 2}')
    assert r.status_code == 200
    r = client.post(COMPLETIONS, content=b'{"prompt": "x", "max_tokens": 2}',
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_body_size_limit(fake_engine: FakeAsyncLLM) -> None:
    app = build_app(fake_engine, server_args(max_request_body_bytes=1000))
    with TestClient(app) as c:
        small = {"prompt": "x" * 10, "max_tokens": 1}
        assert c.post(COMPLETIONS, json=small).status_code == 200
        big = {"prompt": "x" * 2000, "max_tokens": 1}
        error = assert_error(c.post(COMPLETIONS, json=big), 413, None)
        assert error["code"] == "request_too_large"

        def chunks() -> Any:  # no Content-Length: counted while read
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"x" * 100
            yield b'"}'

        assert_error(c.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"}), 413,
                     None)
        assert c.post(COMPLETIONS, json=small).status_code == 200
    assert all(len(call.prompt) < 100 for call in fake_engine.calls)


def test_context_length_errors(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    error = assert_error(client.post(CHAT, json={**OK_BODY, "max_tokens": 1000}), 400, "max_tokens")
    assert error["code"] == "context_length_exceeded"
    assert "maximum context length is 128 tokens" in error["message"]
    long = [{"role": "user", "content": "x" * 200}]
    assert_error(client.post(CHAT, json={"messages": long}), 400, "messages")
    assert_error(client.post(COMPLETIONS, json={"prompt": "x" * 200}), 400, "prompt")
    assert fake_engine.calls == []


def test_unknown_model_everywhere(client: TestClient) -> None:
    error = assert_error(client.post(CHAT, json={**OK_BODY, "model": "gpt-9"}), 404, "model", "NotFoundError")
    assert error["code"] == "model_not_found"
    assert_error(client.get("/v1/models/gpt-9"), 404, "model", "NotFoundError")
    assert_error(client.post("/detokenize", json={"model": "gpt-9", "tokens": [1]}), 404, "model", "NotFoundError")
    assert_error(client.get("/v1/nope"), 404, None, "NotFoundError")
    assert_error(client.get(CHAT), 405, None)


def test_template_error_is_400(fake_engine: FakeAsyncLLM) -> None:
    fake_engine.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with TestClient(build_app(fake_engine, server_args())) as c:
        error = assert_error(c.post(CHAT, json=OK_BODY), 400, "messages")
        assert "roles must alternate" in error["message"]
        assert_error(c.post("/tokenize", json={"messages": OK_BODY["messages"]}), 400, "messages")
    fake_engine.tokenizer.chat_template = None
    with TestClient(build_app(fake_engine, server_args())) as c:
        error = assert_error(c.post(CHAT, json=OK_BODY), 400, "messages")
        assert "--chat-template" in error["message"]


def test_chat_template_kwargs_reserved(client: TestClient) -> None:
    assert_error(client.post(CHAT, json={**OK_BODY, "chat_template_kwargs": {"tokenize": True}}), 400,
                 "chat_template_kwargs")


def test_engine_invalid_request_maps_to_400(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    fake_engine.fail_with = InvalidRequestError("bad_words: too long", param="bad_words")
    assert_error(client.post(CHAT, json=OK_BODY), 400, "bad_words")
    # Streaming requests the engine rejects get a plain 400 too, not a stream.
    assert_error(client.post(CHAT, json={**OK_BODY, "stream": True}), 400, "bad_words")
    assert_error(client.post(COMPLETIONS, json={"prompt": "x", "stream": True}), 400, "bad_words")


def test_unexpected_error_is_500_without_internals(client: TestClient, fake_engine: FakeAsyncLLM,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    fake_engine.fail_with = RuntimeError("secret internal detail")
    with caplog.at_level(logging.ERROR):
        r = client.post(CHAT, json=OK_BODY)
    error = assert_error(r, 500, None, "server_error")
    assert "secret" not in r.text and error["message"] == "Internal server error."
    assert "secret internal detail" in caplog.text and "Traceback" in caplog.text
    assert client.get("/health").status_code == 200


def test_engine_generate_error_is_500(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    fake_engine.fail_with = EngineGenerateError("request failed in the engine")
    assert_error(client.post(CHAT, json=OK_BODY), 500, None, "server_error")
    assert client.get("/health").status_code == 200


def test_engine_dead_non_stream(client: TestClient, fake_engine: FakeAsyncLLM, fake_app: Any) -> None:
    fake_engine.die_after = 2
    error = assert_error(client.post(CHAT, json={**OK_BODY, "max_tokens": 10}), 500, None, "server_error")
    assert error["code"] == "engine_dead"
    assert fake_app.state.server_state.engine_dead
    assert_error(client.get("/health"), 503, None, "server_error")


def test_engine_dead_mid_stream(client: TestClient, fake_engine: FakeAsyncLLM, fake_app: Any) -> None:
    from tests.entrypoints.helpers import sse_events

    fake_engine.die_after = 3
    r = client.post(CHAT, json={**OK_BODY, "max_tokens": 10, "stream": True})
    assert r.status_code == 200
    payloads = sse_events(r.text)
    assert payloads[-1] == "[DONE]"
    import json

    error = json.loads(payloads[-2])
    assert set(error) == {"error"} and error["error"]["type"] == "server_error"
    assert error["error"]["code"] == "engine_dead"
    content = "".join(json.loads(p)["choices"][0]["delta"].get("content", "") for p in payloads[:-2])
    assert content == "Par"
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
        c.post(CHAT, json=OK_BODY)
    assert calls == [1]


def test_param_from_loc() -> None:
    assert param_from_loc(("body", "messages", 0, "content")) == "messages.[0].content"
    assert param_from_loc(("stop", "list[str]", 0)) == "stop"
    assert param_from_loc(("prompt", "str")) == "prompt"
    assert param_from_loc(("body",)) is None
