"""Triton kernels for paged attention: the KV-cache write and attention over a flattened, unpadded batch.

Portable Triton only (no vendor intrinsics), so the same code runs on NVIDIA and AMD GPUs and, with
``TRITON_INTERPRET=1``, on CPU tensors (slowly; that is how the tests run it).

KV cache layout (one layer), the same as the torch backend's::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]   kv_cache[0] = keys, kv_cache[1] = values

Token ``p`` of a request lives in block ``block_table[req, p // block_size]`` at offset ``p % block_size``
(PagedAttention, Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023).

Attention kernel: one program per (query tile, KV head). A query tile is ``BLOCK_Q`` consecutive query tokens
of one request times the ``GROUP`` query heads that share the KV head (grouped-query attention), flattened
into ``BLOCK_M = BLOCK_Q * GROUP_P2`` rows so that one K/V tile loaded from the cache serves every head of
the group. Keys are visited ``BLOCK_N`` positions at a time with the online softmax of FlashAttention-2
(Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", Algorithm 1):
running row max ``m``, running denominator ``l``, rescaled accumulator, one division at the end. Scores use
base 2 (``exp2`` with the scale pre-multiplied by ``log2(e)``).

Prefill chunks, chunks on top of a cached prefix and decodes mix freely: query ``i`` of a request with
``q_len`` new tokens and ``seq_len`` tokens in total sits at position ``seq_len - q_len + i`` and sees keys
``0 .. seq_len - q_len + i`` (causal; with a sliding window ``W`` only the last ``W`` of those, and the
key loop starts at the window of the tile's first query). Tiles never straddle requests. The program → (request, tile) map is
found on the device by a binary search over ``query_start_loc`` (no host sync, no extra metadata):
request ``r`` owns the program ids ``[qsl[r] // BLOCK_Q + r, qsl[r + 1] // BLOCK_Q + r + 1)``, which is at
least ``ceil(q_len_r / BLOCK_Q)`` ids; the spare ones exit at once. The grid is therefore
``T // BLOCK_Q + B`` programs along axis 0 for ``T`` tokens and ``B`` requests.

Encoder-only (bidirectional) attention runs the same kernel without the causal mask over the step's own keys and
values, read as a cache of one-token blocks (:func:`encoder_attention`).

Quantized caches (``--kv-cache-dtype``, rows as :mod:`tokenmill.attention.kv_cache_quant` defines them): the write
kernel quantizes (int8: per-row absmax scale stored in the row's last 4 bytes, codes rounded half to even; fp8:
clamped to the format's largest finite value, then cast), the attention kernel widens each loaded K/V tile to
float32 and, for int8, multiplies it by its rows' scales (read through a float32 view of the cache).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenmill.attention.kv_cache_quant import FP8_MAX, SCALE_BYTES, kv_cache_row_size

_LOG2E = 1.4426950408889634
_QUANT_NONE, _QUANT_INT8, _QUANT_FP8 = 0, 1, 2
# _round_to_fp8's constants per format: mantissa bits dropped from float32's 23, 1.5 * 2**23 subnormal steps (2**-9,
# 2**-16), smallest normal.
_FP8_ROUNDING = {
    torch.float8_e4m3fn: dict(MANT_DROP=20, SUB_MAGIC=1.5 * 2.0**14, MIN_NORMAL=2.0**-6),
    torch.float8_e5m2: dict(MANT_DROP=21, SUB_MAGIC=1.5 * 2.0**7, MIN_NORMAL=2.0**-14),
}


@triton.jit
def _round_to_fp8(x, FP8_MAX: tl.constexpr, MANT_DROP: tl.constexpr, SUB_MAGIC: tl.constexpr,
                  MIN_NORMAL: tl.constexpr):
    """float32 ``x`` clamped to ``+-FP8_MAX`` and rounded to the nearest fp8 value, half to even, still as float32
    (so the cast to fp8 that follows is exact): a normal value keeps ``23 - MANT_DROP`` mantissa bits (rounded on
    its bits, the carry going into the exponent); below ``MIN_NORMAL`` it is rounded to the subnormal step by adding
    and subtracting ``SUB_MAGIC`` (1.5 times 2**23 steps). Done here rather than by the cast because the Triton
    interpreter's float32-to-fp8 cast loses the carry when the mantissa rounds up (0.4949 became 0.25; triton 3.9)."""
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    bits = x.to(tl.int32, bitcast=True)
    half = (1 << (MANT_DROP - 1)) - 1
    bits = (bits + half + ((bits >> MANT_DROP) & 1)) & ~((1 << MANT_DROP) - 1)
    normal = bits.to(tl.float32, bitcast=True)
    sub = (tl.abs(x) + SUB_MAGIC) - SUB_MAGIC  # on the magnitude: a tiny negative value rounds to -0.0, as torch's
    return tl.where(tl.abs(x) < MIN_NORMAL, tl.where(x < 0, -sub, sub), normal)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_blk,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_tok,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    SCALE_COL: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANT_DROP: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
):
    """One program per new token: copy its ``[Hkv, D]`` key and value into cache slot ``slot_mapping[t]``,
    quantized with ``QUANT`` (int8: scales to ``k_scale_ptr`` / ``v_scale_ptr``, float32 views of the caches, at
    float ``SCALE_COL`` of each row; fp8: clamped to ``FP8_MAX``).

    A negative slot means "no slot" (padding) and is skipped.
    """
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // KV_BLOCK_SIZE
    off = slot % KV_BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE)
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
    k_row = blk * stride_kc_blk + off * stride_kc_tok + offs_h * stride_kc_head  # [BLOCK_H] row starts
    v_row = blk * stride_vc_blk + off * stride_vc_tok + offs_h * stride_vc_head
    if QUANT == 1:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        k_scale = tl.max(tl.where(mask, tl.abs(k), 0.0), axis=1) / 127.0
        v_scale = tl.max(tl.where(mask, tl.abs(v), 0.0), axis=1) / 127.0
        k_scale = tl.where(k_scale > 0.0, k_scale, 1.0)
        v_scale = tl.where(v_scale > 0.0, v_scale, 1.0)
        # x / scale correctly rounded (div_rn: the plain "/" may compile to an approximate division on GPUs), then
        # adding and subtracting 1.5 * 2**23 rounds a float32 of magnitude below 2**22 to an integer, half to even
        # (|x / scale| <= 127 here), in portable Triton (no libdevice rint): the codes torch.round gives.
        k = tl.minimum(tl.maximum((tl.math.div_rn(k, k_scale[:, None]) + 12582912.0) - 12582912.0, -127.0), 127.0)
        v = tl.minimum(tl.maximum((tl.math.div_rn(v, v_scale[:, None]) + 12582912.0) - 12582912.0, -127.0), 127.0)
        h_valid = offs_h < NUM_KV_HEADS
        tl.store(k_scale_ptr + k_row // 4 + SCALE_COL, k_scale, mask=h_valid)
        tl.store(v_scale_ptr + v_row // 4 + SCALE_COL, v_scale, mask=h_valid)
    elif QUANT == 2:
        k = _round_to_fp8(k.to(tl.float32), FP8_MAX, MANT_DROP, SUB_MAGIC, MIN_NORMAL)
        v = _round_to_fp8(v.to(tl.float32), FP8_MAX, MANT_DROP, SUB_MAGIC, MIN_NORMAL)
    tl.store(k_cache_ptr + k_row[:, None] + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + v_row[:, None] + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new keys/values into their cache slots.

    Args:
        key, value: ``[T, Hkv, D]`` (any float dtype; converted to the cache's, or quantized for an int8 / fp8
            cache as :func:`tokenmill.attention.kv_cache_quant.quantize_kv` does). The last dim must be contiguous.
        kv_cache: ``[2, num_blocks, block_size, Hkv, R]`` (``R = kv_cache_row_size(D, dtype)``); contiguous for
            an int8 cache, else its last dim must be contiguous.
        slot_mapping: ``[T]`` int64 (or int32), ``block_id * block_size + offset``; negative = skip.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    _check_last_dim_contiguous(key=key, value=value, kv_cache=kv_cache)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    quant, k_scales, v_scales, scale_col = _quant_args(kv_cache, head_size)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_size),
        KV_BLOCK_SIZE=k_cache.shape[1],
        QUANT=quant,
        SCALE_COL=scale_col,
        FP8_MAX=FP8_MAX.get(kv_cache.dtype, 0.0),
        **_FP8_ROUNDING.get(kv_cache.dtype, _FP8_ROUNDING[torch.float8_e4m3fn]),
    )


def _quant_args(kv_cache: torch.Tensor, head_size: int) -> tuple[int, torch.Tensor, torch.Tensor, int]:
    """``(QUANT, key scales, value scales, SCALE_COL)`` of a cache: for int8 the float32 views of the key and value
    caches and the float column of each row's scale; for the others the caches themselves (never read)."""
    if kv_cache.dtype == torch.int8:
        row = kv_cache.shape[-1]
        if row != kv_cache_row_size(head_size, torch.int8) or not kv_cache.is_contiguous():
            raise ValueError(f"kv_cache: an int8 cache must be contiguous with rows of "
                             f"{kv_cache_row_size(head_size, torch.int8)} elements for head size {head_size}, got "
                             f"shape {tuple(kv_cache.shape)}")
        scales = kv_cache.view(torch.float32)
        return _QUANT_INT8, scales[0], scales[1], row // SCALE_BYTES - 1
    if kv_cache.dtype in FP8_MAX:
        return _QUANT_FP8, kv_cache[0], kv_cache[1], 0
    return _QUANT_NONE, kv_cache[0], kv_cache[1], 0


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    soft_cap,
    num_reqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_kc_blk,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_tok,
    stride_vc_head,
    stride_bt,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    QUANT: tl.constexpr,
    SCALE_COL: tl.constexpr,
):
    """Attention of one (query tile, KV head), causal unless ``CAUSAL`` is false (then every query sees all
    ``seq_len`` keys of its request); see the module docstring for the mapping. ``QUANT``: the cache's rows are
    int8 codes (1; scales through ``k_scale_ptr`` / ``v_scale_ptr``, float32 views of the caches, at float
    ``SCALE_COL`` of each row) or fp8 (2), widened to float32 as they are loaded."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    # Request of this program: the largest r with qsl[r] // BLOCK_Q + r <= pid. (``pid * 0`` makes the
    # bounds int32 tensors: loop-carried values may not start as constexprs, and num_reqs == 1 is one.)
    lo = pid * 0
    hi = pid * 0 + (num_reqs - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    req = lo
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + req)
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # tokens already cached before this step's chunk

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = tile * BLOCK_Q + offs_m // GROUP_P2  # query index inside the request
    head_in_group = offs_m % GROUP_P2
    row_valid = (q_idx < q_len) & (head_in_group < GROUP)
    q_head = kvh * GROUP + head_in_group
    tok = (q_start + q_idx).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_SIZE

    q_ptrs = q_ptr + tok[:, None] * stride_q_tok + q_head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_FP32:  # float32 inputs (exact IEEE products, no TF32), or bfloat16 under the interpreter
        q = q.to(tl.float32)
    q_pos = ctx_len + q_idx  # [BLOCK_M] absolute position of each row's query

    # Keys needed by this tile: 0 .. position of its last valid query (all of the request's, bidirectional).
    if CAUSAL:
        last_q = tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
        kv_end = ctx_len + last_q + 1
    else:
        kv_end = seq_len
    # With a sliding window the tile's first query sees keys from ctx_len + tile * BLOCK_Q - W + 1 on:
    # the loop starts at that key's BLOCK_N tile and loads are masked below it (never read).
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(ctx_len + tile * BLOCK_Q - SLIDING_WINDOW + 1, 0)
    else:
        kv_start = ctx_len * 0
    loop_start = (kv_start // BLOCK_N) * BLOCK_N

    # Finite "minus infinity" for the running max so fully masked rows never compute (-inf) - (-inf).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    kc_head = k_cache_ptr + kvh * stride_kc_head
    vc_head = v_cache_ptr + kvh * stride_vc_head

    for start_n in range(loop_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = (offs_n < kv_end) & (offs_n >= kv_start)
        blk = tl.load(bt_row + offs_n // KV_BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        in_blk = offs_n % KV_BLOCK_SIZE
        k_off = blk * stride_kc_blk + in_blk * stride_kc_tok  # [BLOCK_N]
        v_off = blk * stride_vc_blk + in_blk * stride_vc_tok
        # K^T tile [BLOCK_D, BLOCK_N] and V tile [BLOCK_N, BLOCK_D], gathered through the block table.
        k = tl.load(kc_head + k_off[None, :] + offs_d[:, None], mask=d_valid[:, None] & n_valid[None, :], other=0.0)
        v = tl.load(vc_head + v_off[:, None] + offs_d[None, :], mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        if QUANT == 1:
            k_scale = tl.load(k_scale_ptr + (kvh * stride_kc_head + k_off) // 4 + SCALE_COL, mask=n_valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + (kvh * stride_vc_head + v_off) // 4 + SCALE_COL, mask=n_valid, other=0.0)
            k = k.to(tl.float32) * k_scale[None, :]
            v = v.to(tl.float32) * v_scale[:, None]
        elif QUANT == 2:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if DOT_FP32:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if SOFT_CAP:  # c * tanh(s / c) on the natural-log scores, then back to base 2
            x = s * (scale_log2 / 1.4426950408889634) / soft_cap
            s = soft_cap * (2.0 * tl.sigmoid(2.0 * x) - 1.0) * 1.4426950408889634
        else:
            s = s * scale_log2
        if CAUSAL:
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        else:
            visible = (q_pos[:, None] >= 0) & n_valid[None, :]  # [BLOCK_M, BLOCK_N], as in the causal case
        if SLIDING_WINDOW > 0:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_o_tok + q_head[:, None] * stride_o_head + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened batch over the paged KV cache (the new tokens must be cached already).

    Args:
        query: ``[T, Hq, D]`` float16/bfloat16/float32, last dim contiguous.
        kv_cache: ``[2, num_blocks, block_size, Hkv, R]``, last dim contiguous; ``Hq % Hkv == 0``; float, or
            int8 (contiguous, ``R = kv_cache_row_size(D, int8)``) / float8_e4m3fn / float8_e5m2 (``R = D``).
        block_table: ``[B, max_blocks]`` int32, KV block ids of each request.
        query_start_loc: ``[B + 1]`` int32, first token of each request in ``query`` (last entry = T).
        seq_lens: ``[B]`` int32, cached + new tokens of each request.
        scale: softmax scale.
        max_query_len: longest query of the batch (picks the tile shape; decode-only batches get small tiles).
        out: optional ``[T, Hq, D]`` output buffer (last dim contiguous).
        block_n: keys per inner-loop step (power of two, >= 16); default chosen from ``D``.
        sliding_window: query at ``p`` sees keys ``p - W < j <= p`` only; cache blocks wholly before the
            window of every query of a tile are not read.
        soft_cap: scaled scores become ``c * tanh(s / c)`` (Gemma 2).

    Returns:
        ``[T, Hq, D]`` in ``query``'s dtype (``out`` when given).
    """
    num_kv_heads = kv_cache.shape[3]
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of KV heads ({num_kv_heads})")
    if out is None:
        out = torch.empty_like(query)
    _check_last_dim_contiguous(query=query, kv_cache=kv_cache, out=out)
    return _launch(query, kv_cache[0], kv_cache[1], block_table, query_start_loc, seq_lens, scale, max_query_len,
                   out, block_n, sliding_window, soft_cap, causal=True,
                   quant=_quant_args(kv_cache, query.shape[-1]))


