"""End to end: one real ``tokenmill serve`` process with the embedded SmolLM2-135M-Instruct on 127.0.0.1, driven
by the official ``openai`` client and by raw HTTP (httpx).

Kept lean for a small CPU: few and short generations (``max_tokens`` of a few tokens), one server for the
whole module (its SIGTERM shutdown is checked by the fixture's teardown).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import time
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints import helpers
from tests.entrypoints.conftest import REAL_SERVED_NAME, RealServer
from tests.entrypoints.helpers import CHAT, COMPLETIONS, BadInput, assert_error, bad_inputs, sse_chunks

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
VOCAB_SIZE = 49152
MAX_MODEL_LEN = 2048  # the fixture's --max-model-len
TABLE = bad_inputs(REAL_SERVED_NAME, VOCAB_SIZE, MAX_MODEL_LEN)


def metric(text: str, name: str, **labels: str) -> float:
    return helpers.metric(text, name, REAL_SERVED_NAME, **labels)


@pytest.fixture(scope="module")
def oai(real_server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server: RealServer, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.url + path, timeout=120, **kwargs)


def metrics_text(server: RealServer) -> str:
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


# ------------------------------------------------------------------------------------------------ routes


def test_health_version_models(real_server: RealServer, oai: openai.OpenAI) -> None:
    assert httpx.get(real_server.url + "/health").status_code == 200
    assert httpx.get(real_server.url + "/version").json()["version"]
    assert [m.id for m in oai.models.list().data] == [REAL_SERVED_NAME]
    card = oai.models.retrieve(REAL_SERVED_NAME)
    assert card.id == REAL_SERVED_NAME
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_chat_stream_equals_non_stream(real_server: RealServer, oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": REAL_SERVED_NAME, "messages": QUESTION, "temperature": 0, "max_tokens": 8}
    full = oai.chat.completions.create(**kwargs)
    assert "Paris" in (full.choices[0].message.content or "")
    assert full.choices[0].message.role == "assistant"
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # /tokenize with the same messages gives exactly the prompt the chat completion used.
    tok = post(real_server, "/tokenize", json={"model": REAL_SERVED_NAME, "messages": QUESTION}).json()
    assert tok["count"] == full.usage.prompt_tokens == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    text = post(real_server, "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert "What is the capital of France?" in text and text.rstrip().endswith("assistant")


def test_chat_stream_n2_framing(real_server: RealServer) -> None:
    body = {"messages": QUESTION, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 7, "stream": True,
            "ignore_eos": True}
    chunks = sse_chunks(post(real_server, CHAT, json=body).text)
    assert all("usage" not in c and len(c["choices"]) == 1 for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in m["delta"] for m in mine[1:])
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == ["length"] == [mine[-1]["finish_reason"]]
        assert "".join(m["delta"].get("content", "") for m in mine)


def post_all(server: RealServer, requests: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """POST the requests concurrently (one engine batch, much cheaper than one after another on a CPU)."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(server.url + path, json=body) for path, body in requests))

    responses = asyncio.run(run())
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


def test_completion_prompt_forms(real_server: RealServer) -> None:
    ids = post(real_server, "/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    client = openai.AsyncOpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    common: dict[str, Any] = {"model": REAL_SERVED_NAME, "max_tokens": 2, "temperature": 0,
                              "extra_body": {"ignore_eos": True}}

    async def run() -> list[Any]:
        try:
            return await asyncio.gather(
                client.completions.create(prompt="The capital of France is", **common),
                client.completions.create(prompt=ids, echo=True, **common),
                client.completions.create(prompt=["The capital of France is", "One, two,"], **common),
                client.completions.create(prompt=[ids, ids[:3]], n=2, seed=1, **{**common, "temperature": 0.8}),
            )
        finally:
            await client.close()

    text, by_ids, batch, lists = asyncio.run(run())
    assert by_ids.choices[0].text == "The capital of France is" + text.choices[0].text
    assert by_ids.usage.prompt_tokens == text.usage.prompt_tokens == len(ids)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == text.choices[0].text
    assert batch.usage.completion_tokens == 4
    assert [c.index for c in lists.choices] == [0, 1, 2, 3]
    assert lists.usage.prompt_tokens == len(ids) + 3  # each prompt once, whatever n
    assert lists.usage.completion_tokens == 8


