"""The torch paged-attention backend (the reference path on CPU) against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from tests.attention.paged_reference import MIXED_Q_LENS, MIXED_SEQ_LENS, make_batch, new_kv, reference_attention, rel_err
from tokenmill.attention.backends.torch_paged import TorchPagedAttentionBackend


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
def test_torch_backend_mixed_batch_matches_fp64_reference(block_size, num_heads, num_kv_heads):
    head_size = 16
    batch = make_batch(
        MIXED_Q_LENS,
        MIXED_SEQ_LENS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        fill_cache=False,
        # The batched-decode path reads whole blocks (and table padding) and masks the scores, so unused
        # slots must hold finite values (0 * NaN = NaN); the engine's cache is zero-initialised.
        poison=1.0e4,
    )
    scale = head_size**-0.5
    impl = TorchPagedAttentionBackend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads)
    k, v = new_kv(batch)
    # The reference batch uses [2, num_blocks, block_size, Hkv, D]; this backend keeps heads outermost.
    kv_cache = batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous()
    _, num_blocks, bs, hkv, d = batch.kv_cache.shape
    assert kv_cache.shape == TorchPagedAttentionBackend.get_kv_cache_shape(num_blocks, bs, hkv, d)
    out = impl.forward(batch.q.reshape(len(batch.q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), kv_cache, batch.md)
    out = out.view_as(batch.q)
    assert rel_err(out, reference_attention(batch, scale)) < 1e-5


def test_torch_backend_dummy_run_is_causal_attention():
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_size, t = 4, 2, 16, 9
    impl = TorchPagedAttentionBackend.get_impl_cls()(num_heads, head_size, 0.3, num_kv_heads)
    q, k, v = torch.randn(t, num_heads * head_size), torch.randn(t, num_kv_heads * head_size), torch.randn(t, num_kv_heads * head_size)
    out = impl.forward(q, k, v, torch.empty(0), None)
    batch = make_batch([t], [t], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, block_size=4)
    batch.q = q.view(t, num_heads, head_size)
    batch.k_full = [k.view(t, num_kv_heads, head_size)]
    batch.v_full = [v.view(t, num_kv_heads, head_size)]
    assert rel_err(out.view_as(batch.q), reference_attention(batch, 0.3)) < 1e-5
