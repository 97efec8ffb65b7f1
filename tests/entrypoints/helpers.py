"""Helpers shared by the server tests: request bodies, SSE parsing, error checks and the bad-input table."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
INVALID = "invalid_request_error"


def sse_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the framing on the way."""
    assert text.endswith("\n\n"), text[-200:]
    events = text.split("\n\n")[:-1]
    payloads = []
    for event in events:
        assert event.startswith("data: "), event
        assert "\n" not in event
        payloads.append(event[len("data: "):])
    return payloads


def sse_chunks(text: str) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body that ends with ``data: [DONE]``."""
    payloads = sse_events(text)
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def assert_error(response: Any, status: int, param: str | None, type_: str = INVALID) -> dict[str, Any]:
    """Check an OpenAI error object; returns its ``error`` member."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_
    assert error["param"] == param
    assert error["message"]
    return error


def metric(text: str, name: str, model: str, **labels: str) -> float:
    """The value of one sample in Prometheus text: ``name`` with exactly the labels ``model_name=model``,
    ``engine`` (default ``"0"``) and ``labels``."""
    wanted = {"model_name": model, "engine": "0", **labels}
    for line in text.splitlines():
        match = re.match(r"^([^{\s]+)(?:\{([^}]*)\})? (\S+)$", line)
        if match is None or match.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if got == wanted:
            return float(match.group(3))
    raise AssertionError(f"no sample {name}{wanted} in:\n{text}")


@dataclass
class BadInput:
    """One row of the bad-input table: a request and the error it must get."""

    id: str
    path: str
    status: int
    param: str | None
    body: Any = None  # dict/list -> JSON; bytes -> sent as is
    headers: dict[str, str] = field(default_factory=dict)
    type_: str = INVALID

    def request_kwargs(self) -> dict[str, Any]:
        if isinstance(self.body, bytes):
            headers = {"Content-Type": "application/json", **self.headers}
            return {"content": self.body, "headers": headers}
        return {"content": json.dumps(self.body).encode(),
                "headers": {"Content-Type": "application/json", **self.headers}}


