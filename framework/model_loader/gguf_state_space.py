"""GGUF files of llama.cpp's state-space and hybrid architectures, which transformers' GGUF reader does not read.

A ``mamba2`` file (llama.cpp's ``convert_hf_to_gguf.py``, ``Mamba2Model``) becomes a transformers
``Mamba2Config`` built here from its ``ssm.*`` metadata, and its tensors get transformers' ``Mamba2ForCausalLM``
names back with the converter's changes undone: it stores ``A = -exp(A_log)`` and ``D`` as ``[heads, 1]``, the
conv weight squeezed from ``[channels, 1, kernel]`` to ``[channels, kernel]``, the gated norm as ``[groups,
inner / groups]`` and ``dt_bias`` as ``ssm_dt.bias``. It writes no head size: ``ssm.time_step_rank`` is the
number of heads, so the head size is ``ssm.inner_size / heads``. The hybrid files (``granitehybrid``,
``falcon-h1``, ``nemotron_h``, ``nemotron_h_moe``) store their Mamba2 layers the same way; their configs and names
are in :mod:`tokenmill.model_loader.gguf_hybrid` and :mod:`tokenmill.model_loader.gguf_nemotron_h`.

Other llama.cpp architectures with state layers (:func:`state_space_architectures`) are refused by name
(``tokenmill.model_loader.hf_config``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

# llama.cpp architecture -> tokenmill architecture, for the state-space and hybrid files read here
GGUF_STATE_SPACE_ARCHITECTURES = {
    "mamba2": "Mamba2ForCausalLM",
    "granitehybrid": "GraniteMoeHybridForCausalLM",
    "falcon-h1": "FalconH1ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "nemotron_h_moe": "NemotronHForCausalLM",
}

_MAMBA2_GLOBAL = {
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
    "output.weight": "lm_head.weight",
}
# a Mamba2 mixer's tensors -> their names inside transformers' mixer module (``mixer.`` / ``mamba.``)
SSM_LAYER_PARTS = {
    "ssm_in.weight": "in_proj.weight",
    "ssm_in.bias": "in_proj.bias",
    "ssm_conv1d.weight": "conv1d.weight",
    "ssm_conv1d.bias": "conv1d.bias",
    "ssm_dt.bias": "dt_bias",
    "ssm_a": "A_log",
    "ssm_d": "D",
    "ssm_norm.weight": "norm.weight",
    "ssm_out.weight": "out_proj.weight",
    "ssm_out.bias": "out_proj.bias",
}
_MAMBA2_LAYER = {"attn_norm.weight": "norm.weight", **{k: f"mixer.{v}" for k, v in SSM_LAYER_PARTS.items()}}
BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@cache
def state_space_architectures() -> frozenset[str]:
    """llama.cpp's names of every architecture ``gguf`` knows with state-space (``SSM_*``) tensors."""
    import gguf

    return frozenset(gguf.MODEL_ARCH_NAMES[arch] for arch, tensors in gguf.MODEL_TENSORS.items()
                     if any(t.name.startswith("SSM_") for t in tensors))


def metadata_value(reader: Any, key: str) -> Any:
    """The scalar (or string) metadata ``key`` of an open ``gguf.GGUFReader`` (an array's first element);
    ``None`` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    part = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(part).decode()
    return part.tolist()[0]


def metadata_list(reader: Any, key: str) -> list[Any] | None:
    """The numeric array (or scalar, as one element) metadata ``key``; ``None`` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    return [field.parts[i].tolist()[0] for i in field.data]


def arch_metadata(reader: Any, arch: str) -> Callable[..., Any]:
    """``value(key, default)``: the metadata ``{arch}.{key}``, or ``default``; without a default a missing key
    raises ``ValueError`` naming it."""
    missing = object()

    def value(key: str, default: Any = missing) -> Any:
        got = metadata_value(reader, f"{arch}.{key}")
        if got is not None:
            return got
        if default is missing:
            raise ValueError(f"{arch} GGUF file: the metadata has no {arch}.{key}")
        return default

    return value


