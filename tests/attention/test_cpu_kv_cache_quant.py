"""tokenmill-cpu's C++ kernels over quantized KV caches (int8 rows with scales, fp8 e4m3 / e5m2): the cache write
against the torch reference bit for bit, decode attention against the float64 reference, at each instruction-set
level (the lower ones in a subprocess, tests/lower_isa.py)."""

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
from tokenmill.attention.backends.torch_paged import TorchPagedAttentionBackend
from tokenmill.attention.kv_cache_quant import kv_cache_row_size, quantize_kv
from tokenmill_cpu import kernels
from tokenmill_cpu.attention import CpuPagedAttentionBackend


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    assert kernels.load(), "tokenmill-cpu's C++ kernels did not build (see the log)"


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=QUANT_IDS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(9, 3, 64), (12, 1, 72), (2, 1, 8)],
                         ids=["gqa3", "group12-tail", "tiny-head"])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (7, 20.0)], ids=["full", "w7-softcap"])
def test_quantized_decode_kernel_matches_fp64_reference(dtype, num_heads, num_kv_heads, head_size, window, soft_cap):
    seq_lens = [1, 15, 16, 17, 40]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=16, poison=1.0e4)
    scale = head_size**-0.5
    cache = head_major_quantized(batch, dtype)
    out = kernels.paged_decode(batch.q, cache, batch.md.block_table, batch.md.seq_lens, scale, window, soft_cap)
    assert out.dtype == torch.float32
    out = out.view_as(batch.q)
    # Exactly attention over the values the cache holds (float32 arithmetic) ...
    assert rel_err(out, reference_attention(read_back(batch, dtype, keep_fresh=False), scale, window, soft_cap)) < 1e-5
    if soft_cap is None and window is None:  # ... and within the quantization bound of the unquantized attention
        assert_within_quantization_bound(out, batch, dtype, scale)


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=QUANT_IDS)
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [64, 18])
def test_quantized_write_kernel_matches_the_torch_write_bit_for_bit(dtype, source, head_size):
    from tokenmill.plugin_api import write_kv_cache

    g = torch.Generator().manual_seed(4)
    qkv = (torch.randn(40, 5 * head_size, generator=g) * torch.logspace(-4, 3, 40)[:, None]).to(source)
    qkv[5] = 0  # an all-zero row: scale 1
    k = qkv[:, : 2 * head_size].view(40, 2, head_size)  # strided views of one projection, as the models give
    v = qkv[:, 3 * head_size :].view(40, 2, head_size)
    row = kv_cache_row_size(head_size, dtype)
    cache = quantize_kv(torch.randn(2, 2, 10, 16, head_size), dtype).contiguous()
    assert cache.shape[-1] == row
    slots = torch.randperm(160, generator=torch.Generator().manual_seed(1))[:40]
    slots[[3, 17]] = -1
    keep = slots >= 0
    want = cache.clone()
    write_kv_cache(k[keep], v[keep], want, slots[keep])
    got = cache.clone()
    kernels.write_kv_cache(k, v, got, slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_quantized_kernels_refuse_bad_rows_and_queries():
    batch = make_batch([1], [5], num_heads=2, num_kv_heads=1, head_size=16, block_size=4)
    narrow = torch.zeros(2, 1, batch.kv_cache.shape[1], 4, 16, dtype=torch.int8)  # int8 rows without their scale
    with pytest.raises(RuntimeError, match="rows of 20 elements for head size 16"):
        kernels.paged_decode(batch.q, narrow, batch.md.block_table, batch.md.seq_lens, 0.25)
    cache = head_major_quantized(batch, torch.int8)
    with pytest.raises(RuntimeError, match="under float32 q"):
        kernels.paged_decode(batch.q.bfloat16(), cache, batch.md.block_table, batch.md.seq_lens, 0.25)
    k = torch.zeros(1, 1, 16)
    with pytest.raises(RuntimeError, match=r"rows of 20 elements for head size 16"):
        kernels.write_kv_cache(k, k, narrow, torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=QUANT_IDS)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_backend_mixed_batch_over_a_quantized_cache_matches_the_torch_backend(dtype, model_dtype):
    num_heads, num_kv_heads, head_size, block_size = 8, 2, 32, 8
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=block_size, fill_cache=False, poison=1.0e4)
    scale = head_size**-0.5
    k, v = new_kv(batch)
    args = (batch.q.reshape(len(batch.q), -1).to(model_dtype), k.reshape(len(k), -1).to(model_dtype),
            v.reshape(len(v), -1).to(model_dtype))
    caches, outs = [], []
    for backend in (CpuPagedAttentionBackend, TorchPagedAttentionBackend):
        impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads)
        caches.append(head_major_quantized(batch, dtype))
        outs.append(impl.forward(*args, caches[-1], batch.md).view_as(batch.q))
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))  # the C++ write is torch's
    assert outs[0].dtype == model_dtype
    tol = 1e-5 if model_dtype == torch.float32 else 2e-2
    assert rel_err(outs[0], outs[1].double()) < tol
    if model_dtype == torch.float32:
        assert_within_quantization_bound(outs[0], batch, dtype, scale)


@pytest.mark.lower_isa
@pytest.mark.slow
@pytest.mark.parametrize(("capability", "isa"), [("default", "scalar"), ("avx2", "avx2")])
def test_lower_isa_builds_read_and_write_quantized_caches(capability, isa):
    """The plain C++ and the AVX2/FMA/F16C builds (the same builds as tests/attention/test_cpu_paged.py's lower-ISA
    test) run this file's kernel checks."""
    from tests.lower_isa import check_lower_isa_build

    check_lower_isa_build(__file__, capability, "paged_decode", isa,
                          "(gqa3 or tail or tiny) and not lower_isa or write_kernel or refuse")
