"""A block-quantized GGUF weight as the weight loaders receive it when weights stay quantized.

With ``--quantization`` and a GGUF file (``tokenmill.model_loader.quantized_loading``) the loader hands 2-D
block-quantized tensors to the layers' weight loaders as :class:`GGUFQuantTensor` instead of float32: rows are
independent in every GGML block type (a block never spans two rows), so the row slices, splits and permutations
the loaders make (tensor-parallel shards, fused q/k/v and gate/up, llama.cpp's rotary row order) are made on the
blocks themselves. Anything that needs values calls :meth:`GGUFQuantTensor.dequantize` (float32, one tensor at a
time), which is what a layer that does not keep weights quantized does.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from tokenmill.model_loader.gguf_dequant import BLOCK_TYPES, dequantize_blocks


class GGUFQuantTensor:
    """Rows of a GGUF tensor in one of :data:`~tokenmill.model_loader.gguf_dequant.BLOCK_TYPES`.

    Attributes:
        type_name: the GGML type (``"Q4_0"``, ``"Q6_K"``, ...).
        blocks: ``[rows, bytes_per_row]`` uint8, possibly a read-only view of the file's memory map (never
            written).
        shape: ``(rows, values_per_row)``, the float tensor it stands for.

    Raises (constructor):
        ValueError: an unknown type, or ``bytes_per_row`` that is not a whole number of blocks.
    """

    def __init__(self, type_name: str, blocks: torch.Tensor) -> None:
        if type_name not in BLOCK_TYPES:
            raise ValueError(f"GGUF type {type_name} is not a block type tokenmill reads ({', '.join(BLOCK_TYPES)})")
        size, per_block, _ = BLOCK_TYPES[type_name]
        if blocks.dim() != 2 or blocks.dtype != torch.uint8 or blocks.shape[1] % size:
            raise ValueError(f"{type_name} rows must be [rows, k * {size}] uint8, got {tuple(blocks.shape)}")
        self.type_name = type_name
        self.blocks = blocks
        self.shape = torch.Size((blocks.shape[0], blocks.shape[1] // size * per_block))

    @classmethod
    def from_numpy(cls, type_name: str, data: np.ndarray) -> GGUFQuantTensor:
        """Wrap ``[rows, bytes_per_row]`` uint8 ``data`` (a view of the file's map: not copied)."""
        with warnings.catch_warnings():  # read-only map: torch warns that writes would fail; none are made
            warnings.simplefilter("ignore", UserWarning)
            return cls(type_name, torch.from_numpy(data))

    def dim(self) -> int:
        return 2

    @property
    def values_per_block(self) -> int:
        return BLOCK_TYPES[self.type_name][1]

    def narrow(self, dim: int, start: int, length: int) -> GGUFQuantTensor | torch.Tensor:
        """Rows ``start:start + length`` (``dim`` 0, no copy); along ``dim`` 1 the whole row is itself and any
        other column range is dequantized first (row-parallel shards: a float32 ``[rows, length]``)."""
        if dim == 0:
            return GGUFQuantTensor(self.type_name, self.blocks.narrow(0, start, length))
        if start == 0 and length == self.shape[1]:
            return self
        return self.dequantize().narrow(dim, start, length)

    def split(self, sizes: Sequence[int], dim: int = 0) -> list[GGUFQuantTensor]:
        """Consecutive row ranges of ``sizes`` rows (``dim`` 0 only: fused q/k/v and gate/up tensors)."""
        if dim != 0:
            raise ValueError("GGUFQuantTensor splits rows only")
        parts, start = [], 0
        for size in sizes:
            parts.append(GGUFQuantTensor(self.type_name, self.blocks.narrow(0, start, size)))
            start += size
        return parts

    def __getitem__(self, rows: slice) -> GGUFQuantTensor:
        """A row slice (the vocabulary shard of an embedding)."""
        return GGUFQuantTensor(self.type_name, self.blocks[rows])

    def index_rows(self, index: torch.Tensor) -> GGUFQuantTensor:
        """Rows in the order of ``index`` (``[rows]`` int64): a copy of those rows' blocks."""
        return GGUFQuantTensor(self.type_name, self.blocks.index_select(0, index))

    def dequantize(self) -> torch.Tensor:
        """``shape`` float32, a new tensor."""
        return dequantize_blocks(self.blocks.contiguous(), self.type_name)


def as_float(loaded: torch.Tensor | GGUFQuantTensor) -> torch.Tensor:
    """``loaded`` itself, or the float32 values of a :class:`GGUFQuantTensor`."""
    return loaded.dequantize() if isinstance(loaded, GGUFQuantTensor) else loaded
