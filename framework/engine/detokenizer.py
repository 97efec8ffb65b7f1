"""Incremental detokenization: token ids in, text out, one step at a time, never half a character.

Each request decodes a small window of its latest tokens (the "prefix/read offset" method): the window's
text minus the text of its already-emitted head is what is new. Text whose end is U+FFFD (an incomplete
UTF-8 sequence, e.g. the first byte-level token of an emoji) is held back until the character completes,
so the cost per token is a decode of a few tokens whatever the output length.

Special tokens (added tokens flagged special):

* ``skip_special_tokens=True``: they are dropped; the text equals ``tokenizer.decode(ids,
  skip_special_tokens=True)``.
* ``skip_special_tokens=False, spaces_between_special_tokens=False``: they are decoded with the rest;
  the text equals ``tokenizer.decode(ids, skip_special_tokens=False)``.
* ``skip_special_tokens=False, spaces_between_special_tokens=True``: each special token is its own
  segment and a single space separates it from neighbouring text unless whitespace already does (the
  behaviour of Hugging Face's slow tokenizers; fast tokenizers ignore the flag).

Output text is decoded in the context of the last few prompt tokens, so a first token such as
SentencePiece's ``"▁Paris"`` keeps its leading space (``" Paris"``). No ``clean_up_tokenization_spaces``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Tokens of context taken from the end of the prompt (enough for any decoder's look-behind).
_PROMPT_CONTEXT_TOKENS = 4
# A UTF-8 character spans at most 4 bytes; past this many pending tokens the bytes are invalid, not partial.
_MAX_PENDING_TOKENS = 6
# Drop decoded tokens from the window's list once this many are behind it (keeps memory O(window)).
_TRIM_AFTER = 64


class TokenizerView:
    """What detokenization needs from one tokenizer, computed once and shared by all requests.

    Args:
        tokenizer: a ``transformers`` tokenizer; a fast one (with ``backend_tokenizer``) is decoded through a
            private copy of its ``tokenizers.Tokenizer``, so decoding here never contends with another thread
            that encodes (and may reconfigure truncation) with the original.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode: Callable[[list[int]], str]
        if backend is not None:
            from tokenizers import Tokenizer

            private = Tokenizer.from_str(backend.to_str())
            self._decode = lambda ids: private.decode(ids, skip_special_tokens=False)
        else:
            self._decode = lambda ids: tokenizer.decode(
                ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        special_text: dict[int, str] = {}
        for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(added, "special", False):
                special_text[int(token_id)] = str(added.content)
        for token_id in getattr(tokenizer, "all_special_ids", None) or []:
            if token_id not in special_text:
                special_text[int(token_id)] = str(tokenizer.convert_ids_to_tokens(int(token_id)))
        self.special_text = special_text
        self.special_ids = frozenset(special_text)
        self._token_text: dict[int, str] = {}

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens kept and no space clean-up."""
        return self._decode(ids)

    def token_text(self, token_id: int) -> str:
        """Text of one token on its own (used for logprobs; partial characters show as U+FFFD)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._decode([token_id])
            self._token_text[token_id] = text
        return text


class _Window:
    """Prefix/read-offset decoder over one contiguous run of tokens.

    ``_ids[_prefix:_read]`` were emitted already (their text is ``_prefix_text``); ``_ids[_read:]`` are
    pending.
    """

    __slots__ = ("_decode", "_ids", "_prefix", "_read", "_prefix_text")

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids = list(context)
        self._prefix_text = decode(self._ids) if self._ids else ""
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: its tail is no usable context.
            self._ids, self._prefix_text = [], ""
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        """Add a token; returns newly complete text ("" while a character is incomplete)."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix :])
        if text.endswith(REPLACEMENT_CHAR) and len(self._ids) - self._read < _MAX_PENDING_TOKENS:
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Everything still pending, incomplete characters included (as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._advance(self._decode(self._ids[self._prefix :]))

    def _advance(self, text: str) -> str:
        new_text = text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix :])
        if self._prefix > _TRIM_AFTER:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return new_text


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, step by step.

    Args:
        view: the shared :class:`TokenizerView`.
        prompt_token_ids: the request's prompt (its last few tokens give the decoding context).
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: separate kept special tokens from text by a space.
    """

    def __init__(
        self,
        view: TokenizerView,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._view = view
        self._skip = skip_special_tokens
        self._segmented = not skip_special_tokens and spaces_between_special_tokens
        self._last_char = ""
        self._new_segment = False
        special = view.special_ids
        tail = list(prompt_token_ids[-2 * _PROMPT_CONTEXT_TOKENS :])
        if self._skip:
            context = [t for t in tail if t not in special][-_PROMPT_CONTEXT_TOKENS:]
        else:
            context = tail[-_PROMPT_CONTEXT_TOKENS:]
            if self._segmented:
                last_special = max((i for i, t in enumerate(context) if t in special), default=-1)
                context = context[last_special + 1 :]
        self._window = _Window(view.decode, context)

    def push(self, token_ids: Iterable[int]) -> str:
        """Add generated tokens; returns the text they complete (possibly "")."""
        special = self._view.special_ids
        pieces: list[str] = []
        for token_id in token_ids:
            if token_id in special:
                if self._skip:
                    continue
                if self._segmented:
                    pieces.append(self._join(self._window.flush(), self._new_segment))
                    pieces.append(self._join(self._view.special_text[token_id], True))
                    self._window = _Window(self._view.decode)
                    self._new_segment = True
                    continue
            text = self._window.push(token_id)
            if text:
                pieces.append(self._join(text, self._new_segment))
                self._new_segment = False
        return "".join(pieces)

    def flush(self) -> str:
        """Text held back for an incomplete character; call once when the request finishes."""
        text = self._join(self._window.flush(), self._new_segment)
        self._new_segment = False
        return text

    def _join(self, piece: str, new_segment: bool) -> str:
        if not piece:
            return ""
        if (
            self._segmented
            and new_segment
            and self._last_char
            and not self._last_char.isspace()
            and not piece[0].isspace()
        ):
            piece = " " + piece
        self._last_char = piece[-1]
        return piece