def test_logprobs_shapes(real_server: RealServer) -> None:
    chat, cmpl = post_all(real_server, [
        (CHAT, {"messages": QUESTION, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 3}),
        (COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 2, "echo": True, "logprobs": 1,
                       "temperature": 0, "ignore_eos": True, "prompt_logprobs": 0}),
    ])
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)  # greedy: best
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    choice = cmpl["choices"][0]
    lp = choice["logprobs"]
    n_prompt = cmpl["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == n_prompt + 2
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == choice["text"]
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == n_prompt


def test_sampling_controls_reach_the_model(real_server: RealServer) -> None:
    target = post(real_server, "/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()
    [tid] = target["tokens"]
    base = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    seeded = {**base, "temperature": 1.0, "seed": 1234}
    biased, allowed, plain, banned, seeded_a, seeded_b, stopped = (r["choices"][0] for r in post_all(real_server, [
        (COMPLETIONS, {**base, "logit_bias": {str(tid): 100}}),
        (COMPLETIONS, {**base, "allowed_token_ids": [tid]}),
        (COMPLETIONS, base),
        (COMPLETIONS, {**base, "bad_words": ["Paris"]}),
        (COMPLETIONS, seeded),
        (COMPLETIONS, seeded),
        (COMPLETIONS, {**base, "stop_token_ids": [tid], "logit_bias": {str(tid): 100}}),
    ]))
    assert biased["text"] == " banana" * 2
    assert allowed["text"] == " banana" * 2
    assert "Paris" in plain["text"]
    assert "Paris" not in banned["text"]
    assert seeded_a["text"] == seeded_b["text"]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == tid and stopped["text"] == ""


# ----------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("case", TABLE, ids=[c.id for c in TABLE])
def test_bad_input_table(real_server: RealServer, case: BadInput) -> None:
    # The fake-engine suite follows every row with a generation; here (a real model on a small CPU) the
    # server must stay healthy after each row, and one generation follows the whole table.
    r = httpx.post(real_server.url + case.path, timeout=60, **case.request_kwargs())
    assert_error(r, case.status, case.param, case.type_)
    assert httpx.get(real_server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(real_server.url + "/v1/models", timeout=10).status_code == 200


def test_generation_after_bad_inputs(real_server: RealServer) -> None:
    ok = post(real_server, COMPLETIONS, json={"prompt": [1, 2, 3], "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    text = metrics_text(real_server)
    assert metric(text, "tokenmill:num_requests_running") == 0


def test_oversized_body_refused_before_reading(real_server: RealServer) -> None:
    host, port = real_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 40000000\r\n\r\n{")
        answer = b""
        while chunk := sock.recv(65536):  # the server closes the connection after answering
            answer += chunk
        answer = answer.decode("latin-1")
    assert answer.startswith("HTTP/1.1 413"), answer
    assert '"code":"request_too_large"' in answer.replace(" ", "")


def test_openai_client_raises_typed_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=REAL_SERVED_NAME, messages=QUESTION, temperature=-1)
    assert info.value.param == "temperature"


# ---------------------------------------------------------------------------------- ids, prefix, metrics


def test_request_id_and_prefix_cache(real_server: RealServer) -> None:
    messages = [{"role": "user", "content": "Tell me about the history of Paris, the capital of France. " * 4}]
    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    post(real_server, CHAT, json=body)
    r = post(real_server, CHAT, json=body, headers={"X-Request-Id": "my-id-1"})
    assert r.headers["x-request-id"] == "my-id-1"
    usage = r.json()["usage"]
    assert 16 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    text = metrics_text(real_server)
    assert metric(text, "tokenmill:prefix_cache_hits_total") >= 16
    assert metric(text, "tokenmill:prefix_cache_queries_total") >= metric(text, "tokenmill:prefix_cache_hits_total")


def test_metrics_after_traffic(real_server: RealServer) -> None:
    text = metrics_text(real_server)
    assert metric(text, "tokenmill:prompt_tokens_total") > 0
    assert metric(text, "tokenmill:generation_tokens_total") > 0
    assert metric(text, "tokenmill:request_success_total", finished_reason="length") > 0
    for family in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                   "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert metric(text, f"tokenmill:{family}_count") > 0, family
        assert metric(text, f"tokenmill:{family}_sum") >= 0, family
    assert metric(text, "tokenmill:num_requests_running") == 0
    assert metric(text, "tokenmill:kv_cache_usage_perc") == 0


# ----------------------------------------------------------------------------------- aborts and load


def _engine_idle(server: RealServer) -> tuple[float, float, float]:
    text = metrics_text(server)
    return (metric(text, "tokenmill:num_requests_running"), metric(text, "tokenmill:num_requests_waiting"),
            metric(text, "tokenmill:kv_cache_usage_perc"))


def test_abort_on_client_close_frees_everything(real_server: RealServer) -> None:
    body = {"messages": QUESTION, "max_tokens": 1500, "stream": True, "ignore_eos": True}

    async def open_streams(client: httpx.AsyncClient, stack: contextlib.AsyncExitStack) -> None:
        async def one() -> None:
            response = await stack.enter_async_context(client.stream("POST", real_server.url + CHAT, json=body))
            lines = response.aiter_lines()
            stack.push_async_callback(lines.aclose)  # keep the iterator (and its connection) alive until then
            async for line in lines:  # until content: the request holds KV blocks in the engine
                if '"content":"' in line and '"content":""' not in line:
                    return

        await asyncio.gather(*(one() for _ in range(3)))

    async def run() -> tuple[tuple[float, float, float], float]:
        async with httpx.AsyncClient(timeout=120) as client:
            async with contextlib.AsyncExitStack() as stack:
                await asyncio.wait_for(open_streams(client, stack), timeout=120)
                busy = _engine_idle(real_server)
            return busy, time.monotonic()  # the streams are closed here

    busy, closed = asyncio.run(run())
    assert busy[0] + busy[1] == 3 and busy[2] > 0, busy
    # Scrapes every 0.1 s for 3 s, each in its own thread (an answer waits for the engine step in progress,
    # which takes long on a loaded CPU); one of them must see the engine idle. Unaborted, the three requests
    # would run for their 1,500 tokens, far longer than that.
    with concurrent.futures.ThreadPoolExecutor(max_workers=31) as pool:
        probes = []
        for i in range(31):
            time.sleep(max(0.0, closed + 0.1 * i - time.monotonic()))
            probes.append(pool.submit(_engine_idle, real_server))
        states = [p.result(timeout=30) for p in probes]
    assert (0, 0, 0) in states, f"running/waiting/kv-usage within 3 s of the clients closing: {states}"
    assert _engine_idle(real_server) == (0, 0, 0)
    text = metrics_text(real_server)
    assert metric(text, "tokenmill:request_success_total", finished_reason="abort") >= 3


def test_non_stream_disconnect_frees_everything(real_server: RealServer) -> None:
    body = {"messages": QUESTION, "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(real_server.url + CHAT, json=body, timeout=httpx.Timeout(10, read=1.5))
    deadline = time.monotonic() + 3
    while _engine_idle(real_server) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _engine_idle(real_server) == (0, 0, 0)


def test_load_64_concurrent_streams(real_server: RealServer) -> None:
    clients, max_tokens = 64, 8

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, dict[str, Any]]:
        body = {"prompt": f"Item {i}:", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0.7, "seed": i, "stream_options": {"include_usage": True}}
        async with client.stream("POST", real_server.url + COMPLETIONS, json=body) as r:
            assert r.status_code == 200
            raw = (await r.aread()).decode()
        chunks = sse_chunks(raw)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        return text, chunks[-1]["usage"]

    async def run() -> list[tuple[str, dict[str, Any]]]:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(timeout=180, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(clients))), timeout=180)

    started = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - started
    assert len(results) == clients
    for text, usage in results:
        assert usage["completion_tokens"] == max_tokens and usage["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + max_tokens
        assert text
    deadline = time.monotonic() + 5
    while _engine_idle(real_server) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _engine_idle(real_server) == (0, 0, 0)
    print(f"64 streams x {max_tokens} tokens in {elapsed:.1f} s")  # noqa: T201


def test_still_healthy_at_the_end(real_server: RealServer) -> None:
    assert httpx.get(real_server.url + "/health").status_code == 200
    r = post(real_server, CHAT, json={"messages": QUESTION, "max_tokens": 2})
    assert r.status_code == 200 and json.loads(r.text)["choices"][0]["message"]["content"]
