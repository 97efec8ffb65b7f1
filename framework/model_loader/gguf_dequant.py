"""GGUF tensor data to float32 torch tensors, with torch doing the arithmetic for the common block types.

``gguf.quants.dequantize`` runs on one core through numpy temporaries: the embedded SmolLM2 file (210 ``Q4_1``
tensors, one ``Q8_0``) took it 0.76-1.62 s, and torch 0.36-0.57 s (docs/benchmarks-history.md, "2026-12-01 Xeon
(1dff90a)"). The block layouts below are GGML's (llama.cpp ``ggml-common.h``; the ``gguf`` package implements the
same ones): each block covers 32 consecutive values of a row and starts with a float16 scale ``d``.

* ``Q4_0`` (18 bytes): ``d``, then 16 bytes of 4-bit codes; value ``j`` is ``d * (code_j - 8)``.
* ``Q4_1`` (20 bytes): ``d``, a float16 minimum ``m``, then 16 bytes of codes; value ``j`` is ``d * code_j + m``.
* ``Q8_0`` (34 bytes): ``d``, then 32 int8 codes; value ``j`` is ``d * code_j``.

In the 4-bit types byte ``i`` holds code ``i`` in its low nibble and code ``i + 16`` in its high nibble. Torch
computes exactly what ``gguf.quants`` computes (the same float32 products and sums), so the loaded weights are
bit-identical; every other type goes through ``gguf.quants``.
"""

from __future__ import annotations

import numpy as np
import torch

_BLOCK = 32


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[B, 16]`` uint8 bytes -> ``[B, 32]`` uint8 codes: the low nibbles, then the high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    return d * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return d * _nibbles(blocks[:, 4:]).float() + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    return blocks[:, 2:].contiguous().view(torch.int8).float() * d


_TORCH_BLOCKS = {"Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1), "Q8_0": (34, _q8_0)}


def dequantize_gguf(data: np.ndarray, tensor_type: object) -> torch.Tensor:
    """The float32 values of one GGUF tensor.

    Args:
        data: the tensor's bytes as ``gguf`` maps them: ``[rows, bytes_per_row]`` uint8 for block types, the
            element array for ``F32`` / ``F16`` / ``BF16`` (any leading shape).
        tensor_type: its ``gguf.GGMLQuantizationType``.

    Returns:
        a new contiguous float32 tensor (never a view of the file): ``[rows, values_per_row]`` for block types,
        ``data``'s shape otherwise.

    Raises:
        NotImplementedError: ``gguf`` cannot dequantize this type either.
    """
    name = getattr(tensor_type, "name", str(tensor_type))
    if name in ("F32", "F16"):
        return torch.from_numpy(np.array(data, dtype=np.float32, order="C"))
    if name in _TORCH_BLOCKS and data.dtype == np.uint8:
        size, fn = _TORCH_BLOCKS[name]
        rows = data.shape[:-1]
        raw = torch.from_numpy(np.ascontiguousarray(data).reshape(-1, size).copy())
        return fn(raw).reshape(*rows, data.shape[-1] // size * _BLOCK)
    import gguf

    return torch.from_numpy(np.array(gguf.quants.dequantize(data, tensor_type), dtype=np.float32, order="C"))
