"""Quantized KV caches (``--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2``): the row format and the torch backend's
attention over it, against the float64 reference within the quantization error bound."""

from __future__ import annotations

import pytest
import torch

from tests.attention.paged_reference import MIXED_Q_LENS, MIXED_SEQ_LENS, make_batch, new_kv, reference_attention, rel_err
from tests.attention.quant_reference import (
    QUANT_DTYPES,
    QUANT_IDS,
    assert_within_quantization_bound,
    head_major_quantized,
    read_back,
)
from tokenmill.attention.backends.torch_paged import TorchPagedAttentionBackend, gather_kv
from tokenmill.attention.kv_cache_quant import (
    dequantize_kv,
    kv_cache_row_size,
    quantize_kv,
    read_back_error_bound,
    row_scales,
)


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=QUANT_IDS)
@pytest.mark.parametrize("head_size", [16, 18])
def test_rows_read_back_within_the_format_bound(dtype, head_size):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, head_size, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]
    x[0] = 0  # all-zero rows
    x[1, 0, 0] = 1e-6  # below fp8's normals
    rows = quantize_kv(x, dtype)
    assert rows.dtype == dtype and rows.shape == (50, 3, kv_cache_row_size(head_size, dtype))
    back = dequantize_kv(rows, head_size, torch.float64)
    assert bool(((back - x.double()).abs() <= read_back_error_bound(x, dtype)).all())
    assert torch.equal(back[0], torch.zeros(3, head_size, dtype=torch.float64))
    assert torch.equal(quantize_kv(x, dtype), rows)  # deterministic: a row depends on its values only
    assert torch.equal(quantize_kv(x[7:9], dtype), rows[7:9])
    if dtype == torch.int8:
        assert rows.shape[-1] == (20 if head_size == 16 else 24)  # codes padded to 4 bytes, then the scale
        codes = rows[..., :head_size].to(torch.int32)
        assert int(codes.abs().max()) == 127 and int(codes[0].abs().max()) == 0
        torch.testing.assert_close(row_scales(rows)[2:], x[2:].abs().amax(-1) / 127, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", QUANT_DTYPES[1:], ids=QUANT_IDS[1:])
def test_fp8_rows_saturate_instead_of_overflowing(dtype):
    rows = quantize_kv(torch.tensor([1.0e6, -1.0e6, 3.0]), dtype)
    limit = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
    assert rows.float().tolist() == [limit, -limit, 3.0]


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=QUANT_IDS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(4, 2, 16), (6, 3, 20)], ids=["gqa2-d16", "gqa2-d20"])
@pytest.mark.parametrize("block_size", [1, 8])
def test_torch_backend_mixed_batch_over_a_quantized_cache(dtype, num_heads, num_kv_heads, head_size, block_size):
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=block_size, fill_cache=False, poison=1.0e4)
    scale = head_size**-0.5
    impl = TorchPagedAttentionBackend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads)
    cache = head_major_quantized(batch, dtype)
    k, v = new_kv(batch)
    out = impl.forward(batch.q.reshape(len(batch.q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), cache,
                       batch.md).view_as(batch.q)
    assert_within_quantization_bound(out, batch, dtype, scale)
    # Exactly attention over what the cache gives back (fresh prompts attend to their own keys and values).
    assert rel_err(out, reference_attention(read_back(batch, dtype, keep_fresh=True), scale)) < 1e-5
    # The step's keys went into the cache quantized as quantize_kv does.
    written = cache[0].view(num_kv_heads, -1, cache.shape[-1])[:, batch.md.slot_mapping].transpose(0, 1)
    assert torch.equal(written, quantize_kv(k, dtype))


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=QUANT_IDS)
def test_gather_kv_reads_a_quantized_cache_back(dtype):
    batch = make_batch([1], [13], num_heads=2, num_kv_heads=2, head_size=18, block_size=4)
    cache = head_major_quantized(batch, dtype)
    raw_k, _ = gather_kv(cache, batch.md.block_table[0], 13, 4)
    assert raw_k.dtype == dtype and raw_k.shape == (13, 2, kv_cache_row_size(18, dtype))
    k, v = gather_kv(cache, batch.md.block_table[0], 13, 4, dtype=torch.float32, head_size=18)
    assert k.shape == (13, 2, 18) and k.dtype == torch.float32
    assert bool(((v.double() - batch.v_full[0].double()).abs() <= read_back_error_bound(batch.v_full[0], dtype)).all())
