"""LayerScaleLlamaForCausalLM: Llama whose attention and MLP outputs are each multiplied by a learned
per-channel gain before their residual add (LayerScale, Touvron et al. 2021, "Going deeper with Image
Transformers"), as a tokenmill model plugin in one file.

Checkpoint: a Llama checkpoint plus ``model.layers.<i>.attn_scale`` and ``model.layers.<i>.mlp_scale``
(``[hidden_size]`` each), with ``"architectures": ["LayerScaleLlamaForCausalLM"]`` in config.json (the config
itself is a plain ``LlamaConfig``: ``model_type`` stays ``"llama"``).

Built only from ``tokenmill.plugin_api``, so it runs on every platform, with tensor parallelism (the gains are
replicated: they act on the full hidden dimension after the row-parallel projections' all-reduce).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.plugin_api import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    GatedMLP,
    attention_args,
    hookimpl,
)

TOKENMILL_PLUGIN_API = ">=1.0,<2"
ARCHITECTURE = "LayerScaleLlamaForCausalLM"


class LayerScaleDecoderLayer(DecoderLayer):
    """A pre-norm Llama layer with ``attn_scale`` and ``mlp_scale`` gains (checkpoint names as the attributes)."""

    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        cfg = config.hf_config
        super().__init__(
            DecoderAttention(**attention_args(config, layer_idx, f"{prefix}.self_attn")),
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act),
            cfg.hidden_size,
            cfg.rms_norm_eps,
        )
        self.attn_scale = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.mlp_scale = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]``, ``hidden_states [T, H]``, the residual stream (``None`` in the first layer) ->
        ``(this layer's output, residual)``; RMSNorm's ``(x, residual)`` form fuses each residual add."""
        if residual is None:
            residual = hidden_states
            h = self.input_layernorm(hidden_states)
        else:
            h, residual = self.input_layernorm(hidden_states, residual)
        h = self.self_attn(positions, h) * self.attn_scale
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h) * self.mlp_scale, residual


class LayerScaleLlamaForCausalLM(DecoderForCausalLM):
    """The model contract (forward, compute_logits, load_weights) comes from DecoderForCausalLM; the q/k/v and
    gate/up checkpoint tensors stack into the fused projections through its default tables."""

    layer_type = LayerScaleDecoderLayer


@hookimpl
def tokenmill_register_models(registry: Any) -> None:
    registry.register_model(ARCHITECTURE, f"{__name__}:LayerScaleLlamaForCausalLM")
