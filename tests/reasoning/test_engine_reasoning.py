"""The engine side of reasoning models on the tiny random Llama (float32): a grammar is not enforced while the
output thinks, a thinking budget forces the end marker, and after it the answer follows the grammar; the state
machine that tracks the thinking on its own."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.engine.tiny_model import tiny_llama_with_tokenizer
from tokenmill.core.reasoning_state import ReasoningState
from tokenmill.entrypoints.llm import LLM
from tokenmill.reasoning import ReasoningParserManager
from tokenmill.sampling_params import ReasoningParams, SamplingParams, SamplingParamsError
from tokenmill.sampling_params import StructuredOutputsParams as SO

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM(tiny_llama_with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("tiny_reasoning") / "model"),
               dtype="float32")


def end_ids(llm: LLM) -> list[int]:
    return list(llm.get_tokenizer().encode("</think>", add_special_tokens=False))


def run(llm: LLM, **kw: object) -> list[int]:
    """Greedy token ids; EOS is held off for ``min_tokens`` (default all of them: random weights like EOS)."""
    max_tokens = kw.pop("max_tokens", 40)
    kw.setdefault("min_tokens", max_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return list(llm.generate(["Think about it:"], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_the_grammar_waits_for_the_end_marker(llm: LLM) -> None:
    free = run(llm, max_tokens=12)
    thinking = ReasoningParams(end_token_ids=end_ids(llm))
    assert not any(free[i:i + len(thinking.end_token_ids)] == thinking.end_token_ids for i in range(len(free)))
    constrained = run(llm, max_tokens=12, structured_outputs=SO(json=SCHEMA))
    assert constrained != free  # the schema changes the very first token on this model
    # with reasoning the grammar waits for "</think>", which this random model never writes: free text
    assert run(llm, max_tokens=12, structured_outputs=SO(json=SCHEMA), reasoning=thinking) == free


@pytest.mark.parametrize("budget", [0, 5])
def test_budget_forces_the_end_marker_then_the_answer_follows_the_schema(llm: LLM, budget: int) -> None:
    marker = end_ids(llm)
    reasoning = ReasoningParams(end_token_ids=marker, thinking_token_budget=budget)
    out = run(llm, max_tokens=80, min_tokens=budget + len(marker),
              structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True), reasoning=reasoning)
    assert out[:budget] == run(llm, max_tokens=max(budget, 1))[:budget]  # free thinking up to the budget
    assert out[budget:budget + len(marker)] == marker  # then the marker, forced
    text = llm.get_tokenizer().decode(out, skip_special_tokens=True)
    parser = ReasoningParserManager.get_reasoning_parser("deepseek_r1")(llm.get_tokenizer())
    _, content = parser.extract_reasoning(text)
    assert content is not None
    jsonschema.validate(json.loads(content), SCHEMA)


def test_budget_without_grammar_ends_the_thinking(llm: LLM) -> None:
    marker = end_ids(llm)
    out = run(llm, max_tokens=20, reasoning=ReasoningParams(end_token_ids=marker, thinking_token_budget=3))
    assert out[3:3 + len(marker)] == marker and len(out) == 20  # the answer goes on, unconstrained


def test_reasoning_state_tracks_and_forces() -> None:
    state = ReasoningState(ReasoningParams(end_token_ids=[7, 8, 9], thinking_token_budget=3))
    out: list[int] = []
    for t in (1, 7):
        out.append(t)
        assert state.observe(out) is False
    assert state.forced_token(out) is None  # two thinking tokens, budget three
    out.append(8)
    assert not state.observe(out)
    assert state.forced_token(out) == 9  # continues the marker the output already began
    out.append(9)
    assert state.observe(out) is True and state.ended
    assert state.forced_token(out) is None and not state.constrains_sampling
    fresh = ReasoningState(ReasoningParams(end_token_ids=[7, 8], thinking_token_budget=0))
    assert fresh.forced_token([]) == 7


def test_reasoning_params_are_checked() -> None:
    with pytest.raises(SamplingParamsError, match="reasoning"):
        SamplingParams(reasoning=ReasoningParams(end_token_ids=[]))
    with pytest.raises(SamplingParamsError, match="thinking_token_budget"):
        SamplingParams(reasoning=ReasoningParams(end_token_ids=[3], thinking_token_budget=-1))
