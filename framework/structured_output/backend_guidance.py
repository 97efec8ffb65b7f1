"""The llguidance backend (PyPI ``llguidance``), chosen with ``--structured-outputs-backend guidance`` or by
``auto`` for constraints xgrammar cannot compile.

Every constraint becomes an llguidance grammar string: JSON schemas through llguidance's JSON compiler (objects
accept additional properties unless the schema, or ``disable_additional_properties``, says otherwise: JSON
Schema's own default), regexes directly, grammars as Lark (GBNF is converted with llguidance's converter),
choices as a Lark alternation. Structural tags are not supported by this backend.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend_types import (
    GrammarSpecError,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    choice_literals,
    MAX_WHITESPACE_RUN,
    clean_library_error,
    is_lark,
)

_UNSUPPORTED_MARKERS = ("not supported", "unsupported", "not implemented", "unimplemented")


def _llg() -> Any:
    import llguidance

    return llguidance


def _close_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` gets ``false``."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_string(params: StructuredOutputsParams, param: str = "structured_outputs") -> str:
    """The llguidance grammar (its JSON serialisation) of ``params``.

    Raises:
        GrammarSpecError: the schema is not JSON, the GBNF cannot be converted, or the constraint is a
            structural tag (``unsupported``).
    """
    llg = _llg()
    kind = params.kind
    matcher = llg.LLMatcher
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarSpecError(f"{param}: the JSON schema is not valid JSON: {exc}", param) from exc
        if params.disable_additional_properties:
            schema = _close_objects(schema)
        try:
            options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
            if not params.disable_any_whitespace:
                options["whitespace_pattern"] = rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE_RUN}}}"
            return matcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError) as exc:
            raise GrammarSpecError(f"{param}: invalid JSON schema: {clean_library_error(exc)}", param) from exc
    if kind == "regex":
        return matcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return matcher.grammar_from_lark("start: " + " | ".join(choice_literals(params.choice or [])))
    if kind == "grammar":
        text = params.grammar or ""
        if not is_lark(text):
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = gbnf_to_lark(text)
            except Exception as exc:  # noqa: BLE001 - the converter raises plain exceptions
                raise GrammarSpecError(f"{param}: invalid EBNF grammar: {clean_library_error(exc)}", param) from exc
        return matcher.grammar_from_lark(text)
    raise GrammarSpecError(
        f"{param}: {kind} is not supported by the guidance backend (use xgrammar)", param, unsupported=True
    )


class GuidanceGrammar(StructuredOutputGrammar):
    """An ``llguidance.LLMatcher``. It terminates when it accepts a stop token (as xgrammar's matcher does): once
    the grammar is complete llguidance's mask allows only the stop tokens, so the request ends with EOS and the
    EOS is never mistaken for text."""

    def __init__(self, matcher: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.terminated = False

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if self.terminated:
                return False
            if token in self.stop_token_ids and self.matcher.is_stopped():
                # llguidance stops by itself once nothing can follow; the stop token then ends the request.
                self.terminated = True
                continue
            if not self.matcher.consume_token(token) or self.matcher.is_error():
                return False
            if token in self.stop_token_ids:
                self.terminated = True
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens[: self.matcher.validate_tokens(tokens)]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.terminated = False
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        assert row.is_contiguous() and row.dtype == torch.int32
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def is_terminated(self) -> bool:
        return self.terminated

    def reset(self) -> None:
        self.terminated = False
        self.matcher.reset()


class GuidanceBackend(StructuredOutputBackend):
    """llguidance over the model's (fast) tokenizer."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        import llguidance.hf

        try:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                             eos_token=list(stop_token_ids) or None)
        except ValueError as exc:
            raise GrammarSpecError(
                f"structured_outputs: the guidance backend needs a fast tokenizer ({exc}); use xgrammar"
            ) from exc

    @classmethod
    def validate(cls, params: StructuredOutputsParams, param: str = "structured_outputs") -> None:
        grammar = grammar_string(params, param)
        error = _llg().LLMatcher.validate_grammar(grammar, None)
        if error:
            raise _spec_error(params.kind, error, param)

    def compile(self, params: StructuredOutputsParams) -> Any:
        grammar = grammar_string(params)
        error = _llg().LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise _spec_error(params.kind, error, "structured_outputs")
        return grammar

    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        matcher = _llg().LLMatcher(self.ll_tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise GrammarSpecError(f"structured_outputs: {clean_library_error(Exception(matcher.get_error()))}")
        return GuidanceGrammar(matcher, self.vocab_size, self.stop_token_ids)


def _spec_error(kind: str, message: str, param: str) -> GrammarSpecError:
    text = clean_library_error(Exception(message))
    unsupported = any(m in text.lower() for m in _UNSUPPORTED_MARKERS)
    what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}.get(kind, kind)
    return GrammarSpecError(f"{param}: invalid {what} for the guidance backend: {text}", param, unsupported)
