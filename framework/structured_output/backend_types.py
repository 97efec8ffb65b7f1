"""The interface between the engine and a structured-output library (xgrammar, llguidance).

A :class:`StructuredOutputBackend` turns a request's :class:`~tokenmill.sampling_params.StructuredOutputsParams`
into a compiled grammar (cached by the manager, shared by every request with the same constraint) and makes a
fresh :class:`StructuredOutputGrammar` (a matcher: per-request parse state) from it. The names follow vLLM V1's
``vllm/v1/structured_output/backend_types.py``; the split into ``compile`` / ``new_grammar`` is ours, so that the
expensive part (tokenizer-aware compilation) is done once per distinct constraint.

Token bitmasks are ``int32`` tensors ``[rows, ceil(vocab_size / 32)]`` on the CPU; bit ``t % 32`` of word
``t // 32`` is 1 when token ``t`` is allowed (the layout both libraries use).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any

import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import StructuredOutputsParams


# Longest run of whitespace a JSON grammar allows between tokens (when whitespace is not disabled): enough for
# indented JSON, and a model cannot loop on newlines until max_tokens (small models do).
MAX_WHITESPACE_RUN = 20


class GrammarSpecError(InvalidRequestError):
    """A constraint the backend cannot compile: invalid schema, regex or grammar, or a feature the backend
    lacks. ``param`` names the request field; ``unsupported`` is True for a valid spec the backend cannot do
    (``auto`` then tries the other backend)."""

    def __init__(self, message: str, param: str = "structured_outputs", unsupported: bool = False) -> None:
        super().__init__(message, param=param)
        self.unsupported = unsupported


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str, bool, bool]:
    """Cache key of a constraint, independent of the backend: ``(kind, spec text, compact, closed objects)``.

    A JSON schema given as an object is serialised without sorting its keys (property order matters: both
    backends generate properties in the order the schema lists them).
    """
    kind = params.kind
    if kind == "json":
        spec = params.json if isinstance(params.json, str) else json.dumps(params.json, ensure_ascii=False)
    elif kind == "choice":
        spec = json.dumps(params.choice, ensure_ascii=False)
    elif kind == "json_object":
        spec = ""
    else:
        spec = str(getattr(params, kind))
    return (kind, spec, params.disable_any_whitespace, params.disable_additional_properties)


def is_lark(grammar: str) -> bool:
    """Whether a ``grammar`` is Lark (llguidance's syntax) rather than EBNF/GBNF (``rule ::= ...``)."""
    return "::=" not in grammar


_CPP_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\] [^\s:]+:\d+: ")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false: ")


def clean_library_error(exc: BaseException) -> str:
    """A library's error message without C++ log prefixes (``[10:30:31] file.cc:94: ``), on one line."""
    text = _CHECK_FAILED.sub("", _CPP_LOCATION.sub("", str(exc)))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines)[:2000] or type(exc).__name__


class StructuredOutputGrammar(ABC):
    """One request's matcher: which tokens may come next, given the tokens accepted so far."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over ``tokens`` (sampled, in order); False when one is not allowed (state then undefined)."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar would accept now (the state is not changed)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row ``index`` of ``bitmask`` (int32 ``[rows, ceil(V / 32)]``, CPU)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and nothing more may follow (the request should stop)."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start state (no tokens accepted)."""


class StructuredOutputBackend(ABC):
    """A structured-output library bound to one tokenizer.

    Args:
        tokenizer: the model's ``transformers`` tokenizer.
        vocab_size: the model's vocabulary size (logits width; may exceed the tokenizer's, the extra ids are
            never allowed).
        stop_token_ids: the tokens that end generation (EOS and the model's other end-of-turn ids); a
            complete grammar allows exactly these.
    """

    name: str = ""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids

    @classmethod
    @abstractmethod
    def validate(cls, params: StructuredOutputsParams, param: str = "structured_outputs") -> None:
        """Check, without a tokenizer, that this backend can compile ``params`` (cheap; the front end calls it
        before a request is queued).

        Raises:
            GrammarSpecError: invalid spec (``unsupported=False``) or a feature this backend lacks
                (``unsupported=True``); ``param`` is set.
        """

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """Compile ``params`` against the tokenizer; the result is shared between requests (thread-safe use).

        Raises:
            GrammarSpecError: the spec does not compile.
        """

    @abstractmethod
    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher for ``compiled``."""

    def allocate_token_bitmask(self, num_rows: int) -> torch.Tensor:
        """``[num_rows, ceil(vocab_size / 32)]`` int32, every token allowed."""
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def destroy(self) -> None:
        """Release the library's resources (thread pools, caches)."""


def choice_literals(choices: list[str]) -> list[str]:
    """Each choice as a double-quoted grammar literal (JSON string escapes, which EBNF and Lark both read)."""
    return [json.dumps(c, ensure_ascii=False) for c in choices]
