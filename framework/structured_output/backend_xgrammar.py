"""The xgrammar backend (PyPI ``xgrammar``): the default one.

JSON schemas are compiled with xgrammar's ``strict_mode`` (objects take no properties beyond ``properties``,
arrays no items beyond ``items``/``prefixItems``), which is also vLLM's behaviour with xgrammar. Grammars are
EBNF (GBNF) or Lark; choices become an EBNF alternation of string literals; structural tags take vLLM's
``{"type": "structural_tag", "structures": [...], "triggers": [...]}`` or xgrammar's own
``{"type": "structural_tag", "format": {...}}``.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from tokenmill.sampling_params import StructuredOutputsParams
# Same import list as backend_guidance: both backends implement the one interface with the same helpers.
from tokenmill.structured_output.backend_types import (
    GrammarSpecError,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    choice_literals,
    MAX_WHITESPACE_RUN,
    clean_library_error,
    is_lark,
)

# Phrases in xgrammar's errors that mean "valid, but not implemented" rather than "invalid".
_UNSUPPORTED_MARKERS = ("not supported", "unsupported", "not implemented")


# JSON Schema keywords xgrammar 0.2 accepts but does not enforce (its output could then violate the schema);
# "allOf" counts only with several subschemas. Found by compiling schemas and feeding violating documents.
_UNENFORCED_KEYWORDS = ("contains", "minContains", "maxContains")


def unenforced_keywords(schema: Any) -> list[str]:
    """The JSON Schema keywords in ``schema`` (recursively) that xgrammar would silently not enforce."""
    found: list[str] = []

    def walk(node: Any, in_properties: bool = False) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for key, value in node.items():
                if not in_properties:
                    if key in _UNENFORCED_KEYWORDS and key not in found:
                        found.append(key)
                    if key == "allOf" and isinstance(value, list) and len(value) > 1 and key not in found:
                        found.append(key)
                # Keys under "properties" / "$defs" are names, not keywords.
                walk(value, in_properties=not in_properties and key in ("properties", "$defs", "definitions",
                                                                        "patternProperties"))

    walk(schema)
    return found


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def _schema_text(params: StructuredOutputsParams) -> str:
    if params.kind == "json_object":
        return '{"type": "object"}'
    assert params.json is not None
    return params.json if isinstance(params.json, str) else json.dumps(params.json, ensure_ascii=False)


def _json_options(params: StructuredOutputsParams) -> dict[str, Any]:
    any_whitespace = not params.disable_any_whitespace
    return {"any_whitespace": any_whitespace, "strict_mode": True,
            "max_whitespace_cnt": MAX_WHITESPACE_RUN if any_whitespace else None}


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(choice_literals(choices))


def _structural_tag_args(text: str, param: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments of ``Grammar.from_structural_tag`` / ``compile_structural_tag`` for vLLM's or xgrammar's
    structural-tag JSON."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarSpecError(f"{param}: structural_tag is not valid JSON: {exc}", param) from exc
    if isinstance(tag, dict) and "structures" in tag:
        xgr = _xgr()
        try:
            items = [
                xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                for s in tag["structures"]
            ]
            triggers = list(tag["triggers"])
        except (KeyError, TypeError) as exc:
            raise GrammarSpecError(
                f"{param}: structural_tag: each of 'structures' needs 'begin', 'schema' and 'end', and "
                f"'triggers' must be a list of strings ({exc!r})",
                param,
            ) from exc
        return (items, triggers), {}
    return (text,), {}


class XgrammarGrammar(StructuredOutputGrammar):
    """An ``xgrammar.GrammarMatcher`` (rollback is unlimited in xgrammar's Earley matcher)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_processed_tokens = 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if not self.matcher.accept_token(token):
                return False
            self.num_processed_tokens += 1
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        accepted: list[int] = []
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            accepted.append(token)
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def reset(self) -> None:
        self.matcher.reset()
        self.num_processed_tokens = 0


class XgrammarBackend(StructuredOutputBackend):
    """Compiles with one ``xgrammar.GrammarCompiler`` over the model's tokenizer."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        xgr = _xgr()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # The manager keeps its own cache of compiled grammars (one per distinct constraint, LRU); xgrammar's
        # cache would hold a second copy.
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    @classmethod
    def validate(cls, params: StructuredOutputsParams, param: str = "structured_outputs") -> None:
        xgr = _xgr()
        kind = params.kind
        if kind == "json":
            try:
                schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            except json.JSONDecodeError as exc:
                raise GrammarSpecError(f"{param}: the JSON schema is not valid JSON: {exc}", param) from exc
            unenforced = unenforced_keywords(schema)
            if unenforced:
                raise GrammarSpecError(
                    f"{param}: the xgrammar backend cannot enforce the JSON Schema keyword(s) "
                    f"{', '.join(unenforced)}; use --structured-outputs-backend guidance or auto (which picks "
                    "guidance for such schemas when it can)",
                    param, unsupported=True,
                )
        try:
            if kind in ("json", "json_object"):
                xgr.Grammar.from_json_schema(_schema_text(params), **_json_options(params))
            elif kind == "regex":
                xgr.Grammar.from_regex(params.regex)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(_choice_ebnf(params.choice or []))
            elif kind == "grammar":
                grammar = params.grammar or ""
                if is_lark(grammar):
                    xgr.Grammar.from_lark(grammar)
                else:
                    xgr.Grammar.from_ebnf(grammar)
            elif kind == "structural_tag":
                args, kwargs = _structural_tag_args(params.structural_tag or "", param)
                xgr.Grammar.from_structural_tag(*args, **kwargs)
        except GrammarSpecError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own types
            raise _spec_error(kind, exc, param) from exc

    def compile(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        c = self.compiler
        try:
            if kind in ("json", "json_object"):
                return c.compile_json_schema(_schema_text(params), **_json_options(params))
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar(_choice_ebnf(params.choice or []))
            if kind == "grammar":
                grammar = params.grammar or ""
                return c.compile_lark(grammar) if is_lark(grammar) else c.compile_grammar(grammar)
            if kind == "structural_tag":
                args, kwargs = _structural_tag_args(params.structural_tag or "", "structured_outputs")
                return c.compile_structural_tag(*args, **kwargs)
        except GrammarSpecError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _spec_error(kind, exc, "structured_outputs") from exc
        raise GrammarSpecError(f"structured_outputs: unknown constraint kind {kind!r}")

    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        return XgrammarGrammar(_xgr().GrammarMatcher(compiled))


def _spec_error(kind: str, exc: BaseException, param: str) -> GrammarSpecError:
    message = clean_library_error(exc)
    unsupported = any(m in message.lower() for m in _UNSUPPORTED_MARKERS)
    what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar", "structural_tag": "structural tag"}[kind]
    return GrammarSpecError(f"{param}: invalid {what} for the xgrammar backend: {message}", param, unsupported)
