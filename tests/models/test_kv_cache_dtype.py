"""``--kv-cache-dtype``: a KV cache in another dtype than the model's (vLLM's flag of the same name)."""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.models.test_llama_correctness import PROMPTS, run_engine
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.engine_args import EngineArgs
from tokenmill.sampling_params import SamplingParams


def _core(model: str, **kwargs) -> EngineCore:
    return EngineCore(EngineArgs(model=model, **kwargs).create_engine_config())


def test_bfloat16_cache_under_a_float32_model_holds_twice_the_blocks(tiny_llama_dir):
    full = _core(tiny_llama_dir, dtype="float32", block_size=4, kv_cache_memory="1MiB")
    half = _core(tiny_llama_dir, dtype="float32", block_size=4, kv_cache_memory="1MiB", kv_cache_dtype="bfloat16")
    assert full.config.cache_config.cache_dtype == "float32"  # auto: the model's dtype
    assert half.config.cache_config.cache_dtype == "bfloat16"
    runner = half.executor.worker.model_runner
    assert runner.kv_caches and all(kv.dtype == torch.bfloat16 for kv in runner.kv_caches)
    assert all(kv.dtype == torch.float32 for kv in full.executor.worker.model_runner.kv_caches)
    assert next(runner.model.parameters()).dtype == torch.float32
    blocks = [c.scheduler.kv_cache_manager.block_pool.num_blocks for c in (full, half)]
    assert blocks[1] in (2 * blocks[0], 2 * blocks[0] + 1)
    outs = run_engine(half, PROMPTS, max_tokens=12)  # also checks that every block is free again
    assert [len(o) for o in outs] == [12] * len(PROMPTS)


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match=r"kv_cache_dtype: .*fp8 KV caches are not supported"):
        EngineArgs(model=None, kv_cache_dtype="fp8").create_engine_config()
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        EngineArgs(model=None, kv_cache_dtype="int8").create_engine_config()
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "bfloat16"])).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp4"])


@pytest.mark.slow
def test_default_model_answers_alike_with_a_bfloat16_cache(default_model_path, hf_default_tokenizer):
    tok = hf_default_tokenizer
    questions = ["What is the capital of France?", "Count from one to ten.", "Name three colours."]
    prompts = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))

    def answers(cache_dtype: str) -> list[list[int]]:
        core = _core(default_model_path, dtype="float32", max_model_len=512, kv_cache_memory="64MiB",
                     kv_cache_dtype=cache_dtype)
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"q{i}", p, SamplingParams(temperature=0, max_tokens=24),
                                               eos_token_id=tok.eos_token_id))
        outs: dict[str, list[int]] = {f"q{i}": [] for i in range(len(prompts))}
        while core.has_unfinished_requests():
            for o in core.step().outputs:
                outs[o.request_id] += o.new_token_ids
        return [outs[f"q{i}"] for i in range(len(prompts))]

    full, half = answers("auto"), answers("bfloat16")
    assert "Paris" in tok.decode(half[0])
    for q, a, b in zip(questions, full, half):
        agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert agree >= 8, (q, tok.decode(a), tok.decode(b))  # rounding the cache may flip a late near-tie only