def bad_inputs(model: str, vocab_size: int, max_model_len: int) -> list[BadInput]:
    """The issue's bad-input table for a server with this model name, vocabulary and context length."""
    msgs = [{"role": "user", "content": "Hi"}]

    def chat(**fields: Any) -> dict[str, Any]:
        return {"model": model, "messages": msgs, "max_tokens": 4, **fields}

    def cmpl(**fields: Any) -> dict[str, Any]:
        return {"model": model, "prompt": "Hello", "max_tokens": 4, **fields}

    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return [
        BadInput("not-object-list", CHAT, 400, None, b"[1, 2]"),
        BadInput("not-object-string", COMPLETIONS, 400, None, b'"text"'),
        BadInput("not-object-null", CHAT, 400, None, b"null"),
        BadInput("invalid-json", CHAT, 400, None, b'{"model": '),
        BadInput("empty-body", COMPLETIONS, 400, None, b""),
        BadInput("nested-too-deep", CHAT, 400, None, deep),
        BadInput("content-type-text", CHAT, 415, None, json.dumps(chat()).encode(),
                 {"Content-Type": "text/plain"}),
        BadInput("content-type-form", COMPLETIONS, 415, None, b"prompt=hi",
                 {"Content-Type": "application/x-www-form-urlencoded"}),
        BadInput("missing-messages", CHAT, 400, "messages", {"model": model}),
        BadInput("missing-prompt", COMPLETIONS, 400, "prompt", {"model": model}),
        BadInput("messages-wrong-type", CHAT, 400, "messages", chat(messages="hello")),
        BadInput("role-empty", CHAT, 400, "messages.[0].role", chat(messages=[{"role": "", "content": "x"}])),
        BadInput("role-not-string", CHAT, 400, "messages.[0].role", chat(messages=[{"role": 3, "content": "x"}])),
        BadInput("content-null-user", CHAT, 400, "messages.[0].content",
                 chat(messages=[{"role": "user", "content": None}])),
        BadInput("content-missing-system", CHAT, 400, "messages.[1].content",
                 chat(messages=[{"role": "user", "content": "x"}, {"role": "system"}])),
        BadInput("content-image", CHAT, 400, "messages.[0].content",
                 chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])),
        BadInput("content-lone-surrogate", CHAT, 400, "messages.[0].content",
                 b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        BadInput("temperature-string", CHAT, 400, "temperature", chat(temperature="hot")),
        BadInput("n-string", COMPLETIONS, 400, "n", cmpl(n="many")),
        BadInput("stream-list", CHAT, 400, "stream", chat(stream=[1])),
        BadInput("stop-ints", CHAT, 400, "stop", chat(stop=[1, 2])),
        BadInput("empty-messages", CHAT, 400, "messages", chat(messages=[])),
        BadInput("empty-prompt", COMPLETIONS, 400, "prompt", cmpl(prompt="")),
        BadInput("empty-prompt-list", COMPLETIONS, 400, "prompt", cmpl(prompt=[])),
        BadInput("empty-prompt-in-batch", COMPLETIONS, 400, "prompt", cmpl(prompt=["ok", ""])),
        BadInput("token-id-over-vocab", COMPLETIONS, 400, "prompt", cmpl(prompt=[1, vocab_size])),
        BadInput("token-id-negative", COMPLETIONS, 400, "prompt", cmpl(prompt=[[5], [-1]])),
        BadInput("detokenize-over-vocab", "/detokenize", 400, "tokens", {"tokens": [vocab_size + 5]}),
        BadInput("stop-token-over-vocab", CHAT, 400, "stop_token_ids", chat(stop_token_ids=[vocab_size])),
        BadInput("allowed-token-over-vocab", COMPLETIONS, 400, "allowed_token_ids",
                 cmpl(allowed_token_ids=[0, vocab_size])),
        BadInput("logit-bias-over-vocab", CHAT, 400, "logit_bias", chat(logit_bias={str(vocab_size): 5})),
        BadInput("logit-bias-not-id", COMPLETIONS, 400, "logit_bias", cmpl(logit_bias={"hello": 5})),
        BadInput("logit-bias-value", CHAT, 400, "logit_bias", chat(logit_bias={"5": 101})),
        BadInput("prompt-plus-max-tokens", COMPLETIONS, 400, "max_tokens", cmpl(max_tokens=max_model_len)),
        BadInput("chat-max-completion-tokens-over", CHAT, 400, "max_completion_tokens",
                 chat(max_tokens=None, max_completion_tokens=max_model_len)),
        BadInput("prompt-over-context", COMPLETIONS, 400, "prompt", cmpl(prompt=[5] * max_model_len)),
        BadInput("max-tokens-zero", COMPLETIONS, 400, "max_tokens", cmpl(max_tokens=0)),
        BadInput("max-tokens-negative", CHAT, 400, "max_tokens", chat(max_tokens=-3)),
        BadInput("max-completion-tokens-zero", CHAT, 400, "max_completion_tokens",
                 chat(max_tokens=None, max_completion_tokens=0)),
        BadInput("temperature-negative", CHAT, 400, "temperature", chat(temperature=-0.5)),
        BadInput("temperature-over-openai-range", CHAT, 400, "temperature", chat(temperature=2.5)),
        BadInput("temperature-over-openai-range-completions", COMPLETIONS, 400, "temperature",
                 cmpl(temperature=3)),
        BadInput("unknown-field", CHAT, 400, "no_such_field", chat(no_such_field=1)),
        BadInput("unknown-field-completions", COMPLETIONS, 400, "guided_jsn", cmpl(guided_jsn={"type": "object"})),
        BadInput("bad-regex-completions", COMPLETIONS, 400, "guided_regex", cmpl(guided_regex="[a-")),
        BadInput("bad-schema-chat", CHAT, 400, "response_format.json_schema.schema",
                 chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}})),
        BadInput("refused-field", CHAT, 400, "use_beam_search", chat(use_beam_search=True)),
        BadInput("refused-field-completions", COMPLETIONS, 400, "prompt_embeds", cmpl(prompt_embeds="AAAA")),
        BadInput("unknown-field-tokenize", "/tokenize", 400, "no_such_field", {"prompt": "x", "no_such_field": 1}),
        BadInput("truncate-prompt-tokens-zero", COMPLETIONS, 400, "truncate_prompt_tokens",
                 cmpl(truncate_prompt_tokens=0)),
        BadInput("temperature-nan", COMPLETIONS, 400, "temperature",
                 json.dumps(cmpl()).encode()[:-1] + b', "temperature": NaN}'),
        BadInput("top-p-over", CHAT, 400, "top_p", chat(top_p=1.5)),
        BadInput("top-p-zero", COMPLETIONS, 400, "top_p", cmpl(top_p=0)),
        BadInput("top-k-under", COMPLETIONS, 400, "top_k", cmpl(top_k=-2)),
        BadInput("min-p-over", CHAT, 400, "min_p", chat(min_p=1.5)),
        BadInput("presence-penalty-over", CHAT, 400, "presence_penalty", chat(presence_penalty=2.5)),
        BadInput("frequency-penalty-under", COMPLETIONS, 400, "frequency_penalty", cmpl(frequency_penalty=-2.5)),
        BadInput("repetition-penalty-zero", CHAT, 400, "repetition_penalty", chat(repetition_penalty=0)),
        BadInput("min-tokens-over-max", COMPLETIONS, 400, "min_tokens", cmpl(min_tokens=10)),
        BadInput("n-zero", CHAT, 400, "n", chat(n=0)),
        BadInput("n-negative", COMPLETIONS, 400, "n", cmpl(n=-1)),
        BadInput("n-absurd", CHAT, 400, "n", chat(n=10**9)),
        BadInput("n-huge-int", COMPLETIONS, 400, "n", cmpl(n=10**30)),
        BadInput("too-many-sequences", COMPLETIONS, 400, "prompt", cmpl(prompt=["a"] * 600, n=2)),
        BadInput("logprobs-over-max", COMPLETIONS, 400, "logprobs", cmpl(logprobs=21)),
        BadInput("top-logprobs-over-max", CHAT, 400, "top_logprobs", chat(logprobs=True, top_logprobs=21)),
        BadInput("top-logprobs-without-logprobs", CHAT, 400, "top_logprobs", chat(top_logprobs=2)),
        BadInput("prompt-logprobs-over-max", COMPLETIONS, 400, "prompt_logprobs", cmpl(prompt_logprobs=21)),
        BadInput("prompt-logprobs-stream", CHAT, 400, "prompt_logprobs", chat(prompt_logprobs=1, stream=True)),
        BadInput("seed-over-int64", CHAT, 400, "seed", chat(seed=2**63)),
        BadInput("seed-under-int64", COMPLETIONS, 400, "seed", cmpl(seed=-(2**63) - 1)),
        BadInput("stream-options-without-stream", CHAT, 400, "stream_options",
                 chat(stream_options={"include_usage": True})),
        BadInput("tools-auto-without-parser", CHAT, 400, "tool_choice",
                 chat(tools=[{"type": "function", "function": {"name": "f"}}])),
        BadInput("continue-final-not-assistant", CHAT, 400, "continue_final_message",
                 chat(continue_final_message=True, add_generation_prompt=False)),
        BadInput("unknown-model-chat", CHAT, 404, "model", chat(model="no-such-model"), type_="NotFoundError"),
        BadInput("unknown-model-completions", COMPLETIONS, 404, "model", cmpl(model="gpt-9"),
                 type_="NotFoundError"),
        BadInput("unknown-model-tokenize", "/tokenize", 404, "model", {"model": "gpt-9", "prompt": "x"},
                 type_="NotFoundError"),
    ]
