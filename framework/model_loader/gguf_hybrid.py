"""GGUF files of llama.cpp's hybrid (Mamba2 + attention) architectures: their transformers configs and names
(Nemotron-H's configs in :mod:`tokenmill.model_loader.gguf_nemotron_h`).

``granitehybrid`` (Granite 4.0-H; llama.cpp's ``convert_hf_to_gguf.py``, ``GraniteHybridModel``) becomes a
``GraniteMoeHybridConfig``:

* ``attention.head_count_kv`` is one number per layer, 0 for a Mamba2 layer: ``layer_types`` comes from it;
* Granite's multipliers are ``embedding_scale``, ``attention.scale``, ``residual_scale`` and ``logit_scale``;
* the converter switches RoPE with ``rope.scaling.finetuned`` (false for a Granite 4.0-H, which has no
  positional encoding, and then writes a placeholder ``context_length`` of 2**20); llama.cpp applies RoPE when
  the key is true or absent, so does tokenmill (over whole heads: a partial ``rope.dimension_count``, as in
  Bamba files, which llama.cpp also writes as ``granitehybrid``, is refused);
* the experts' merged ``input_linear`` ``[E, 2I, H]`` is split into ``ffn_gate_exps`` / ``ffn_up_exps`` (the
  router is ``ffn_gate_inp``), the shared MLP's into ``ffn_gate_shexp`` / ``ffn_up_shexp`` (``ffn_gate`` /
  ``ffn_up`` / ``ffn_down`` in a file without experts); the loader takes the halves as they are;
* query/key rows are permuted into llama.cpp's rotary layout, as in a ``llama`` file (undone in
  :mod:`tokenmill.model_loader.gguf_weights`); the Mamba2 layers as in a ``mamba2`` file
  (:mod:`tokenmill.model_loader.gguf_state_space`).

``falcon-h1`` (``FalconH1Model``) becomes a ``FalconH1Config``. The converter multiplies Falcon-H1's muP
multipliers into the weights (embeddings, LM head, q/k/v by ``attention_in_multiplier``, k also by
``key_multiplier``, the attention output, the MLP's gate and down projections, the mixer's input projection by
``ssm_in_multiplier`` and each of its five sections by ``ssm_multipliers``, its output projection) and writes
none of them, so the config read here has every multiplier 1. Its query/key rows are not permuted (NeoX rotary
layout); the head size is ``attention.key_length`` (not hidden / heads in any Falcon-H1); the pre-MLP norm is
``blk.N.ffn_norm`` without ``.weight`` (as gguf's tensor map names it). llama.cpp's Mamba2 layer gates before
its optional grouped norm: ``mamba_norm_before_gate`` is false.
"""

from __future__ import annotations

from typing import Any

from tokenmill.model_loader.gguf_nemotron_h import (
    NEMOTRON_H_ARCHITECTURES,
    NEMOTRON_H_LAYER_NAMES,
    nemotron_h_config,
)
from tokenmill.model_loader.gguf_state_space import (
    BLOCK_RE,
    GGUF_STATE_SPACE_ARCHITECTURES,
    SSM_LAYER_PARTS,
    arch_metadata,
    mamba2_config,
    mamba2_hf_name,
    metadata_list,
    metadata_value,
    ssm_sizes,
    token_ids,
)

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_ATTENTION_PARTS = {f"{k}.{kind}": f"{v}.{kind}" for k, v in _ATTENTION.items() for kind in ("weight", "bias")}
_MAMBA_PARTS = {k: f"mamba.{v}" for k, v in SSM_LAYER_PARTS.items()}
_LAYER_NAMES = {
    "granitehybrid": {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        **_ATTENTION_PARTS,
        **_MAMBA_PARTS,
        "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
        # 3-D tensors of all experts: the generic loader's names without ``.weight``
        "ffn_gate_exps.weight": "block_sparse_moe.experts.gate_proj",
        "ffn_up_exps.weight": "block_sparse_moe.experts.up_proj",
        "ffn_down_exps.weight": "block_sparse_moe.experts.down_proj",
        **{f"ffn_{p}{suffix}.weight": f"shared_mlp.{p}_proj.weight"
           for p in ("gate", "up", "down") for suffix in ("_shexp", "")},
    },
    "falcon-h1": {
        "attn_norm.weight": "input_layernorm.weight",
        # gguf's tensor map names Falcon-H1's pre_ff_layernorm.weight "blk.N.ffn_norm", without ".weight"
        "ffn_norm": "pre_ff_layernorm.weight",
        "ffn_norm.weight": "pre_ff_layernorm.weight",
        **_ATTENTION_PARTS,
        **_MAMBA_PARTS,
        **{f"ffn_{p}.weight": f"feed_forward.{p}_proj.weight" for p in ("gate", "up", "down")},
    },
    **{arch: NEMOTRON_H_LAYER_NAMES for arch in NEMOTRON_H_ARCHITECTURES},
}


