"""GGUF tensor data to float32 torch tensors, with torch doing the arithmetic for every block type tokenmill loads.

``gguf.quants.dequantize`` is vectorized numpy on one core: on the embedded SmolLM2 file (210 ``Q4_1`` tensors,
one ``Q8_0``) it took 0.80-0.86 s against torch's 0.56-0.63 s on one thread of a busy 2-core Zen 3; on one
2048 x 8192 tensor torch is about as fast for ``Q4_0`` (0.10 s) and up to 2.5x slower for the others (0.08-0.24 s
against 0.03-0.10 s; docs/quantization.md). Torch is used for every block type all the same: the quantized
loader and the quantized embedding (``tokenmill.model_loader.gguf_tensor``) work on torch tensors of a few rows
at a time, where a numpy round trip per call costs more than the arithmetic. The block layouts below are GGML's
(llama.cpp ``ggml-common.h``; the ``gguf`` package implements the same ones). Every function repeats
``gguf.quants``' float32 operations in the same order (products then sums, no fused multiply-add), so the
results are bit-identical to it (``tests/models/test_gguf_dequant.py``).

Blocks of 32 values starting with a float16 scale ``d``:

* ``Q4_0`` (18 bytes): ``d``, 16 bytes of 4-bit codes; value ``d * (code - 8)``.
* ``Q4_1`` (20 bytes): ``d``, a float16 minimum ``m``, 16 bytes of codes; value ``d * code + m``.
* ``Q5_0`` (22 bytes): ``d``, 4 bytes of fifth bits (bit ``j`` of a little-endian uint32 for value ``j``),
  16 bytes of low nibbles; value ``d * (code - 16)``.
* ``Q5_1`` (24 bytes): ``d``, ``m``, the fifth bits, the nibbles; value ``d * code + m``.
* ``Q8_0`` (34 bytes): ``d``, 32 int8 codes; value ``d * code``.

In the 4- and 5-bit types byte ``i`` holds value ``i``'s low nibble and value ``i + 16``'s in its high nibble.

Super-blocks of 256 values (k-quants), sub-blocks of 32 (``Q4_K``, ``Q5_K``) or 16 (``Q2_K``, ``Q3_K``,
``Q6_K``) values with their own integer scale (and minimum) multiplied by the float16 super-block ``d``
(``dmin``):

* ``Q2_K`` (84): 16 scale bytes (low nibble scale, high nibble minimum), 64 bytes of 2-bit codes, ``d``,
  ``dmin``; value ``d * sc * q - dmin * mn``.
* ``Q3_K`` (110): 32 bytes of high-bit masks, 64 bytes of 2-bit codes, 12 bytes of 6-bit scales, ``d``;
  value ``d * (sc - 32) * q`` with ``q = low - 4 * (1 - high)``.
* ``Q4_K`` (144): ``d``, ``dmin``, 12 bytes of eight 6-bit scales and minimums, 128 bytes of nibbles;
  value ``d * sc * q - dmin * mn``.
* ``Q5_K`` (176): as ``Q4_K`` with 32 bytes of fifth bits before the nibbles.
* ``Q6_K`` (210): 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales, ``d``;
  value ``d * sc * (q - 32)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

_BLOCK = 32
QK_K = 256


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """``[B, 2]`` uint8 -> ``[B, 1]`` float32 (a little-endian float16 per row)."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[B, 16]`` uint8 bytes -> ``[B, 32]`` uint8 codes: the low nibbles, then the high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _float_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[B, 16]`` uint8 bytes -> ``[B, 32]`` float32 codes (the low nibbles, then the high nibbles), written
    straight into the float32 result, which the caller scales in place: no uint8 concatenation and no float32
    temporaries."""
    out = torch.empty(qs.shape[0], 2, 16, dtype=torch.float32)
    out[:, 0].copy_(qs & 0x0F)
    out[:, 1].copy_(qs >> 4)
    return out.view(qs.shape[0], 32)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """``[B, 4]`` uint8 (a little-endian uint32 per row) -> ``[B, 32]`` uint8 bits, bit ``j`` at column ``j``."""
    word = qh.contiguous().view(torch.int32)  # [B, 1]; bit 31 sign-extends, the mask below drops it
    return ((word >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)


def _shifted(raw: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """``raw [B, G, W]`` uint8 -> ``[B, G, len(shifts), W]``: each byte shifted right by each shift, masked."""
    s = torch.tensor(shifts, dtype=torch.uint8).reshape(1, 1, -1, 1)
    return (raw.unsqueeze(2) >> s) & mask


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _float_nibbles(b[:, 2:]).sub_(8).mul_(_f16(b[:, :2]))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _float_nibbles(b[:, 4:]).mul_(_f16(b[:, :2])).add_(_f16(b[:, 2:4]))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(b[:, 6:]) | (_fifth_bits(b[:, 2:6]) << 4)).to(torch.int8) - 16
    return _f16(b[:, :2]) * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]) | (_fifth_bits(b[:, 4:8]) << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float().mul_(_f16(b[:, :2]))


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Q4_K``/``Q5_K``'s 12 scale bytes ``[B, 12]`` -> eight 6-bit scales and eight 6-bit minimums, ``[B, 8]``."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = _shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])
    low = _shifted(scales[:, :8].reshape(n, 1, 8), (0, 4), 0x0F).reshape(n, 16)
    high = _shifted(scales[:, 8:].reshape(n, 1, 4), (0, 2, 4, 6), 0x03).reshape(n, 16)
    sc = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * sc).reshape(n, 16, 1)
    ql = _shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16)
    qh = _shifted(hmask.reshape(n, 1, 32), tuple(range(8)), 1).reshape(n, 16, 16) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _shifted(b[:, 16:].reshape(n, 4, 32), (0, 4), 0x0F).reshape(n, 8, 32).float()
    return ((d * sc.float()).reshape(n, 8, 1) * q - (dmin * mn.float()).reshape(n, 8, 1)).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    ql = _shifted(b[:, 48:].reshape(n, 4, 32), (0, 4), 0x0F).reshape(n, 8, 32)
    qh = _shifted(b[:, 16:48].reshape(n, 1, 32), tuple(range(8)), 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()
    return ((d * sc.float()).reshape(n, 8, 1) * q - (dmin * mn.float()).reshape(n, 8, 1)).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = _shifted(b[:, :128].reshape(n, 2, 64), (0, 4), 0x0F).reshape(n, 8, 32)
    qh = _shifted(b[:, 128:192].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 8, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * sc).reshape(n, 16, 1)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


# name -> (bytes per block, values per block, [blocks, bytes] uint8 -> [blocks, values] float32)
BLOCK_TYPES: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q4_0": (18, 32, _q4_0), "Q4_1": (20, 32, _q4_1), "Q5_0": (22, 32, _q5_0), "Q5_1": (24, 32, _q5_1),
    "Q8_0": (34, 32, _q8_0), "Q2_K": (84, QK_K, _q2_k), "Q3_K": (110, QK_K, _q3_k), "Q4_K": (144, QK_K, _q4_k),
    "Q5_K": (176, QK_K, _q5_k), "Q6_K": (210, QK_K, _q6_k),
}


def dequantize_blocks(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """``raw [rows, bytes_per_row]`` uint8 blocks of GGML type ``type_name`` -> ``[rows, values_per_row]`` float32.

    Raises:
        KeyError: not one of :data:`BLOCK_TYPES`.
    """
    size, per_block, fn = BLOCK_TYPES[type_name]
    rows = raw.shape[0]
    return fn(raw.reshape(-1, size)).reshape(rows, raw.shape[1] // size * per_block)


def dequantize_gguf(data: np.ndarray, tensor_type: object) -> torch.Tensor:
    """The float32 values of one GGUF tensor.

    Args:
        data: the tensor's bytes as ``gguf`` maps them: ``[..., bytes_per_row]`` uint8 for block types, the
            element array for ``F32`` / ``F16`` / ``BF16`` (any leading shape).
        tensor_type: its ``gguf.GGMLQuantizationType``.

    Returns:
        a new contiguous float32 tensor (never a view of the file): ``[..., values_per_row]`` for block types,
        ``data``'s shape otherwise.

    Raises:
        NotImplementedError: ``gguf`` cannot dequantize this type either.
    """
    name = getattr(tensor_type, "name", str(tensor_type))
    if name in ("F32", "F16"):
        return torch.from_numpy(np.array(data, dtype=np.float32, order="C"))
    if name in BLOCK_TYPES and data.dtype == np.uint8:
        lead = data.shape[:-1]
        raw = torch.from_numpy(np.ascontiguousarray(data).reshape(-1, data.shape[-1]).copy())
        return dequantize_blocks(raw, name).reshape(*lead, -1)
    import gguf

    return torch.from_numpy(np.array(gguf.quants.dequantize(data, tensor_type), dtype=np.float32, order="C"))


class BlockGroups(NamedTuple):
    """GGUF rows as group-quantized codes: ``w = (codes - offset) * scales + mins`` (per group of ``group_size``
    consecutive values), the same float32 operations as :func:`dequantize_blocks` (bit-identical values)."""

    codes: torch.Tensor  # [rows, K] uint8, unsigned, at most ``bits`` bits
    scales: torch.Tensor  # [rows, K / group_size] float16 (the file's) or float32 (k-quants: products of the file's)
    mins: torch.Tensor | None  # [rows, K / group_size] like ``scales``, or None
    offset: int
    bits: int
    group_size: int


def _k_groups(b: torch.Tensor, q: torch.Tensor, rows: int, bits: int) -> BlockGroups:
    """``Q4_K``/``Q5_K`` super-blocks ``b [B, bytes]`` with codes ``q [B, 8, 32]``: sub-blocks of 32 with scale
    ``d * sc`` and minimum ``-(dmin * mn)``."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    scales, mins = (d * sc.float()).reshape(rows, -1), (-(dmin * mn.float())).reshape(rows, -1)
    return BlockGroups(q.reshape(rows, -1), scales, mins, 0, bits, 32)


