"""``tokenmill bench structured`` end to end at tiny shapes: the JSON holds both workloads, consistent figures and
the time breakdown (figures themselves are not checked: this is not a timed test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engine.tiny_model import tiny_llama_with_tokenizer
from tokenmill.entrypoints.cli import main


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_llama_with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("bench_so") / "model")


def test_structured_bench_writes_consistent_json(model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "so.json"
    rc = main(["bench", "structured", "--model", model_dir, "--num-prompts", "6", "--concurrency", "4",
               "--input-len", "8", "--output-len", "6", "--repeats", "1", "--json", str(out),
               "--max-model-len", "64", "--num-gpu-blocks-override", "64", "--block-size", "4"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "structured" and r["num_constrained"] == 3
    mixed, = r["runs"]["mixed"]
    plain, = r["runs"]["unconstrained"]
    assert plain["output_tokens"] == 36  # 6 requests x 6 tokens
    assert mixed["output_tokens"] == 36  # the default schema outlasts 6 tokens: every request is length-capped
    assert mixed["output_tokens_per_s"] == pytest.approx(36 / mixed["elapsed_s"])
    assert r["ratio_mixed_over_unconstrained"] == pytest.approx(
        r["median_output_tokens_per_s"]["mixed"] / r["median_output_tokens_per_s"]["unconstrained"])
    for label in ("bitmask_fill", "matcher_advance", "logits_masking", "execute_model", "engine_step"):
        assert mixed["timers"][label]["calls"] > 0, label
    assert "bitmask_fill" not in plain["timers"]


def test_structured_bench_refuses_data_parallel_engine_cores(model_dir: str) -> None:
    with pytest.raises(SystemExit, match="--data-parallel-size must be 1"):
        main(["bench", "structured", "--model", model_dir, "--data-parallel-size", "2"])