def read_state_space_config(path: str) -> Any | None:
    """The transformers config of a ``mamba2``, ``granitehybrid``, ``falcon-h1``, ``nemotron_h`` or
    ``nemotron_h_moe`` GGUF file; ``None`` for any other architecture (transformers' GGUF reader reads the dense
    ones; the other state-space ones are refused by the caller).

    Raises:
        ValueError: a file whose metadata lacks a size or whose sizes do not fit the config class.
    """
    import gguf

    reader = gguf.GGUFReader(path)
    arch = metadata_value(reader, "general.architecture")
    if arch == "mamba2":
        return mamba2_config(reader)
    if arch in NEMOTRON_H_ARCHITECTURES:
        return nemotron_h_config(reader, arch)
    if arch in GGUF_STATE_SPACE_ARCHITECTURES:
        return hybrid_config(reader, arch)
    return None


def state_space_hf_name(name: str, arch: str) -> str | None:
    """The transformers name of tensor ``name`` of a state-space or hybrid file
    (``blk.3.ssm_a`` -> ``backbone.layers.3.mixer.A_log`` for ``mamba2``); ``None`` for unknown names."""
    return mamba2_hf_name(name) if arch == "mamba2" else hybrid_hf_name(name, arch)


def hybrid_hf_name(name: str, arch: str) -> str | None:
    """``blk.3.ssm_in.weight`` -> ``model.layers.3.mamba.in_proj.weight`` for a ``granitehybrid``, ``falcon-h1``
    or Nemotron-H file; ``None`` for unknown names or architectures."""
    parts = _LAYER_NAMES.get(arch)
    if parts is None:
        return None
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = BLOCK_RE.match(name)
    part = None if m is None else parts.get(m.group(2))
    return None if part is None else f"model.layers.{m.group(1)}.{part}"  # type: ignore[union-attr]


