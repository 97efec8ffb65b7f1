"""Triton paged-attention kernels under the Triton interpreter (CPU), against a float64 reference.

``TRITON_INTERPRET=1`` is set before triton is imported, so the kernels run on CPU tensors (slowly: shapes
are small). The same kernels run compiled on a GPU in ``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import os
import sys

# The interpreter only takes effect if it is on before triton's first import in this process.
_TRITON_IMPORTED_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402

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
from tokenmill.attention.backends.torch_paged import TorchPagedAttentionBackend  # noqa: E402
from tokenmill.attention.backends.triton_paged import TritonPagedAttentionBackend  # noqa: E402
from tokenmill.attention.kv_cache_quant import quantize_kv  # noqa: E402
from tokenmill.attention.ops.triton_paged_attention import paged_attention, reshape_and_cache  # noqa: E402

if _TRITON_IMPORTED_COMPILED or os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set; run these tests with TRITON_INTERPRET=1",
        allow_module_level=True,
    )

GQA = pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])


def _run_kernel(batch, scale: float, **kwargs) -> torch.Tensor:
    md = batch.md
    return paged_attention(
        batch.q, batch.kv_cache, md.block_table, md.query_start_loc, md.seq_lens, scale, md.max_query_len, **kwargs
    )


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@GQA
def test_mixed_batch_matches_fp64_reference(block_size, num_heads, num_kv_heads):
    head_size = 16
    batch = make_batch(
        MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        block_size=block_size, seed=block_size,
    )
    scale = head_size**-0.5
    out = _run_kernel(batch, scale)
    assert not out.isnan().any(), "the kernel read a cache slot outside a request's context"
    assert rel_err(out, reference_attention(batch, scale)) < 1e-5


@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [
        ([1, 1, 1, 1], [1, 17, 64, 33]),  # decode only (small tiles)
        ([70], [70]),  # one prefill longer than a query tile
        ([20, 45], [100, 45]),  # long chunk on a cached prefix + prefill, several tiles each
    ],
    ids=["decode-only", "long-prefill", "prefix-chunks"],
)
def test_tile_boundaries(q_lens, seq_lens):
    head_size, scale = 16, 0.2
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=1, head_size=head_size, block_size=16, seed=3)
    out = _run_kernel(batch, scale, block_n=16)
    assert rel_err(out, reference_attention(batch, scale)) < 1e-5


@pytest.mark.parametrize("window,soft_cap", [(5, None), (20, 15.0), (None, 2.0)], ids=["w5", "w20-softcap", "softcap"])
def test_sliding_window_and_soft_cap_never_read_blocks_outside_the_window(window, soft_cap):
    from tests.attention.paged_reference import poison_outside_window

    # Decodes far past the window, a chunk on a long cached prefix, a prefill longer than the window.
    q_lens, seq_lens = [1, 20, 1, 30, 3], [60, 100, 3, 30, 17]
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_size=16, block_size=4, seed=11)
    if window is not None:
        assert poison_outside_window(batch, window) > 0  # NaN: any read of them shows in the output
    out = _run_kernel(batch, 0.25, block_n=16, sliding_window=window, soft_cap=soft_cap)
    assert not out.isnan().any()
    assert rel_err(out, reference_attention(batch, 0.25, window, soft_cap)) < 1e-5


def test_head_size_not_power_of_two_and_odd_group():
    # D = 24 is padded to 32 inside the kernel; 3 query heads per KV head are padded to 4 rows.
    batch = make_batch([4, 1], [9, 13], num_heads=6, num_kv_heads=2, head_size=24, block_size=8, seed=5)
    out = _run_kernel(batch, 24**-0.5)
    assert rel_err(out, reference_attention(batch, 24**-0.5)) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_half_precision(dtype, tol):
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=4, num_kv_heads=2, head_size=32, block_size=16, dtype=dtype)
    out = _run_kernel(batch, 32**-0.5)
    assert out.dtype == dtype
    assert rel_err(out, reference_attention(batch, 32**-0.5)) < tol


def _index_copy_reference(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The Triton layout ``[2, num_blocks, block_size, Hkv, D]`` written with plain index_copy_."""
    hkv, d = k.shape[1], k.shape[2]
    cache[0].view(-1, hkv, d).index_copy_(0, slots, k.to(cache.dtype))
    cache[1].view(-1, hkv, d).index_copy_(0, slots, v.to(cache.dtype))


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_matches_index_copy(block_size, dtype):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_size, t = 16, 2, 24, 11
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g).to(dtype)
    expected = cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    k = torch.randn(t, num_kv_heads, head_size, generator=g).to(dtype)
    v = torch.randn(t, num_kv_heads, head_size, generator=g).to(dtype)
    reshape_and_cache(k, v, cache, slots)
    _index_copy_reference(k, v, expected, slots)
    assert torch.equal(cache, expected)
    # float32 keys into a bfloat16 cache are converted (the interpreter may round differently: 1 ulp).
    k32, v32 = torch.randn(t, num_kv_heads, head_size, generator=g), torch.randn(t, num_kv_heads, head_size, generator=g)
    reshape_and_cache(k32, v32, cache, slots)
    _index_copy_reference(k32, v32, expected, slots)
    torch.testing.assert_close(cache, expected, rtol=2**-7, atol=0)


