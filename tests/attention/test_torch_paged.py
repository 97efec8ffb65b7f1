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


# Mixed batch for windows: decodes far past the window, chunks on a cached prefix that starts inside and
# outside it, a prefill longer than the window, and short requests the window does not reach.
WINDOW_Q_LENS = [12, 1, 5, 1, 3, 1, 9]
WINDOW_SEQ_LENS = [12, 19, 40, 1, 3, 33, 30]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window,soft_cap", [(5, None), (8, 20.0), (None, 2.0), (64, None)],
                         ids=["w5", "w8-softcap", "softcap", "w-longer-than-context"])
def test_torch_backend_sliding_window_and_soft_cap_never_read_blocks_outside_the_window(block_size, window, soft_cap):
    from tests.attention.paged_reference import poison_outside_window

    num_heads, num_kv_heads, head_size = 4, 2, 16
    batch = make_batch(WINDOW_Q_LENS, WINDOW_SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=block_size, fill_cache=False, poison=1.0e4, seed=block_size)
    if window is not None and window < 16:
        assert poison_outside_window(batch, window) > 0
    scale = head_size**-0.5
    impl = TorchPagedAttentionBackend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads,
                                                     sliding_window=window, logits_soft_cap=soft_cap)
    k, v = new_kv(batch)
    kv_cache = batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous()
    out = impl.forward(batch.q.reshape(len(batch.q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), kv_cache, batch.md)
    out = out.view_as(batch.q)
    assert not out.isnan().any(), "a block outside the window was read"
    assert rel_err(out, reference_attention(batch, scale, window, soft_cap)) < 1e-5
    # A pure decode step goes through the device-only decode path.
    dec = make_batch([1] * 5, [1, 7, 20, 33, 64], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=head_size, block_size=block_size, poison=1.0e4, seed=7)
    if window is not None:
        poison_outside_window(dec, window)
    kv_cache = dec.kv_cache.permute(0, 3, 1, 2, 4).contiguous()
    out = impl.forward_decode(dec.q, kv_cache, dec.md.block_table, dec.md.seq_lens, block_size)
    assert rel_err(out.view_as(dec.q), reference_attention(dec, scale, window, soft_cap)) < 1e-5


@pytest.mark.parametrize("window,soft_cap", [(None, None), (3, None), (None, 5.0)], ids=["full", "w3", "softcap"])
def test_bidirectional_spans_match_the_reference(window, soft_cap):
    """``mm_prefix_ranges`` (Gemma 3's image tokens): a fresh prompt with two spans, a chunk on a cached prefix
    whose span began in the cache (a prefix-cache hit inside an image), a span wholly in the past, a span
    reaching past the chunk's end (clipped: its later keys do not exist yet), and decodes."""
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 16, 4
    q_lens, seq_lens = [12, 6, 1, 5, 4], [12, 15, 20, 9, 10]
    spans = [[(2, 7), (8, 11)], [(7, 13)], [(3, 9)], [(1, 4)], [(7, 14)]]
    batch = make_batch(q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                       block_size=block_size, fill_cache=False, poison=1.0e4, seed=3)
    batch.md.mm_prefix_ranges = spans
    scale = head_size**-0.5
    impl = TorchPagedAttentionBackend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads,
                                                     sliding_window=window, logits_soft_cap=soft_cap)
    k, v = new_kv(batch)
    kv_cache = batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous()
    out = impl.forward(batch.q.reshape(len(batch.q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), kv_cache,
                       batch.md).view_as(batch.q)
    want = reference_attention(batch, scale, window, soft_cap, spans=[[(a, min(b, n)) for a, b in r]
                                                                      for r, n in zip(spans, seq_lens)])
    assert rel_err(out, want) < 1e-5
    assert rel_err(out, reference_attention(batch, scale, window, soft_cap)) > 1e-2  # the spans changed it


def test_sliding_window_decode_branch_for_torch_compile(monkeypatch):
    """The decode path's traced branch (broadcast products instead of matmuls, taken under torch.compile), run
    eagerly: with window and soft cap it matches the reference too. (tests/models/test_compiled_families.py
    compiles a windowed model end to end.)"""
    from tests.attention.paged_reference import poison_outside_window

    impl = TorchPagedAttentionBackend.get_impl_cls()(4, 16, 0.25, 2, sliding_window=6, logits_soft_cap=10.0)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for n in (2, 5):
        batch = make_batch([1] * n, [3 + 9 * i for i in range(n)], num_heads=4, num_kv_heads=2, head_size=16,
                           block_size=4, poison=1.0e4, seed=n)
        poison_outside_window(batch, 6)
        out = impl.forward_decode(batch.q, batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous(), batch.md.block_table,
                           batch.md.seq_lens, 4)
        assert rel_err(out.view_as(batch.q), reference_attention(batch, 0.25, 6, 10.0)) < 1e-5


def test_dummy_run_applies_the_window():
    torch.manual_seed(1)
    t = 11
    impl = TorchPagedAttentionBackend.get_impl_cls()(2, 8, 0.3, 1, sliding_window=3)
    q, k, v = torch.randn(t, 16), torch.randn(t, 8), torch.randn(t, 8)
    out = impl.forward(q, k, v, torch.empty(0), None)
    batch = make_batch([t], [t], num_heads=2, num_kv_heads=1, head_size=8, block_size=4)
    batch.q, batch.k_full, batch.v_full = q.view(t, 2, 8), [k.view(t, 1, 8)], [v.view(t, 1, 8)]
    assert rel_err(out.view_as(batch.q), reference_attention(batch, 0.3, 3)) < 1e-5


def test_attention_layer_refuses_options_its_backend_lacks():
    from tokenmill.attention.selector import set_attn_backend
    from tokenmill.layers import Attention

    class NoWindowBackend(TorchPagedAttentionBackend):
        name = "NO_WINDOW"
        supports_sliding_window = False

    set_attn_backend(NoWindowBackend)
    try:
        with pytest.raises(ValueError, match="NO_WINDOW does not support sliding_window"):
            Attention(4, 16, 0.25, 2, prefix="model.layers.0.self_attn.attn", sliding_window=8)
        Attention(4, 16, 0.25, 2, prefix="x", logits_soft_cap=5.0)  # supported: fine
    finally:
        set_attn_backend(None)


def test_a_multimodal_prefix_lm_leaves_a_backend_without_supports_mm_prefix(monkeypatch):
    """The platform's pick falls back to TORCH_PAGED; a backend the user named is refused."""
    from types import SimpleNamespace

    from tokenmill.attention.selector import ATTENTION_BACKEND_ENV, select_attn_backend

    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)

    class Platform:
        name = "fake"

        @classmethod
        def get_attn_backend_cls(cls, config):
            return "TRITON_PAGED"

    config = SimpleNamespace(attention_backend=None, model_config=SimpleNamespace(is_mm_prefix_lm=True))
    choice = select_attn_backend(Platform, config)
    assert choice.backend_cls is TorchPagedAttentionBackend and "lacks supports_mm_prefix" in choice.reason
    config.model_config.is_mm_prefix_lm = False
    assert select_attn_backend(Platform, config).name == "TRITON_PAGED"
    config.model_config.is_mm_prefix_lm, config.attention_backend = True, "TRITON_PAGED"
    with pytest.raises(ValueError, match="supports_mm_prefix"):
        select_attn_backend(Platform, config)
