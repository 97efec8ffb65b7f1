"""The built-in reasoning parsers on crafted outputs: the finished split, and every way of cutting the output
into streaming deltas (a marker split across deltas, a marker and answer text in one delta)."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.reasoning import ReasoningParserManager, ReasoningStream, UnknownReasoningParserError
from tokenmill.reasoning.marker_parser import marker_token_ids, partial_marker_length


class CharTokenizer:
    """One token per character (id = code point), plus optional special tokens with ids from 1000."""

    def __init__(self, specials: tuple[str, ...] = ()) -> None:
        self.specials = {s: 1000 + i for i, s in enumerate(specials)}
        self.unk_token_id = 0

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.specials.get(token, self.unk_token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def parser(name: str, **template_kwargs: Any) -> Any:
    tokenizer = CharTokenizer(("[THINK]", "[/THINK]") if name == "mistral" else ())
    return ReasoningParserManager.get_reasoning_parser(name)(tokenizer, template_kwargs or None)


# (parser, template kwargs, output, expected reasoning, expected content)
CASES = [
    ("qwen3", {}, "<think>\nI add 2 and 2.\n</think>\n\nIt is 4.", "I add 2 and 2.", "It is 4."),
    ("qwen3", {}, "I add 2 and 2.</think>It is 4.", "I add 2 and 2.", "It is 4."),  # tag in the prompt
    ("qwen3", {}, "<think>still thinking", "still thinking", None),  # cut by max_tokens
    ("qwen3", {"enable_thinking": False}, "It is 4.", None, "It is 4."),
    ("qwen3", {"enable_thinking": False}, "a </think> b", None, "a </think> b"),
    ("deepseek_r1", {}, "Let me see.\n</think>\n\n4", "Let me see.", "4"),
    ("deepseek_r1", {}, "<think>Let me see.</think>4", "Let me see.", "4"),
    ("deepseek_r1", {}, "no end marker", "no end marker", None),
    ("deepseek_r1", {}, "</think>only answer", None, "only answer"),
    ("granite", {"thinking": True}, "Here is my thought process:\nsum.\nHere is my response:\n4", "sum.", "4"),
    ("granite", {"thinking": True}, "Here's my thought process: a\n\nHere's my response: b", "a", "b"),
    ("granite", {"thinking": True}, "Just 4.", None, "Just 4."),
    ("granite", {}, "Here is my thought process: x Here is my response: y", None,
     "Here is my thought process: x Here is my response: y"),
    ("mistral", {}, "[THINK]2+2[/THINK]4", "2+2", "4"),
    ("mistral", {}, "4 [THINK]", None, "4 [THINK]"),
]


@pytest.mark.parametrize("name, kwargs, output, reasoning, content", CASES)
def test_extract_reasoning(name: str, kwargs: dict, output: str, reasoning: str | None,
                           content: str | None) -> None:
    assert parser(name, **kwargs).extract_reasoning(output) == (reasoning, content)


def _stream(name: str, kwargs: dict, pieces: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(parser(name, **kwargs))
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        delta = stream.update(piece, [ord(c) for c in piece], final=i == len(pieces) - 1)
        reasoning += delta.reasoning or ""
        content += delta.content or ""
    return reasoning, content


@pytest.mark.parametrize("name, kwargs, output, reasoning, content", CASES)
def test_every_two_and_three_way_split_streams_the_same_split(name: str, kwargs: dict, output: str,
                                                              reasoning: str | None, content: str | None) -> None:
    expected = (reasoning or "", content or "")
    for i in range(len(output) + 1):
        assert _stream(name, kwargs, [output[:i], output[i:]]) == expected, i
    # three deltas: every cut of the end marker's neighbourhood into three pieces
    for i in range(len(output) + 1):
        for j in range(i, min(len(output), i + 12) + 1):
            assert _stream(name, kwargs, [output[:i], output[i:j], output[j:]]) == expected, (i, j)


@pytest.mark.parametrize("name, kwargs, output, reasoning, content", CASES)
def test_one_character_deltas_never_send_marker_text(name: str, kwargs: dict, output: str,
                                                     reasoning: str | None, content: str | None) -> None:
    stream = ReasoningStream(parser(name, **kwargs))
    sent_reasoning = ""
    for i, ch in enumerate(output):
        delta = stream.update(ch, [ord(ch)], final=False)
        sent_reasoning += delta.reasoning or ""
        # what was sent is always a prefix of the final reasoning: no piece of an end marker leaks into it
        assert (reasoning or "").startswith(sent_reasoning), (i, sent_reasoning)


def test_end_marker_and_answer_in_one_delta() -> None:
    p = parser("qwen3")
    delta = p.extract_reasoning_streaming("<think>abc", "<think>abc</think>Answer", "</think>Answer", [], [], [])
    assert delta is not None and (delta.reasoning, delta.content) == (None, "Answer")
    delta = p.extract_reasoning_streaming("<think>ab", "<think>abc</th", "c</th", [], [], [])
    assert delta is not None and (delta.reasoning, delta.content) == ("c", None)


def test_is_reasoning_end_and_end_token_ids() -> None:
    qwen = parser("qwen3")
    end = [ord(c) for c in "</think>"]
    assert qwen.reasoning_end_token_ids == end
    assert not qwen.is_reasoning_end([ord(c) for c in "<think>abc</thin"])
    assert qwen.is_reasoning_end([ord(c) for c in "<think>abc</think>x"])
    mistral = parser("mistral")
    assert mistral.reasoning_end_token_ids == [1001]  # the special token itself, not its characters
    assert mistral.is_reasoning_end([1000, 65, 1001]) and not mistral.is_reasoning_end([1000, 65])
    assert mistral.skip_special_tokens is False and qwen.skip_special_tokens is None


def test_thinking_switches() -> None:
    assert parser("qwen3").thinking_enabled
    assert not parser("qwen3", enable_thinking=False).thinking_enabled
    assert not parser("granite").thinking_enabled and parser("granite", thinking=True).thinking_enabled
    assert parser("deepseek_r1").thinking_enabled and parser("mistral").thinking_enabled


def test_partial_marker_length() -> None:
    assert partial_marker_length("abc</th", ("</think>",)) == 4
    assert partial_marker_length("abc<", ("</think>",)) == 1
    assert partial_marker_length("abc</think>", ("</think>",)) == 0  # a whole marker is not partial
    assert partial_marker_length("a <b", ("</think>",)) == 0
    assert partial_marker_length("x Here's my", ("Here is my response:", "Here's my response:")) == 9


def test_marker_token_ids_fall_back_to_encoding() -> None:
    assert marker_token_ids(CharTokenizer(), "[/THINK]") == [ord(c) for c in "[/THINK]"]
    assert marker_token_ids(CharTokenizer(("[/THINK]",)), "[/THINK]") == [1000]


def test_registry_lists_builtins_and_refuses_unknown_names() -> None:
    assert {"deepseek_r1", "granite", "mistral", "qwen3"} <= set(ReasoningParserManager.list_reasoning_parsers())
    with pytest.raises(UnknownReasoningParserError, match="unknown reasoning parser 'nope'.*qwen3"):
        ReasoningParserManager.get_reasoning_parser("nope")


def test_tokenmill_plugins_lists_the_reasoning_parsers() -> None:
    from tokenmill.entrypoints.plugins_diagnosis import collect_diagnosis, format_diagnosis

    report = collect_diagnosis()
    parsers = report["reasoning_parsers"]
    assert parsers["qwen3"]["target"].endswith("qwen3_reasoning_parser:Qwen3ReasoningParser")
    assert "builtin_reasoning_parsers" in parsers["qwen3"]["source"]
    text = format_diagnosis(report)
    assert "Reasoning parsers:" in text and "deepseek_r1" in text.split("Reasoning parsers:")[1]
