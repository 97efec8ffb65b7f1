"""ReasoningParser: how a reasoning model separates its thinking from its answer.

A parser is built once per request (per choice when streaming), with the served model's tokenizer and the
request's ``chat_template_kwargs`` (a template switch such as Qwen3's ``enable_thinking`` decides whether the
output starts inside the thinking). It offers three views of the same split, after vLLM's ``ReasoningParser``:

* :meth:`ReasoningParser.extract_reasoning`: a finished output -> ``(reasoning, content)``;
* :meth:`ReasoningParser.extract_reasoning_streaming`: one streaming step -> a :class:`ReasoningDelta`;
* :meth:`ReasoningParser.is_reasoning_end`: whether generated token ids contain the end of the thinking (the
  engine starts enforcing a grammar there).

The streamed pieces of a parser must add up to prefixes of what :meth:`extract_reasoning` returns for the
finished text; :class:`tokenmill.reasoning.ReasoningStream` sends the rest at the end of a stream (text a parser
held back while a marker might have been starting).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class ReasoningDelta:
    """What one streaming step adds: thinking text and answer text (``None`` when that part did not grow)."""

    reasoning: str | None = None
    content: str | None = None

    def __bool__(self) -> bool:
        return bool(self.reasoning) or bool(self.content)


class ReasoningParser(ABC):
    """Base of reasoning parsers (register one with the ``tokenmill_register_reasoning_parsers`` hook).

    Args:
        tokenizer: the served model's ``transformers`` tokenizer.
        chat_template_kwargs: the request's ``chat_template_kwargs`` (``None``: the template's defaults).
    """

    name: ClassVar[str] = ""

    def __init__(self, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs: Mapping[str, Any] = chat_template_kwargs or {}

    # ------------------------------------------------------------------ what the engine needs

    @property
    def thinking_enabled(self) -> bool:
        """Whether this request's output may hold thinking (``False``: e.g. Qwen3 with ``enable_thinking``
        off, whose output is the answer only; the engine then constrains from the first token)."""
        return True

    @property
    def reasoning_end_token_ids(self) -> list[int]:
        """The token ids of the marker that ends the thinking, as the model emits it (``[]`` when the model
        has none). The engine looks for them in the generated tokens before it enforces a grammar, and
        appends them when a thinking budget runs out."""
        return []

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """True when ``token_ids`` (generated token ids) contain the end-of-thinking marker."""
        end = self.reasoning_end_token_ids
        return bool(end) and contains_subsequence(token_ids, end)

    @property
    def skip_special_tokens(self) -> bool | None:
        """``False`` when the parser's markers are special tokens that must stay in the detokenized text (the
        request's ``skip_special_tokens`` is then overridden); ``None``: keep the request's setting."""
        return None

    # ------------------------------------------------------------------ text

    @abstractmethod
    def extract_reasoning(self, model_output: str, request: Any = None) -> tuple[str | None, str | None]:
        """Split a finished output into ``(reasoning, content)``; ``None`` for a part that is absent."""

    @abstractmethod
    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> ReasoningDelta | None:
        """The thinking and answer text one streaming step adds (``None``: nothing to send yet).

        ``current_text == previous_text + delta_text`` and likewise for the token ids. A parser may hold text
        back (e.g. ``"</thi"``, which may become the end marker); whatever it still holds when the stream ends
        is sent by :class:`tokenmill.reasoning.ReasoningStream` from :meth:`extract_reasoning`.
        """


def contains_subsequence(token_ids: Sequence[int], needle: Sequence[int]) -> bool:
    """True when ``needle`` (non-empty) occurs contiguously in ``token_ids``."""
    n = len(needle)
    if n == 1:
        return needle[0] in token_ids
    first = needle[0]
    for i in range(len(token_ids) - n + 1):
        if token_ids[i] == first and list(token_ids[i:i + n]) == list(needle):
            return True
    return False
