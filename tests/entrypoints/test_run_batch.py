"""``tokenmill run-batch``: OpenAI batch lines run by the server's handlers without HTTP (over the fake engine,
fast), and the command end to end with the embedded default model (slow)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.entrypoints.fake_engine import REPLY, SERVED_NAME, FakeAsyncLLM, server_args
from tokenmill.entrypoints.openai.api_server import build_app
from tokenmill.entrypoints.openai.run_batch import BatchRunner

CHAT_BODY = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
CMPL_BODY = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 3}


def line(custom_id: str, url: str, body: Any, **extra: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


LINES = [
    line("chat-ok", "/v1/chat/completions", CHAT_BODY),
    '{"custom_id": "broken", "url": ',
    line("cmpl-ok", "/v1/completions", CMPL_BODY),
    "",
    line("bad-url", "/v1/images/generations", {"prompt": "x"}),
    line("no-messages", "/v1/chat/completions", {"model": SERVED_NAME}),
    line("bad-model", "/v1/completions", {**CMPL_BODY, "model": "gpt-9"}),
    line("streamed", "/v1/chat/completions", {**CHAT_BODY, "stream": True}),
    json.dumps({"method": "POST", "url": "/v1/completions", "body": CMPL_BODY}),
    line("get", "/v1/completions", CMPL_BODY, method="GET"),
    line("body-list", "/v1/completions", [1, 2]),
    line("too-long", "/v1/completions", {**CMPL_BODY, "max_tokens": 10_000}),
]


def run_lines(lines: list[str], engine: FakeAsyncLLM | None = None) -> list[dict[str, Any]]:
    app = build_app(engine or FakeAsyncLLM(max_model_len=256), server_args())
    written: list[str] = []
    count = asyncio.run(BatchRunner(app).run(lines, written.append, max_concurrency=4, progress=False))
    app.state.tokenization.shutdown()
    assert count == len(written) and all(w.endswith("\n") and w.count("\n") == 1 for w in written)
    return [json.loads(w) for w in written]


def test_one_result_per_line_in_order_with_errors_per_line() -> None:
    out = run_lines(LINES)
    assert [o["custom_id"] for o in out] == ["chat-ok", None, "cmpl-ok", "bad-url", "no-messages", "bad-model",
                                             "streamed", None, "get", "body-list", "too-long"]
    assert all(o["id"].startswith("batch_req_") for o in out) and len({o["id"] for o in out}) == len(out)
    by_id = dict(zip([o["custom_id"] or f"#{i}" for i, o in enumerate(out)], out))
    chat, cmpl = by_id["chat-ok"], by_id["cmpl-ok"]
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    assert chat["response"]["request_id"] == chat["id"]
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["choices"][0]["message"]["content"] == REPLY[:5]
    assert cmpl["response"]["body"]["choices"][0]["text"] == REPLY[:3]
    # lines that are no request: response null, error with a code
    codes = {o["custom_id"] or f"#{i}": o["error"]["code"] for i, o in enumerate(out) if o["response"] is None}
    assert codes == {"#1": "invalid_json", "bad-url": "invalid_url", "#7": "missing_custom_id",
                     "get": "invalid_method", "body-list": "invalid_body"}
    # requests the server refuses: their HTTP status and OpenAI error object
    for custom_id, status, param in (("no-messages", 400, "messages"), ("bad-model", 404, "model"),
                                     ("streamed", 400, "stream"), ("too-long", 400, "max_tokens")):
        response = by_id[custom_id]["response"]
        assert by_id[custom_id]["error"] is None
        assert response["status_code"] == status, response
        assert response["body"]["error"]["param"] == param


def test_engine_failure_is_a_500_line_and_the_rest_still_run() -> None:
    engine = FakeAsyncLLM(max_model_len=256, die_after=2)
    out = run_lines([line("a", "/v1/completions", CMPL_BODY)], engine)
    assert out[0]["response"]["status_code"] == 500 and out[0]["response"]["body"]["error"]["type"] == "server_error"


@pytest.mark.slow
def test_cli_with_the_default_model(tmp_path: Path) -> None:
    from tokenmill.model_loader.default_model import DefaultModelMissingError, default_model_path

    try:
        default_model_path()
    except DefaultModelMissingError as exc:
        pytest.skip(str(exc))
    model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    lines = [
        line("c1", "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                            "max_tokens": 4, "temperature": 0}),
        "not json",
        line("p1", "/v1/completions", {"model": model, "prompt": "The capital of France is", "max_tokens": 3,
                                       "temperature": 0}),
    ]
    out_path = tmp_path / "results.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "run-batch", "-i", "-", "-o", str(out_path),
         "--max-model-len", "512", "--kv-cache-memory", "256MiB", "--disable-progress-bar"],
        input="\n".join(lines), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = [json.loads(text) for text in out_path.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["c1", None, "p1"]
    assert out[0]["response"]["status_code"] == 200 and out[0]["response"]["body"]["usage"]["completion_tokens"] > 0
    assert out[1]["error"]["code"] == "invalid_json"
    assert out[2]["response"]["body"]["choices"][0]["text"]


def test_a_line_that_is_not_utf8_is_that_lines_error(tmp_path: Path) -> None:
    from tokenmill.entrypoints.openai.run_batch import _open

    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xff\xfe{"custom_id": "bin"}\n' + line("chat-ok", "/v1/chat/completions", CHAT_BODY).encode())
    with _open(str(path), "r") as f:
        lines = f.read().splitlines()
    out = run_lines(lines)
    assert [o["custom_id"] for o in out] == [None, "chat-ok"]
    assert out[0]["error"]["code"] == "invalid_json" and "UTF-8" in out[0]["error"]["message"]
    assert out[1]["response"]["status_code"] == 200
