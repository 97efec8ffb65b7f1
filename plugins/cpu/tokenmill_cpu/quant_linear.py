"""Block-quantized weights for tokenmill-cpu's integer matmul kernels (``csrc/quant_linear.cpp``).

Why a custom kernel: a decode step of one request reads every weight once, so its matmuls run at the speed
weights stream from memory. torch's packed-weight CPU ops convert every weight to bfloat16 before multiplying
(``aten._weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``: at one row they streamed the weights at 13-15
GB/s, these kernels at 26-30 GB/s; docs/benchmarks.md, "Quantized matmul kernels"); these kernels quantize the
few activation rows to 14-bit integers instead and multiply integers with the AVX-512 VNNI dot product
(``vpdpbusd``), or on AVX2 CPUs with ``vpmaddubsw`` / ``vpmaddwd`` (exact 16-bit pair sums), with no per-weight
conversion (``tokenmill_cpu.kernels.isa()`` says which).
``python benchmarks/quant_linear.py`` measures both against torch on SmolLM2-135M's shapes.

Formats, per block of 32 input channels of one output row (GGUF's, so a GGUF checkpoint's codes come back):

* :class:`Q8Weight` (``--quantization int8``, and the LM head under ``int4``): ``w = d * q``,
  ``q = round(w / d)`` in ``-127..127``, ``d = max|w| / 127`` (GGUF ``Q8_0``).
* :class:`Q4Weight` (``--quantization int4``): ``w = d * q + m``, ``q = round((w - m) / d)`` in ``0..15``,
  ``m = min w``, ``d = (max w - m) / 15`` (GGUF ``Q4_1``); or, for rows whose minimum is ``-8 d`` (GGUF ``Q4_0``,
  symmetric GPTQ/AWQ), ``w = d * (q - 8)`` with no minimums stored: 4.5 bits a weight instead of 5; GGUF ``Q4_K``
  keeps its super-blocks: ``d = D * sc``, ``m = M * mn`` with 8-bit ``sc``, ``mn`` per block and float16 ``D``,
  ``M`` per 256 weights (4.625 bits a weight).

``d`` and ``m`` are float16 (or, for ``Q4_K``, products computed exactly in float32 by the kernel). Activations
are quantized per row in blocks of 32 (scale ``max|x| / 8191``; why not 8 bits: ``csrc/quant_linear.cpp``),
finer than their bfloat16 rounding except next to an outlier in the same block; ``tests/models/test_quant_linear.py`` checks the kernels against a float64 reference and
``benchmarks/quant_agreement.py`` reports greedy agreement on real prompts.
"""

from __future__ import annotations

import torch

from tokenmill.plugin_api import QuantizedWeight, UnsupportedShapeError

BLOCK = 32  # input channels per scale
ROWS = 16  # output rows per panel of the packed layout


def _check_shape(weight: torch.Tensor, method: str) -> tuple[int, int]:
    n, k = weight.shape
    if k % BLOCK or n % ROWS:
        raise UnsupportedShapeError(
            f"{method} needs input features divisible by {BLOCK} and output features by {ROWS}, got [{n}, {k}]"
        )
    return n, k


