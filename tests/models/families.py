"""Tiny random-weight models of every built-in family, built with transformers' own config classes.

Each spec switches on what is special about its family (bias, q/k norm, sliding window shorter than the test
prompts, soft caps, partial rotary, scaled rope, multipliers, MoE with more experts than top-k). Weights are
transformers' random init plus noise on every 1-D parameter (norm weights, biases), so that zero-initialised
biases and Gemma's ``(1 + w)`` norms really take part. Models are built once per session
(:func:`family_dir`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.conftest import TINY_CONFIG

COMMON = {**TINY_CONFIG, "max_position_embeddings": 256, "pad_token_id": 0, "tie_word_embeddings": False}

WINDOW = 8  # shorter than most test prompts


@dataclass(frozen=True)
class FamilySpec:
    """Attributes:
    name: test id.
    config_cls, model_cls: names in ``transformers``.
    kwargs: config arguments on top of :data:`COMMON`.
    special: what the spec exercises (for test ids and docs).
    """

    name: str
    config_cls: str
    model_cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    special: str = ""


FAMILIES: list[FamilySpec] = [
    FamilySpec("mistral", "MistralConfig", "MistralForCausalLM",
               dict(head_dim=16, sliding_window=WINDOW), "sliding window on every layer"),
    FamilySpec("qwen2", "Qwen2Config", "Qwen2ForCausalLM",
               dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                     "rope_theta": 10000.0}),
               "q/k/v bias, sliding window on layer 1 only, YaRN rope, tied embeddings"),
    FamilySpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
               dict(head_dim=32, attention_bias=True, use_sliding_window=True, sliding_window=WINDOW,
                    max_window_layers=1),
               "per-head q/k norm, head_dim != hidden/heads, q/k/v/o bias, sliding window"),
    FamilySpec("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=1.5,
                    final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
               "four (1+w) norms, GeGLU, embedding scale, attention and final soft caps, alternating window"),
    FamilySpec("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                        "rope_theta": 1000000.0}},
                    tie_word_embeddings=True),
               "per-head (1+w) q/k norm, local/global rope theta, linear scaling on global layers"),
    FamilySpec("phi3", "Phi3Config", "Phi3ForCausalLM",
               dict(original_max_position_embeddings=128, sliding_window=WINDOW,
                    rope_parameters={"rope_type": "longrope", "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                                     "short_factor": [1.0, 1.3, 1.9, 2.5], "long_factor": [1.0, 2.0, 4.0, 8.0]}),
               "fused qkv_proj / gate_up_proj checkpoint, LongRoPE, partial rotary 0.5, sliding window"),
    FamilySpec("granite", "GraniteConfig", "GraniteForCausalLM",
               dict(embedding_multiplier=6.0, attention_multiplier=0.15, residual_multiplier=0.4,
                    logits_scaling=3.0, attention_bias=True, mlp_bias=True),
               "embedding / attention / residual / logit multipliers, attention and MLP biases"),
    FamilySpec("olmo2", "Olmo2Config", "Olmo2ForCausalLM", dict(),
               "whole-projection q/k norm, post-norms"),
    FamilySpec("mixtral", "MixtralConfig", "MixtralForCausalLM",
               dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
               "MoE 4 experts top-2 (renormalised), sliding window"),
    FamilySpec("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
               dict(head_dim=16, num_hidden_layers=3, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1]),
               "MoE 6 experts top-2 without renormalisation, a dense layer by mlp_only_layers, q/k norm"),
]
BY_NAME = {f.name: f for f in FAMILIES}


def build_family(spec: FamilySpec, path: str, seed: int = 0) -> str:
    """Save a random-weight model of ``spec`` in Hugging Face layout under ``path``; returns ``path``."""
    import transformers

    config = getattr(transformers, spec.config_cls)(**{**COMMON, **spec.kwargs})
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            elif ".experts." in name or name.endswith("gate.weight"):
                p.normal_(0, 0.1)  # routers and experts: distinct, non-trivial choices
    model.save_pretrained(path)
    return path


_BUILT: dict[str, str] = {}
_TOKENIZER: list[Any] = []


def family_dir(name: str, root: str) -> str:
    """The session's model directory of family ``name`` (built under ``root`` on first use), with the byte-level
    test tokenizer (ids < 400, inside every family's 512) saved next to the weights for ``LLM`` and the server."""
    if name not in _BUILT:
        from tests.engine.engine_fakes import byte_level_tokenizer

        if not _TOKENIZER:
            _TOKENIZER.append(byte_level_tokenizer())
        path = build_family(BY_NAME[name], os.path.join(root, name))
        _TOKENIZER[0].save_pretrained(path)
        _BUILT[name] = path
    return _BUILT[name]
