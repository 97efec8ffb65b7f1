"""A real ``tokenmill serve --reasoning-parser deepseek_r1`` over the tiny random Llama, whose chat template opens
a thinking block at the end of the prompt: a thinking budget ends the random thinking, and the grammar of
``response_format`` / ``tool_choice: "required"`` then holds the answer; streamed and whole answers agree."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.engine.tiny_model import tiny_llama_with_tokenizer
from tests.entrypoints.conftest import RealServer, run_server

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
BUDGET = 6
# random weights like EOS: hold it off until the thinking, the forced "</think>" and a few answer tokens are out
EXTRA = {"thinking_token_budget": BUDGET, "min_tokens": BUDGET + 12}


@pytest.fixture(scope="module")
def model(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_llama_with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("reasoning_model") / "model")


@pytest.fixture(scope="module")
def no_whitespace(model: str) -> dict[str, Any]:
    """A ``logit_bias`` banning the byte-level tokens made of whitespace only: random weights would fill the
    whitespace a tool-call grammar allows until ``max_tokens``."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(model).get_vocab()
    return {"logit_bias": {str(i): -100 for t, i in vocab.items() if t and all(c in "ĠĊĉč" for c in t)}}


@pytest.fixture(scope="module")
def server(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    template = tmp_path_factory.mktemp("reasoning_template") / "think.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    yield from run_server(str(tmp_path_factory.mktemp("reasoning_server")), [
        model, "--dtype", "float32", "--max-model-len", "512", "--reasoning-parser", "deepseek_r1",
        "--chat-template", str(template), "--served-model-name", "tiny"])


@pytest.fixture(scope="module")
def oai(server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(oai: openai.OpenAI, extra: dict[str, Any] | None = None, **kw: Any) -> Any:
    return oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Report."}],
                                       temperature=0, max_tokens=200, extra_body={**EXTRA, **(extra or {})}, **kw)


def test_grammar_holds_the_answer_after_free_thinking(oai: openai.OpenAI) -> None:
    # compact JSON: random weights would fill the whitespace the schema allows until max_tokens
    constraint = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    message = chat(oai, constraint).choices[0].message
    jsonschema.validate(json.loads(message.content), SCHEMA)
    thinking = message.model_extra.get("reasoning")
    assert thinking == message.model_extra.get("reasoning_content")
    assert "</think>" not in (thinking or "") and "</think>" not in message.content
    # the same request streamed: the deltas add up to the same thinking and answer
    reasoning, content = "", ""
    for chunk in chat(oai, constraint, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
    assert (reasoning or None, content) == (thinking, message.content)


def test_required_tool_call_after_thinking_is_valid(oai: openai.OpenAI, no_whitespace: dict[str, Any]) -> None:
    choice = chat(oai, no_whitespace, tools=[TOOL], tool_choice="required", parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
