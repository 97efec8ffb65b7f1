"""Qwen2, Qwen3, Mistral and Phi-3 written to GGUF with the ``gguf`` package and served from the file.

The reference is transformers on the original safetensors directory: the file must give the same greedy tokens
and prompt logprobs. Qwen files are not query/key-permuted (llama.cpp does not permute them), the Mistral file
is written as llama.cpp does (architecture ``llama``, permuted rows, named ``mistral``) and must load as
``MistralForCausalLM``; the Phi-3 file has fused q/k/v and gate/up tensors, partial rotary and LongRoPE factors
stored as tensors, as llama.cpp writes them.
"""

from __future__ import annotations

import os

import pytest

from tests.models.families import BY_NAME, FamilySpec, build_family
from tests.models.gguf_writer import write_gguf
from tests.models.test_families import MAX_TOKENS, PROMPTS, hf_reference, run_wave, tokens
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs
from tokenmill.sampling_params import SamplingParams

# GGUF metadata carries no sliding window or rope scaling for these architectures: plain variants.
GGUF_FAMILIES = [
    (FamilySpec("qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)), "qwen2",
     "Qwen2ForCausalLM"),
    (FamilySpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, attention_bias=True)), "qwen3",
     "Qwen3ForCausalLM"),
    (FamilySpec("mistral", "MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=None)), "llama",
     "MistralForCausalLM"),
    (FamilySpec("phi3", "Phi3Config", "Phi3ForCausalLM", {k: v for k, v in BY_NAME["phi3"].kwargs.items()
                                                            if k != "sliding_window"}), "phi3", "Phi3ForCausalLM"),
]


@pytest.mark.parametrize("spec,arch,expected_arch", GGUF_FAMILIES, ids=[f[0].name for f in GGUF_FAMILIES])
def test_gguf_file_matches_transformers_on_the_original_weights(spec, arch, expected_arch, tmp_path):
    model_dir = build_family(spec, str(tmp_path / spec.name), seed=5)
    # transformers reads a "llama" file whose general.name is "mistral" as a Mistral config
    path = write_gguf(model_dir, str(tmp_path / f"{spec.name}.gguf"), arch, name=spec.name)
    config = EngineArgs(model=path, dtype="float32", block_size=4, max_num_batched_tokens=16,
                        num_gpu_blocks_override=256).create_engine_config()
    assert config.model_config.architectures == [expected_arch]
    assert config.model_config.gguf_file == os.path.basename(path)
    core = EngineCore(config)
    outs = run_wave(core, "g", SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                              prompt_logprobs=1))
    greedy, rows = hf_reference(model_dir, PROMPTS, MAX_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        assert tokens(outs[i]) == greedy[i], f"prompt {i}"
        got = [lps[0] for _, lps, _ in outs[i][0].prompt_logprobs]
        want = [float(rows[i][t, prompt[t + 1]]) for t in range(len(prompt) - 1)]
        assert got == pytest.approx(want, abs=1e-4)


def test_gguf_names_and_permutation_per_architecture():
    from tokenmill.model_loader.gguf_weights import PERMUTED_ARCHS, gguf_to_hf_name

    assert "llama" in PERMUTED_ARCHS and not {"qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2"} & PERMUTED_ARCHS
    assert gguf_to_hf_name("blk.1.attn_q_norm.weight", "qwen3") == "model.layers.1.self_attn.q_norm.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight", "llama") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight", "gemma2") == "model.layers.0.pre_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.2.ffn_up.weight", "phi3") == "model.layers.2.mlp.gate_up_proj.weight"
    assert gguf_to_hf_name("blk.2.attn_qkv.weight", "phi3") == "model.layers.2.self_attn.qkv_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_gate_exps.weight", "qwen3moe") == "model.layers.0.mlp.experts.gate_proj"
    assert gguf_to_hf_name("blk.0.attn_q.bias", "qwen2") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.0.something_new.weight", "qwen2") is None
