"""A weight with integer codes, per-group scales and zero points, as the weight loaders receive it from an AWQ or
GPTQ checkpoint (``tokenmill.model_loader.hf_quant_weights``).

Its value is ``w[n, k] = scales[n, group(k)] * (codes[n, k] - zeros[n, group(k)])``, computed exactly in float32
(codes and zero points are at most 9-bit integers, scales float16 or bfloat16). Rows are independent, so the row
slices and splits the loaders make (fused q/k/v and gate/up, tensor-parallel shards) are made on the codes; a
layer that does not keep weights quantized calls :meth:`GroupQuantTensor.dequantize`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class GroupQuantTensor:
    """Rows of a group-quantized weight.

    Attributes:
        codes: ``[N, K]`` uint8, unsigned codes in ``0 .. 2**bits - 1``.
        scales: ``[N, G]`` float (the checkpoint's dtype).
        zeros: ``[N, G]`` int16, the zero point each code is offset by.
        bits: bits per code (4 or 8).
        group_size: input channels per group when ``g_idx`` is ``None`` (``G = K / group_size``).
        g_idx: ``[K]`` int64 group of each input channel (GPTQ's activation order), or ``None``: channel ``k`` is
            in group ``k // group_size``.
        shape: ``(N, K)``.

    Raises (constructor):
        ValueError: inconsistent shapes.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                 group_size: int, g_idx: torch.Tensor | None = None) -> None:
        n, k = codes.shape
        if scales.shape != zeros.shape or scales.shape[0] != n:
            raise ValueError(f"group-quantized weight: scales {tuple(scales.shape)} and zero points "
                             f"{tuple(zeros.shape)} do not match codes {tuple(codes.shape)}")
        if g_idx is None and (k % group_size or k // group_size != scales.shape[1]):
            raise ValueError(f"group-quantized weight: {k} input channels are not {scales.shape[1]} groups of "
                             f"{group_size}")
        if g_idx is not None and (g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[1]):
            raise ValueError(f"group-quantized weight: g_idx must be [{k}] in 0..{scales.shape[1] - 1}")
        self.codes, self.scales, self.zeros = codes, scales, zeros
        self.bits, self.group_size, self.g_idx = bits, group_size, g_idx
        self.shape = torch.Size((n, k))

    def dim(self) -> int:
        return 2

    def _rows(self, start: int, length: int) -> GroupQuantTensor:
        return GroupQuantTensor(self.codes.narrow(0, start, length), self.scales.narrow(0, start, length),
                                self.zeros.narrow(0, start, length), self.bits, self.group_size, self.g_idx)

    def narrow(self, dim: int, start: int, length: int) -> GroupQuantTensor | torch.Tensor:
        """Rows ``start:start + length`` (``dim`` 0, no copy); along ``dim`` 1 the whole row is itself; any other
        range (column ranges, and negative ``dim``: what a loader that does not know this class asks, e.g.
        ``FusedMoE``'s) is taken from the dequantized weight (float32)."""
        if dim == 0:
            return self._rows(start, length)
        if dim == 1 and start == 0 and length == self.shape[1]:
            return self
        return self.dequantize().narrow(dim, start, length)

    def split(self, sizes: Sequence[int], dim: int = 0) -> list[GroupQuantTensor]:
        """Consecutive row ranges of ``sizes`` rows (``dim`` 0 only).

        Raises:
            ValueError: ``dim`` is not 0.
        """
        if dim != 0:
            raise ValueError("GroupQuantTensor splits rows only")
        out, start = [], 0
        for size in sizes:
            out.append(self._rows(start, size))
            start += size
        return out

    def group_of_channels(self) -> torch.Tensor:
        """``[K]`` int64: the group of each input channel."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.shape[1]) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32, a new tensor (exact: see the module docstring)."""
        g = self.group_of_channels()
        codes = self.codes.to(torch.int32) - self.zeros.to(torch.int32)[:, g]
        return codes.float() * self.scales.float()[:, g]

    def contiguous_groups(self) -> GroupQuantTensor | None:
        """The same weight with groups of consecutive channels (``g_idx`` ``None``): itself, or, for an activation
        order whose groups fall on aligned runs of channels, per-run scales and zero points (runs as long as
        possible: a power-of-two fraction of the group size); ``None`` when neighbouring channels are in different
        groups."""
        if self.g_idx is None:
            return self
        k, n_groups = self.shape[1], self.scales.shape[1]
        run = max(1, 1 << int(math.log2(max(1, k // n_groups))))
        while run > 1 and (k % run or bool((self.g_idx.reshape(-1, run) != self.g_idx[::run, None]).any())):
            run //= 2
        if run == 1:  # one scale per channel would be no format's layout
            return None
        groups = self.g_idx[::run]
        return GroupQuantTensor(self.codes, self.scales[:, groups], self.zeros[:, groups], self.bits, run)

    def input_order(self) -> torch.Tensor | None:
        """``[K]`` int64: the input channels sorted by group (stable), or ``None`` without ``g_idx``."""
        return None if self.g_idx is None else torch.argsort(self.g_idx, stable=True)

    def permuted(self, perm: torch.Tensor) -> GroupQuantTensor:
        """The weight with input channel ``i`` holding channel ``perm[i]`` (a copy of the codes)."""
        g_idx = self.group_of_channels()[perm]
        return GroupQuantTensor(self.codes.index_select(1, perm), self.scales, self.zeros, self.bits,
                                self.group_size, g_idx)

    def with_group_size(self, size: int) -> GroupQuantTensor:
        """The same weight (``g_idx`` ``None``) with groups split into groups of ``size`` channels (``size``
        divides ``group_size``)."""
        rep = self.group_size // size
        return GroupQuantTensor(self.codes, self.scales.repeat_interleave(rep, dim=1),
                                self.zeros.repeat_interleave(rep, dim=1), self.bits, size)

    @staticmethod
    def cat(parts: Sequence[GroupQuantTensor]) -> GroupQuantTensor | None:
        """``parts``' rows as one weight with consecutive groups of one size (the smallest common one), or
        ``None`` when one of them has no such form (:meth:`contiguous_groups`)."""
        regular = [p.contiguous_groups() for p in parts]
        if any(r is None for r in regular):
            return None
        size = math.gcd(*[r.group_size for r in regular])  # type: ignore[union-attr]
        regular = [r.with_group_size(size) for r in regular]  # type: ignore[union-attr]
        if len(regular) == 1:
            return regular[0]
        dtype = regular[0].scales.dtype if len({r.scales.dtype for r in regular}) == 1 else torch.float32
        return GroupQuantTensor(torch.cat([r.codes for r in regular]), torch.cat([r.scales.to(dtype) for r in regular]),
                                torch.cat([r.zeros for r in regular]), max(r.bits for r in regular), size)


def unpack_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., W]`` int32 -> ``[..., W * 32 / bits]`` int16, the codes of each word lowest bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1).to(torch.int16)