def _panel_scales(values: torch.Tensor) -> torch.Tensor:
    """``[N, K / 32]`` per-block values -> the kernel's ``[N / 16, K / 32, 16]`` float16."""
    n, nb = values.shape
    return values.reshape(n // ROWS, ROWS, nb).permute(0, 2, 1).contiguous()


def _block_values(panels: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_panel_scales`: ``[N / 16, K / 32, 16]`` -> ``[N, K / 32]`` float32."""
    p, nb, _ = panels.shape
    return panels.permute(0, 2, 1).reshape(p * ROWS, nb).float()


def _safe_div(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return torch.where(d > 0, x / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(x))


_LOW = 0x0F0F0F0F
_HIGH = -0x0F0F0F10  # 0xF0F0F0F0 as an int32


def _no_mins(n: int) -> torch.Tensor:
    """The ``mins`` of a :class:`Q4Weight` whose codes are centred at 8: ``[N / 16, 0, 16]`` float16."""
    return torch.empty(n // ROWS, 0, ROWS, dtype=torch.float16)


def _no_super_scales(n: int) -> torch.Tensor:
    """The ``super_scales`` of a :class:`Q4Weight` with float16 scales: ``[N / 16, 0, 2, 16]`` float16."""
    return torch.empty(n // ROWS, 0, 2, ROWS, dtype=torch.float16)


def _panels_of_words(words: torch.Tensor) -> torch.Tensor:
    """``[N, W]`` int32, each word four bytes of one row -> the panel layout ``[N / 16, W * 64]`` uint8:
    ``[W][16 rows][4 bytes]`` per panel of 16 rows."""
    n, w = words.shape
    return words.reshape(n // ROWS, ROWS, w).transpose(1, 2).contiguous().view(torch.uint8).reshape(n // ROWS, -1)


def _q4_words(qs: torch.Tensor) -> torch.Tensor:
    """GGUF 4-bit codes ``[N, K / 32, 4]`` int32 (16 bytes per block; byte ``t``: value ``t`` in the low nibble,
    ``t + 16`` in the high one) -> :class:`Q4Weight`'s packed panels, moving nibbles four bytes at a time.

    The kernel's byte ``i`` of 8-channel group ``j`` holds channel ``8j + i`` low and ``8j + 4 + i`` high; a
    block's groups 0-1 are its values 0-15 (the low nibbles of bytes 0-15), groups 2-3 its values 16-31 (the
    high nibbles): group 0 = low(bytes 0-3) | low(bytes 4-7) << 4, group 2 = high(bytes 0-3) >> 4 |
    high(bytes 4-7), and groups 1, 3 the same with bytes 8-15."""
    w0, w1, w2, w3 = qs.unbind(-1)
    groups = torch.stack((
        (w0 & _LOW) | ((w1 & _LOW) << 4),
        (w2 & _LOW) | ((w3 & _LOW) << 4),
        ((w0 >> 4) & _LOW) | (w1 & _HIGH),
        ((w2 >> 4) & _LOW) | (w3 & _HIGH),
    ), dim=-1)
    return _panels_of_words(groups.reshape(qs.shape[0], -1))


def _open_blocks(cls: type[QuantizedWeight], blocks: torch.Tensor, size: int, method: str
                 ) -> tuple[QuantizedWeight, torch.Tensor, torch.Tensor]:
    """An empty ``cls`` for GGUF rows of ``size``-byte blocks of 32 values, the blocks ``[N, K / 32, size]`` and
    their leading float16 scales ``d`` ``[N, K / 32]``.

    Raises:
        UnsupportedShapeError: ``N`` is not a multiple of 16.
    """
    n, nb = blocks.shape[0], blocks.shape[1] // size
    _check_shape(torch.empty(n, nb * BLOCK, device="meta"), method)
    b = blocks.reshape(n, nb, size)
    obj = cls.__new__(cls)
    QuantizedWeight.__init__(obj, torch.empty(n, nb * BLOCK, device="meta"))
    return obj, b, b[..., :2].contiguous().view(torch.float16).reshape(n, nb)


def _zero_point_blocks(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, method: str
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Group-quantized rows (``QuantizedWeight.from_zero_point``) as per-block scales ``d [N, K / 32]`` float16
    and zero points ``[N, K / 32]`` int32, or ``None`` when groups are not whole blocks or a scale is not a
    float16.

    Raises:
        UnsupportedShapeError: ``K`` is not a multiple of 32 or ``N`` of 16.
    """
    n, k = _check_shape(codes, method)
    group = k // scales.shape[1]
    d = scales.to(torch.float16)
    if group % BLOCK or not torch.isfinite(d).all() or not torch.equal(d.to(scales.dtype), scales):
        return None
    rep = group // BLOCK
    return d.repeat_interleave(rep, dim=1), zeros.to(torch.int32).repeat_interleave(rep, dim=1)


def _concat_panels(cls: type[QuantizedWeight], parts: list[QuantizedWeight],
                   **buffers: list[torch.Tensor]) -> QuantizedWeight:
    """Row tiles (each a multiple of 16 rows) joined: every buffer is ``[N / 16, ...]``, panel-major; ``buffers``
    gives some buffers' per-part tensors instead of the parts' own."""
    obj = cls.__new__(cls)
    n = sum(p.out_features for p in parts)
    QuantizedWeight.__init__(obj, torch.empty(n, parts[0].in_features, device="meta"))
    names = [name for name, _ in parts[0].named_buffers()]
    obj.store(**{name: torch.cat(buffers.get(name) or [getattr(p, name) for p in parts]) for name in names})
    return obj


class Q8Weight(QuantizedWeight):
    """8-bit copy of a weight ``[N, K]`` in blocks of 32 (``K`` a multiple of 32, ``N`` of 16).

    Attributes:
        packed: ``[N / 16, K * 16]`` uint8, codes ``q + 128`` in the kernel's panel layout (``[K / 4][16 rows][4]``
            per panel).
        scales: ``[N / 16, K / 32, 16]`` float16.

    Raises:
        UnsupportedShapeError: ``K`` is not a multiple of 32 or ``N`` of 16.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        n, k = _check_shape(weight, "int8")
        blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
        d = (blocks.abs().amax(dim=-1) / 127.0).clamp(max=65504.0).to(torch.float16)
        codes = (_safe_div(blocks, d.float()[..., None]).round().clamp(-127, 127) + 128).to(torch.uint8)
        self._pack(codes.reshape(n, k), d)

    def _pack(self, codes: torch.Tensor, d: torch.Tensor) -> None:
        """``codes [N, K]`` uint8 (``q + 128``), ``d [N, K / 32]`` float16 -> the kernel's buffers."""
        n, k = codes.shape
        packed = codes.reshape(n // ROWS, ROWS, k // 4, 4).permute(0, 2, 1, 3).reshape(n // ROWS, k * ROWS)
        self.store(packed=packed.contiguous(), scales=_panel_scales(d))

    @classmethod
    def from_gguf(cls, type_name: str, blocks: torch.Tensor) -> Q8Weight | None:
        """GGUF ``Q8_0`` (``w = d * q``) and ``Q5_0`` (``w = d * (q - 16)``, codes -16..15) rows, exactly: the
        same codes and float16 scales, repacked without a float copy; ``None`` for any other type.

        Args:
            type_name: the GGML type.
            blocks: ``[N, K / 32 * bytes_per_block]`` uint8.

        Raises:
            UnsupportedShapeError: ``N`` is not a multiple of 16.
        """
        if type_name not in ("Q8_0", "Q5_0"):
            return None
        obj, b, d = _open_blocks(cls, blocks, 34 if type_name == "Q8_0" else 22, "int8")
        n, nb = d.shape
        if type_name == "Q8_0":
            q = b[..., 2:].contiguous()
            if (q == 0x80).any():  # -128: outside the kernel's -127..127 (llama.cpp never writes it)
                return None
            words = q.view(torch.int32).reshape(n, nb * 8) ^ -0x7F7F7F80  # q + 128 = q ^ 0x80 per byte
            obj.store(packed=_panels_of_words(words), scales=_panel_scales(d))
            return obj
        qs, qh = b[..., 6:], b[..., 2:6].contiguous().view(torch.int32)  # [n, nb, 16], [n, nb, 1]
        high = ((qh >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8) << 4
        codes = (torch.cat((qs & 0x0F, qs >> 4), dim=-1) | high) + (128 - 16)  # (q in 0..31) - 16 + 128
        obj._pack(codes.reshape(n, nb * BLOCK), d)
        return obj

    @classmethod
    def from_zero_point(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
                        ) -> Q8Weight | None:
        """AWQ/GPTQ rows (``QuantizedWeight.from_zero_point``), exactly: codes ``q - z`` with the group's scale
        (groups a multiple of 32 channels, float16 scales); ``None`` when a ``q - z`` is outside -127..127 (an
        8-bit code far from its zero point) or a scale is not a float16.

        Raises:
            UnsupportedShapeError: ``K`` is not a multiple of 32 or ``N`` of 16.
        """
        blocks = _zero_point_blocks(codes, scales, zeros, "int8")
        if blocks is None:
            return None
        d, z = blocks
        n, k = codes.shape
        q = codes.to(torch.int32).reshape(n, k // BLOCK, BLOCK) - z[..., None]
        if int(q.min()) < -127 or int(q.max()) > 127:
            return None
        obj = cls.__new__(cls)
        QuantizedWeight.__init__(obj, torch.empty(n, k, device="meta"))
        obj._pack((q + 128).to(torch.uint8).reshape(n, k), d)
        return obj

    @classmethod
    def concat_rows(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """``parts`` (each :class:`Q8Weight`) as one weight, rows in order."""
        return _concat_panels(cls, parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` (float32, bfloat16 or float16) -> ``[..., N]`` in ``x``'s dtype."""
        lead = x.shape[:-1]
        y = torch.ops.tokenmill_cpu.q8_linear(x.reshape(-1, self.in_features).contiguous(), self.packed, self.scales)
        return y.reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, ``[N, K]`` float32 (tests and error reports)."""
        n, k, p = self.out_features, self.in_features, self.out_features // ROWS
        codes = self.packed.reshape(p, k // 4, ROWS, 4).permute(0, 2, 1, 3).reshape(n, k).float() - 128.0
        return (codes.reshape(n, -1, BLOCK) * _block_values(self.scales)[..., None]).reshape(n, k)


class Q4Weight(QuantizedWeight):
    """4-bit copy of a weight ``[N, K]`` in blocks of 32 with a scale and a minimum (``K`` a multiple of 32,
    ``N`` of 16), or with a scale only and codes centred at 8 (``w = d * (q - 8)``: GGUF ``Q4_0``), or with 8-bit
    factors of per-256-weight scales and minimums (GGUF ``Q4_K``).

    A decode step reads every weight once, so bytes per weight set its speed: 5 bits with float16 minimums, 4.5
    centred, 4.625 with 8-bit factors.

    Attributes:
        packed: ``[N / 16, K * 8]`` uint8, two codes per byte in the kernel's panel layout (``[K / 8][16 rows][4]``
            bytes per panel: channel ``8j + i`` in the low nibble, ``8j + 4 + i`` in the high one).
        scales: ``[N / 16, K / 32, 16]`` float16, or uint8 factors ``sc`` of ``super_scales[:, :, 0]``.
        mins: ``[N / 16, K / 32, 16]`` float16, ``[N / 16, 0, 16]`` when the codes are centred at 8, or uint8
            factors ``mn`` of ``super_scales[:, :, 1]``.
        super_scales: ``[N / 16, K / 256, 2, 16]`` float16 (``D``, ``M``: a block's ``d = D * sc``, ``m = M * mn``)
            with uint8 scales, else ``[N / 16, 0, 2, 16]``.

    Raises:
        UnsupportedShapeError: ``K`` is not a multiple of 32 or ``N`` of 16.
    """

    lm_head_method = "int8"  # why the head stays 8-bit: tokenmill_cpu.int4.Int4WeightOnly

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        n, k = _check_shape(weight, "int4")
        blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
        low = blocks.amin(dim=-1).to(torch.float16)
        d = ((blocks.amax(dim=-1) - low.float()) / 15.0).clamp(max=65504.0).to(torch.float16)
        codes = _safe_div(blocks - low.float()[..., None], d.float()[..., None]).round().clamp(0, 15).to(torch.uint8)
        self._pack(codes.reshape(n, k), d, low)

    def _pack(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> None:
        """``codes [N, K]`` uint8 (0..15), ``d``, ``m`` ``[N, K / 32]`` float16 (``m`` ``None``: codes centred at
        8) -> the kernel's buffers."""
        n, k = codes.shape
        # [P, 16, K/8, 2, 4] -> [P, K/8, 2, 16, 4]: half 0 (channels 8j..8j+3) low nibble, half 1 high nibble
        c = codes.reshape(n // ROWS, ROWS, k // 8, 2, 4).permute(0, 2, 3, 1, 4)
        packed = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n // ROWS, k * ROWS // 2).contiguous()
        self.store(packed=packed, scales=_panel_scales(d), mins=_no_mins(n) if m is None else _panel_scales(m),
                   super_scales=_no_super_scales(n))

    @property
    def centred(self) -> bool:
        """Whether the codes are centred at 8 with no minimums stored (``w = d * (q - 8)``)."""
        return self.mins.shape[1] == 0

    @property
    def super_blocked(self) -> bool:
        """Whether scales and minimums are 8-bit factors of ``super_scales`` (GGUF ``Q4_K``)."""
        return self.scales.dtype == torch.uint8

    def _super(self, i: int) -> torch.Tensor:
        """``super_scales[:, :, i]`` repeated for each of its 8 blocks: ``[N / 16, K / 32, 16]`` float32."""
        return self.super_scales[:, :, i].float().repeat_interleave(8, dim=1)

    def block_scales(self) -> torch.Tensor:
        """Every block's scale ``d``, ``[N / 16, K / 32, 16]`` float32 (exact)."""
        return self.scales.float() * self._super(0) if self.super_blocked else self.scales.float()

    def block_mins(self) -> torch.Tensor:
        """Every block's minimum ``m`` (``-8 d`` when centred), ``[N / 16, K / 32, 16]`` float32 (exact)."""
        if self.super_blocked:
            return self.mins.float() * self._super(1)
        return self.scales.float() * -8.0 if self.centred else self.mins.float()

    @classmethod
    def from_gguf(cls, type_name: str, blocks: torch.Tensor) -> Q4Weight | None:
        """GGUF ``Q4_1`` (``w = d * q + m``), ``Q4_0`` (``w = d * (q - 8)``, kept centred: no minimums) and
        ``Q4_K`` (:meth:`_from_q4_k`) rows: the same codes and scales, repacked without a float copy; ``None`` for
        any other type or a ``Q4_0`` scale above 65504 / 8 (whose ``-8 d`` would not be a float16 where
        :meth:`concat_rows` needs it).

        Args:
            type_name: the GGML type.
            blocks: ``[N, K / 32 * bytes_per_block]`` uint8.

        Raises:
            UnsupportedShapeError: ``N`` is not a multiple of 16.
        """
        if type_name == "Q4_K":
            return cls._from_q4_k(blocks)
        if type_name not in ("Q4_0", "Q4_1"):
            return None
        size = 18 if type_name == "Q4_0" else 20
        obj, b, d = _open_blocks(cls, blocks, size, "int4")
        n, nb = d.shape
        if type_name == "Q4_0":
            m = None
            if not torch.isfinite(d * -8.0).all():
                return None
        else:
            m = b[..., 2:4].contiguous().view(torch.float16).reshape(n, nb)
        # 16-bit units: Q4_0's codes start at byte 2 of an 18-byte block (not 4-byte aligned), Q4_1's at byte 4
        if blocks.storage_offset() % 2 or not blocks.is_contiguous():  # a file with an odd data alignment
            blocks = blocks.contiguous().clone()
        qs = blocks.view(torch.int16).reshape(n, nb, size // 2)[..., (size - 16) // 2:].contiguous()
        packed = _q4_words(qs.view(torch.int32).reshape(n, nb, 4))
        obj.store(packed=packed, scales=_panel_scales(d), mins=_no_mins(n) if m is None else _panel_scales(m),
                  super_scales=_no_super_scales(n))
        return obj

    @classmethod
    def _from_q4_k(cls, blocks: torch.Tensor) -> Q4Weight:
        """GGUF ``Q4_K`` rows: each 256-value super-block is eight 32-value sub-blocks ``w = (d sc) q - (dmin mn)``
        with 6-bit ``sc``, ``mn``: kept as they are, ``sc`` and ``mn`` as uint8 factors of ``D = d``,
        ``M = -dmin`` (the kernel's products are exact in float32)."""
        n, ns = blocks.shape[0], blocks.shape[1] // 144
        _check_shape(torch.empty(n, ns * 256, device="meta"), "int4")
        b = blocks.reshape(n * ns, 144)
        d, dmin = b[:, :2].contiguous().view(torch.float16), b[:, 2:4].contiguous().view(torch.float16)
        sc6, mn6 = b[:, 4:8], b[:, 8:12]
        md = b[:, 12:16]
        sc = torch.cat((sc6 & 0x3F, (md & 0x0F) | ((sc6 >> 2) & 0x30)), dim=1)  # [n * ns, 8] uint8
        mn = torch.cat((mn6 & 0x3F, (md >> 4) | ((mn6 >> 2) & 0x30)), dim=1)
        qs = b[:, 16:].reshape(n * ns, 4, 1, 32)  # chunk j: sub-block 2j in the low nibbles, 2j + 1 in the high
        codes = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, ns * 256)
        obj = cls.__new__(cls)
        QuantizedWeight.__init__(obj, torch.empty(n, ns * 256, device="meta"))
        obj._pack(codes, sc.reshape(n, ns * 8), mn.reshape(n, ns * 8))
        # [n, ns, 2] -> [P, ns, 2, 16]
        sup = torch.cat((d, -dmin), dim=1).reshape(n // ROWS, ROWS, ns, 2).permute(0, 2, 3, 1).contiguous()
        obj.store(super_scales=sup)
        return obj

    @classmethod
    def from_zero_point(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
                        ) -> Q4Weight | None:
        """4-bit AWQ/GPTQ rows (``QuantizedWeight.from_zero_point``), exactly: the same codes, ``d`` the group's
        scale and ``m = -z d``; ``None`` for more than 4 bits, or when a ``z d`` is not a float16 (an odd zero
        point times a scale with all 11 bits used: the loader then tries the int8 format, which holds any 4-bit
        row exactly) or a scale is not a float16.

        Raises:
            UnsupportedShapeError: ``K`` is not a multiple of 32 or ``N`` of 16.
        """
        if bits > 4:
            return None
        blocks = _zero_point_blocks(codes, scales, zeros, "int4")
        if blocks is None:
            return None
        d, z = blocks
        m32 = -(z.float() * d.float())  # exact in float32: an 11-bit significand times a 5-bit integer
        m = m32.to(torch.float16)
        if not torch.isfinite(m).all() or not torch.equal(m.float(), m32):
            return None
        if bool((z == 8).all()):  # symmetric checkpoints: no minimums to store
            m = None
        obj = cls.__new__(cls)
        QuantizedWeight.__init__(obj, torch.empty(codes.shape, device="meta"))
        obj._pack(codes.contiguous(), d, m)
        return obj

    @classmethod
    def concat_rows(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """``parts`` (each :class:`Q4Weight`) as one weight, rows in order. Parts of different forms are joined
        with float16 scales and minimums: ``-8 d`` for centred ones (exact: :meth:`from_gguf` keeps it within
        float16), ``D * sc``, ``M * mn`` rounded to float16 for super-blocked ones."""
        if len({(p.centred, p.super_blocked) for p in parts}) > 1:
            return _concat_panels(cls, parts, scales=[p.block_scales().to(torch.float16) for p in parts],
                                  mins=[p.block_mins().to(torch.float16) for p in parts],
                                  super_scales=[_no_super_scales(p.out_features) for p in parts])
        return _concat_panels(cls, parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` (float32, bfloat16 or float16) -> ``[..., N]`` in ``x``'s dtype."""
        lead = x.shape[:-1]
        y = torch.ops.tokenmill_cpu.q4_linear(
            x.reshape(-1, self.in_features).contiguous(), self.packed, self.scales, self.mins, self.super_scales
        )
        return y.reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, ``[N, K]`` float32 (tests and error reports)."""
        n, k, p = self.out_features, self.in_features, self.out_features // ROWS
        b = self.packed.reshape(p, k // 8, ROWS, 4)
        c = torch.stack((b & 0x0F, b >> 4), dim=2)  # [P, K/8, 2, 16, 4]
        codes = c.permute(0, 3, 1, 2, 4).reshape(n, k).float()
        d, m = _block_values(self.block_scales())[..., None], _block_values(self.block_mins())[..., None]
        return (codes.reshape(n, -1, BLOCK) * d + m).reshape(n, k)
