"""The Triton paged-attention kernels over quantized KV caches (int8 rows with scales, fp8 e4m3 / e5m2) under the
Triton interpreter (CPU): the cache write against the torch reference bit for bit, attention against the float64
reference within the quantization error bound."""

from __future__ import annotations

import os
import sys

# The interpreter only takes effect if it is on before triton's first import in this process.
_TRITON_IMPORTED_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tests.attention.paged_reference import (  # noqa: E402
    MIXED_Q_LENS,
    MIXED_SEQ_LENS,
    make_batch,
    new_kv,
    reference_attention,
    rel_err,
)
from tests.attention.quant_reference import (  # noqa: E402
    QUANT_DTYPES,
    QUANT_IDS,
    assert_within_quantization_bound,
    read_back,
)
from tokenmill.attention.backends.triton_paged import TritonPagedAttentionBackend  # noqa: E402
from tokenmill.attention.kv_cache_quant import quantize_kv  # noqa: E402

if _TRITON_IMPORTED_COMPILED or os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run these tests with TRITON_INTERPRET=1",
                allow_module_level=True)


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=QUANT_IDS)
def test_triton_backend_writes_and_reads_a_quantized_cache(dtype):
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 16, 4
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=block_size, fill_cache=False, poison=1.0e4)
    scale = head_size**-0.5
    cache = quantize_kv(batch.kv_cache, dtype).contiguous()  # the cached prefixes, quantized
    assert cache.shape == TritonPagedAttentionBackend.get_kv_cache_shape(*cache.shape[1:4], cache.shape[-1])
    impl = TritonPagedAttentionBackend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads)
    k, v = new_kv(batch)
    k[0, 0] = 0  # an all-zero row (int8 scale 1)
    batch.k_full[0][0, 0] = 0
    out = impl.forward(batch.q.reshape(len(batch.q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), cache,
                       batch.md).view_as(batch.q)
    written = cache[0].view(-1, num_kv_heads, cache.shape[-1])[batch.md.slot_mapping]
    assert torch.equal(written.view(torch.uint8), quantize_kv(k, dtype).view(torch.uint8))  # torch's rows, bit for bit
    # Every key and value, the step's own included, is read back from the cache.
    assert rel_err(out, reference_attention(read_back(batch, dtype, keep_fresh=False), scale)) < 1e-5
    assert_within_quantization_bound(out, batch, dtype, scale)
