"""Phi-3 / Phi-3.5 / Phi-4-mini (Abdin et al. 2024): the Llama layout with checkpoints that ship fused
``qkv_proj`` and ``gate_up_proj`` tensors, LongRoPE scaling, partial rotary (Phi-4-mini) and an optional
sliding window on every layer."""

from __future__ import annotations

from tokenmill.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Fused checkpoint tensors match the parameters directly (their loaders split them per rank); the
    stacked table still accepts split q/k/v or gate/up tensors."""

    layer_type = LlamaDecoderLayer
