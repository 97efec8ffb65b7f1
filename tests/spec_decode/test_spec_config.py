"""SpeculativeConfig: parsing (dict, JSON, CLI flag), validation with errors that name the key, the draft
model's vocabulary check, the n-gram proposer, and the Prometheus counters."""

from __future__ import annotations

import argparse

import pytest

from tokenmill.engine_args import EngineArgs
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram_proposer import NgramProposer


def test_parse_dict_json_and_defaults() -> None:
    c = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.num_lookahead_tokens) == (1, 3, 0)
    c = SpeculativeConfig.from_user('{"model": "/some/draft", "num_speculative_tokens": 2}')
    assert c.method == "draft_model" and c.num_lookahead_tokens == 2
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert EngineArgs.from_cli_args(args).speculative_config == '{"method": "ngram", "num_speculative_tokens": 5}'


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, "speculative_config.model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "unknown key"),
    ],
)
def test_bad_settings_name_the_key(value, match) -> None:
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_user(value)


def test_draft_with_another_vocabulary_is_refused(tiny_llama_dir, tiny_other_vocab_dir) -> None:
    args = EngineArgs(model=tiny_llama_dir, speculative_config={"method": "draft_model", "model": tiny_other_vocab_dir,
                                                                "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"vocabulary of 256 tokens .* has 512"):
        args.create_engine_config()


def test_missing_draft_and_pipeline_parallel_are_refused(tiny_llama_dir, tmp_path) -> None:
    with pytest.raises((FileNotFoundError, ValueError)):
        EngineArgs(model=tiny_llama_dir, speculative_config={"model": str(tmp_path / "nope"),
                                                             "num_speculative_tokens": 2}).create_engine_config()
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineArgs(model=tiny_llama_dir, pipeline_parallel_size=2, distributed_executor_backend="mp",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2}).create_engine_config()


def test_ngram_proposer() -> None:
    p = NgramProposer(3, 1, 3)
    assert p.propose([1, 2, 3, 4, 5, 1, 2]) == [3, 4, 5]  # longest match "1 2"
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]) == [7, 1, 2]  # the latest occurrence with 3 tokens after
    assert p.propose([1, 2, 3]) == []  # no earlier occurrence
    assert p.propose([4, 4]) == [4]
    assert p.propose([1, 2, 3, 4, 5, 1, 2], max_tokens=1) == [3]
    assert NgramProposer(3, 2, 3).propose([1, 2, 3, 1]) == []  # only 1-grams match, below prompt_lookup_min


def test_prometheus_counters() -> None:
    from tests.entrypoints.helpers import metric
    from tokenmill.engine.messages import SchedulerStats
    from tokenmill.metrics.prometheus import PrometheusStatLogger
    from tokenmill.spec_decode.metrics import SpecDecodingStats

    logger = PrometheusStatLogger("m")
    stats = SpecDecodingStats.new(3)
    stats.observe_draft(3, 2)
    stats.observe_draft(3, 0)
    logger.record_scheduler_stats(SchedulerStats(spec_decoding_stats=stats.take()))
    assert (stats.num_drafts, stats.num_accepted_tokens_per_pos) == (0, [0, 0, 0])
    text = logger.render().decode()
    assert metric(text, "tokenmill:spec_decode_num_drafts_total", "m") == 2
    assert metric(text, "tokenmill:spec_decode_num_draft_tokens_total", "m") == 6
    assert metric(text, "tokenmill:spec_decode_num_accepted_tokens_total", "m") == 2
    assert metric(text, "tokenmill:spec_decode_num_accepted_tokens_per_pos_total", "m", position="1") == 1
    assert metric(text, "tokenmill:spec_decode_num_accepted_tokens_per_pos_total", "m", position="2") == 0
