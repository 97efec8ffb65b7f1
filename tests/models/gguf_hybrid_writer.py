"""Write tiny transformers hybrid checkpoints as GGUF files the way llama.cpp's ``convert_hf_to_gguf.py`` does
(``GraniteHybridModel`` -> ``granitehybrid``, ``FalconH1Model`` -> ``falcon-h1``, ``NemotronHModel`` ->
``nemotron_h`` / ``nemotron_h_moe``), with the ``gguf`` package.

The converter's transforms mirrored here: the Mamba2 layers as ``Mamba2Model`` stores them (``A = -exp(A_log)``
and ``D`` as ``[heads, 1]``, the conv weight squeezed, the gated norm as ``[groups, inner / groups]``,
``dt_bias`` as ``ssm_dt.bias``); Granite's merged expert / shared-MLP ``input_linear`` split into gate and up,
its query/key rows permuted into llama.cpp's rotary layout, its multipliers, per-layer ``head_count_kv`` and
``rope.scaling.finetuned`` as metadata; Falcon-H1's muP multipliers multiplied into the weights. With a
``qtype`` the tensors the converter quantizes (``--outtype q8_0``: 2-D and 3-D ``.weight`` tensors except norms,
the router and the conv weight) are written in that type where their rows are whole blocks, the rest float32.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tests.models.gguf_writer import _add_tensor, _finish, _permute, add_vocab, mamba2_layout

# llama.cpp's converter keeps these float whatever the output type (besides 1-D tensors and norms)
_FLOAT_PARTS = (".ffn_gate_inp.weight", ".ssm_conv1d.weight")


def _config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _state(model_dir: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return {k: v.astype(np.float32) for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}


def _rope_theta(cfg: dict[str, Any]) -> float:
    return float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))


def converter_quantizes(gguf_name: str, array: np.ndarray, qtype: Any) -> bool:
    """Whether the converter writes ``gguf_name`` in ``qtype``: a ``.weight`` of 2 or more dimensions, not a
    norm, the router or the conv weight, whose rows are whole blocks (otherwise the converter falls back to
    float16; float32 here)."""
    import gguf

    return (qtype is not None and array.ndim >= 2 and gguf_name.endswith(".weight")
            and not gguf_name.endswith(("_norm.weight", *_FLOAT_PARTS))
            and array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0)


def _add_ssm_sizes(w: Any, *, conv_kernel: int, state: int, groups: int, inner: int, heads: int) -> None:
    """The Mamba2 mixer's ``ssm.*`` metadata as the converter writes it (``time_step_rank``: the heads)."""
    w.add_ssm_conv_kernel(conv_kernel)
    w.add_ssm_state_size(state)
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(heads)


def _write(path: str, arch: str, tensors: Iterator[tuple[str | tuple[str, ...], str, np.ndarray]], qtype: Any,
           metadata: Callable[[Any], None]) -> tuple[str, set[str]]:
    """Write ``(hf_name, gguf_name, array)`` tensors after ``metadata(writer)`` (``hf_name``: a tuple for a
    tensor merged from several); returns the path and the transformers names of the tensors written quantized."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    metadata(w)
    quantized: set[str] = set()
    for hf_name, gguf_name, array in tensors:
        q = converter_quantizes(gguf_name, array, qtype)
        if q:
            quantized.update((hf_name,) if isinstance(hf_name, str) else hf_name)
        _add_tensor(w, gguf_name, array, qtype if q else None)
    return _finish(w, path), quantized


def _hybrid_layout(name: str, array: np.ndarray, groups: int, cfg: dict[str, Any], tensor_map: Any
                   ) -> tuple[str, np.ndarray]:
    """``GraniteHybridModel``'s changes to one tensor (Nemotron-H's converter inherits them): the Mamba2 layout,
    the query/key rows permuted into llama.cpp's rotary layout; returns its GGUF name and array."""
    name, array = mamba2_layout(name, array, groups)
    if name.endswith("q_proj.weight"):
        array = _permute(array, cfg["num_attention_heads"])
    elif name.endswith("k_proj.weight"):
        array = _permute(array, cfg["num_key_value_heads"])
    gguf_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
    assert gguf_name is not None, name
    return gguf_name, array


