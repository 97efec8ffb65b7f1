"""Greedy tokens from tokenmill equal transformers' generate() for the same weights."""

from __future__ import annotations


import pytest

from tests.conftest import hf_greedy
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreOutput, EngineCoreRequest
from tokenmill.engine_args import EngineArgs
from tokenmill.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 33, 44, 100], [7] * 13, [3, 4], list(range(20, 61)), [11, 300, 301, 302, 17, 18, 19, 400, 2]]


def step_until_idle(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[EngineCoreOutput]]:
    """Add ``requests`` together and step ``core`` until it is idle; returns each request's outputs and checks
    that no KV block leaked."""
    for r in requests:
        core.add_request(r)
    outs: dict[str, list[EngineCoreOutput]] = {r.request_id: [] for r in requests}
    steps = 0
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            outs[o.request_id].append(o)
        steps += 1
        assert steps < 10_000
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks, "KV blocks leaked after all requests finished"
    return outs


def tokens(outs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def run_engine(core: EngineCore, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True) -> list[list[int]]:
    requests = [
        EngineCoreRequest(f"req-{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos),
                          eos_token_id=None if ignore_eos else 2)
        for i, p in enumerate(prompts)
    ]
    outs = step_until_idle(core, requests)
    return [tokens(outs[r.request_id]) for r in requests]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(block_size=16, max_num_batched_tokens=2048),
        dict(block_size=4, max_num_batched_tokens=16),  # chunked prefill across many steps
        dict(block_size=8, max_num_batched_tokens=64, enable_prefix_caching=False),
    ],
    ids=["one-step-prefill", "chunked", "no-prefix-cache"],
)
def test_tiny_llama_greedy_matches_transformers(tiny_llama_dir, engine_kwargs):
    core = EngineCore(EngineArgs(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=256, **engine_kwargs).create_engine_config())
    ours = run_engine(core, PROMPTS, max_tokens=12)
    ref = hf_greedy(tiny_llama_dir, PROMPTS, 12)
    assert ours == ref


def test_preempted_and_resumed_greedy_output_is_unchanged(tiny_llama_dir):
    args = dict(model=tiny_llama_dir, dtype="float32", block_size=4)
    roomy = EngineCore(EngineArgs(num_gpu_blocks_override=256, **args).create_engine_config())
    expected = run_engine(roomy, PROMPTS, max_tokens=20)
    tight = EngineCore(EngineArgs(num_gpu_blocks_override=24, **args).create_engine_config())
    preemptions = 0
    original = tight.scheduler._preempt

    def counting(req):
        nonlocal preemptions
        preemptions += 1
        original(req)

    tight.scheduler._preempt = counting
    assert run_engine(tight, PROMPTS, max_tokens=20) == expected
    assert preemptions > 0


def test_tied_embeddings_model(tmp_path):
    from tests.conftest import build_tiny_llama

    d = build_tiny_llama(str(tmp_path / "tied"), tie=True, seed=3)
    core = EngineCore(EngineArgs(model=d, dtype="float32", num_gpu_blocks_override=64).create_engine_config())
    prompts = PROMPTS[:3]
    assert run_engine(core, prompts, max_tokens=8) == hf_greedy(d, prompts, 8)


@pytest.mark.slow
def test_default_gguf_model_greedy_matches_transformers(hf_default_tokenizer, hf_default_model):
    import torch

    tok, hf = hf_default_tokenizer, hf_default_model
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Count from one to ten.",
        "Give me three tips for staying healthy.",
    ]
    prompts = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    core = EngineCore(EngineArgs(max_model_len=1024, kv_cache_memory="128MiB").create_engine_config())
    eos = tok.eos_token_id
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"q{i}", p, SamplingParams(temperature=0, max_tokens=32), eos_token_id=eos))
    outs = {f"q{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            outs[o.request_id] += o.new_token_ids
    for i, p in enumerate(prompts):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        assert outs[f"q{i}"] == ref[0, len(p) :].tolist(), questions[i]
    assert "Paris" in tok.decode(outs["q0"])
