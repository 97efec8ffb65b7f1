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
        _add_tensor(w, gguf_name, array, qtype if array.ndim == 2 else None)
    return _finish(w, path)


def _add_tensor(w: Any, name: str, array: np.ndarray, qtype: Any) -> None:
    """``array`` as ``name``: quantized to ``qtype`` (``gguf.quants.quantize``), or float32 when ``qtype`` is None."""
    import gguf

    if qtype is not None:
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)
    else:
        w.add_tensor(name, np.ascontiguousarray(array))


def _finish(w: Any, path: str) -> str:
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
    add_vocab(w, cfg)


def add_vocab(w: Any, cfg: dict[str, Any], tokenizer: Any = None) -> None:
    """A ``<tok_i>`` vocabulary of ``cfg["vocab_size"]`` pieces, or with ``tokenizer`` (a transformers byte-level
    BPE fast tokenizer) its pieces, merges and special tokens padded with ``[PAD<i>]`` to the model's vocabulary
    as llama.cpp's converter pads them; and the bos/eos ids of ``cfg``."""
    n = cfg["vocab_size"]
    w.add_vocab_size(n)
    w.add_tokenizer_model("gpt2")
    if tokenizer is None:
        tokens, types = [f"<tok_{i}>" for i in range(n)], [1] * n
    else:
        vocab = tokenizer.get_vocab()
        pieces = sorted(vocab, key=vocab.__getitem__)
        assert [vocab[p] for p in pieces] == list(range(len(pieces))) and len(pieces) <= n
        special = set(tokenizer.all_special_tokens)
        tokens = pieces + [f"[PAD{i}]" for i in range(len(pieces), n)]
        types = [3 if p in special else 1 for p in pieces] + [5] * (n - len(pieces))  # control / normal / unused
        merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_token_list(tokens)
    w.add_token_types(types)
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


def mamba2_layout(name: str, array: np.ndarray, groups: int) -> tuple[str, np.ndarray]:
    """llama.cpp's ``Mamba2Model`` changes to one Mamba2 mixer tensor (transformers' name and layout in):
    ``dt_bias`` renamed ``dt_proj.bias``, ``A = -exp(A_log)`` and ``D`` as ``[heads, 1]``, the conv weight
    squeezed to ``[channels, kernel]``, the gated norm (``mixer.norm`` / ``mamba.norm``) as ``[groups, inner /
    groups]``; other tensors unchanged."""
    if name.endswith(".dt_bias"):
        return name.removesuffix(".dt_bias") + ".dt_proj.bias", array
    if name.endswith(".A_log"):
        return name, -np.exp(array).reshape(-1, 1)
    if name.endswith(".D"):
        return name, array.reshape(-1, 1)
    if name.endswith("conv1d.weight"):
        return name, array.squeeze(1)
    if name.endswith(("mixer.norm.weight", "mamba.norm.weight")):
        return name, array.reshape(groups, -1)
    return name, array


def write_mamba2_gguf(model_dir: str, path: str, *, qtype: Any = None, tokenizer: Any = None) -> str:
    """Convert a transformers ``Mamba2ForCausalLM`` directory to ``path`` as llama.cpp's converter writes a
    ``mamba2`` file: ``ssm.*`` metadata (``time_step_rank`` = heads, no head size), ``dt_bias`` as
    ``ssm_dt.bias``, ``A = -exp(A_log)`` and ``D`` as ``[heads, 1]``, the conv weight squeezed to ``[channels,
    kernel]``, the gated norm as ``[groups, inner / groups]``; a tied head is left out. ``qtype``: 2-D tensors
    whose rows are whole blocks in that type (``gguf.quants.quantize``; not the conv weight, as llama.cpp), the
    rest float32. ``tokenizer``: as :func:`add_vocab`. Returns ``path``."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    inner = int(cfg["expand"] * cfg["hidden_size"])
    w = gguf.GGUFWriter(path, "mamba2")
    w.add_name("tiny-mamba2")
    w.add_context_length(2**20)  # llama.cpp's placeholder: a Mamba2 has no trained context length
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_ssm_conv_kernel(cfg["conv_kernel"])
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(cfg["state_size"])
    w.add_ssm_time_step_rank(inner // cfg["head_dim"])
    w.add_ssm_group_count(cfg["n_groups"])
    w.add_layer_norm_rms_eps(float(cfg["layer_norm_epsilon"]))
    add_vocab(w, cfg, tokenizer)
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MAMBA2, cfg["num_hidden_layers"])
    for hf_name, array in load_file(os.path.join(model_dir, "model.safetensors")).items():
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        hf_name, array = mamba2_layout(hf_name, array.astype(np.float32), cfg["n_groups"])
        gguf_name = tensor_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        quantize = (qtype is not None and array.ndim == 2 and "conv1d" not in hf_name
                    and array.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0)
        _add_tensor(w, gguf_name, array, qtype if quantize else None)
    return _finish(w, path)