def encoder_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bidirectional (encoder-only) attention of a flattened batch of whole sequences, no KV cache: each query
    sees every key of its own sequence.

    The attention kernel reads ``key`` / ``value`` as a cache of one-token blocks whose block table lists each
    sequence's rows, so the same code (online softmax, grouped heads) serves both.

    Args:
        query: ``[T, Hq, D]``; key, value: ``[T, Hkv, D]``; float16/bfloat16/float32, last dims contiguous.
        query_start_loc: ``[B + 1]`` int32, first row of each sequence (last entry = T).
        seq_lens: ``[B]`` int32, each sequence's length (``query_start_loc`` differences).
        scale: softmax scale.
        max_seq_len: longest sequence (the block table's width).
        out: optional ``[T, Hq, D]`` output buffer.

    Returns:
        ``[T, Hq, D]`` in ``query``'s dtype (``out`` when given).

    Raises:
        ValueError: ``Hq`` is not a multiple of ``Hkv``.
    """
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of KV heads ({key.shape[1]})")
    if out is None:
        out = torch.empty_like(query)
    _check_last_dim_contiguous(query=query, key=key, value=value, out=out)
    rows = torch.arange(max(max_seq_len, 1), dtype=torch.int32, device=query.device)
    block_table = (query_start_loc[:-1, None] + rows[None, :]).to(torch.int32)
    return _launch(query, key.unsqueeze(1), value.unsqueeze(1), block_table, query_start_loc, seq_lens, scale,
                   max_seq_len, out, None, None, None, causal=False)


def _launch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int,
            out: torch.Tensor, block_n: int | None, sliding_window: int | None, soft_cap: float | None,
            causal: bool, quant: tuple[int, torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """Launch the attention kernel over ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, Hkv, R]``
    (``quant``: :func:`_quant_args` of a quantized cache)."""
    quant_kind, k_scales, v_scales, scale_col = quant or (_QUANT_NONE, k_cache, v_cache, 0)
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_size))
    # Rows per tile: >= 16 (the smallest tl.dot M), 64 when prefill tokens are present.
    block_m = max(16 if max_query_len <= 1 else 64, group_p2)
    block_q = block_m // group_p2
    if block_n is None:
        block_n = 64 if block_d <= 64 else 32
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        block_table,
        query_start_loc,
        seq_lens,
        float(scale) * _LOG2E,
        float(soft_cap or 0.0),
        num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        # The cache strides go in as scalars, as in the reshape_and_cache launch above: each kernel takes its own
        # argument list.
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        HEAD_SIZE=head_size,
        BLOCK_D=block_d,
        GROUP=group,
        GROUP_P2=group_p2,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        KV_BLOCK_SIZE=k_cache.shape[1],
        DOT_FP32=query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and _interpreting()),
        SLIDING_WINDOW=int(sliding_window or 0),
        SOFT_CAP=bool(soft_cap),
        CAUSAL=causal,
        QUANT=quant_kind,
        SCALE_COL=scale_col,
        num_warps=4,
    )
    return out


def _interpreting() -> bool:
    """Whether kernels run under the Triton interpreter (``TRITON_INTERPRET=1``). Its ``tl.dot`` gives wrong
    results for bfloat16 operands (triton 3.9, seen here), so bfloat16 products are done in float32 there."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {t.stride()}")


__all__ = ["paged_attention", "reshape_and_cache"]
