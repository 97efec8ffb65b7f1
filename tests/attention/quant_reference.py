"""Helpers of the quantized-KV-cache tests: quantized copies of a paged batch's cache and the error bound of
attention over a quantized cache against the float64 reference."""

from __future__ import annotations

import copy
import math

import torch

from tests.attention.paged_reference import PagedBatch, reference_attention
from tokenmill.attention.kv_cache_quant import attention_error_bound, dequantize_kv, quantize_kv

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
QUANT_IDS = ["int8", "fp8_e4m3", "fp8_e5m2"]


def head_major_quantized(batch: PagedBatch, dtype: torch.dtype) -> torch.Tensor:
    """make_batch's float cache ``[2, blocks, block_size, Hkv, D]`` quantized into the torch backend's layout
    ``[2, Hkv, blocks, block_size, R]``."""
    return quantize_kv(batch.kv_cache.permute(0, 3, 1, 2, 4), dtype).contiguous()


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


def batch_error_bound(batch: PagedBatch, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``[T, Hq, D]`` bound on ``|attention over the dtype cache - float64 reference|``
    (:func:`tokenmill.attention.kv_cache_quant.attention_error_bound` per request), plus 1e-4 for float32
    arithmetic."""
    qsl = batch.md.query_start_loc_cpu
    bound = torch.empty(batch.q.shape, dtype=torch.float64)
    for r, (k, v) in enumerate(zip(batch.k_full, batch.v_full)):
        bound[qsl[r]:qsl[r + 1]] = attention_error_bound(batch.q[qsl[r]:qsl[r + 1]], k, v, dtype, scale) + 1e-4
    return bound


def assert_within_quantization_bound(out: torch.Tensor, batch: PagedBatch, dtype: torch.dtype, scale: float) -> None:
    """``out`` ``[T, Hq, D]`` is the float64 reference of ``batch`` within :func:`batch_error_bound`."""
    err = (out.double() - reference_attention(batch, scale)).abs()
    bound = batch_error_bound(batch, dtype, scale)
    assert bool((err <= bound).all()), f"largest error {err.max():.3g}, worst error/bound {(err / bound).max():.3g}"
    assert math.isfinite(float(err.max()))

