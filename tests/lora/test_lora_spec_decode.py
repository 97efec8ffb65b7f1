"""LoRA with speculative decoding: n-gram drafts are verified by the target with each request's adapter (greedy
tokens equal transformers + peft, adapters and the base model in one batch, drafts really verified, prefix-cache
hashes keyed by the adapter, no KV leak); a draft model together with ``--enable-lora`` is refused at config
time."""

from __future__ import annotations

import pytest

from tests.lora.adapters import peft_greedy
from tests.spec_decode.engine_utils import NGRAM, check_hashes
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.engine_args import EngineArgs
from tokenmill.lora import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.metrics import SpecDecodingStats

pytestmark = pytest.mark.timeout(300)

# copying context, so the n-gram lookup proposes drafts from the start
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [100, 101, 102] * 8]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_ngram_speculation_with_adapters_matches_peft(lora_llama_dir, llama_adapters):
    core = EngineCore(EngineArgs(model=lora_llama_dir, dtype="float32", enable_lora=True, max_loras=2,
                                 max_lora_rank=8, block_size=4, num_gpu_blocks_override=256,
                                 speculative_config=NGRAM).create_engine_config())
    a1 = LoRARequest("a1", 1, llama_adapters["a1"])
    a3 = LoRARequest("a3", 3, llama_adapters["a3"])
    kinds = {"a1": a1, "a3": a3, "base": None}
    for i, prompt in enumerate(PROMPTS):
        for name, lora in kinds.items():
            core.add_request(EngineCoreRequest(f"{name}-{i}", prompt, GREEDY, lora_request=lora))
    tokens: dict[str, list[int]] = {}
    stats = SpecDecodingStats.new(core.scheduler.num_spec_tokens)
    steps = 0
    while core.has_unfinished_requests():
        out = core.step()
        steps += 1
        assert steps < 1000
        for o in out.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if out.scheduler_stats is not None and out.scheduler_stats.spec_decoding_stats is not None:
            stats.add(out.scheduler_stats.spec_decoding_stats)
        check_hashes(core)
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks, "KV blocks leaked"
    for name, lora in kinds.items():
        ref = peft_greedy(lora_llama_dir, lora.lora_path if lora else None, PROMPTS, MAX_TOKENS)
        assert [tokens[f"{name}-{i}"] for i in range(len(PROMPTS))] == ref, name
    assert tokens["a1-0"] != tokens["base-0"] or tokens["a1-1"] != tokens["base-1"]
    # drafts were proposed and verified (some taken), so verification ran with the adapters' mapping
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def test_draft_model_with_lora_is_refused(lora_llama_dir):
    args = EngineArgs(model=lora_llama_dir, dtype="float32", enable_lora=True,
                      speculative_config={"method": "draft_model", "model": lora_llama_dir,
                                          "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config: the draft_model method does not support --enable-lora"):
        args.create_engine_config()
