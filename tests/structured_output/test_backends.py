"""The structured-output backends on the byte-level test tokenizer (no model): every constraint kind, both
backends, random walks that may only take allowed tokens end in text the constraint accepts; invalid constraints
are refused with the field named; ``auto`` picks llguidance only for what xgrammar cannot do."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tests.structured_output.helpers import VOCAB, make_manager, random_walk, text_of
from tokenmill.sampling_params import SamplingParamsError, StructuredOutputsParams
from tokenmill.structured_output import GrammarSpecError, resolve_structured_outputs
from tokenmill.worker.grammar_bitmask import apply_grammar_bitmask, unpack_bitmask

BACKENDS = ["xgrammar", "guidance"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


def compile_grammar(backend: str, **fields):
    params = resolve_structured_outputs(StructuredOutputsParams(backend=backend, **fields))
    manager = make_manager(backend)
    return manager, manager._create_grammar(params)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_walks_validate(backend: str, seed: int) -> None:
    _, grammar = compile_grammar(backend, json=PERSON, disable_any_whitespace=True)
    text = text_of(random_walk(grammar, seed))
    # strict=False: xgrammar's rule for strings with maxLength lets raw control characters through (a random walk
    # over byte tokens finds them; real models do not write them).
    jsonschema.validate(json.loads(text, strict=False), PERSON)


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_object_is_an_object(backend: str) -> None:
    _, grammar = compile_grammar(backend, json_object=True, disable_any_whitespace=True)
    tokens = random_walk(grammar, 3, max_steps=2000)
    assert isinstance(json.loads(text_of(tokens)), dict)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_regex_walks_match(backend: str, seed: int) -> None:
    pattern = r"(cat|dog)-[0-9]{2,4}(!|\?)"
    _, grammar = compile_grammar(backend, regex=pattern)
    assert re.fullmatch(pattern, text_of(random_walk(grammar, seed)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_choice_gives_one_of_the_choices(backend: str) -> None:
    choices = ['say "yes"', "no\\way", "naïve café"]
    for seed in range(4):
        _, grammar = compile_grammar(backend, choice=choices)
        assert text_of(random_walk(grammar, seed)) in choices


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grammar_text", [
    'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?',
    'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/',
])
def test_ebnf_and_lark_grammars(backend: str, grammar_text: str) -> None:
    _, grammar = compile_grammar(backend, grammar=grammar_text)
    for seed in range(3):
        grammar.reset()
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text_of(random_walk(grammar, seed)))


def test_structural_tag_with_xgrammar() -> None:
    tag = {"type": "structural_tag", "triggers": ["<fn="],
           "structures": [{"begin": "<fn=add>", "schema": {"type": "object", "properties": {
               "a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}, "end": "</fn>"}]}
    _, grammar = compile_grammar("xgrammar", structural_tag=json.dumps(tag))
    tokenizer_ids = __import__("tests.structured_output.helpers", fromlist=["tokenizer"]).tokenizer().encode(
        'x <fn=add>{"a": 3}</fn> y', add_special_tokens=False)
    assert grammar.accept_tokens("r", tokenizer_ids)
    assert grammar.validate_tokens(tokenizer_ids[:1]) == tokenizer_ids[:1]


def test_validate_tokens_and_rollback() -> None:
    _, grammar = compile_grammar("xgrammar", regex="ab+c")
    tok = __import__("tests.structured_output.helpers", fromlist=["tokenizer"]).tokenizer()
    good = tok.encode("abbc", add_special_tokens=False)
    bad = tok.encode("x", add_special_tokens=False)
    assert grammar.validate_tokens(good) == good
    assert grammar.validate_tokens(bad) == []
    assert grammar.accept_tokens("r", good)
    grammar.rollback(len(good))
    assert grammar.accept_tokens("r", good)


@pytest.mark.parametrize(("fields", "backend", "match"), [
    ({"json": {"type": "object", "properties": 5}}, "xgrammar", "properties must be an object"),
    ({"json": {"type": "strin"}}, "auto", "strin"),
    ({"json": "{not json"}, "guidance", "not valid JSON"),
    ({"regex": "a["}, "auto", "Unclosed"),
    ({"regex": "a["}, "guidance", "unclosed character class"),
    ({"grammar": 'root ::= "a" | undefined_rule'}, "xgrammar", "undefined_rule"),
    ({"structural_tag": "{}"}, "guidance", "not supported by the guidance backend"),
    ({"json": {"type": "array", "contains": {"const": 1}}}, "xgrammar", "cannot enforce"),
])
def test_invalid_constraints_are_refused_with_the_field(fields: dict, backend: str, match: str) -> None:
    with pytest.raises(GrammarSpecError, match=match) as info:
        resolve_structured_outputs(StructuredOutputsParams(**fields), backend, param="response_format")
    assert info.value.param == "response_format"


def test_shape_errors_name_the_field() -> None:
    with pytest.raises(SamplingParamsError, match="exactly one of"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(SamplingParamsError, match="choice entries"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(SamplingParamsError, match="backend must be"):
        StructuredOutputsParams(regex="a", backend="outlines")


def test_auto_picks_per_request() -> None:
    assert resolve_structured_outputs(StructuredOutputsParams(json=PERSON)).backend == "xgrammar"
    # xgrammar would not enforce allOf with several subschemas; llguidance does.
    two = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]}
    assert resolve_structured_outputs(StructuredOutputsParams(json=two)).backend == "guidance"
    # Structural tags are xgrammar's only.
    tag = json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}})
    assert resolve_structured_outputs(StructuredOutputsParams(structural_tag=tag)).backend == "xgrammar"


def test_compiled_grammars_are_cached_by_constraint() -> None:
    manager = make_manager()
    params = resolve_structured_outputs(StructuredOutputsParams(json=PERSON))
    first = manager._create_grammar(params)
    second = manager._create_grammar(resolve_structured_outputs(StructuredOutputsParams(json=dict(PERSON))))
    assert first is not second  # one matcher each
    assert (manager.num_compiled, manager.num_cache_hits) == (1, 1)
    manager._create_grammar(resolve_structured_outputs(StructuredOutputsParams(json=PERSON,
                                                                               disable_any_whitespace=True)))
    assert manager.num_compiled == 2


def test_apply_bitmask_touches_only_constrained_rows_in_batch_order() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    original = logits.clone()
    words = (VOCAB + 31) // 32
    bitmask = torch.zeros(2, words, dtype=torch.int32)
    bitmask[0, 0] = 0b1010  # request "c": tokens 1 and 3
    bitmask[1, 2] = 1  # request "a": token 64
    out = apply_grammar_bitmask(logits, ["a", "b", "c"], bitmask.numpy(), ["c", "a"])
    assert torch.equal(out[1], original[1])  # unconstrained row: bit for bit
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [64]
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [1, 3]
    assert out[2, 3] == original[2, 3]


def test_unpack_bitmask_pads_beyond_the_mask() -> None:
    packed = torch.tensor([[-1]], dtype=torch.int32)
    allowed = unpack_bitmask(packed, 40)
    assert allowed[0, :32].all() and not allowed[0, 32:].any()
