"""GGUF files of Nemotron-H: llama.cpp's ``nemotron_h`` (Mamba2, attention and ``relu2`` MLP layers) and
``nemotron_h_moe`` (Mamba2, attention and MoE layers), as ``convert_hf_to_gguf.py``'s ``NemotronHModel`` writes
them, become a transformers ``NemotronHConfig`` and its parameter names.

What the converter writes and this module reads back:

* the layer kinds as two per-layer arrays: ``attention.head_count_kv`` (non-zero for an attention layer) and
  ``feed_forward_length`` (non-zero for an MLP layer in a ``nemotron_h`` file, for an MoE layer in a
  ``nemotron_h_moe`` file); a layer with both zero is a Mamba2 layer. A file therefore holds either MLP or MoE
  layers, never both;
* the attention head size as ``attention.key_length``; no positional encoding (``rope.scaling.finetuned``
  false, a placeholder ``context_length`` of 2**20, as for Granite 4.0-H);
* the router as ``expert_count`` / ``expert_used_count`` / ``expert_feed_forward_length`` /
  ``expert_shared_feed_forward_length`` / ``expert_weights_norm`` / ``expert_weights_scale`` /
  ``expert_group_count`` and the optional ``moe_latent_size``; the correction bias as ``exp_probs_b.bias``, the
  experts as 3-D ``ffn_up_exps`` / ``ffn_down_exps``, the shared expert as ``ffn_*_shexp``, the latent
  projections as ``ffn_latent_down`` / ``ffn_latent_up``;
* the Mamba2 layers as in a ``mamba2`` file (:mod:`tokenmill.model_loader.gguf_state_space`), the query/key
  rows permuted as in a ``llama`` file (undone in :mod:`tokenmill.model_loader.gguf_weights`; without RoPE the
  permutation would not change the scores, but the weights are restored exactly).

Refused with a clear error: files with multi-token-prediction blocks (``nextn_predict_layers``), expert groups
without ``expert_group_used_count``, a gating function other than sigmoid.
"""

from __future__ import annotations

from typing import Any

from tokenmill.model_loader.gguf_state_space import (
    GGUF_STATE_SPACE_ARCHITECTURES,
    SSM_LAYER_PARTS,
    arch_metadata,
    metadata_list,
    ssm_sizes,
    token_ids,
)

NEMOTRON_H_ARCHITECTURES = ("nemotron_h", "nemotron_h_moe")
_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (gguf.ExpertGatingFuncType.SIGMOID)

# a block's tensors -> their names inside transformers' ``model.layers.<i>`` of NemotronHForCausalLM
NEMOTRON_H_LAYER_NAMES = {
    "attn_norm.weight": "norm.weight",
    **{f"attn_{k}.{kind}": f"mixer.{v}.{kind}" for k, v in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"),
                                                            ("output", "o_proj")) for kind in ("weight", "bias")},
    **{k: f"mixer.{v}" for k, v in SSM_LAYER_PARTS.items()},
    **{f"ffn_{p}.{kind}": f"mixer.{p}_proj.{kind}" for p in ("up", "down") for kind in ("weight", "bias")},
    **{f"ffn_{p}_shexp.weight": f"mixer.shared_experts.{p}_proj.weight" for p in ("up", "down")},
    "ffn_gate_inp.weight": "mixer.gate.weight",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "exp_probs_b": "mixer.gate.e_score_correction_bias",
    # 3-D tensors of all experts: the generic loader's names without ``.weight``
    "ffn_up_exps.weight": "mixer.experts.up_proj",
    "ffn_down_exps.weight": "mixer.experts.down_proj",
    "ffn_latent_down.weight": "mixer.fc1_latent_proj.weight",
    "ffn_latent_up.weight": "mixer.fc2_latent_proj.weight",
}


def _per_layer(reader: Any, arch: str, key: str, layers: int) -> list[int]:
    got = metadata_list(reader, f"{arch}.{key}")
    if got is None or len(got) != layers:
        raise ValueError(f"{arch} GGUF file: {key} must give one number per layer ({layers}) to tell the layer "
                         f"kinds apart, got {got}")
    return [int(v) for v in got]


