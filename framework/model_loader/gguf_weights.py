"""Weights of a GGUF file, dequantized (``gguf_dequant``) and renamed to Hugging Face names.

Name mapping follows llama.cpp's tensor names (``blk.N.attn_q``, ...), per architecture where they differ:
Gemma's ``ffn_norm`` is the pre-feedforward norm, Phi-3 stores gate and up fused in ``ffn_up`` and q/k/v in
``attn_qkv``, MoE files hold each layer's experts as 3-D ``ffn_{gate,up,down}_exps`` tensors.

Fix-ups llama.cpp's converter applied and this module undoes:

* Query/key rows interleaved per head (its rotary layout) for the architectures whose converter permutes
  them (:data:`PERMUTED_ARCHS`: Llama, Mistral and Mixtral files use ``llama``, plus Granite, Granite
  4.0-H's ``granitehybrid`` and Nemotron-H's ``nemotron_h`` / ``nemotron_h_moe``): restored to the Hugging
  Face order, so the same model code serves both formats. Qwen2/3, Gemma, Phi-3, OLMo 2 and Falcon-H1 files
  are not permuted.
* Gemma norm weights stored as ``1 + w``: one is subtracted (the model adds it back).
* State-space and hybrid files (``mamba2``, ``granitehybrid``, ``falcon-h1``, ``nemotron_h``,
  ``nemotron_h_moe``): names and layout in :mod:`tokenmill.model_loader.gguf_state_space`,
  :mod:`tokenmill.model_loader.gguf_hybrid` and :mod:`tokenmill.model_loader.gguf_nemotron_h`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from tokenmill.model_loader.gguf_hybrid import state_space_hf_name
from tokenmill.model_loader.gguf_state_space import (
    GGUF_STATE_SPACE_ARCHITECTURES,
    changes_state_space_layout,
    undo_state_space_layout,
)
from tokenmill.model_loader.gguf_tensor import GGUFQuantTensor

# llama.cpp architectures whose files tokenmill serves (transformers' GGUF reader gives the config of the dense
# ones; ``llama`` covers Llama, Mistral and Mixtral files)
GGUF_FILE_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3",
                                     *GGUF_STATE_SPACE_ARCHITECTURES})


def unsupported_architecture_message(arch: str) -> str:
    """Why a GGUF file of llama.cpp architecture ``arch`` is refused, naming the architectures that load."""
    return (f"GGUF architecture {arch!r} is not supported; tokenmill reads GGUF files of the llama.cpp "
            f"architectures {', '.join(sorted(GGUF_FILE_ARCHITECTURES))} (serve other models from their Hugging "
            "Face checkpoints)")


PERMUTED_ARCHS = frozenset({"llama", "granite", "granitemoe", "granitehybrid", "nemotron_h", "nemotron_h_moe",
                            "deci"})
GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_ARCH_LAYER_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_EXPERTS_3D = (".experts.gate_proj", ".experts.up_proj", ".experts.down_proj")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ``None`` for unknown names.

    3-D expert tensors map to ``model.layers.N.mlp.experts.{gate,up,down}_proj`` (no ``.weight``), which the
    generic weight loader takes as all experts at once.
    """
    if arch in GGUF_STATE_SPACE_ARCHITECTURES:
        return state_space_hf_name(name, arch)
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m is None:
        return None
    part = _ARCH_LAYER_NAMES.get(arch, {}).get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
    if part is None:
        return None
    hf = f"model.layers.{m.group(1)}.{part}"
    return hf if hf.endswith(_EXPERTS_3D) else f"{hf}.{m.group(3)}"


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_any(w: torch.Tensor | GGUFQuantTensor, n_heads: int) -> torch.Tensor | GGUFQuantTensor:
    """:func:`_unpermute` on float rows, or on the rows of GGUF blocks (a row order: blocks never span rows)."""
    if isinstance(w, torch.Tensor):
        return _unpermute(w, n_heads)
    return w.index_rows(_unpermute(torch.arange(w.shape[0]), n_heads))


def gguf_architecture(reader: Any) -> str:
    """``general.architecture`` of an open ``gguf.GGUFReader``."""
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def iterate_gguf_weights(
    path: str, hf_config: Any, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFQuantTensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of a GGUF file, one at a time: each a new contiguous float32
    tensor, or with ``keep_quantized`` a :class:`GGUFQuantTensor` for 2-D block-quantized tensors (a view of the
    file). A tensor's mapped pages are released when the consumer asks for the next one.

    Raises:
        ValueError: a tensor name has no Hugging Face equivalent (an unsupported architecture).
    """
    from tokenmill.model_loader.gguf_cache import read_gguf_tensors
    from tokenmill.model_loader.gguf_dequant import BLOCK_TYPES, dequantize_gguf

    arch, tensors = read_gguf_tensors(path)
    n_heads = getattr(hf_config, "num_attention_heads", None) or 0  # none in an attention-free model
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_heads
    for tensor in tensors:
        hf_name = gguf_to_hf_name(tensor.name, arch)
        if hf_name is None:
            if tensor.name.startswith("rope_"):  # precomputed rope tables / factors: the config has them
                continue
            raise ValueError(f"GGUF tensor {tensor.name!r} of architecture {arch!r} has no known Hugging Face name")
        type_name = tensor.tensor_type.name
        array: torch.Tensor | GGUFQuantTensor
        if keep_quantized and type_name in BLOCK_TYPES and tensor.data.ndim == 2:
            array = GGUFQuantTensor.from_numpy(type_name, tensor.data)
        else:
            array = dequantize_gguf(tensor.data, tensor.tensor_type)
        if isinstance(array, GGUFQuantTensor) and arch in GGUF_STATE_SPACE_ARCHITECTURES \
                and changes_state_space_layout(hf_name):
            array = array.dequantize()  # a norm stored 2-D: its float values are reshaped below
        if arch in PERMUTED_ARCHS:
            if hf_name.endswith("q_proj.weight"):
                array = _unpermute_any(array, n_heads)
            elif hf_name.endswith("k_proj.weight"):
                array = _unpermute_any(array, n_kv)
        if isinstance(array, torch.Tensor):
            if arch in GEMMA_ARCHS and hf_name.endswith("norm.weight"):
                array = array - 1.0
            elif arch in GGUF_STATE_SPACE_ARCHITECTURES:
                array = undo_state_space_layout(hf_name, array)
            array = array.contiguous()
        yield hf_name, array
        tensor.release()
