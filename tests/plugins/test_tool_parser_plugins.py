"""Tool parsers are plugins: a package's ``tokenmill_register_tool_parsers`` hook adds one, and the server uses it
for ``tool_choice="auto"`` (checked through the app over the fake engine)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from fastapi.testclient import TestClient

from tests.entrypoints.fake_engine import SERVED_NAME, FakeAsyncLLM, server_args
from tokenmill.entrypoints.openai.api_server import build_app
from tokenmill.tool_parsers import ToolParserManager, UnknownToolParserError

if TYPE_CHECKING:
    from conftest import FakeSite

PARSER_MODULE = """
from tokenmill.plugin_api import PartialParse, PartialToolCall, ToolParser
from tokenmill.plugins import hookimpl


class CapitalParser(ToolParser):
    \"\"\"Reads 'capital' as a call of lookup(word="capital"); the text before it is content.\"\"\"

    def parse(self, text, final):
        at = text.find("capital")
        if at < 0:
            return PartialParse(content=text)
        return PartialParse(content=text[:at], tool_calls=[PartialToolCall("lookup", '{"word": "capital"}', True)])


@hookimpl
def tokenmill_register_tool_parsers(registry):
    registry.register_tool_parser("capital_words", __name__ + ":CapitalParser")
"""

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def test_builtin_parsers_come_through_the_hook(clean_plugin_state: None) -> None:
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(ToolParserManager.list_tool_parsers())


def test_a_plugin_parser_is_used_by_the_server(fake_site: FakeSite) -> None:
    module = fake_site.unique_module("tool_parsers")
    fake_site.add_module(module, PARSER_MODULE)
    fake_site.add_distribution("fake-tool-parsers", {"tokenmill.plugins": {"capital": module}})
    assert ToolParserManager.get_tool_parser("capital_words").__name__ == "CapitalParser"
    app = build_app(FakeAsyncLLM(), server_args(enable_auto_tool_choice=True, tool_call_parser="capital_words"))
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Capital?"}], "tools": TOOLS}
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=body).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Paris is the "
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "lookup", "arguments": '{"word": "capital"}'}
    assert call["id"].startswith("call_") and call["type"] == "function"


def test_unknown_parser_stops_the_app_at_start(fake_site: FakeSite) -> None:
    with pytest.raises(UnknownToolParserError, match="registered"):
        build_app(FakeAsyncLLM(), server_args(enable_auto_tool_choice=True, tool_call_parser="nope"))
    with pytest.raises(ValueError, match="--tool-call-parser"):
        build_app(FakeAsyncLLM(), server_args(enable_auto_tool_choice=True))
