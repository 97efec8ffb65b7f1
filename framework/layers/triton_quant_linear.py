"""Group-quantized weights multiplied by a Triton kernel: the ``--quantization`` formats of the CUDA and ROCm
platforms (``Platform.get_quant_method_cls``), shared by both plugins through the plugin API as their attention
backend is.

One layout holds every format the quantized loader hands a layer (``tokenmill.model_loader.quantized_loading``),
exactly: unsigned 4- or 8-bit codes per weight, a scale per group of consecutive input channels, and either
integer zero points per group, one constant zero point, or float minimums per group
(:mod:`tokenmill.layers.triton_group_quant` has the layout and the kernel):

* AWQ, GPTQ (4/8 bits, any group size; activation order through ``PermutedInput``) and compressed-tensors integer
  schemes (W4A16, W8A16; W8A8's activation scales are dropped at load, activations stay in the model's dtype):
  :meth:`TritonGroupQuantWeight.from_zero_point` keeps the checkpoint's codes, scales (their dtype) and zero
  points (a constant one when every group has the same);
* GGUF ``Q4_0``, ``Q4_1``, ``Q4_K`` (:class:`TritonInt4Weight`), ``Q5_0``, ``Q5_1``, ``Q8_0``, ``Q5_K``, ``Q6_K``
  (:class:`TritonInt8Weight`, 5- and 6-bit codes in bytes): :meth:`from_gguf`, the values
  ``tokenmill.model_loader.gguf_dequant`` computes, bit for bit (k-quant scales as float32 products); ``Q2_K`` and
  ``Q3_K`` are dequantized and quantized again to the 4-bit format by the loader;
* float weights (``--quantization int8|int4`` of a float checkpoint): the constructor quantizes groups of 32,
  ``int8`` symmetric (``q = round(w / d) + 128``, ``d = max|w| / 127``, GGUF ``Q8_0``), ``int4`` with a minimum
  (``q = round((w - m) / d)``, ``m = min w``, ``d = (max w - m) / 15``, GGUF ``Q4_1``), float16 ``d`` and ``m``;
* FP8 checkpoints are dequantized to float at load (``tokenmill.model_loader.scaled_quant_weights``) and run as
  float layers: no FP8 weight kernel here.

Any ``N`` and ``K`` (the kernel masks ragged tiles). The kernel runs on whatever device the tensors are on: a
GPU, or the CPU under ``TRITON_INTERPRET=1`` (the tests, the conformance kit's emulated devices).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tokenmill.layers.quantization import QuantizedWeight

FLOAT_GROUP = 32  # input channels per scale when quantizing a float weight
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[N, K]`` unsigned codes -> ``[N, ceil(K * bits / 8)]`` uint8, lowest bits first (the kernel's layout)."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``[N, K]`` uint8."""
    if bits == 8:
        return packed
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)[:, :k]