def test_reshape_and_cache_skips_negative_slots():
    cache = torch.zeros(2, 4, 4, 1, 16)
    k = torch.ones(3, 1, 16)
    reshape_and_cache(k, 2 * k, cache, torch.tensor([5, -1, 0]))
    flat = cache.view(2, -1, 16)
    assert flat[0, 5].eq(1).all() and flat[1, 0].eq(2).all()
    assert flat[:, [1, 2, 3, 4, 6, 7]].eq(0).all()


@GQA
def test_backend_forward_writes_cache_then_attends(num_heads, num_kv_heads):
    """Full AttentionImpl.forward: new K/V go through slot_mapping; torch backend agrees too."""
    head_size, block_size = 16, 8
    scale = head_size**-0.5
    batch = make_batch(
        MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        block_size=block_size, fill_cache=False, poison=0.0,
    )
    k, v = new_kv(batch)
    t = len(batch.q)
    args = (batch.q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1))
    ref = reference_attention(batch, scale)
    # The torch backend keeps heads outermost ([2, Hkv, blocks, block_size, D]); compare caches in one layout.
    to_layout = {
        TritonPagedAttentionBackend: lambda c: c,
        TorchPagedAttentionBackend: lambda c: c.permute(0, 3, 1, 2, 4).contiguous(),
    }
    from_layout = {
        TritonPagedAttentionBackend: lambda c: c,
        TorchPagedAttentionBackend: lambda c: c.permute(0, 2, 3, 1, 4),
    }
    caches = {}
    for backend in (TritonPagedAttentionBackend, TorchPagedAttentionBackend):
        cache = to_layout[backend](batch.kv_cache.clone())
        assert backend.get_kv_cache_shape(*batch.kv_cache.shape[1:4], head_size) == cache.shape
        impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads)
        out = impl.forward(*args, cache, batch.md)
        assert out.shape == (t, num_heads * head_size) and out.dtype == batch.q.dtype
        assert rel_err(out.view_as(batch.q), ref) < 1e-5, backend.name
        caches[backend] = from_layout[backend](cache)
    torch.testing.assert_close(caches[TritonPagedAttentionBackend], caches[TorchPagedAttentionBackend], rtol=0, atol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_backend_dummy_run_without_metadata(window):
    num_heads, num_kv_heads, head_size, t = 4, 2, 16, 7
    batch = make_batch([t], [t], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, block_size=4)
    k, v = new_kv(batch)
    impl = TritonPagedAttentionBackend.get_impl_cls()(num_heads, head_size, 0.25, num_kv_heads, sliding_window=window)
    out = impl.forward(batch.q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), torch.empty(0), None)
    assert rel_err(out.view_as(batch.q), reference_attention(batch, 0.25, window)) < 1e-5


def test_backend_module_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from tokenmill.attention.backends import triton_paged as m\n"
        "assert not m.triton_available()\n"
        "try:\n"
        "    m.TritonPagedAttentionBackend.get_impl_cls()(2, 16, 0.25, 1)\n"
        "except ImportError as e:\n"
        "    assert 'TORCH_PAGED' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_gpu_platforms_choose_triton_when_installed(monkeypatch):
    import importlib.util

    from tokenmill_cuda.platform import CudaPlatform
    from tokenmill_rocm.platform import RocmPlatform

    from tokenmill.attention.backends.triton_paged import TritonPagedAttentionBackend
    from tokenmill.attention.selector import select_attn_backend

    for platform in (CudaPlatform, RocmPlatform):
        assert platform.get_attn_backend_cls(None) == "TRITON_PAGED"  # type: ignore[arg-type]
        assert select_attn_backend(platform, None).backend_cls is TritonPagedAttentionBackend
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    for platform in (CudaPlatform, RocmPlatform):
        assert platform.get_attn_backend_cls(None) == "TORCH_PAGED"  # type: ignore[arg-type]


def test_engine_greedy_with_triton_backend_matches_transformers(tiny_llama_dir, monkeypatch):
    """The whole engine (chunked prefill, prefix reuse, decodes) on the Triton backend, interpreted on CPU."""
    from tests.conftest import hf_greedy
    from tests.models.test_llama_correctness import run_engine
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine_args import EngineArgs
    from tokenmill.platforms import get_current_platform

    path = "tokenmill.attention.backends.triton_paged:TritonPagedAttentionBackend"
    monkeypatch.setattr(get_current_platform(), "get_attn_backend_cls", classmethod(lambda cls, config: path))
    prompts = [[1, 5, 9, 33, 44, 100], [7] * 13, [3, 4], [7] * 13 + [8, 9]]
    args = EngineArgs(model=tiny_llama_dir, dtype="float32", block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=64)
    core = EngineCore(args.create_engine_config())
    assert core.executor.worker.model_runner.attn_backend is TritonPagedAttentionBackend
    assert run_engine(core, prompts, max_tokens=6) == hf_greedy(tiny_llama_dir, prompts, 6)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_queries_over_a_reduced_cache(cache_dtype):
    # --kv-cache-dtype under a float32 model: values exact in the cache dtype, arithmetic in float32.
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                       dtype=cache_dtype)
    batch.q = torch.randn(batch.q.shape, generator=torch.Generator().manual_seed(7))
    out = _run_kernel(batch, 0.25)
    assert out.dtype == torch.float32
    assert rel_err(out, reference_attention(batch, 0.25)) < 1e-5


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
