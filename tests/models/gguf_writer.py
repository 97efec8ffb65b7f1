"""Write a tiny Hugging Face model directory as a float32 GGUF file with the ``gguf`` package (as llama.cpp's
converter lays it out: its tensor names, its metadata keys, query/key rows permuted for ``llama`` files)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's rotary layout: the two halves of each head interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: str, path: str, arch: str, *, name: str = "tiny", qtype: Any = None) -> str:
    """Convert ``model_dir`` (safetensors + config.json) to ``path``; ``arch`` is llama.cpp's architecture name
    (``"qwen2"``, ``"qwen3"``, ``"llama"``, ``"phi3"``). A small tokenizer vocabulary (``<tok_i>`` pieces) is included so
    that transformers reads the vocabulary size. ``qtype`` (a ``gguf.GGMLQuantizationType`` that
    ``gguf.quants.quantize`` writes): every 2-D tensor in that type, else float32. Returns ``path``."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    n_layers = cfg["num_hidden_layers"]
    n_heads, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(path, arch)
    add_metadata(w, cfg, name)
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
        if qtype is not None and array.ndim == 2:
            w.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_metadata(w: Any, cfg: dict[str, Any], name: str = "tiny") -> None:
    """llama.cpp's metadata keys for a Hugging Face ``config.json`` dict, and a ``<tok_i>`` vocabulary."""
    n_heads, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    rope = cfg.get("rope_parameters") or {}
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
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


def llama_config(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> dict[str, Any]:
    """A Llama ``config.json`` dict (tied embeddings, context 512)."""
    return {"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": intermediate,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}


def random_llama_tensors(cfg: dict[str, Any], seed: int = 0, std: float = 0.02) -> Iterator[tuple[str, np.ndarray]]:
    """``(gguf_name, float32 array)`` of a random Llama in llama.cpp's names and shapes (tied head: no
    ``output.weight``), one tensor at a time; norms are ones."""
    rng = np.random.default_rng(seed)
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    yield "token_embd.weight", rng.standard_normal((cfg["vocab_size"], h), dtype=np.float32) * np.float32(std * 50)
    for i in range(cfg["num_hidden_layers"]):
        for part, shape in (("attn_q", (h, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)), ("attn_output", (h, h)),
                            ("ffn_gate", (f, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))):
            yield f"blk.{i}.{part}.weight", rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        yield f"blk.{i}.attn_norm.weight", np.ones(h, dtype=np.float32)
        yield f"blk.{i}.ffn_norm.weight", np.ones(h, dtype=np.float32)
    yield "output_norm.weight", np.ones(h, dtype=np.float32)


# Byte offsets of each k-quant block's float16 scales: random bytes there would be NaN, infinite or huge
_K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_k_blocks(qtype: Any, rows: int, cols: int, seed: int, scale: float = 0.1) -> np.ndarray:
    """``[rows, bytes]`` uint8 of a random k-quant (``gguf`` cannot quantize to these) tensor ``[rows, cols]``:
    random codes and integer scales, float16 super-block scales uniform in ``scale * [0.01, 1]`` (every 17th
    zero)."""
    import gguf

    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for off in _K_SCALE_OFFSETS[qtype.name]:
        d = (rng.uniform(0.01, 1.0, raw.shape[0]) * scale).astype(np.float16)
        d[::17] = 0
        raw[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def write_random_llama_gguf(path: str, cfg: dict[str, Any], qtype: Any, seed: int = 0, std: float = 0.02) -> str:
    """A random Llama (:func:`random_llama_tensors`) as a GGUF file whose 2-D tensors are ``qtype``
    (``gguf.quants.quantize``; k-quants, which gguf cannot write, as :func:`random_k_blocks` with the float
    tensor's standard deviation as scale; norms stay float32), written without holding the float model.
    Returns ``path``."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    add_metadata(w, cfg, "random")
    for i, (name, array) in enumerate(random_llama_tensors(cfg, seed, std)):
        if array.ndim == 2 and qtype.name in _K_SCALE_OFFSETS:
            w.add_tensor(name, random_k_blocks(qtype, *array.shape, seed + i, float(array.std()) / 300),
                         raw_dtype=qtype)
        elif array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