def _granite_tensors(cfg: dict[str, Any], state: dict[str, np.ndarray]) -> Iterator[tuple[str, str, np.ndarray]]:
    import gguf

    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, cfg["num_hidden_layers"])
    experts = bool(cfg.get("num_local_experts"))
    for name, array in state.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("block_sparse_moe.input_linear.weight"):  # [E, 2I, H]: gate rows, then up rows
            gate, up = np.split(array, 2, axis=-2)
            yield name, f"blk.{layer}.ffn_gate_exps.weight", gate
            yield name, f"blk.{layer}.ffn_up_exps.weight", up
            continue
        if name.endswith("shared_mlp.input_linear.weight"):
            gate, up = np.split(array, 2, axis=-2)
            suffix = "_shexp" if experts else ""
            yield name, f"blk.{layer}.ffn_gate{suffix}.weight", gate
            yield name, f"blk.{layer}.ffn_up{suffix}.weight", up
            continue
        if name.endswith("shared_mlp.output_linear.weight") and not experts:
            yield name, f"blk.{layer}.ffn_down.weight", array
            continue
        yield name, *_hybrid_layout(name, array, cfg["mamba_n_groups"], cfg, tensor_map)


def write_granite_hybrid_gguf(model_dir: str, path: str, *, qtype: Any = None, tokenizer: Any = None
                              ) -> tuple[str, set[str]]:
    """Convert a transformers ``GraniteMoeHybridForCausalLM`` directory to a ``granitehybrid`` file at ``path``
    as ``GraniteHybridModel`` does. ``tokenizer``: as :func:`tests.models.gguf_writer.add_vocab`. Returns the
    path and the transformers names of the tensors written in ``qtype``."""
    cfg = _config(model_dir)
    layers = cfg["num_hidden_layers"]
    # IBM's checkpoints say "attention" / "mamba"; transformers saves "full_attention" / "linear_attention"
    attention = [t in ("attention", "full_attention") for t in cfg["layer_types"]]

    def metadata(w: Any) -> None:
        use_rope = all(attention)  # the converter's rule: RoPE only without Mamba2 layers (or for Bamba)
        w.add_name("tiny-granitehybrid")
        w.add_block_count(layers)
        w.add_context_length(cfg["max_position_embeddings"] if use_rope else 2**20)
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv([cfg["num_key_value_heads"] if a else 0 for a in attention])
        w.add_rope_freq_base(_rope_theta(cfg))
        w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
        w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
        w.add_rope_scaling_finetuned(use_rope)
        if cfg.get("num_local_experts"):
            w.add_expert_count(cfg["num_local_experts"])
            w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
        w.add_attention_scale(float(cfg["attention_multiplier"]))
        w.add_embedding_scale(float(cfg["embedding_multiplier"]))
        w.add_residual_scale(float(cfg["residual_multiplier"]))
        w.add_logit_scale(float(cfg["logits_scaling"]))
        _add_ssm_sizes(w, conv_kernel=cfg["mamba_d_conv"], state=cfg["mamba_d_state"], groups=cfg["mamba_n_groups"],
                       inner=cfg["mamba_expand"] * cfg["hidden_size"], heads=cfg["mamba_n_heads"])
        add_vocab(w, cfg, tokenizer)

    return _write(path, "granitehybrid", _granite_tensors(cfg, _state(model_dir)), qtype, metadata)


def falcon_h1_folded(model_dir: str) -> dict[str, np.ndarray]:
    """The Falcon-H1 state dict with the muP multipliers multiplied in as ``FalconH1Model.modify_tensors`` does
    (what a ``falcon-h1`` file holds before its layout changes)."""
    cfg = _config(model_dir)
    inner, bc = cfg["mamba_d_ssm"], cfg["mamba_n_groups"] * cfg["mamba_d_state"]
    attn_in = cfg["attention_in_multiplier"]
    sections = np.cumsum([0, inner, inner, bc, bc])
    out = {}
    for name, array in _state(model_dir).items():
        array = array.copy()
        if "down_proj" in name:
            array *= cfg["mlp_multipliers"][1]
        elif "gate_proj" in name:
            array *= cfg["mlp_multipliers"][0]
        elif "k_proj" in name:
            array *= cfg["key_multiplier"] * attn_in
        elif "q_proj" in name or "v_proj" in name:
            array *= attn_in
        elif "o_proj" in name:
            array *= cfg["attention_out_multiplier"]
        elif "out_proj" in name:
            array *= cfg["ssm_out_multiplier"]
        elif "in_proj" in name:
            array *= cfg["ssm_in_multiplier"]
            for start, end, m in zip(sections, [*sections[1:], array.shape[0]], cfg["ssm_multipliers"]):
                array[start:end] *= m
        elif "lm_head" in name:
            array *= cfg["lm_head_multiplier"]
        elif "embed_tokens" in name:
            array *= cfg["embedding_multiplier"]
        out[name] = array
    return out