def ssm_sizes(reader: Any, arch: str) -> dict[str, int]:
    """The Mamba2 mixer sizes of a file's ``ssm.*`` metadata: ``inner`` channels, ``heads``
    (``ssm.time_step_rank``, where llama.cpp's converter writes the number of heads), ``head_dim`` (inner /
    heads), ``state``, ``conv_kernel``, ``groups`` (1 when absent).

    Raises:
        ValueError: a size is missing or ``ssm.inner_size`` is not a multiple of the heads.
    """
    value = arch_metadata(reader, arch)
    inner, heads = int(value("ssm.inner_size")), int(value("ssm.time_step_rank"))
    if heads <= 0 or inner % heads:
        raise ValueError(f"{arch} GGUF file: ssm.inner_size {inner} must be a multiple of ssm.time_step_rank "
                         f"(heads) {heads}")
    return dict(inner=inner, heads=heads, head_dim=inner // heads, state=int(value("ssm.state_size")),
                conv_kernel=int(value("ssm.conv_kernel")), groups=int(value("ssm.group_count", 1)))


def token_ids(reader: Any) -> dict[str, Any]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of the file's ``tokenizer.ggml.*`` metadata
    (``None`` where absent)."""
    return {f"{key}_token_id": metadata_value(reader, f"tokenizer.ggml.{name}_token_id")
            for key, name in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))}


def mamba2_config(reader: Any) -> Any:
    from transformers import Mamba2Config

    value = arch_metadata(reader, "mamba2")
    hidden = int(value("embedding_length"))
    ssm = ssm_sizes(reader, "mamba2")
    if ssm["inner"] % hidden:
        raise ValueError(f"mamba2 GGUF file: ssm.inner_size {ssm['inner']} must be a multiple of "
                         f"embedding_length {hidden}")
    names = {t.name: t for t in reader.tensors}
    embedding = names.get("token_embd.weight")
    if embedding is None:
        raise ValueError("mamba2 GGUF file: no token_embd.weight tensor")
    return Mamba2Config(
        vocab_size=int(embedding.shape[1]),  # GGUF shapes are innermost first: [hidden, vocab]
        hidden_size=hidden,
        num_hidden_layers=int(value("block_count")),
        state_size=ssm["state"],
        conv_kernel=ssm["conv_kernel"],
        expand=ssm["inner"] // hidden,
        num_heads=ssm["heads"],
        head_dim=ssm["head_dim"],
        n_groups=ssm["groups"],
        layer_norm_epsilon=float(value("attention.layer_norm_rms_epsilon")),
        use_bias="blk.0.ssm_in.bias" in names,
        use_conv_bias="blk.0.ssm_conv1d.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        **token_ids(reader),
        architectures=[GGUF_STATE_SPACE_ARCHITECTURES["mamba2"]],
    )


def mamba2_hf_name(name: str) -> str | None:
    """``blk.3.ssm_a`` -> ``backbone.layers.3.mixer.A_log`` for a ``mamba2`` file; ``None`` for unknown names."""
    if name in _MAMBA2_GLOBAL:
        return _MAMBA2_GLOBAL[name]
    m = BLOCK_RE.match(name)
    part = None if m is None else _MAMBA2_LAYER.get(m.group(2))
    return None if part is None else f"backbone.layers.{m.group(1)}.{part}"  # type: ignore[union-attr]


_RELAID_SUFFIXES = (".A_log", ".D", "mixer.norm.weight", "mamba.norm.weight", "conv1d.weight")


def changes_state_space_layout(hf_name: str) -> bool:
    """Whether :func:`undo_state_space_layout` reshapes or changes the tensor of ``hf_name``."""
    return hf_name.endswith(_RELAID_SUFFIXES)


def undo_state_space_layout(hf_name: str, array: torch.Tensor) -> torch.Tensor:
    """Transformers' layout of a float tensor llama.cpp's converter changed (see the module docstring): ``A``
    ``[heads, 1]`` -> ``A_log`` ``[heads]``, ``D`` ``[heads, 1]`` -> ``[heads]``, conv ``[channels, kernel]`` ->
    ``[channels, 1, kernel]``, gated norm ``[groups, inner / groups]`` -> ``[inner]``; others unchanged."""
    if hf_name.endswith(".A_log"):
        return torch.log(-array.reshape(-1))
    if hf_name.endswith((".D", "mixer.norm.weight", "mamba.norm.weight")):
        return array.reshape(-1)
    if hf_name.endswith("conv1d.weight") and array.dim() == 2:
        return array.unsqueeze(1)
    return array
