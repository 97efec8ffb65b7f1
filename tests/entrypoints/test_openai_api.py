"""The OpenAI server's logic against a fake engine: response shapes, streaming rules, sampling fields, logprobs,
chat templates, auth, request ids, models and client disconnects."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from tokenmill.entrypoints.openai.api_server import build_app
from tokenmill.sampling_params import RequestOutputKind

from tests.entrypoints.fake_engine import REPLY, SERVED_NAME, FakeAsyncLLM, server_args
from tests.entrypoints.helpers import CHAT, COMPLETIONS, assert_error, sse_chunks, sse_events


def chat_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 64, "temperature": 0}
    body.update(overrides)
    return body


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
    assert p.max_tokens is None  # up to the context length, resolved by the engine
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


def test_chat_stream_usage_key_rules(client: TestClient) -> None:
    # Without include_usage no chunk has a usage key; with it every chunk but the last has "usage": null.
    chunks = sse_chunks(client.post(CHAT, json=chat_body(stream=True, max_tokens=4)).text)
    assert all(c["choices"] and "usage" not in c for c in chunks)
    chunks = sse_chunks(client.post(CHAT, json=chat_body(stream=True, max_tokens=4,
                                                         stream_options={"include_usage": True})).text)
    assert all(c["usage"] is None and c["choices"] for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    # stream_options.include_usage false is the same as no stream_options
    chunks = sse_chunks(client.post(CHAT, json=chat_body(stream=True, max_tokens=4,
                                                         stream_options={"include_usage": False})).text)
    assert all(c["choices"] and "usage" not in c for c in chunks)


def test_chat_stream_continuous_usage(client: TestClient) -> None:
    body = chat_body(stream=True, max_tokens=3,
                     stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = sse_chunks(client.post(CHAT, json=body).text)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 3 and counts[0] == 0


def test_chat_stream_n2_each_choice_framed(client: TestClient) -> None:
    r = client.post(CHAT, json=chat_body(stream=True, n=2, max_tokens=5))
    chunks = sse_chunks(r.text)
    assert all(len(c["choices"]) == 1 for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in m["delta"] for m in mine[1:])
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == ["length"]
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["delta"] == {}
        assert "".join(m["delta"].get("content", "") for m in mine) == REPLY[:5]


def test_completion_stream_n2_indexes_and_usage(client: TestClient) -> None:
    r = client.post(COMPLETIONS, json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 3, "stream": True})
    chunks = sse_chunks(r.text)
    assert all("usage" not in c for c in chunks)
    for index in range(4):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(m["text"] for m in mine) == REPLY[:3]
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == ["length"]


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


def test_completion_echo_with_logprobs(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    r = client.post(COMPLETIONS, json={"prompt": "abc", "max_tokens": 2, "echo": True, "logprobs": 1})
    choice = r.json()["choices"][0]
    assert choice["text"] == "abc" + REPLY[:2]
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "c", *REPLY[:2]]
    assert lp["token_logprobs"] == [None, -1.0, -1.0, -0.25, -0.25]
    # The k best and the actual token (up to k + 1 entries, as in the OpenAI legacy API).
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"a": -0.5, "b": -1.0}
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    assert fake_engine.calls[0].params.prompt_logprobs == 1
    assert "prompt_logprobs" not in choice  # only when asked for by name
    # Streamed: the echo chunk carries the prompt's logprobs.
    r = client.post(COMPLETIONS, json={"prompt": "abc", "max_tokens": 2, "echo": True, "logprobs": 0,
                                       "stream": True})
    chunks = sse_chunks(r.text)
    assert chunks[0]["choices"][0]["text"] == "abc"
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0, -1.0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc" + REPLY[:2]
    offsets = [o for c in chunks[1:] if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [3, 4]


def test_prompt_logprobs_shapes(client: TestClient) -> None:
    r = client.post(COMPLETIONS, json={"prompt": "ab", "max_tokens": 1, "prompt_logprobs": 1})
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None
    assert plp[1] == {str(ord("b")): {"logprob": -1.0, "rank": 2, "decoded_token": "b"},
                      str(ord("a")): {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}
    r = client.post(CHAT, json=chat_body(max_tokens=1, prompt_logprobs=0))
    body = r.json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert "prompt_logprobs" not in client.post(CHAT, json=chat_body(max_tokens=1)).json()


def test_sampling_extras_reach_the_engine(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    extras = {"logit_bias": {"5": 3.5, "7": -100}, "allowed_token_ids": [5, 7, 9], "bad_words": ["foo"],
              "seed": -(2**63), "top_k": 10**12, "min_p": 0.05, "spaces_between_special_tokens": False,
              "prompt_logprobs": 2, "min_tokens": 1}
    assert client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, **extras}).status_code == 200
    assert client.post(CHAT, json=chat_body(max_tokens=2, **extras)).status_code == 200
    for call in fake_engine.calls:
        p = call.params
        assert p.logit_bias == {5: 3.5, 7: -100.0} and p.allowed_token_ids == [5, 7, 9]
        assert p.bad_words == ["foo"] and p.seed == -(2**63) and p.prompt_logprobs == 2
        assert p.top_k == 1000  # clamped to the vocabulary: same meaning, a small integer
        assert p.min_p == 0.05 and not p.spaces_between_special_tokens and p.min_tokens == 1


def test_max_completion_tokens_wins(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    client.post(CHAT, json=chat_body(max_tokens=9, max_completion_tokens=4))
    assert fake_engine.calls[0].params.max_tokens == 4


def test_chat_roles_and_tool_messages(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "developer", "content": "D"},
        {"role": "user", "content": [{"type": "text", "text": "U"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "T", "tool_call_id": "c1"},
    ]
    assert client.post(CHAT, json=chat_body(messages=messages, max_tokens=2)).status_code == 200
    prompt = "".join(map(chr, fake_engine.calls[0].prompt))
    assert prompt == "<|system|>S\n<|developer|>D\n<|user|>U\n<|assistant|>\n<|tool|>T\n<|assistant|>"


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


def _input_for(path: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "x"}]} if path == CHAT else {"prompt": "x"}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stream_disconnect_aborts(fake_engine: FakeAsyncLLM, path: str) -> None:
    fake_engine.delay_s = 0.01
    app = build_app(fake_engine, server_args())
    body = {"stream": True, "max_tokens": 30, **_input_for(path)}
    sent = asyncio.run(_call_asgi(app, path, body, disconnect_after_chunks=2))
    assert sent[0]["status"] == 200
    assert len(fake_engine.calls) == 1
    assert fake_engine.aborted == [fake_engine.calls[0].request_id]
    assert not fake_engine.active


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_non_stream_disconnect_aborts(fake_engine: FakeAsyncLLM, path: str) -> None:
    fake_engine.delay_s = 0.05
    app = build_app(fake_engine, server_args())
    body = {"max_tokens": 30, **_input_for(path)}
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
