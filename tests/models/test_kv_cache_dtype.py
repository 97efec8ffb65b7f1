"""``--kv-cache-dtype``: a KV cache in another dtype than the model's (vLLM's flag of the same name)."""

from __future__ import annotations

import argparse
import logging

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
    for bad in ("fp4", "int4", "fp8_inc"):
        with pytest.raises(ValueError, match=rf"kv_cache_dtype: must be one of .*int8, fp8, fp8_e4m3, fp8_e5m2, got '{bad}'"):
            EngineArgs(model=None, kv_cache_dtype=bad).create_engine_config()
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for name in ("bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", name])).kv_cache_dtype == name
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


def _blocks(core: EngineCore) -> int:
    return core.scheduler.kv_cache_manager.block_pool.num_blocks


@pytest.fixture(scope="module")
def float32_reference(tiny_llama_dir):
    """Greedy tokens and KV blocks of the tiny model with its float32 cache, and a bfloat16 cache's block count."""
    full = _core(tiny_llama_dir, dtype="float32", block_size=4, kv_cache_memory="1MiB")
    half = _core(tiny_llama_dir, dtype="float32", block_size=4, kv_cache_memory="1MiB", kv_cache_dtype="bfloat16")
    return run_engine(full, PROMPTS, max_tokens=16), _blocks(full), _blocks(half)


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_e5m2"])
def test_quantized_cache_holds_more_blocks_and_generates_alike(tiny_llama_dir, float32_reference, name, caplog):
    # The freed memory shows as blocks: fp8 takes a quarter of float32's bytes per row, int8 a quarter plus the
    # 4-byte scale of each row (head size 16 here: 20 bytes against 64, 32 for bfloat16).
    ref_tokens, full_blocks, half_blocks = float32_reference
    with caplog.at_level(logging.INFO, logger="tokenmill.worker.worker"):
        core = _core(tiny_llama_dir, dtype="float32", block_size=4, kv_cache_memory="1MiB", kv_cache_dtype=name)
    # 2 layers x K and V x 2 KV heads x 4 tokens x a row of 20 (int8) or 16 bytes
    row = 20 if name == "int8" else 16
    assert f"KV cache: {_blocks(core)} blocks of {2 * 2 * 2 * 4 * row} bytes" in caplog.text
    runner = core.executor.worker.model_runner
    want = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[name]
    assert core.config.cache_config.cache_dtype == ("fp8_e4m3" if name == "fp8" else name)
    assert runner.kv_caches and all(kv.dtype == want for kv in runner.kv_caches)
    blocks = _blocks(core)
    if name == "int8":
        assert runner.kv_caches[0].shape[-1] == 20
        assert blocks in range(full_blocks * 64 // 20 - 1, full_blocks * 64 // 20 + 3)
        assert blocks in range(half_blocks * 32 // 20 - 1, half_blocks * 32 // 20 + 3)
    else:
        assert blocks in range(4 * full_blocks, 4 * full_blocks + 4) and blocks in range(2 * half_blocks, 2 * half_blocks + 2)
    outs = run_engine(core, PROMPTS, max_tokens=16)  # also checks that every block is free again
    # Greedy agreement: tokens before each answer's first difference from the float32 cache's (after one the
    # answers continue different texts). Figures in docs/quantization.md.
    agree = [next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), len(ref)) for ref, out in zip(ref_tokens, outs)]
    print(f"{name}: greedy tokens agreeing with the float32 cache's {sum(agree)}/{sum(map(len, ref_tokens))} {agree}")
    # A random model's next-token scores are close together, so the coarser formats flip more of them: e5m2 keeps
    # 2 mantissa bits, e4m3 3, int8 about 7 per row.
    assert sum(agree) >= {"int8": 0.8, "fp8": 0.75, "fp8_e5m2": 0.5}[name] * sum(map(len, ref_tokens)), agree


def test_a_backend_without_quantized_caches_refuses_one(tiny_llama_dir, monkeypatch):
    from tokenmill.attention.backends.torch_paged import TorchPagedAttentionBackend

    monkeypatch.setattr(TorchPagedAttentionBackend, "supported_quantized_kv_cache_dtypes", ("int8",))
    with pytest.raises(ValueError, match=r"kv_cache_dtype: the .* attention backend does not support a 'fp8_e5m2' KV "
                                         r"cache \(it supports int8\)"):
        _core(tiny_llama_dir, dtype="float32", kv_cache_dtype="fp8_e5m2", attention_backend="TORCH_PAGED")
