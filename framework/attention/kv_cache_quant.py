"""Quantized KV caches (``--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2``): how a row is stored and read back.

Every backend stores the cache as rows of one KV head and one token (``head_size`` elements in the float layouts);
a quantized cache changes only what a row holds, never the paged addressing (:mod:`tokenmill.attention.paged_cache`):

* ``int8``: a row is ``head_size`` int8 codes, padded to a multiple of 4, followed by the row's scale as a float32
  in its last 4 bytes (:func:`kv_cache_row_size`). The scale is the row's absolute maximum over 127 (per token
  and KV head, symmetric), a code is ``round_half_even(x / scale)`` in ``[-127, 127]``, and a row reads back as
  ``code * scale``, so ``|x - code * scale| <= scale / 2``. A row's codes and scale depend on that row's values
  only: the same tokens give the same block contents, so prefix-cached blocks are reused as they are, and a block
  copied anywhere carries its scales with it.
* ``fp8_e4m3`` (``float8_e4m3fn``, torch's and the OCP FP8 ``E4M3``) and ``fp8_e5m2``: a row is ``head_size`` fp8
  values with scale 1.0, as vLLM stores an fp8 cache whose checkpoint has no calibrated ``k_scale``/``v_scale``
  (its default ``calculate_kv_scales=False``): values are rounded to nearest-even and saturate at the format's
  largest finite value (448, 57344) instead of becoming NaN or infinity. Relative error at most ``2**-4``
  (e4m3) or ``2**-3`` (e5m2) of a normal value; below the smallest normal (``2**-6``, ``2**-14``) the absolute
  error is at most half the subnormal step (``2**-10``, ``2**-17``).

The torch functions here are the reference the backends' kernels follow (the CPU plugin's C++ kernels and the
Triton kernels write the same codes and scales).
"""

from __future__ import annotations

import torch

from tokenmill.config import QUANTIZED_KV_CACHE_DTYPES, canonical_kv_cache_dtype