def nemotron_h_config(reader: Any, arch: str) -> Any:
    """The transformers ``NemotronHConfig`` of a ``nemotron_h`` / ``nemotron_h_moe`` file (an open
    ``gguf.GGUFReader``).

    Raises:
        ValueError: missing or inconsistent metadata, or what the module docstring lists as refused.
    """
    from transformers import NemotronHConfig

    value = arch_metadata(reader, arch)
    names = {t.name: t for t in reader.tensors}
    embedding = names.get("token_embd.weight")
    if embedding is None:
        raise ValueError(f"{arch} GGUF file: no token_embd.weight tensor")
    if int(value("nextn_predict_layers", 0) or 0):
        raise ValueError(f"{arch} GGUF file: multi-token-prediction blocks (nextn_predict_layers) are not "
                         "supported; convert the model without them (llama.cpp's --no-mtp)")
    layers = int(value("block_count"))
    kv = _per_layer(reader, arch, "attention.head_count_kv", layers)
    ff = _per_layer(reader, arch, "feed_forward_length", layers)
    moe = arch == "nemotron_h_moe"
    if any(k and f for k, f in zip(kv, ff)) or len({k for k in kv if k}) > 1:
        raise ValueError(f"{arch} GGUF file: head_count_kv {kv} and feed_forward_length {ff} do not describe one "
                         "mixer per layer with one key/value head count")
    block_types = ["full_attention" if k else ("moe" if moe else "mlp") if f else "linear_attention"
                   for k, f in zip(kv, ff)]
    hidden, heads = int(value("embedding_length")), int(value("attention.head_count"))
    ssm = ssm_sizes(reader, arch)
    eps = value("attention.layer_norm_rms_epsilon", None) or value("attention.layer_norm_epsilon", 1e-5)
    fields: dict[str, Any] = dict(
        vocab_size=int(embedding.shape[1]),  # GGUF shapes are innermost first: [hidden, vocab]
        hidden_size=hidden,
        layers_block_type=block_types,
        num_attention_heads=heads,
        num_key_value_heads=max(kv) or heads,
        head_dim=int(value("attention.key_length", hidden // heads)),
        max_position_embeddings=int(value("context_length")),
        intermediate_size=max(ff) or 1,
        mlp_bias=any(n.endswith((".ffn_up.bias", ".ffn_up_shexp.bias")) for n in names),
        ssm_state_size=ssm["state"],
        mamba_num_heads=ssm["heads"],
        mamba_head_dim=ssm["head_dim"],
        n_groups=ssm["groups"],
        conv_kernel=ssm["conv_kernel"],
        use_conv_bias=any(n.endswith(".ssm_conv1d.bias") for n in names),
        use_bias=any(n.endswith(".ssm_in.bias") for n in names),
        layer_norm_epsilon=float(eps),
        tie_word_embeddings="output.weight" not in names,
        **token_ids(reader),
        architectures=[GGUF_STATE_SPACE_ARCHITECTURES[arch]],
    )
    if moe:
        fields.update(_moe_fields(value, arch))
    return NemotronHConfig(**fields)


def _moe_fields(value: Any, arch: str) -> dict[str, Any]:
    gating = value("expert_gating_func", _SIGMOID_GATING)
    if int(gating) != _SIGMOID_GATING:
        raise ValueError(f"{arch} GGUF file: expert_gating_func {gating} is not sigmoid ({_SIGMOID_GATING}), "
                         "which Nemotron-H's router uses")
    groups = int(value("expert_group_count", 1) or 1)
    used_groups = value("expert_group_used_count", None)
    if used_groups is None and groups > 1:
        raise ValueError(f"{arch} GGUF file: {groups} expert groups but no expert_group_used_count")
    latent = value("moe_latent_size", None)
    return dict(
        n_routed_experts=int(value("expert_count")),
        num_experts_per_tok=int(value("expert_used_count")),
        moe_intermediate_size=int(value("expert_feed_forward_length")),
        moe_shared_expert_intermediate_size=int(value("expert_shared_feed_forward_length")),
        norm_topk_prob=bool(value("expert_weights_norm", True)),
        routed_scaling_factor=float(value("expert_weights_scale", 1.0)),
        n_group=groups,
        topk_group=int(used_groups or 1),
        moe_latent_size=int(latent) if latent else None,
    )
