"""Write a tiny Hugging Face model directory as a float32 GGUF file with the ``gguf`` package (as llama.cpp's
converter lays it out: its tensor names, its metadata keys, query/key rows permuted for ``llama`` files)."""

from __future__ import annotations

import json
import os

import numpy as np


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's rotary layout: the two halves of each head interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: str, path: str, arch: str, *, name: str = "tiny") -> str:
    """Convert ``model_dir`` (safetensors + config.json) to ``path``; ``arch`` is llama.cpp's architecture name
    (``"qwen2"``, ``"qwen3"``, ``"llama"``, ``"phi3"``). A small tokenizer vocabulary (``<tok_i>`` pieces) is included so
    that transformers reads the vocabulary size. Returns ``path``."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    n_layers = cfg["num_hidden_layers"]
    n_heads, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * float(rope.get("partial_rotary_factor") or 1.0)))
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<tok_{i}>" for i in range(cfg["vocab_size"])])
    w.add_token_types([1] * cfg["vocab_size"])
    w.add_bos_token_id(cfg.get("bos_token_id") or 1)
    w.add_eos_token_id(cfg.get("eos_token_id") or 2)
    if rope.get("rope_type") == "longrope":  # llama.cpp keeps the factors as tensors
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    for hf_name, array in state.items():
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        gguf_name = tensor_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        array = array.astype(np.float32)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            array = _permute(array, n_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            array = _permute(array, n_kv)
        w.add_tensor(gguf_name, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
