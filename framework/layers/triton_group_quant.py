"""Triton kernel for ``y = x @ dequant(W)^T`` with ``W`` group-quantized (the CUDA and ROCm platforms'
``--quantization`` and pre-quantized checkpoint path, :mod:`tokenmill.layers.triton_quant_linear`).

Layout of ``W [N, K]`` (row-major, one output row per row):

* ``packed``: ``[N, ceil(K * BITS / 8)]`` uint8; ``8 / BITS`` codes of consecutive input channels per byte,
  lowest bits first (``BITS`` 4 or 8), unsigned codes in ``0 .. 2**BITS - 1``;
* ``scales``: ``[N, ceil(K / GROUP_SIZE)]`` float16, bfloat16 or float32, one per group of ``GROUP_SIZE``
  consecutive input channels;
* ``zeros`` (optional): ``[N, G]`` uint8 or int16 integer zero points; without them every group's zero point is
  the constant ``ZERO_OFFSET``;
* ``mins`` (optional): ``[N, G]`` float, added after scaling.

The value multiplied is ``w[n, k] = (code - zero) * scale + min`` in float32 (exact for the integer formats:
``code - zero`` has at most 9 bits, a float16 or bfloat16 scale at most 11, a float32 scale of a GGUF k-quant
17). Each program computes a ``BLOCK_M x BLOCK_N`` tile of ``y``: for each ``BLOCK_K`` slice of the input
channels it loads the codes of a ``BLOCK_K x BLOCK_N`` tile of ``W^T``, dequantizes them in registers (scales,
zero points and minimums gathered per element, so any group size works, including groups longer than the tile)
and accumulates ``tl.dot`` in float32. float32 activations are multiplied in IEEE float32 (no TF32); bfloat16 and
float16 ones with the tile rounded to their dtype (under the interpreter in float32: its bfloat16 ``tl.dot`` is
wrong, triton 3.9).

Triton is imported here: import this module only where a kernel runs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _group_quant_matmul_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    zeros_ptr,
    mins_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_om,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_MINS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    PER_BYTE: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :],
                    other=0.0)
        w_valid = k_valid[:, None] & n_valid[None, :]  # [BLOCK_K, BLOCK_N]: the tile of W^T
        byte = tl.load(packed_ptr + cols[None, :] * stride_pn + (offs_k // PER_BYTE)[:, None], mask=w_valid, other=0)
        code = (byte.to(tl.int32) >> ((offs_k % PER_BYTE) * BITS)[:, None]) & MASK
        group_offs = cols[None, :] * stride_sn + (offs_k // GROUP_SIZE)[:, None]
        scale = tl.load(scales_ptr + group_offs, mask=w_valid, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + group_offs, mask=w_valid, other=0).to(tl.int32)
            w = (code - zero).to(tl.float32) * scale
        else:
            w = (code - ZERO_OFFSET).to(tl.float32) * scale
        if HAS_MINS:
            w = w + tl.load(mins_ptr + group_offs, mask=w_valid, other=0.0).to(tl.float32)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


def tile_sizes(m: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` for ``m`` activation rows: the fewest rows ``tl.dot`` takes (16) for decode
    steps, up to 64 for prefill."""
    return (16 if m <= 16 else 32 if m <= 32 else 64), 64, 64


def group_quant_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       mins: torch.Tensor | None, *, in_features: int, bits: int, group_size: int,
                       zero_offset: int) -> torch.Tensor:
    """``x [M, K] @ dequant(W)^T`` -> ``[M, N]`` in ``x``'s dtype (module docstring for the layout of ``W``).

    Args:
        x: ``[M, K]`` float32, bfloat16 or float16, contiguous along ``K``.
        packed, scales, zeros, mins: ``W``'s tensors, contiguous along their last dimension.
        in_features: ``K``.
        bits: 4 or 8.
        group_size: input channels per scale.
        zero_offset: the zero point of every group when ``zeros`` is ``None``.

    Raises:
        ValueError: ``bits`` is not 4 or 8, or ``x`` has not ``K`` columns.
    """
    if bits not in (4, 8):
        raise ValueError(f"group-quantized matmul: {bits}-bit codes are not supported (4 or 8)")
    m, k = x.shape
    if k != in_features:
        raise ValueError(f"group-quantized matmul: input has {k} features, the weight {in_features}")
    n = packed.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k = tile_sizes(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _group_quant_matmul_kernel[grid](
        x, packed, scales, scales if zeros is None else zeros, scales if mins is None else mins, out,
        m, n, k, x.stride(0), packed.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, GROUP_SIZE=group_size, ZERO_OFFSET=zero_offset, HAS_ZEROS=zeros is not None,
        HAS_MINS=mins is not None, DOT_FP32=x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and _interpreting()),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
