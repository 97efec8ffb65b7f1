"""Speculation and structured outputs in one batch: constrained requests get no drafts but keep their grammar
(the bitmask reaches the verification path), unconstrained ones keep speculating, and every output equals the
one without speculation."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.engine.tiny_model import tiny_llama_with_tokenizer
from tests.spec_decode.engine_utils import NGRAM
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams as SO

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}}, "required": ["id", "ok"]}
REGEX = r"[a-f]{3}-[0-9]{2}"
# Repetitive prompts: the n-gram proposer finds drafts for the unconstrained rows.
PROMPTS = ["one two three one two three one two three one two", "a b c a b c a b c a b c a b",
           "Hello world, this is", "x y x y x y x y x y x y"]


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_llama_with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("tiny_spec_so") / "model")


def test_constrained_and_speculating_requests_share_a_batch(model_dir: str) -> None:
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(json=SCHEMA,
                                                                                  disable_any_whitespace=True)),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(regex=REGEX)),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]]
    plain = LLM(model_dir, dtype="float32")
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    spec = LLM(model_dir, dtype="float32", speculative_config=NGRAM)
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    jsonschema.validate(json.loads(outs[1].outputs[0].text), SCHEMA)
    assert re.fullmatch(REGEX, outs[2].outputs[0].text)
    stats = spec.llm_engine.spec_decoding_stats
    assert stats.num_draft_tokens > 0  # the unconstrained rows did speculate in these batches
    core = spec.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert core.structured_output_manager.num_live_requests == 0