_FALCON_UNIT_MULTIPLIERS = dict(
    embedding_multiplier=1.0, lm_head_multiplier=1.0, mlp_multipliers=[1.0, 1.0], key_multiplier=1.0,
    attention_in_multiplier=1.0, attention_out_multiplier=1.0, ssm_multipliers=[1.0] * 5, ssm_in_multiplier=1.0,
    ssm_out_multiplier=1.0,
)


def write_falcon_h1_gguf(model_dir: str, path: str, *, qtype: Any = None, tokenizer: Any = None
                         ) -> tuple[str, set[str]]:
    """Convert a transformers ``FalconH1ForCausalLM`` directory to a ``falcon-h1`` file at ``path`` as
    ``FalconH1Model`` does (multipliers folded into the weights, none in the metadata; q/k not permuted).
    ``tokenizer``: as :func:`tests.models.gguf_writer.add_vocab`. Returns the path and the transformers names of
    the tensors written in ``qtype``."""
    import gguf

    cfg = _config(model_dir)
    layers = cfg["num_hidden_layers"]

    def metadata(w: Any) -> None:
        w.add_name("tiny-falcon-h1")
        w.add_block_count(layers)
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(_rope_theta(cfg))
        _add_ssm_sizes(w, conv_kernel=cfg["mamba_d_conv"], state=cfg["mamba_d_state"], groups=cfg["mamba_n_groups"],
                       inner=cfg["mamba_d_ssm"], heads=cfg["mamba_d_ssm"] // cfg["mamba_d_head"])
        w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
        add_vocab(w, cfg, tokenizer)

    def tensors() -> Iterator[tuple[str, str, np.ndarray]]:
        tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON_H1, layers)
        for source, array in falcon_h1_folded(model_dir).items():
            if source == "lm_head.weight" and cfg.get("tie_word_embeddings"):
                continue
            name, array = mamba2_layout(source, array, cfg["mamba_n_groups"])
            gguf_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            yield source, gguf_name, array

    return _write(path, "falcon-h1", tensors(), qtype, metadata)


