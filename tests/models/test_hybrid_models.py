"""Hybrid (state + attention) and attention-free models against transformers on tiny random checkpoints.

Per architecture one engine (module scope) runs six prompts of 2 to 40 tokens, greedy, 24 tokens each:
chunked prefill (16-token budget, 4-token blocks, so long prompts span several steps and carry their state
across chunks), requests joining the running batch while others decode, fewer state slots than requests (slots
are reused), and preemption (a tiny KV cache for models with attention layers; a forced preemption for the
attention-free one) after which the request is recomputed into a fresh slot, and a running request aborted. Tokens must equal transformers'
``generate(do_sample=False)``, prompt logprobs must be within 1e-4 (float32), and
every KV block and state slot must be free at the end.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.models.test_families import hf_reference
from tokenmill.engine.messages import EngineCoreEventType, EngineCoreOutput, EngineCoreRequest
from tokenmill.sampling_params import SamplingParams

MAX_TOKENS = 24
BASE = [(i * 37 + 11) % 500 + 3 for i in range(40)]
PROMPTS = [BASE[:33], BASE[:20] + [5, 6, 7], [3, 4], BASE[:9], [7] * 13, BASE]
COMMON = dict(vocab_size=512, hidden_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
              tie_word_embeddings=False)


@dataclass(frozen=True)
class HybridSpec:
    """Attributes:
    name: test id.
    config_cls, model_cls: names in ``transformers`` (the engine must pick the class of the same name).
    kwargs: config arguments on top of :data:`COMMON`.
    num_blocks: the KV cache (blocks of 4 tokens); small enough to force preemptions when the model has
        attention layers.
    """

    name: str
    config_cls: str
    model_cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    num_blocks: int = 256


SPECS = [
    HybridSpec("mamba2", "Mamba2Config", "Mamba2ForCausalLM",
               dict(num_hidden_layers=2, state_size=16, expand=2, num_heads=8, head_dim=16, n_groups=2,
                    conv_kernel=4, chunk_size=8)),
    # mamba, attention, mamba, attention; MoE 4 experts top-2 plus the shared MLP; Granite's multipliers
    HybridSpec("granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
               dict(num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=48,
                    num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16,
                    mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
                    embedding_multiplier=6.0, attention_multiplier=0.15, residual_multiplier=0.4,
                    logits_scaling=3.0, max_position_embeddings=256),
               num_blocks=24),
    # attention and a Mamba2 mixer side by side in every layer, no gated norm, muP multipliers all != 1, a head
    # size apart from hidden / heads (as in every Falcon-H1 checkpoint)
    HybridSpec("falcon_h1", "FalconH1Config", "FalconH1ForCausalLM",
               dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=96,
                    mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                    mamba_expand=2, mamba_d_ssm=128, mamba_chunk_size=8, mamba_rms_norm=False,
                    max_position_embeddings=256,
                    embedding_multiplier=2.0, lm_head_multiplier=0.5, mlp_multipliers=[0.8, 1.3],
                    key_multiplier=0.7, attention_in_multiplier=1.2, attention_out_multiplier=0.9,
                    ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], ssm_in_multiplier=0.7, ssm_out_multiplier=1.4),
               num_blocks=24),
    # gated DeltaNet, gated attention, DeltaNet, gated attention; 2 key heads for 4 value heads; MoE with a
    # shared expert on layers 0-2, a dense MLP on layer 3; partial rotary 0.25
    HybridSpec("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
               dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[3],
                    max_position_embeddings=256),
               num_blocks=24),
    # Mamba2, MoE, attention (no RoPE), relu2 MLP, Mamba2; 8 experts without a gate in 2 groups (one eligible),
    # top-2 by sigmoid scores with a correction bias, scaled by 2.5, a latent width, a shared expert
    HybridSpec("nemotron_h", "NemotronHConfig", "NemotronHForCausalLM",
               dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention"],
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                    mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
                    chunk_size=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                    moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=32,
                    routed_scaling_factor=2.5, max_position_embeddings=256),
               num_blocks=24),
    # Mamba-1 (RMS-normalised dt / B / C), attention (no RoPE), Mamba-1, attention; 4 experts top-2 (softmax
    # weights not renormalised) after the Mamba layers, SwiGLU MLPs after the attention layers
    HybridSpec("jamba", "JambaConfig", "JambaForCausalLM",
               dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                    expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=64, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                    mamba_dt_rank=8, max_position_embeddings=256),
               num_blocks=24),
]


def build(spec: HybridSpec, path: str) -> str:
    import transformers

    from tests.engine.engine_fakes import byte_level_tokenizer

    config = getattr(transformers, spec.config_cls)(**{**COMMON, **spec.kwargs})
    torch.manual_seed(0)
    model = getattr(transformers, spec.model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms, biases, dt_bias, A_log, D: away from their initial constants
                p.add_(torch.randn_like(p) * 0.1)
            elif "experts" in name or "router" in name:
                p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # Nemotron-H's router: a bias that changes the choice
                b.normal_(0, 0.1)
    model.save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=SPECS, ids=[s.name for s in SPECS])
def hybrid(request, tmp_path_factory):
    from tokenmill.entrypoints.llm import LLM

    spec: HybridSpec = request.param
    model_dir = build(spec, str(tmp_path_factory.mktemp(spec.name)))
    llm = LLM(model_dir, dtype="float32", block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
              num_gpu_blocks_override=spec.num_blocks)
    # one left-padded generate batch: the padding masks zero the padded tokens' conv inputs and state updates,
    # which gave the same tokens as one unpadded generate per prompt for every model here
    yield spec, llm, hf_reference(model_dir, PROMPTS, MAX_TOKENS), model_dir
    llm.llm_engine.shutdown()


def run(core, requests: list[EngineCoreRequest], join_after: int, preempt_at: int | None
        ) -> dict[str, list[EngineCoreOutput]]:
    """Add the first half of ``requests`` and one more that is aborted once it runs, step ``join_after``
    times, add the rest; step until all finish. ``preempt_at``: at that step, preempt the newest running request
    (as the scheduler does when short of blocks)."""
    half = len(requests) // 2
    for r in requests[:half]:
        core.add_request(r)
    core.add_request(EngineCoreRequest("aborted", BASE[:30], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                       eos_token_id=None))
    outs: dict[str, list[EngineCoreOutput]] = {r.request_id: [] for r in requests}
    for step in range(10_000):
        victim = core.scheduler.requests.get("aborted")
        if victim is not None and victim.num_computed_tokens > 0:  # running, holding a slot: abort it
            assert core.scheduler.kv_cache_manager.get_state_slot("aborted") is not None
            core.abort_requests(["aborted"])
        if step == join_after:
            for r in requests[half:]:
                core.add_request(r)
        if step == preempt_at and core.scheduler.running:
            core.scheduler._preempt(core.scheduler.running[-1])
        if step > join_after and not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            if o.request_id != "aborted":
                outs[o.request_id].append(o)
    return outs


def test_greedy_tokens_and_prompt_logprobs_match_transformers(hybrid):
    spec, llm, (greedy, rows), _ = hybrid
    core = llm.llm_engine.engine_core.engine_core
    runner = core.executor.worker.model_runner
    assert type(runner.model).__name__ == spec.model_cls
    assert runner.state_layers and not core.scheduler.kv_cache_manager.enable_caching
    requests = [EngineCoreRequest(f"r{i}", p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                             prompt_logprobs=1 if i % 2 == 0 else None),
                                  eos_token_id=None)
                for i, p in enumerate(PROMPTS)]
    attention_free = core.config.cache_config.attention_free
    outs = run(core, requests, join_after=3, preempt_at=6 if attention_free else None)
    assert "aborted" not in core.scheduler.requests
    preempted = sum(e.type == EngineCoreEventType.PREEMPTED for o in outs.values() for out in o for e in (out.events or []))
    assert preempted > 0, "the test must exercise preemption"
    for i, prompt in enumerate(PROMPTS):
        got = [t for o in outs[f"r{i}"] for t in o.new_token_ids]
        assert got == greedy[i], f"prompt {i} (len {len(prompt)})"
        if i % 2 == 0:
            entries = next(o.prompt_logprobs for o in outs[f"r{i}"] if o.prompt_logprobs is not None)
            lps = [e[1][0] for e in entries]
            want = [float(rows[i][t, prompt[t + 1]]) for t in range(len(prompt) - 1)]
            assert lps == pytest.approx(want, abs=1e-4), f"prompt logprobs of prompt {i}"
    kv = core.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks, "KV blocks leaked"
    assert kv.mamba_manager.get_num_free_slots() == kv.mamba_manager.num_slots, "state slots leaked"



def test_state_slots_come_out_of_the_kv_cache_memory(hybrid):
    """With ``kv_cache_memory`` the state slots (``max_num_seqs`` of them) are paid first and the KV blocks get
    the rest; a budget that cannot hold the slots is refused, naming them."""
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine_args import EngineArgs

    spec, llm, _, model_dir = hybrid
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    per_slot, per_block = runner.state_bytes_per_slot(), runner.kv_cache_bytes_per_block()
    assert per_slot > 0
    budget = 4 * per_slot + 50 * per_block + 7 if per_block else 4 * per_slot + 7
    config = EngineArgs(model=model_dir, dtype="float32", block_size=4, max_num_seqs=4,
                        kv_cache_memory=str(budget)).create_engine_config()
    assert config.cache_config.num_state_slots == 4 and not config.cache_config.enable_prefix_caching
    core = EngineCore(config)
    try:
        if per_block:
            assert config.cache_config.num_gpu_blocks == 50
        else:  # attention-free: the blocks only count tokens, enough for the whole context
            assert config.cache_config.num_gpu_blocks * 4 >= config.model_config.max_model_len
    finally:
        core.shutdown()
    small = EngineArgs(model=model_dir, dtype="float32", block_size=4, max_num_seqs=4,
                       kv_cache_memory=str(3 * per_slot)).create_engine_config()
    with pytest.raises(ValueError, match="state slots"):
        EngineCore(small)


def test_attention_free_model_takes_a_context_longer_than_2048(tmp_path):
    """A Mamba2 config names no position limit: as in vLLM, ``max_model_len`` defaults to 2048 and any longer
    ``--max-model-len`` is taken; a 2,100-token prompt (two prefill chunks of the default 2048-token budget)
    gives transformers' greedy tokens (scan chunks of 64 keep both sides quick at this length)."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from tests.models.test_families import run_wave, tokens
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine_args import EngineArgs

    model_dir = build(replace(SPECS[0], kwargs={**SPECS[0].kwargs, "chunk_size": 64}), str(tmp_path))
    assert EngineArgs(model=model_dir, dtype="float32").create_model_config().max_model_len == 2048
    config = EngineArgs(model=model_dir, dtype="float32", max_model_len=4096, max_num_seqs=1).create_engine_config()
    assert config.model_config.max_model_len == 4096
    prompt = [(i * 37 + 11) % 500 + 3 for i in range(2100)]
    core = EngineCore(config)
    try:
        outs = run_wave(core, "long", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), [prompt])
    finally:
        core.shutdown()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert tokens(outs[0]) == want[0, len(prompt):].tolist()