SCALE_BYTES = 4  # one float32 scale per int8 row
INT8_MAX = 127
FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def is_quantized_kv_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a quantized KV-cache element type (``int8``, ``float8_e4m3fn``, ``float8_e5m2``)."""
    return dtype in QUANTIZED_DTYPES


def check_kv_cache_dtype(attn_backend: type, cache_dtype: str) -> None:
    """Refuse a quantized ``--kv-cache-dtype`` (``"int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``, or the alias ``"fp8"``)
    that ``attn_backend`` does not list in ``supported_quantized_kv_cache_dtypes``; other names pass.

    Raises:
        ValueError: the backend cannot read or write such a cache (the message starts with ``kv_cache_dtype``).
    """
    if cache_dtype not in QUANTIZED_KV_CACHE_DTYPES:
        return
    name = canonical_kv_cache_dtype(cache_dtype)
    supported = tuple(getattr(attn_backend, "supported_quantized_kv_cache_dtypes", ()))
    if name not in supported:
        backend = getattr(attn_backend, "name", "") or attn_backend.__name__
        raise ValueError(f"kv_cache_dtype: the {backend} attention backend does not support a {cache_dtype!r} KV "
                         f"cache (it supports {', '.join(supported) or 'no quantized KV cache'}); choose another "
                         "--kv-cache-dtype or --attention-backend")


def kv_cache_row_size(head_size: int, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` one cache row (one token of one KV head) takes: ``head_size``, or for ``int8``
    ``head_size`` rounded up to a multiple of 4 plus the 4 bytes of the float32 scale (so the scale is aligned)."""
    if dtype == torch.int8:
        return -(-head_size // SCALE_BYTES) * SCALE_BYTES + SCALE_BYTES
    return head_size


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales of int8 cache rows ``[..., row]`` (a view of their last 4 bytes): ``[...]``."""
    return rows[..., -SCALE_BYTES:].view(torch.float32).squeeze(-1)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows of ``x`` in ``dtype``.

    Args:
        x: ``[..., D]`` keys or values, any float dtype.
        dtype: the cache's element type (a float type: a plain cast; ``int8``, ``float8_e4m3fn``, ``float8_e5m2``:
            quantized as the module docstring says).

    Returns:
        ``[..., kv_cache_row_size(D, dtype)]`` in ``dtype``.
    """
    if dtype == torch.int8:
        xf = x.float()
        scale = xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: codes 0, scale 1
        codes = torch.round(xf / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        row = kv_cache_row_size(x.shape[-1], dtype)
        pad = row - SCALE_BYTES - x.shape[-1]
        parts = [codes]
        if pad:
            parts.append(codes.new_zeros(*codes.shape[:-1], pad))
        parts.append(scale.view(torch.int8))  # [..., 1] float32 -> [..., 4] bytes
        return torch.cat(parts, dim=-1)
    if dtype in FP8_MAX:
        limit = FP8_MAX[dtype]
        return x.float().clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def dequantize_kv(rows: torch.Tensor, head_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values ``[..., head_size]`` in ``dtype`` from cache rows ``[..., row]`` (any cache dtype: a float
    cache is only cast)."""
    if rows.dtype == torch.int8:
        return (rows[..., :head_size].to(torch.float32) * row_scales(rows).unsqueeze(-1)).to(dtype)
    return rows.to(dtype)


# fp8 rounding bound: half a step of the 3 (e4m3) or 2 (e5m2) mantissa bits relative to a normal value, half the
# subnormal step below the smallest normal.
_FP8_ERROR = {torch.float8_e4m3fn: (2.0**-4, 2.0**-10), torch.float8_e5m2: (2.0**-3, 2.0**-17)}


def read_back_error_bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest ``|x - dequantize_kv(quantize_kv(x))|`` each element of ``x`` ``[..., D]`` may have in a ``dtype``
    cache, float64 of ``x``'s shape: ``scale / 2`` of its row for int8 (plus float32's rounding of ``code *
    scale``), the fp8 rounding bound (module docstring; values within the format's range).

    Raises:
        ValueError: ``dtype`` is not a quantized KV-cache dtype.
    """
    xd = x.double()
    if dtype == torch.int8:
        scale = xd.abs().amax(dim=-1, keepdim=True) / INT8_MAX
        return (scale / 2).expand_as(xd) + xd.abs() * 2.0**-23
    if dtype not in _FP8_ERROR:
        raise ValueError(f"{dtype} is not a quantized KV-cache dtype")
    rel, absolute = _FP8_ERROR[dtype]
    return torch.maximum(xd.abs() * rel, torch.full_like(xd, absolute))


def attention_error_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype,
                          scale: float) -> torch.Tensor:
    """Bound on how far attention of queries ``q`` ``[L, Hq, D]`` over keys / values ``[S, Hkv, D]`` read back
    from a ``dtype`` cache can be from attention over the exact values, float64 ``[L, Hq, D]``, for any causal
    mask, sliding window or logit soft cap (``c * tanh(s / c)`` moves no score more than ``s`` moved).

    A key error ``|e| <= eps_k`` moves a score by at most ``delta = scale * sum_d |q_d| * max eps_k``; each
    probability then changes by a factor within ``exp(+-2 delta)``, so the probabilities move by at most
    ``exp(2 delta) - 1`` in total, which moves the output by at most that times the largest ``|v|``; value errors
    add at most their own largest bound. Arithmetic rounding is not included.
    """
    group = q.shape[1] // k.shape[1]
    eps_k = read_back_error_bound(k, dtype).amax(dim=(0, 2)).repeat_interleave(group)  # [Hq]
    eps_v = read_back_error_bound(v, dtype).amax(dim=0).repeat_interleave(group, dim=0)  # [Hq, D]
    v_max = v.double().abs().amax(dim=0).repeat_interleave(group, dim=0)  # [Hq, D]
    delta = scale * q.double().abs().sum(-1) * eps_k  # [L, Hq]
    return torch.expm1(2 * delta)[..., None] * v_max + eps_v