def falcon_h1_folded_copy(model_dir: str, out_dir: str) -> str:
    """``model_dir`` with :func:`falcon_h1_folded` weights and every multiplier 1 in its config: the model a
    ``falcon-h1`` file describes, as a transformers checkpoint."""
    from safetensors.numpy import save_file

    shutil.copytree(model_dir, out_dir)
    save_file(falcon_h1_folded(model_dir), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = {**_config(model_dir), **_FALCON_UNIT_MULTIPLIERS}
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return out_dir


def q8_0_rounded_copy(model_dir: str, out_dir: str, rounded: Callable[[str], bool]) -> str:
    """A copy of ``model_dir`` at ``out_dir`` with each tensor whose name passes ``rounded`` replaced by its Q8_0
    round trip in blocks of 32 along its rows, as a Q8_0 file holds it (every such row length is a multiple of
    32)."""
    import gguf
    from safetensors.numpy import load_file, save_file

    q8 = gguf.GGMLQuantizationType.Q8_0
    shutil.copytree(model_dir, out_dir)
    state = load_file(os.path.join(out_dir, "model.safetensors"))
    for name, array in state.items():
        if rounded(name):
            blocks = gguf.quants.quantize(np.ascontiguousarray(array.reshape(-1, 32), dtype=np.float32), q8)
            state[name] = gguf.quants.dequantize(blocks, q8).reshape(array.shape).astype(array.dtype)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _nemotron_h_tensors(cfg: dict[str, Any], state: dict[str, np.ndarray], arch: Any
                        ) -> Iterator[tuple[str | tuple[str, ...], str, np.ndarray]]:
    """``NemotronHModel.modify_tensors``: the experts stacked into ``[E, I, H]`` / ``[E, H, I]``, the correction
    bias as ``exp_probs_b.bias``, the Mamba2 layers as ``Mamba2Model`` stores them, the query/key rows
    permuted."""
    import gguf

    tensor_map = gguf.get_tensor_name_map(arch, len(cfg["layers_block_type"]))
    for name, array in state.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        layer = name.split(".")[2] if name.startswith("backbone.layers.") else None
        if ".mixer.experts." in name:
            expert, proj = name.split(".")[5:7]
            if expert != "0":
                continue
            sources = tuple(f"backbone.layers.{layer}.mixer.experts.{e}.{proj}.weight"
                            for e in range(cfg["n_routed_experts"]))
            stacked = np.stack([state[n] for n in sources])
            yield sources, f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", stacked
            continue
        renamed = name.replace(".e_score_correction_bias", ".e_score_correction.bias")
        yield name, *_hybrid_layout(renamed, array, cfg["n_groups"], cfg, tensor_map)


def write_nemotron_h_gguf(model_dir: str, path: str, *, qtype: Any = None, tokenizer: Any = None
                          ) -> tuple[str, set[str]]:
    """Convert a transformers ``NemotronHForCausalLM`` directory to a ``nemotron_h`` file (MLP layers) or, when
    its config has experts, a ``nemotron_h_moe`` file (MoE layers; the converter writes no MLP layers then) at
    ``path`` as ``NemotronHModel`` does: the layer kinds as per-layer ``head_count_kv`` and
    ``feed_forward_length``, no RoPE (a 2**20 placeholder context), the router's settings as ``expert_*``
    metadata. ``tokenizer``: as :func:`tests.models.gguf_writer.add_vocab`. Returns the path and the
    transformers names of the tensors written in ``qtype``."""
    import gguf

    cfg = _config(model_dir)
    kinds = cfg["layers_block_type"]
    moe = "moe" in kinds
    assert not (moe and "mlp" in kinds), "a nemotron_h_moe file has no MLP layers"
    arch = gguf.MODEL_ARCH.NEMOTRON_H_MOE if moe else gguf.MODEL_ARCH.NEMOTRON_H
    ff = cfg["moe_intermediate_size"] if moe else cfg["intermediate_size"]

    def metadata(w: Any) -> None:
        w.add_name("tiny-nemotron-h")
        w.add_block_count(len(kinds))
        w.add_context_length(2**20)
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length([ff if k in ("mlp", "moe") else 0 for k in kinds])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv([cfg["num_key_value_heads"] if k == "full_attention" else 0 for k in kinds])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_layer_norm_rms_eps(float(cfg["layer_norm_epsilon"]))
        w.add_rope_scaling_finetuned(False)
        _add_ssm_sizes(w, conv_kernel=cfg["conv_kernel"], state=cfg["ssm_state_size"], groups=cfg["n_groups"],
                       inner=cfg["mamba_num_heads"] * cfg["mamba_head_dim"], heads=cfg["mamba_num_heads"])
        if moe:
            w.add_expert_used_count(cfg["num_experts_per_tok"])
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            w.add_expert_shared_feed_forward_length(cfg["moe_shared_expert_intermediate_size"])
            w.add_expert_count(cfg["n_routed_experts"])
            w.add_expert_shared_count(cfg["n_shared_experts"])
            w.add_expert_weights_norm(cfg["norm_topk_prob"])
            w.add_expert_weights_scale(cfg["routed_scaling_factor"])
            w.add_expert_group_count(cfg["n_group"])
            if cfg.get("moe_latent_size") is not None:
                w.add_moe_latent_size(cfg["moe_latent_size"])
        add_vocab(w, cfg, tokenizer)

    return _write(path, gguf.MODEL_ARCH_NAMES[arch], _nemotron_h_tensors(cfg, _state(model_dir), arch), qtype,
                  metadata)
