"""Routes beyond completions, against the fake engine: /tokenize, /detokenize, /metrics, /version, /health,
CORS and the OpenAPI document."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from tokenmill.entrypoints.openai.api_server import build_app

from tests.entrypoints import helpers
from tests.entrypoints.fake_engine import REPLY, SERVED_NAME, FakeAsyncLLM, server_args
from tests.entrypoints.helpers import CHAT, COMPLETIONS, assert_error

MESSAGES = [{"role": "user", "content": "Hi"}]


def metric(text: str, name: str, **labels: str) -> float:
    return helpers.metric(text, name, SERVED_NAME, **labels)


# ----------------------------------------------------------------------------------------- tokenization


def test_tokenize_prompt(client: TestClient) -> None:
    body = client.post("/tokenize", json={"model": SERVED_NAME, "prompt": "Hey"}).json()
    assert body == {"count": 3, "max_model_len": 128, "tokens": [72, 101, 121], "token_strs": None}
    body = client.post("/tokenize", json={"prompt": "Hey", "return_token_strs": True}).json()
    assert body["token_strs"] == ["H", "e", "y"]


def test_tokenize_chat_messages_match_chat_completion(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    body = client.post("/tokenize", json={"messages": MESSAGES}).json()
    assert "".join(map(chr, body["tokens"])) == "<|user|>Hi\n<|assistant|>"
    usage = client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 1}).json()["usage"]
    assert body["count"] == usage["prompt_tokens"] == len(fake_engine.calls[0].prompt)
    body = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert "".join(map(chr, body["tokens"])) == "<|user|>Hi\n"


def test_detokenize(client: TestClient) -> None:
    assert client.post("/detokenize", json={"tokens": [72, 105]}).json() == {"prompt": "Hi"}
    assert client.post("/detokenize", json={"model": SERVED_NAME, "tokens": []}).json() == {"prompt": ""}
    assert_error(client.post("/detokenize", json={"tokens": "Hi"}), 400, "tokens")


def test_tokenize_needs_api_key(fake_engine: FakeAsyncLLM) -> None:
    with TestClient(build_app(fake_engine, server_args(api_key="k"))) as c:
        assert_error(c.post("/tokenize", json={"prompt": "x"}), 401, None)
        assert_error(c.post("/detokenize", json={"tokens": [1]}), 401, None)
        assert c.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer k"}).status_code == 200
        assert c.get("/metrics").status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/version").status_code == 200


# ---------------------------------------------------------------------------------------------- metrics


def test_metrics_families_and_counts(client: TestClient) -> None:
    text = client.get("/metrics").text
    for family in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
                   "generation_tokens_total", "num_preemptions_total"):
        assert metric(text, f"tokenmill:{family}") == 0.0
    for reason in ("stop", "length", "abort", "error"):
        assert metric(text, "tokenmill:request_success_total", finished_reason=reason) == 0.0
    assert "_created" not in text

    client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 5, "n": 2})  # 2 sequences, length
    client.post(COMPLETIONS, json={"prompt": "abc", "max_tokens": 100, "stream": True})  # stop
    text = client.get("/metrics").text
    chat_prompt = len("<|user|>Hi\n<|assistant|>")
    assert metric(text, "tokenmill:prompt_tokens_total") == 2 * chat_prompt + 3
    assert metric(text, "tokenmill:generation_tokens_total") == 2 * 5 + len(REPLY)
    assert metric(text, "tokenmill:request_success_total", finished_reason="length") == 2
    assert metric(text, "tokenmill:request_success_total", finished_reason="stop") == 1
    assert metric(text, "tokenmill:time_to_first_token_seconds_count") == 3
    assert metric(text, "tokenmill:inter_token_latency_seconds_count") == 2 * 4 + len(REPLY) - 1
    for family in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                   "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert metric(text, f"tokenmill:{family}_count") == 3
    assert metric(text, "tokenmill:e2e_request_latency_seconds_bucket", le="+Inf") == 3
    assert metric(text, "tokenmill:num_requests_running") == 0.0
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")


def test_metrics_count_aborts_and_errors(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    fake_engine.die_after = 2
    client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 10})
    text = client.get("/metrics").text
    assert metric(text, "tokenmill:request_success_total", finished_reason="error") == 1
    assert metric(text, "tokenmill:generation_tokens_total") == 2


def test_metrics_rejected_requests_not_counted(client: TestClient) -> None:
    client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 500})
    text = client.get("/metrics").text
    assert sum(metric(text, "tokenmill:request_success_total", finished_reason=r)
               for r in ("stop", "length", "abort", "error")) == 0
    assert not client.app.state.stats.num_tracked  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------ version, CORS, API


def test_version_and_health(client: TestClient) -> None:
    from tokenmill import __version__

    assert client.get("/version").json() == {"version": __version__}
    r = client.get("/health")
    assert r.status_code == 200 and r.content == b""


def test_models_list_and_retrieve(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == SERVED_NAME and card["object"] == "model" and card["max_model_len"] == 128
    assert isinstance(card["created"], int) and card["owned_by"] == "tokenmill"
    assert client.get(f"/v1/models/{SERVED_NAME}").json() == card
    assert_error(client.get("/v1/models/nope"), 404, "model", "NotFoundError")


def test_cors_off_by_default(client: TestClient) -> None:
    r = client.options(CHAT, headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("origins", ["http://a.example,http://b.example", '["http://a.example"]'])
def test_cors_allowed_origins(fake_engine: FakeAsyncLLM, origins: str) -> None:
    with TestClient(build_app(fake_engine, server_args(allowed_origins=origins))) as c:
        pre = c.options(CHAT, headers={"Origin": "http://a.example", "Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "http://a.example"
        r = c.post(CHAT, json={"messages": MESSAGES, "max_tokens": 1}, headers={"Origin": "http://a.example"})
        assert r.headers["access-control-allow-origin"] == "http://a.example"
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        other = c.options(CHAT, headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_openapi_documents_request_bodies(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    components = schema["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "TokenizeChatRequest", "TokenizeCompletionRequest",
                 "DetokenizeRequest", "ChatMessage", "ErrorResponse"):
        assert name in components
    assert "messages" in components["ChatCompletionRequest"]["required"]
    paths: dict[str, Any] = schema["paths"]
    assert {"/v1/completions", "/v1/models", "/v1/models/{model}", "/tokenize", "/detokenize", "/health",
            "/version", "/metrics"} <= set(paths)