class TritonGroupQuantWeight(QuantizedWeight):
    """A weight ``[N, K]`` in the kernel's group-quantized layout (module docstring).

    Attributes:
        bits: bits per stored code (a class attribute: 4 or 8).
        group_size: input channels per scale.
        zero_offset: the zero point of every group when there is no ``zeros`` buffer.
        packed: ``[N, ceil(K * bits / 8)]`` uint8 codes.
        scales: ``[N, G]`` float16, bfloat16 or float32.
        zeros: ``[N, G]`` uint8 or int16 zero points (only when they differ between groups).
        mins: ``[N, G]`` float minimums (GGUF ``Q4_1``-style formats only).

    Raises (constructor):
        ValueError: ``weight`` is not 2-D.
    """

    bits: ClassVar[int] = 8

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        n, k = weight.shape
        groups = -(-k // FLOAT_GROUP)
        w = torch.nn.functional.pad(weight.detach().float(), (0, groups * FLOAT_GROUP - k))
        blocks = w.reshape(n, groups, FLOAT_GROUP)
        if self.bits == 8:
            d = (blocks.abs().amax(dim=-1) / 127.0).clamp(max=65504.0).half()
            codes = _divide(blocks, d.float()[..., None]).round().clamp(-127, 127) + 128
            self._set(codes.reshape(n, -1)[:, :k], d, None, None, 128, FLOAT_GROUP)
        else:
            low = blocks.amin(dim=-1).half()
            d = ((blocks.amax(dim=-1) - low.float()) / 15.0).clamp(max=65504.0).half()
            codes = _divide(blocks - low.float()[..., None], d.float()[..., None]).round().clamp(0, 15)
            self._set(codes.reshape(n, -1)[:, :k], d, None, low, 0, FLOAT_GROUP)

    def _set(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, mins: torch.Tensor | None,
             zero_offset: int, group_size: int) -> None:
        self.group_size, self.zero_offset = group_size, zero_offset
        tensors = {"packed": pack_codes(codes, self.bits), "scales": scales.contiguous()}
        if zeros is not None:
            tensors["zeros"] = zeros.contiguous()
        if mins is not None:
            tensors["mins"] = mins.contiguous()
        self.store(**tensors)

    @classmethod
    def _empty(cls, n: int, k: int) -> TritonGroupQuantWeight:
        obj = cls.__new__(cls)
        QuantizedWeight.__init__(obj, torch.empty(n, k, device="meta"))
        return obj

    @classmethod
    def from_zero_point(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
                        ) -> TritonGroupQuantWeight | None:
        """Group-quantized rows (``QuantizedWeight.from_zero_point``), exactly: the same codes, scales (float16,
        bfloat16 or float32, kept) and zero points; ``None`` for codes wider than :attr:`bits` or another scale
        dtype."""
        if bits > cls.bits or scales.dtype not in _SCALE_DTYPES:
            return None
        n, k = codes.shape
        obj = cls._empty(n, k)
        z = zeros.to(torch.int16)
        if z.numel() and bool((z == z.flatten()[:1]).all()):  # symmetric schemes: one zero point for all
            obj._set(codes, scales, None, None, int(z.flatten()[0]), k // scales.shape[1])
        else:
            fits = int(z.min()) >= 0 and int(z.max()) <= 255
            obj._set(codes, scales, z.to(torch.uint8) if fits else z, None, 0, k // scales.shape[1])
        return obj

    @classmethod
    def from_gguf(cls, type_name: str, blocks: torch.Tensor) -> TritonGroupQuantWeight | None:
        """GGUF rows whose codes take more than half of :attr:`bits` bits and at most :attr:`bits` (so a file is
        held in the narrowest format that holds it), exactly; ``None`` for other types (module docstring).

        Args:
            type_name: the GGML type.
            blocks: ``[N, bytes_per_row]`` uint8.
        """
        from tokenmill.model_loader.gguf_dequant import block_groups

        groups = block_groups(blocks, type_name)
        if groups is None or not cls.bits // 2 < groups.bits <= cls.bits:
            return None
        obj = cls._empty(*groups.codes.shape)
        obj._set(groups.codes, groups.scales, None, groups.mins, groups.offset, groups.group_size)
        return obj

    @classmethod
    def concat_rows(cls, parts: list[QuantizedWeight]) -> QuantizedWeight | None:
        """``parts`` as one weight, rows in order; ``None`` when their group sizes, zero points or buffers
        differ."""
        first = parts[0]
        names = [name for name, _ in first.named_buffers()]
        same = all(isinstance(p, TritonGroupQuantWeight) and p.group_size == first.group_size
                   and p.zero_offset == first.zero_offset and [b for b, _ in p.named_buffers()] == names
                   and all(getattr(p, b).dtype == getattr(first, b).dtype for b in names) for p in parts)
        if not same:
            return None
        obj = cls._empty(sum(p.out_features for p in parts), first.in_features)
        obj.group_size, obj.zero_offset = first.group_size, first.zero_offset
        obj.store(**{name: torch.cat([getattr(p, name) for p in parts]) for name in names})
        return obj

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` (float32, bfloat16 or float16) -> ``[..., N]`` in ``x``'s dtype."""
        from tokenmill.layers.triton_group_quant import group_quant_matmul

        lead = x.shape[:-1]
        y = group_quant_matmul(x.reshape(-1, self.in_features).contiguous(), self.packed, self.scales,
                               getattr(self, "zeros", None), getattr(self, "mins", None), in_features=self.in_features,
                               bits=self.bits, group_size=self.group_size, zero_offset=self.zero_offset)
        return y.reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, ``[N, K]`` float32 (tests and error reports)."""
        k = self.in_features
        group = torch.arange(k, device=self.packed.device) // self.group_size
        codes = unpack_codes(self.packed, self.bits, k).to(torch.int32)
        zeros = getattr(self, "zeros", None)
        codes = codes - (zeros.to(torch.int32)[:, group] if zeros is not None else self.zero_offset)
        w = codes.float() * self.scales.float()[:, group]
        mins = getattr(self, "mins", None)
        return w if mins is None else w + mins.float()[:, group]


class TritonInt8Weight(TritonGroupQuantWeight):
    """``--quantization int8`` (and the LM head under ``int4``): codes of 5 to 8 bits in bytes."""

    bits: ClassVar[int] = 8


class TritonInt4Weight(TritonGroupQuantWeight):
    """``--quantization int4``: codes of at most 4 bits, two per byte; the LM head stays 8-bit (as on the CPU
    plugin: the logits are the most sensitive product)."""

    bits: ClassVar[int] = 4
    lm_head_method = "int8"


def _divide(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return torch.where(d > 0, x / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(x))