def hybrid_config(reader: Any, arch: str) -> Any:
    """The transformers config of a ``granitehybrid`` or ``falcon-h1`` file (an open ``gguf.GGUFReader``).

    Raises:
        ValueError: the metadata lacks a size, or the sizes do not fit the config class.
    """
    names = {t.name: t for t in reader.tensors}
    embedding = names.get("token_embd.weight")
    if embedding is None:
        raise ValueError(f"{arch} GGUF file: no token_embd.weight tensor")
    value = arch_metadata(reader, arch)
    hidden, layers = int(value("embedding_length")), int(value("block_count"))
    ssm = ssm_sizes(reader, arch)
    common = dict(
        vocab_size=int(embedding.shape[1]),  # GGUF shapes are innermost first: [hidden, vocab]
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=int(value("attention.head_count")),
        max_position_embeddings=int(value("context_length")),
        rms_norm_eps=float(value("attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(value("rope.freq_base", 10000.0))},
        attention_bias=any(n.endswith(".attn_q.bias") for n in names),
        tie_word_embeddings="output.weight" not in names,
        mamba_n_heads=ssm["heads"],
        mamba_d_head=ssm["head_dim"],
        mamba_n_groups=ssm["groups"],
        mamba_d_state=ssm["state"],
        mamba_d_conv=ssm["conv_kernel"],
        mamba_conv_bias=any(n.endswith(".ssm_conv1d.bias") for n in names),
        mamba_proj_bias=any(n.endswith(".ssm_in.bias") for n in names),
        **token_ids(reader),
        architectures=[GGUF_STATE_SPACE_ARCHITECTURES[arch]],
    )
    if arch == "granitehybrid":
        return _granite_hybrid_config(reader, value, names, ssm, common)
    return _falcon_h1_config(value, names, ssm, common)


def _granite_hybrid_config(reader: Any, value: Any, names: dict[str, Any], ssm: dict[str, int],
                           common: dict[str, Any]) -> Any:
    from transformers import GraniteMoeHybridConfig

    hidden, layers = common["hidden_size"], common["num_hidden_layers"]
    kv = metadata_list(reader, "granitehybrid.attention.head_count_kv")
    if kv is None or len(kv) not in (1, layers):
        raise ValueError(f"granitehybrid GGUF file: attention.head_count_kv must give one number per layer "
                         f"({layers}), got {kv}")
    kv = kv * layers if len(kv) == 1 else kv
    if len({k for k in kv if k}) > 1:
        raise ValueError(f"granitehybrid GGUF file: the attention layers have different head_count_kv {kv}")
    if ssm["inner"] % hidden:
        raise ValueError(f"granitehybrid GGUF file: ssm.inner_size {ssm['inner']} must be a multiple of "
                         f"embedding_length {hidden}")
    rope = bool(value("rope.scaling.finetuned", True))
    head_dim = hidden // common["num_attention_heads"]
    if rope and int(value("rope.dimension_count", head_dim)) != head_dim:
        # a Bamba file (which llama.cpp also writes as granitehybrid) rotates part of each head
        raise ValueError(f"granitehybrid GGUF file: RoPE over {value('rope.dimension_count')} of {head_dim} "
                         "dimensions per head (partial rotary, Bamba) is not supported; serve the model from its "
                         "Hugging Face checkpoint")
    experts = int(value("expert_count", 0) or 0)
    shared = value("expert_shared_feed_forward_length", None)
    if shared is None:  # a file without experts has the shared MLP as ffn_gate, [hidden, intermediate]
        gate = names.get("blk.0.ffn_gate_shexp.weight") or names.get("blk.0.ffn_gate.weight")
        if gate is None:
            raise ValueError("granitehybrid GGUF file: no expert_shared_feed_forward_length and no blk.0.ffn_gate")
        shared = int(gate.shape[1])
    return GraniteMoeHybridConfig(
        **common,
        num_key_value_heads=max(kv) or common["num_attention_heads"],
        layer_types=["attention" if k else "mamba" for k in kv],
        intermediate_size=int(value("feed_forward_length")),
        shared_intermediate_size=int(shared),
        num_local_experts=experts,
        num_experts_per_tok=int(value("expert_used_count", 0) or 0) if experts else 0,
        mamba_expand=ssm["inner"] // hidden,
        embedding_multiplier=float(value("embedding_scale", 1.0)),
        # llama.cpp's default when the key is absent: 1 / sqrt(head size)
        attention_multiplier=float(value("attention.scale", head_dim ** -0.5)),
        residual_multiplier=float(value("residual_scale", 1.0)),
        logits_scaling=float(value("logit_scale", 1.0)),
        position_embedding_type="rope" if rope else None,
    )


def _falcon_h1_config(value: Any, names: dict[str, Any], ssm: dict[str, int], common: dict[str, Any]) -> Any:
    from transformers import FalconH1Config

    # Falcon-H1's head size is not hidden / heads (64 or 128 in every checkpoint): attention.key_length
    head_dim = int(value("attention.key_length", common["hidden_size"] // common["num_attention_heads"]))
    return FalconH1Config(
        **common,
        num_key_value_heads=int(value("attention.head_count_kv")),
        head_dim=head_dim,
        intermediate_size=int(value("feed_forward_length")),
        mamba_d_ssm=ssm["inner"],
        mamba_rms_norm=any(n.endswith(".ssm_norm.weight") for n in names),
        mamba_norm_before_gate=False,
    )
