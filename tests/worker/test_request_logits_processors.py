"""Per-request logits processors in the worker: built once per request from the names it gives, applied only to
its own logits row, in the two call forms; refused names and bad processors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import LogitsProcessorSpec, SamplingParams
from tokenmill.worker.input_batch import CachedRequestState
from tokenmill.worker.request_logits_processors import apply_request_processors, check_request_processors

FIXTURES = "tests.entrypoints.logits_processor_fixtures"
PATTERN = r"tests\.(entrypoints\.logits_processor_fixtures|worker\.test_request_logits_processors)[:.].*"
BUILT: list[int] = []


def counting(start: int) -> Any:
    """A stateful factory: its processor bans token ``start + k`` at its k-th call."""
    BUILT.append(start)
    calls = [0]

    def processor(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[start + calls[0]] = float("-inf")
        calls[0] += 1
        return logits

    return processor


def wrong_shape(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    return logits[:2]


def state(req_id: str, specs: list[LogitsProcessorSpec] | None, prompt: list[int], output: list[int]
          ) -> CachedRequestState:
    return CachedRequestState(req_id=req_id, token_ids=prompt + output, num_prompt_tokens=len(prompt),
                              sampling_params=SamplingParams(logits_processors=specs), block_ids=[],
                              num_computed_tokens=0)


def test_rows_get_their_own_processors_built_once() -> None:
    BUILT.clear()
    states = [
        state("a", [LogitsProcessorSpec(qualname=f"{FIXTURES}:only_token", args=[3])], [1, 2], []),
        state("b", None, [1], [4]),
        state("c", [LogitsProcessorSpec(qualname="tests.worker.test_request_logits_processors:counting",
                                        kwargs={"start": 8}),
                    LogitsProcessorSpec(qualname=f"{FIXTURES}.after_prompt")], [7, 9], [9]),
    ]
    for step in range(2):
        logits = torch.zeros(3, 12)
        out = apply_request_processors(logits, states, PATTERN)
        assert out.shape == (3, 12)
        assert torch.isfinite(out[0]).tolist() == [i == 3 for i in range(12)]
        assert torch.equal(out[1], torch.zeros(12))  # no processors: untouched
        # counting bans 8, then 9 (its state lives across steps); after_prompt then keeps only token 9
        assert torch.isfinite(out[2]).tolist() == [i == 9 and step == 0 for i in range(12)]
    assert BUILT == [8]  # the factory ran once for request c
    assert states[2].request_processors is not None and states[1].request_processors is None


def test_a_processor_returning_the_wrong_shape_is_an_error() -> None:
    s = state("a", [LogitsProcessorSpec(qualname="tests.worker.test_request_logits_processors:wrong_shape")],
              [1], [])
    with pytest.raises(RuntimeError, match="expected"):
        apply_request_processors(torch.zeros(1, 8), [s], PATTERN)


@pytest.mark.parametrize(("spec", "pattern", "words"), [
    (LogitsProcessorSpec(qualname=f"{FIXTURES}:only_token", args=[1]), None, "--logits-processor-pattern"),
    (LogitsProcessorSpec(qualname="os:system"), PATTERN, "not allowed"),
    (LogitsProcessorSpec(qualname=f"{FIXTURES}:missing"), PATTERN, "could not be imported"),
    (LogitsProcessorSpec(qualname=f"{FIXTURES}:failing_factory", args=["nope"]), PATTERN, "nope"),
    (LogitsProcessorSpec(qualname=f"{FIXTURES}:only_token"), PATTERN, "positional arguments"),
    (LogitsProcessorSpec(qualname="nodots"), ".*", "could not be imported"),
])
def test_refused(spec: LogitsProcessorSpec, pattern: str | None, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words) as info:
        check_request_processors([spec], pattern)
    assert info.value.param == "logits_processors"


def test_refused_with_speculative_decoding_and_a_pattern_must_match_in_full() -> None:
    spec = LogitsProcessorSpec(qualname=f"{FIXTURES}.after_prompt")
    check_request_processors([spec], PATTERN)
    with pytest.raises(InvalidRequestError, match="speculative"):
        check_request_processors([spec], PATTERN, speculative=True)
    with pytest.raises(InvalidRequestError, match="not allowed"):
        check_request_processors([spec], r"tests\.entrypoints")  # a prefix is not enough
    check_request_processors(None, None)  # nothing asked: nothing checked
