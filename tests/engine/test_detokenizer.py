"""Incremental detokenization equals full decoding and never emits half a character."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.engine_fakes import byte_level_tokenizer, metaspace_tokenizer
from tokenmill.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, TokenizerView

MULTIBYTE_TEXTS = [
    "héllo 世界 🎉 naïve café",
    "日本語のテキスト、絵文字😀😃😄!",
    "family 👩‍👩‍👧 flags 🇫🇷🇯🇵 math ∑∫√ done",
    "Hello world, this is ASCII only.",
]


@pytest.fixture(scope="module")
def byte_tok() -> Any:
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def smollm_tok(hf_default_tokenizer: Any) -> Any:
    return hf_default_tokenizer


def stream(tokenizer: Any, ids: list[int], prompt: list[int] | None = None, **kwargs: bool) -> list[str]:
    """The pieces an IncrementalDetokenizer emits, one token at a time, then its flush."""
    detok = IncrementalDetokenizer(TokenizerView(tokenizer), prompt or [], **kwargs)
    return [detok.push([t]) for t in ids] + [detok.flush()]


def check_multibyte(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces), pieces


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_byte_level_incremental_equals_full(byte_tok: Any, text: str) -> None:
    check_multibyte(byte_tok, text)


def test_partial_characters_are_held_back(byte_tok: Any) -> None:
    ids = byte_tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # the emoji is split over byte tokens
    pieces = stream(byte_tok, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and pieces[-2] == "🎉" and pieces[-1] == ""


def test_flush_releases_an_incomplete_character(byte_tok: Any) -> None:
    ids = byte_tok.encode("a🎉", add_special_tokens=False)[:-1]
    pieces = stream(byte_tok, ids)
    assert REPLACEMENT_CHAR not in "".join(pieces[:-1])
    assert "".join(pieces) == byte_tok.decode(ids) and pieces[-1].endswith(REPLACEMENT_CHAR)


@settings(max_examples=150, deadline=None)
@given(
    st.text(
        alphabet=st.sampled_from(list("ab cdé世界🎉😀\n.,ßΩ")) | st.characters(blacklist_categories=("Cs",)),
        max_size=40,
    )
)
def test_property_incremental_equals_full(text: str) -> None:
    tokenizer = _BYTE_TOK_FOR_HYPOTHESIS
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids)


_BYTE_TOK_FOR_HYPOTHESIS = byte_level_tokenizer()


def test_long_output_uses_bounded_window(byte_tok: Any) -> None:
    text = " ".join(MULTIBYTE_TEXTS) * 40
    ids = byte_tok.encode(text, add_special_tokens=False)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(TokenizerView(byte_tok), [])
    out = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert out == text
    assert len(detok._window._ids) < 100  # decoded tokens are dropped, not kept forever


def test_special_tokens(byte_tok: Any) -> None:
    special = byte_tok.convert_tokens_to_ids("<special>")
    a = byte_tok.encode("ab", add_special_tokens=False)
    c = byte_tok.encode(" c🎉", add_special_tokens=False)
    ids = a + [special] + c + [special, special]
    assert "".join(stream(byte_tok, ids)) == "ab c🎉"
    kept = "".join(stream(byte_tok, ids, skip_special_tokens=False, spaces_between_special_tokens=False))
    assert kept == byte_tok.decode(ids, skip_special_tokens=False) == "ab<special> c🎉<special><special>"
    spaced = "".join(stream(byte_tok, ids, skip_special_tokens=False, spaces_between_special_tokens=True))
    assert spaced == "ab <special> c🎉 <special> <special>"


def test_prompt_context_keeps_leading_space_of_metaspace_tokens() -> None:
    tokenizer = metaspace_tokenizer()
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    output = tokenizer.encode("Hello world the end", add_special_tokens=False)[1:]
    assert tokenizer.decode(output).startswith("world")  # decoding alone drops the first space
    pieces = stream(tokenizer, output, prompt)
    full = tokenizer.decode(prompt + output)
    assert "".join(pieces) == full[len(tokenizer.decode(prompt)) :] == " world the end"


def test_token_text_cache(byte_tok: Any) -> None:
    view = TokenizerView(byte_tok)
    token = byte_tok.encode("Hello", add_special_tokens=False)[0]
    assert view.token_text(token) == byte_tok.decode([token])
    assert 2 in view.special_ids and view.special_text[2] == "<eos>"


@pytest.mark.slow
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS + ["<|im_start|>user\nhi 🎉<|im_end|>"])
def test_smollm2_gguf_tokenizer(smollm_tok: Any, text: str) -> None:
    ids = smollm_tok.encode(text, add_special_tokens=False)
    for skip in (True, False):
        pieces = stream(smollm_tok, ids, skip_special_tokens=skip, spaces_between_special_tokens=False)
        assert "".join(pieces) == smollm_tok.decode(ids, skip_special_tokens=skip)
        assert not any(REPLACEMENT_CHAR in p for p in pieces)
