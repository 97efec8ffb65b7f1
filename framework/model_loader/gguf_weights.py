"""Weights of a GGUF file, dequantized with the ``gguf`` package and renamed to Hugging Face names.

llama.cpp's converter stores Llama's query/key projections with the rows of each head interleaved
(its rotary layout); :func:`_unpermute` restores the Hugging Face order, so the same model code and rotary
embedding serve both formats.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ``None`` for unknown names."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iterate_gguf_weights(path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor of a Llama-family GGUF file.

    Raises:
        ValueError: a tensor name has no Hugging Face equivalent (an unsupported architecture).
    """
    import gguf

    reader = gguf.GGUFReader(path)
    n_heads = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_heads
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            if tensor.name.startswith("rope_"):
                continue
            raise ValueError(f"GGUF tensor {tensor.name!r} has no known Hugging Face name")
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if hf_name.endswith("q_proj.weight"):
            array = _unpermute(array, n_heads)
        elif hf_name.endswith("k_proj.weight"):
            array = _unpermute(array, n_kv)
        yield hf_name, torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
