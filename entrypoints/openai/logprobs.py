"""Engine logprobs -> the OpenAI response shapes (chat ``content`` entries, legacy completions lists) and
vLLM's ``prompt_logprobs``.

A logprob of ``-inf`` cannot be written as JSON; it is sent as :data:`MIN_LOGPROB`, as OpenAI-compatible
servers do.
"""

from __future__ import annotations

from typing import Any

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


def top_logprobs_of(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens of one position, best first (the sampled token may rank lower)."""
    if k <= 0:
        return []
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                   -kv[1].logprob))
    return ranked[:k]


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: SampleLogprobs | None, k: int
                  ) -> ChatChoiceLogprobs:
    """``choices[i].logprobs`` of a chat completion: one entry per generated token with its ``k`` best
    alternatives (``k`` = ``top_logprobs``)."""
    content: list[ChatLogprobToken] = []
    for token_id, entry in zip(token_ids, logprobs or []):
        sampled = entry.get(token_id)
        text = token_text(tokenizer, token_id, sampled)
        tops = []
        for tid, lp in top_logprobs_of(entry, k):
            t = token_text(tokenizer, tid, lp)
            tops.append(ChatTopLogprob(token=t, logprob=clamp(lp.logprob), bytes=list(t.encode("utf-8"))))
        content.append(ChatLogprobToken(
            token=text,
            logprob=clamp(sampled.logprob) if sampled is not None else MIN_LOGPROB,
            bytes=list(text.encode("utf-8")),
            top_logprobs=tops,
        ))
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(tokenizer: Any, token_ids: list[int], logprobs: SampleLogprobs | None, k: int,
                        start_offset: int, into: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """Legacy ``logprobs`` of generated tokens, appended to ``into`` (default: a new object).

    Args:
        k: alternatives per position (the request's ``logprobs``); 0 gives ``null`` top_logprobs entries.
        start_offset: character offset of the first token in the choice's text.
    """
    result = into if into is not None else CompletionLogprobs()
    offset = start_offset
    for token_id, entry in zip(token_ids, logprobs or []):
        sampled = entry.get(token_id)
        text = token_text(tokenizer, token_id, sampled)
        result.tokens.append(text)
        result.token_logprobs.append(clamp(sampled.logprob) if sampled is not None else None)
        result.top_logprobs.append(
            {token_text(tokenizer, tid, lp): clamp(lp.logprob) for tid, lp in top_logprobs_of(entry, k)}
            if k > 0 else None
        )
        result.text_offset.append(offset)
        offset += len(text)
    return result


def echo_logprobs(tokenizer: Any, prompt_ids: list[int], prompt_logprobs: PromptLogprobs | None, k: int
                  ) -> CompletionLogprobs:
    """Legacy ``logprobs`` of an echoed prompt: its first token has ``null`` logprob and top_logprobs."""
    result = CompletionLogprobs()
    offset = 0
    entries = list(prompt_logprobs or [])
    for i, token_id in enumerate(prompt_ids):
        entry = entries[i] if i < len(entries) else None
        sampled = entry.get(token_id) if entry else None
        text = token_text(tokenizer, token_id, sampled)
        result.tokens.append(text)
        result.token_logprobs.append(clamp(sampled.logprob) if sampled is not None else None)
        if entry and k > 0:
            result.top_logprobs.append(
                {token_text(tokenizer, tid, lp): clamp(lp.logprob) for tid, lp in top_logprobs_of(entry, k)}
            )
        else:
            result.top_logprobs.append(None)
        result.text_offset.append(offset)
        offset += len(text)
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
