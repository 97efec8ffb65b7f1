"""Every built-in family against transformers on a tiny random model: greedy tokens and prompt logprobs.

One offline ``LLM`` per family with chunked prefill (16-token budget, 4-token blocks) and prefix caching; a
first batch of prompts of different lengths (most longer than the sliding window) asks for prompt logprobs, a
second batch repeats them and must hit the prefix cache and give the same tokens. transformers runs once per
family (one left-padded ``generate`` batch).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.families import FAMILIES, family_dir
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreOutput, EngineCoreRequest
from tokenmill.sampling_params import SamplingParams

MAX_TOKENS = 24
BASE = [(i * 37 + 11) % 500 + 3 for i in range(40)]
PROMPTS = [BASE[:33], BASE[:20] + [5, 6, 7], [3, 4], BASE[:9], [7] * 13, BASE]


def hf_reference(model_dir: str, prompts: list[list[int]], max_new_tokens: int):
    """transformers' greedy continuation of the prompts, generated as one left-padded batch (EOS is an ordinary
    token, as with ``ignore_eos``), and the log-softmax rows over each prompt (``[len(prompt), V]`` float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # (min_new_tokens would instead forbid the EOS token)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        rows = [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]
    return out[:, width:].tolist(), rows


def run_wave(core: EngineCore, tag: str, params: SamplingParams, prompts: list[list[int]] = PROMPTS
             ) -> dict[int, list[EngineCoreOutput]]:
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{tag}{i}", p, params, eos_token_id=None))
    outs: dict[int, list[EngineCoreOutput]] = {i: [] for i in range(len(prompts))}
    for _ in range(10_000):
        if not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            outs[int(o.request_id[len(tag):])].append(o)
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks, "KV blocks leaked after all requests finished"
    return outs


def tokens(outs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def check_against_transformers(core: EngineCore, model_dir: str, prompts: list[list[int]]) -> None:
    """Run ``prompts`` on ``core`` (greedy, :data:`MAX_TOKENS` each, prompt logprobs), shut it down, and assert
    transformers' greedy tokens and prompt logprobs (within 1e-4) on the model of ``model_dir``."""
    try:
        outs = run_wave(core, "g", SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                  prompt_logprobs=1), prompts)
    finally:
        core.shutdown()
    greedy, rows = hf_reference(model_dir, prompts, MAX_TOKENS)
    for i, prompt in enumerate(prompts):
        assert tokens(outs[i]) == greedy[i], f"prompt {i}"
        got = [lps[0] for _, lps, _ in outs[i][0].prompt_logprobs]
        want = [float(rows[i][t, prompt[t + 1]]) for t in range(len(prompt) - 1)]
        assert got == pytest.approx(want, abs=1e-4), f"prompt logprobs of prompt {i}"


@pytest.mark.parametrize("spec", FAMILIES, ids=[f.name for f in FAMILIES])
def test_family_greedy_and_prompt_logprobs_match_transformers(spec, family_root):
    from tokenmill.entrypoints.llm import LLM

    model_dir = family_dir(spec.name, family_root)
    llm = LLM(model_dir, dtype="float32", block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=256,
              enable_prefix_caching=True)
    assert type(llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model).__name__ == spec.model_cls
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    first = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                prompt_logprobs=1), use_tqdm=False)
    again = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                         use_tqdm=False)
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks, "KV blocks leaked after all requests finished"
    greedy, rows = hf_reference(model_dir, PROMPTS, MAX_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        assert list(first[i].outputs[0].token_ids) == greedy[i], f"prompt {i} (len {len(prompt)})"
        assert list(again[i].outputs[0].token_ids) == greedy[i], f"prompt {i} with prefix-cache hits"
        entries = first[i].prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        got = [entries[t + 1][prompt[t + 1]].logprob for t in range(len(prompt) - 1)]
        want = [float(rows[i][t, prompt[t + 1]]) for t in range(len(prompt) - 1)]
        assert got == pytest.approx(want, abs=1e-4), f"prompt logprobs of prompt {i}"
    assert sum(out.num_cached_tokens for out in again) >= 60  # the second batch hit the prefix cache
    llm.llm_engine.shutdown()
