"""End to end: a real ``tokenmill serve`` process with the embedded SmolLM2-135M-Instruct, driven by the official
``openai`` client and by raw HTTP (httpx)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.conftest import REAL_SERVED_NAME, RealServer

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def oai(real_server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server: RealServer, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.url + path, timeout=120, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"]
    return error


def test_health_and_version(real_server: RealServer) -> None:
    assert httpx.get(real_server.url + "/health").status_code == 200
    assert httpx.get(real_server.url + "/version").json()["version"]


def test_models(oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list().data] == [REAL_SERVED_NAME]


def test_chat_capital_of_france(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model=REAL_SERVED_NAME, messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 < r.usage.completion_tokens <= 32


def test_stream_equals_non_stream(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": REAL_SERVED_NAME, "messages": QUESTION, "temperature": 0, "max_tokens": 40}
    full = oai.chat.completions.create(**kwargs)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    # include_usage: one final chunk without choices, same numbers as the non-streamed reply.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_usage_counts_with_length_finish(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model=REAL_SERVED_NAME, messages=QUESTION, max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    c = oai.completions.create(model=REAL_SERVED_NAME, prompt="The capital of France is", max_tokens=5,
                               temperature=0, extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 5 and c.choices[0].text


def test_prefix_cache_reported(real_server: RealServer) -> None:
    messages = [{"role": "user", "content": "Tell me about the history of Paris, the capital of France. " * 4}]
    body = {"model": REAL_SERVED_NAME, "messages": messages, "max_tokens": 2, "temperature": 0}
    post(real_server, "/v1/chat/completions", json=body)
    usage = post(real_server, "/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


def test_concurrent_requests(real_server: RealServer) -> None:
    client = openai.AsyncOpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int) -> Any:
        return await client.chat.completions.create(
            model=REAL_SERVED_NAME, messages=[{"role": "user", "content": f"Count to {i + 3}."}],
            max_tokens=24, temperature=0.7, seed=i,
        )

    async def run() -> list[Any]:
        try:
            return await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert len(results) == 8
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    assert all(r.usage.completion_tokens > 0 for r in results)


def test_completion_stream_equals_non_stream(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": REAL_SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 12,
                              "temperature": 0}
    full = oai.completions.create(**kwargs)
    text = "".join(c.choices[0].text for c in oai.completions.create(stream=True, **kwargs) if c.choices)
    assert text == full.choices[0].text
    echoed = oai.completions.create(echo=True, **kwargs)
    assert echoed.choices[0].text == "The capital of France is" + full.choices[0].text


def test_bad_requests_then_ok(real_server: RealServer) -> None:
    chat = "/v1/chat/completions"
    ok = {"model": REAL_SERVED_NAME, "messages": QUESTION, "max_tokens": 4}
    assert_error(post(real_server, chat, content=b'{"model": ', headers={"Content-Type": "application/json"}),
                 400, None)
    assert_error(post(real_server, chat, content=b"[1, 2, 3]"), 400, None)
    assert_error(post(real_server, chat, json={**ok, "max_tokens": 4096}), 400, "max_tokens")
    assert_error(post(real_server, chat, json={**ok, "messages": []}), 400, "messages")
    assert_error(post(real_server, chat, json={"model": REAL_SERVED_NAME}), 400, "messages")
    assert_error(post(real_server, chat, json={**ok, "temperature": -1}), 400, "temperature")
    error = assert_error(post(real_server, chat, json={**ok, "model": "no-such-model"}), 404, "model")
    assert error["code"] == "model_not_found"
    assert_error(post(real_server, "/v1/completions", json={"model": REAL_SERVED_NAME, "prompt": ""}), 400,
                 "prompt")
    assert_error(post(real_server, "/v1/completions", json={"prompt": [10**9]}), 400, "prompt")
    r = post(real_server, chat, json=ok)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_openai_client_raises_typed_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=REAL_SERVED_NAME, messages=QUESTION, temperature=-1)
    assert info.value.param == "temperature"


def test_request_id_echoed(real_server: RealServer) -> None:
    r = post(real_server, "/v1/chat/completions", headers={"X-Request-Id": "my-id-1"},
             json={"messages": QUESTION, "max_tokens": 2})
    assert r.headers["x-request-id"] == "my-id-1"


def test_disconnect_mid_stream_leaves_server_healthy(real_server: RealServer) -> None:
    body = {"messages": QUESTION, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", real_server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
    assert httpx.get(real_server.url + "/health").status_code == 200
    r = post(real_server, "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 3})
    assert r.status_code == 200
