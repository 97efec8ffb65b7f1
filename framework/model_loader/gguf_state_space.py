"""GGUF files of llama.cpp's state-space architectures, which transformers' GGUF reader does not read.

A ``mamba2`` file (llama.cpp's ``convert_hf_to_gguf.py``, ``Mamba2Model``) becomes a transformers
``Mamba2Config`` built here from its ``ssm.*`` metadata, and its tensors get transformers' ``Mamba2ForCausalLM``
names back with the converter's changes undone: it stores ``A = -exp(A_log)`` and ``D`` as ``[heads, 1]``, the
conv weight squeezed from ``[channels, 1, kernel]`` to ``[channels, kernel]``, the gated norm as ``[groups,
inner / groups]`` and ``dt_bias`` as ``ssm_dt.bias``. It writes no head size: ``ssm.time_step_rank`` is the
number of heads, so the head size is ``ssm.inner_size / heads``.

Other llama.cpp architectures with state layers (:func:`state_space_architectures`) are refused by name
(``tokenmill.model_loader.hf_config``).
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import torch

# llama.cpp architecture -> tokenmill architecture, for the state-space files read here
GGUF_STATE_SPACE_ARCHITECTURES = {"mamba2": "Mamba2ForCausalLM"}

_MAMBA2_GLOBAL = {
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
    "output.weight": "lm_head.weight",
}
_MAMBA2_LAYER = {
    "attn_norm.weight": "norm.weight",
    "ssm_in.weight": "mixer.in_proj.weight",
    "ssm_in.bias": "mixer.in_proj.bias",
    "ssm_conv1d.weight": "mixer.conv1d.weight",
    "ssm_conv1d.bias": "mixer.conv1d.bias",
    "ssm_dt.bias": "mixer.dt_bias",
    "ssm_a": "mixer.A_log",
    "ssm_d": "mixer.D",
    "ssm_norm.weight": "mixer.norm.weight",
    "ssm_out.weight": "mixer.out_proj.weight",
    "ssm_out.bias": "mixer.out_proj.bias",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@cache
def state_space_architectures() -> frozenset[str]:
    """llama.cpp's names of every architecture ``gguf`` knows with state-space (``SSM_*``) tensors."""
    import gguf

    return frozenset(gguf.MODEL_ARCH_NAMES[arch] for arch, tensors in gguf.MODEL_TENSORS.items()
                     if any(t.name.startswith("SSM_") for t in tensors))


def metadata_value(reader: Any, key: str) -> Any:
    """The scalar (or string) metadata ``key`` of an open ``gguf.GGUFReader``; ``None`` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    part = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(part).decode()
    return part.tolist()[0]


def read_state_space_config(path: str) -> Any | None:
    """The transformers config of a ``mamba2`` GGUF file; ``None`` for any other architecture (transformers'
    GGUF reader reads the dense ones; the other state-space ones are refused by the caller).

    Raises:
        ValueError: a ``mamba2`` file whose metadata lacks a size or whose sizes do not fit a ``Mamba2Config``.
    """
    import gguf

    reader = gguf.GGUFReader(path)
    return _mamba2_config(reader) if metadata_value(reader, "general.architecture") == "mamba2" else None


def _mamba2_config(reader: Any) -> Any:
    from transformers import Mamba2Config

    def value(key: str) -> Any:
        got = metadata_value(reader, f"mamba2.{key}")
        if got is None:
            raise ValueError(f"mamba2 GGUF file: the metadata has no mamba2.{key}")
        return got

    hidden, inner = int(value("embedding_length")), int(value("ssm.inner_size"))
    heads = int(value("ssm.time_step_rank"))  # llama.cpp's converter writes the number of heads here
    if inner % hidden or inner % heads:
        raise ValueError(f"mamba2 GGUF file: ssm.inner_size {inner} must be a multiple of embedding_length {hidden} "
                         f"and of ssm.time_step_rank (heads) {heads}")
    names = {t.name: t for t in reader.tensors}
    embedding = names.get("token_embd.weight")
    if embedding is None:
        raise ValueError("mamba2 GGUF file: no token_embd.weight tensor")
    token_ids = {key: metadata_value(reader, f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "padding")}
    return Mamba2Config(
        vocab_size=int(embedding.shape[1]),  # GGUF shapes are innermost first: [hidden, vocab]
        hidden_size=hidden,
        num_hidden_layers=int(value("block_count")),
        state_size=int(value("ssm.state_size")),
        conv_kernel=int(value("ssm.conv_kernel")),
        expand=inner // hidden,
        num_heads=heads,
        head_dim=inner // heads,
        n_groups=int(metadata_value(reader, "mamba2.ssm.group_count") or 1),
        layer_norm_epsilon=float(value("attention.layer_norm_rms_epsilon")),
        use_bias="blk.0.ssm_in.bias" in names,
        use_conv_bias="blk.0.ssm_conv1d.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=token_ids["bos"],
        eos_token_id=token_ids["eos"],
        pad_token_id=token_ids["padding"],
        architectures=[GGUF_STATE_SPACE_ARCHITECTURES["mamba2"]],
    )


def state_space_hf_name(name: str, arch: str) -> str | None:
    """``blk.3.ssm_a`` -> ``backbone.layers.3.mixer.A_log`` for a ``mamba2`` file; ``None`` for unknown names."""
    if arch != "mamba2":
        return None
    if name in _MAMBA2_GLOBAL:
        return _MAMBA2_GLOBAL[name]
    m = _BLOCK_RE.match(name)
    part = None if m is None else _MAMBA2_LAYER.get(m.group(2))
    return None if part is None else f"backbone.layers.{m.group(1)}.{part}"  # type: ignore[union-attr]


_RELAID_SUFFIXES = (".A_log", ".D", "mixer.norm.weight", "conv1d.weight")


def changes_state_space_layout(hf_name: str) -> bool:
    """Whether :func:`undo_state_space_layout` reshapes or changes the tensor of ``hf_name``."""
    return hf_name.endswith(_RELAID_SUFFIXES)


def undo_state_space_layout(hf_name: str, array: torch.Tensor) -> torch.Tensor:
    """Transformers' layout of a float tensor llama.cpp's converter changed (see the module docstring): ``A``
    ``[heads, 1]`` -> ``A_log`` ``[heads]``, ``D`` ``[heads, 1]`` -> ``[heads]``, conv ``[channels, kernel]`` ->
    ``[channels, 1, kernel]``, gated norm ``[groups, inner / groups]`` -> ``[inner]``; others unchanged."""
    if hf_name.endswith(".A_log"):
        return torch.log(-array.reshape(-1))
    if hf_name.endswith((".D", "mixer.norm.weight")):
        return array.reshape(-1)
    if hf_name.endswith("conv1d.weight") and array.dim() == 2:
        return array.unsqueeze(1)
    return array
