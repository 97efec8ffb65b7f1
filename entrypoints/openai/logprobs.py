"""Engine logprobs -> the OpenAI response shapes (chat ``content`` entries, legacy completions lists) and
vLLM's ``prompt_logprobs``.

A logprob of ``-inf`` cannot be written as JSON; it is sent as :data:`MIN_LOGPROB`, as OpenAI-compatible
servers do. With ``as_token_ids`` (vLLM's ``return_tokens_as_token_ids``) tokens are named
``"token_id:<id>"`` instead of by their text, so that tokens that are not whole characters can be told
apart; ``bytes`` stay the UTF-8 bytes of the token's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.engine.detokenizer import IncrementalDetokenizer, TokenizerView
from tokenmill.entrypoints.openai.responses import (
    ChatChoiceLogprobs,
    ChatLogprobToken,
    ChatTopLogprob,
    CompletionLogprobs,
    LogprobInfo,
    PromptLogprobsJSON,
)
from tokenmill.outputs import Logprob, PromptLogprobs, SampleLogprobs

MIN_LOGPROB = -9999.0


def clamp(logprob: float) -> float:
    """``logprob``, with ``-inf`` (and NaN) replaced by :data:`MIN_LOGPROB`."""
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


def token_text(tokenizer: Any, token_id: int, logprob: Logprob | None) -> str:
    """Text of one token (the engine's decoded text, else the tokenizer's)."""
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return str(tokenizer.decode([token_id]))


def token_label(tokenizer: Any, token_id: int, logprob: Logprob | None, as_token_ids: bool) -> str:
    """How a token is named in logprobs: its text, or ``"token_id:<id>"`` with ``as_token_ids``."""
    return f"token_id:{token_id}" if as_token_ids else token_text(tokenizer, token_id, logprob)


class TextOffsets:
    """Character offsets of a sequence's tokens in the text they decode to, fed one token at a time.

    The text is that of the engine's incremental detokenizer (same context, same special-token options), so
    ``offset[i]`` is where token ``i``'s text starts in the choice's text (plus ``start``). The tokens of a
    character split over several tokens (an emoji's bytes) all get the offset of that character. Streamed and
    whole responses feed the same tokens, so they get the same offsets.

    Args:
        view: the tokenizer view (:attr:`Tokenization.view`).
        context: the prompt ids the sequence continues (its decoding context); ``()`` for a prompt itself.
        start: offset of the first token (e.g. the length of an echoed prompt).
    """

    def __init__(self, view: TokenizerView, context: Sequence[int], start: int, *, skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> None:
        self._detokenizer = IncrementalDetokenizer(view, context, skip_special_tokens=skip_special_tokens,
                                                   spaces_between_special_tokens=spaces_between_special_tokens)
        self._chars = start

    def push(self, token_id: int) -> int:
        """The offset of ``token_id``, the sequence's next token."""
        offset = self._chars
        self._chars += len(self._detokenizer.push([token_id]))
        return offset


def echo_text_offsets(view: TokenizerView, prompt_ids: Sequence[int], echo_text: str) -> list[int]:
    """Offsets of an echoed prompt's tokens in ``echo_text`` (the prompt as sent, or its decoded ids).

    Special tokens the tokenizer added (a BOS that is not in the text) take no room; special tokens written
    in the text (``<|im_start|>`` in a hand-made chat prompt) do.
    """
    def fresh() -> IncrementalDetokenizer:
        return IncrementalDetokenizer(view, (), skip_special_tokens=False, spaces_between_special_tokens=False)

    detokenizer = fresh()
    offsets: list[int] = []
    position = 0
    for token_id in prompt_ids:
        piece = detokenizer.push([token_id])
        offsets.append(position)
        if token_id in view.special_ids and not echo_text.startswith(piece, position):
            detokenizer = fresh()  # the text goes on as if the token were not there
            continue
        position += len(piece)
    return offsets


def top_logprobs_of(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens of one position, best first (the sampled token may rank lower)."""
    if k <= 0:
        return []
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                   -kv[1].logprob))
    return ranked[:k]


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: SampleLogprobs | None, k: int,
                  as_token_ids: bool = False) -> ChatChoiceLogprobs:
    """``choices[i].logprobs`` of a chat completion: one entry per generated token with its ``k`` best
    alternatives (``k`` = ``top_logprobs``)."""
    content: list[ChatLogprobToken] = []
    for token_id, entry in zip(token_ids, logprobs or []):
        sampled = entry.get(token_id)
        tops = []
        for tid, lp in top_logprobs_of(entry, k):
            tops.append(ChatTopLogprob(token=token_label(tokenizer, tid, lp, as_token_ids), logprob=clamp(lp.logprob),
                                       bytes=list(token_text(tokenizer, tid, lp).encode("utf-8"))))
        content.append(ChatLogprobToken(
            token=token_label(tokenizer, token_id, sampled, as_token_ids),
            logprob=clamp(sampled.logprob) if sampled is not None else MIN_LOGPROB,
            bytes=list(token_text(tokenizer, token_id, sampled).encode("utf-8")),
            top_logprobs=tops,
        ))
    return ChatChoiceLogprobs(content=content)


def _legacy_top(tokenizer: Any, token_id: int, entry: dict[int, Logprob], k: int, as_token_ids: bool
                ) -> dict[str, float]:
    """One legacy ``top_logprobs`` entry: the ``k`` most likely tokens and the actual one (so up to ``k + 1``
    entries, as the OpenAI legacy API documents; with ``k = 0`` just the actual token)."""
    top = {token_label(tokenizer, tid, lp, as_token_ids): clamp(lp.logprob) for tid, lp in top_logprobs_of(entry, k)}
    actual = entry.get(token_id)
    if actual is not None:
        top.setdefault(token_label(tokenizer, token_id, actual, as_token_ids), clamp(actual.logprob))
    return top


def completion_logprobs(tokenizer: Any, token_ids: list[int], logprobs: SampleLogprobs | None, k: int,
                        offsets: TextOffsets, into: CompletionLogprobs | None = None, as_token_ids: bool = False
                        ) -> CompletionLogprobs:
    """Legacy ``logprobs`` of generated tokens, appended to ``into`` (default: a new object).

    Args:
        k: alternatives per position (the request's ``logprobs``, 0..20).
        offsets: the choice's text offsets; every token of ``token_ids`` is fed to it, in order.
    """
    result = into if into is not None else CompletionLogprobs()
    entries = list(logprobs or [])
    for i, token_id in enumerate(token_ids):
        offset = offsets.push(token_id)
        if i >= len(entries):
            continue
        entry = entries[i]
        sampled = entry.get(token_id)
        result.tokens.append(token_label(tokenizer, token_id, sampled, as_token_ids))
        result.token_logprobs.append(clamp(sampled.logprob) if sampled is not None else None)
        result.top_logprobs.append(_legacy_top(tokenizer, token_id, entry, k, as_token_ids))
        result.text_offset.append(offset)
    return result


def echo_logprobs(tokenizer: Any, view: TokenizerView, prompt_ids: list[int], echo_text: str,
                  prompt_logprobs: PromptLogprobs | None, k: int, as_token_ids: bool = False) -> CompletionLogprobs:
    """Legacy ``logprobs`` of an echoed prompt (``echo_text``): its first token has ``null`` logprob and
    top_logprobs."""
    result = CompletionLogprobs()
    offsets = echo_text_offsets(view, prompt_ids, echo_text)
    entries = list(prompt_logprobs or [])
    for i, token_id in enumerate(prompt_ids):
        entry = entries[i] if i < len(entries) else None
        sampled = entry.get(token_id) if entry else None
        result.tokens.append(token_label(tokenizer, token_id, sampled, as_token_ids))
        result.token_logprobs.append(clamp(sampled.logprob) if sampled is not None else None)
        result.top_logprobs.append(_legacy_top(tokenizer, token_id, entry, k, as_token_ids) if entry else None)
        result.text_offset.append(offsets[i])
    return result


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobsJSON | None:
    """vLLM's ``prompt_logprobs``: per prompt token ``null`` (the first) or token id -> logprob, rank, text."""
    if prompt_logprobs is None:
        return None
    return [
        None if entry is None else {
            token_id: LogprobInfo(logprob=clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for token_id, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]