def block_groups(raw: torch.Tensor, type_name: str) -> BlockGroups | None:
    """``raw [rows, bytes_per_row]`` uint8 blocks of ``type_name`` as :class:`BlockGroups`, or ``None`` for a type
    without that form (``Q2_K``, ``Q3_K``: signed sub-block minimums and scales of 16 values in two levels).

    Codes: ``Q4_0`` 4 bits (offset 8), ``Q4_1`` 4 bits with minimums, ``Q5_0`` 5 bits (offset 16), ``Q5_1`` 5 bits
    with minimums, ``Q8_0`` 8 bits (``q + 128``, offset 128), ``Q4_K``/``Q5_K`` 4/5 bits with float32 scales and
    minimums per 32 values, ``Q6_K`` 6 bits (offset 32) with float32 scales per 16 values."""
    if type_name not in BLOCK_TYPES or type_name in ("Q2_K", "Q3_K"):
        return None
    size, per_block, _ = BLOCK_TYPES[type_name]
    rows = raw.shape[0]
    b = raw.reshape(-1, size)
    n = b.shape[0]
    d = _f16(b[:, :2]).half().reshape(rows, -1)
    if type_name == "Q4_0":
        return BlockGroups(_nibbles(b[:, 2:]).reshape(rows, -1), d, None, 8, 4, 32)
    if type_name == "Q4_1":
        return BlockGroups(_nibbles(b[:, 4:]).reshape(rows, -1), d, _f16(b[:, 2:4]).half().reshape(rows, -1), 0, 4, 32)
    if type_name == "Q5_0":
        q = _nibbles(b[:, 6:]) | (_fifth_bits(b[:, 2:6]) << 4)
        return BlockGroups(q.reshape(rows, -1), d, None, 16, 5, 32)
    if type_name == "Q5_1":
        q = _nibbles(b[:, 8:]) | (_fifth_bits(b[:, 4:8]) << 4)
        return BlockGroups(q.reshape(rows, -1), d, _f16(b[:, 2:4]).half().reshape(rows, -1), 0, 5, 32)
    if type_name == "Q8_0":
        q = (b[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return BlockGroups(q.reshape(rows, -1), d, None, 128, 8, 32)
    if type_name == "Q4_K":
        return _k_groups(b, _shifted(b[:, 16:].reshape(n, 4, 32), (0, 4), 0x0F), rows, 4)
    if type_name == "Q5_K":
        ql = _shifted(b[:, 48:].reshape(n, 4, 32), (0, 4), 0x0F).reshape(n, 8, 32)
        qh = _shifted(b[:, 16:48].reshape(n, 1, 32), tuple(range(8)), 1).reshape(n, 8, 32)
        return _k_groups(b, ql | (qh << 4), rows, 5)
    ql = _shifted(b[:, :128].reshape(n, 2, 64), (0, 4), 0x0F).reshape(n, 8, 32)  # Q6_K
    qh = _shifted(b[:, 128:192].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 8, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    scales = (_f16(b[:, 208:210]) * sc).reshape(rows, -1)
    return BlockGroups((ql | (qh << 4)).reshape(rows, -1), scales, None, 32, 6, 16)
