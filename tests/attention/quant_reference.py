"""Helpers of the quantized-KV-cache tests: quantized copies of a paged batch's cache and the error bound of
attention over a quantized cache against the float64 reference."""

from __future__ import annotations

import copy
import math

import torch

from tests.attention.paged_reference import PagedBatch, reference_attention
from tokenmill.attention.kv_cache_quant import INT8_MAX, dequantize_kv, quantize_kv

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
QUANT_IDS = ["int8", "fp8_e4m3", "fp8_e5m2"]
# fp8 rounding: half a step of the 3 (e4m3) or 2 (e5m2) mantissa bits relative to a normal value, half the
# subnormal step below the smallest normal.
FP8_BOUND = {torch.float8_e4m3fn: (2.0**-4, 2.0**-10), torch.float8_e5m2: (2.0**-3, 2.0**-17)}


def element_error_bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest ``|x - dequantize(quantize(x))|`` each element of ``x`` ``[..., D]`` may have in a ``dtype`` cache
    (float64, ``x``'s shape): ``scale / 2`` of its row for int8 (``scale = absmax / 127``), the fp8 rounding bound
    otherwise; plus float32's rounding of the read-back product."""
    xd = x.double()
    if dtype == torch.int8:
        scale = xd.abs().amax(dim=-1, keepdim=True) / INT8_MAX
        return (scale / 2).expand_as(xd) + xd.abs() * 2.0**-23
    rel, absolute = FP8_BOUND[dtype]
    return torch.maximum(xd.abs() * rel, torch.full_like(xd, absolute))


def head_major_quantized(batch: PagedBatch, dtype: torch.dtype) -> torch.Tensor:
    """make_batch's float cache ``[2, blocks, block_size, Hkv, D]`` quantized into the torch backend's layout
    ``[2, Hkv, blocks, block_size, R]``."""
    return quantize_kv(batch.kv_cache.permute(0, 3, 1, 2, 4), dtype).contiguous()


def slot_rows(batch: PagedBatch, dtype: torch.dtype) -> torch.Tensor:
    """make_batch's float cache quantized in its own layout ``[2, blocks, block_size, Hkv, R]`` (the Triton one)."""
    return quantize_kv(batch.kv_cache, dtype).contiguous()


def read_back(batch: PagedBatch, dtype: torch.dtype, keep_fresh: bool) -> PagedBatch:
    """A copy of ``batch`` whose keys and values are what a ``dtype`` cache gives back, except (``keep_fresh``)
    those of prompts of more than one token with nothing cached before this step (the torch backend attends to
    such a prompt's own keys and values, not the cache's; a one-token query is a decode, read from the cache)."""
    out = copy.copy(batch)
    qsl, sl = batch.md.query_start_loc_cpu, batch.md.seq_lens_cpu
    ks, vs = [], []
    for r, (k, v) in enumerate(zip(batch.k_full, batch.v_full)):
        fresh = qsl[r + 1] - qsl[r] == sl[r] > 1
        if keep_fresh and fresh:
            ks.append(k)
            vs.append(v)
        else:
            d = k.shape[-1]
            ks.append(dequantize_kv(quantize_kv(k, dtype), d, torch.float64))
            vs.append(dequantize_kv(quantize_kv(v, dtype), d, torch.float64))
    out.k_full, out.v_full = ks, vs
    return out


def attention_error_bound(batch: PagedBatch, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``[T, Hq, D]`` bound on ``|attention over the dtype cache - float64 reference|``.

    A key error ``|e| <= eps_k`` moves a score by at most ``delta = scale * sum_d |q_d| * max eps_k``; each
    probability then changes by a factor within ``exp(+-2 delta)``, so the probabilities move by at most
    ``exp(2 delta) - 1`` in total, which moves the output by at most that times the largest ``|v|``; value errors
    add at most their own largest bound. Plus 1e-4 for float32 arithmetic.
    """
    qsl = batch.md.query_start_loc_cpu
    num_heads = batch.q.shape[1]
    bound = torch.empty(batch.q.shape, dtype=torch.float64)
    for r, (k, v) in enumerate(zip(batch.k_full, batch.v_full)):
        group = num_heads // k.shape[1]
        eps_k = element_error_bound(k, dtype).amax(dim=(0, 2)).repeat_interleave(group)  # [Hq]
        eps_v = element_error_bound(v, dtype).amax(dim=0).repeat_interleave(group, dim=0)  # [Hq, D]
        v_max = v.double().abs().amax(dim=0).repeat_interleave(group, dim=0)  # [Hq, D]
        q = batch.q[qsl[r]:qsl[r + 1]].double()  # [L, Hq, D]
        delta = scale * q.abs().sum(-1) * eps_k  # [L, Hq]
        bound[qsl[r]:qsl[r + 1]] = torch.expm1(2 * delta)[..., None] * v_max + eps_v + 1e-4
    return bound


def assert_within_quantization_bound(out: torch.Tensor, batch: PagedBatch, dtype: torch.dtype, scale: float) -> None:
    """``out`` ``[T, Hq, D]`` is the float64 reference of ``batch`` within :func:`attention_error_bound`."""
    err = (out.double() - reference_attention(batch, scale)).abs()
    bound = attention_error_bound(batch, dtype, scale)
    assert bool((err <= bound).all()), f"largest error {err.max():.3g}, worst error/bound {(err / bound).max():.3g}"
    assert math.isfinite(float(err.max()))

