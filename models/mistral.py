"""Mistral (Jiang et al. 2023): the Llama layout with an explicit ``head_dim`` and a sliding window on every
layer when ``sliding_window`` is set."""

from __future__ import annotations

from tokenmill.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """``config.hf_config`` is a transformers MistralConfig; the window comes from ``sliding_window``."""

    layer_type = LlamaDecoderLayer
