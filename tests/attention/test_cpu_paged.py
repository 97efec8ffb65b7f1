"""tokenmill-cpu's paged decode and prefill attention kernels (C++) and the CPU backend that uses them, against a
float64 reference."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.attention.paged_reference import MIXED_Q_LENS, MIXED_SEQ_LENS, make_batch, new_kv, reference_attention, rel_err
from tokenmill_cpu import kernels
from tokenmill_cpu.attention import CpuPagedAttentionBackend
from tokenmill_cpu.platform import CpuPlatform

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    # The CI machine has a compiler and ninja: a build failure must fail here, not fall back silently.
    assert kernels.load(), "tokenmill-cpu's C++ kernels did not build (see the log)"


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """make_batch's [2, blocks, block_size, Hkv, D] cache in the backend's [2, Hkv, blocks, block_size, D]."""
    return cache.permute(0, 3, 1, 2, 4).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size",
    [(4, 4, 64), (9, 3, 64), (12, 1, 72), (16, 2, 16), (2, 1, 8)],
    ids=["mha", "gqa3", "group12-tail", "group8", "tiny-head"],
)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_kernel_matches_fp64_reference_and_never_reads_unused_slots(dtype, num_heads, num_kv_heads, head_size, block_size):
    seq_lens = [1, 15, 16, 17, 33, 100, 2]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=block_size, dtype=dtype)  # unused slots are NaN
    scale = head_size**-0.5
    out = kernels.paged_decode(batch.q, head_major(batch.kv_cache), batch.md.block_table, batch.md.seq_lens, scale)
    assert out.shape == (len(seq_lens), num_heads * head_size) and out.dtype == dtype
    assert rel_err(out.view_as(batch.q), reference_attention(batch, scale)) < TOL[dtype]


def test_kernel_reads_strided_queries_and_returns_zeros_for_empty_context():
    batch = make_batch([1, 1], [5, 9], num_heads=4, num_kv_heads=2, head_size=32, block_size=4)
    wide = torch.randn(2, 4, 48)  # queries as a view with a row stride wider than the heads
    wide[:, :, :32] = batch.q
    q = wide[:, :, :32]
    out = kernels.paged_decode(q, head_major(batch.kv_cache), batch.md.block_table, batch.md.seq_lens, 0.2)
    assert rel_err(out.view_as(batch.q), reference_attention(batch, 0.2)) < 1e-5
    empty = kernels.paged_decode(q, head_major(batch.kv_cache), batch.md.block_table, torch.tensor([0, 9], dtype=torch.int32), 0.2)
    assert torch.equal(empty[0], torch.zeros(128))


def test_kernel_rejects_bad_inputs_with_errors_not_crashes():
    batch = make_batch([1, 1], [5, 9], num_heads=4, num_kv_heads=2, head_size=32, block_size=4)
    cache = head_major(batch.kv_cache)
    bt, sl = batch.md.block_table, batch.md.seq_lens
    bad_table = bt.clone()
    bad_table[1, 0] = cache.shape[2]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.paged_decode(batch.q, cache, bad_table, sl, 0.2)
    with pytest.raises(RuntimeError, match="must have q's dtype"):
        kernels.paged_decode(batch.q.bfloat16(), cache, bt, sl, 0.2)  # only float32 queries widen a cache
    with pytest.raises(RuntimeError, match="must have q's dtype"):
        kernels.paged_decode(batch.q.double(), cache.bfloat16(), bt, sl, 0.2)
    with pytest.raises(RuntimeError, match="int32"):
        kernels.paged_decode(batch.q, cache, bt.long(), sl, 0.2)
    with pytest.raises(RuntimeError, match="kv_cache"):
        kernels.paged_decode(batch.q, cache.transpose(1, 2), bt, sl, 0.2)
    with pytest.raises(RuntimeError, match="needs more blocks"):
        kernels.paged_decode(batch.q, cache, bt, torch.tensor([5, bt.shape[1] * 4 + 1], dtype=torch.int32), 0.2)
    with pytest.raises(RuntimeError, match="at least one KV head"):
        kernels.paged_decode(batch.q, cache[:, :0].contiguous(), bt, sl, 0.2)
    with pytest.raises(RuntimeError, match="multiple"):
        kernels.paged_decode(batch.q[:, :3].contiguous(), cache, bt, sl, 0.2)
    empty = kernels.paged_decode(batch.q[:0], cache, bt[:0], sl[:0], 0.2)
    assert empty.shape == (0, 4 * 32)


def test_kernel_traces_under_torch_compile_with_dynamic_batch():
    compiled = torch.compile(kernels.paged_decode, dynamic=True, fullgraph=True)
    for n in (2, 5):
        batch = make_batch([1] * n, [3 + 7 * i for i in range(n)], num_heads=6, num_kv_heads=2, head_size=16, block_size=8)
        out = compiled(batch.q, head_major(batch.kv_cache), batch.md.block_table, batch.md.seq_lens, 0.25)
        assert rel_err(out.view_as(batch.q), reference_attention(batch, 0.25)) < 1e-5


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch-fallback"])
def test_cpu_backend_mixed_batch_matches_fp64_reference(use_kernel):
    num_heads, num_kv_heads, head_size, block_size = 8, 2, 16, 8
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=block_size, fill_cache=False, poison=1.0e4)
    impl = CpuPagedAttentionBackend.get_impl_cls()(num_heads, head_size, head_size**-0.5, num_kv_heads)
    assert impl.use_kernel
    impl.use_kernel = use_kernel
    k, v = new_kv(batch)
    out = impl.forward(batch.q.reshape(len(batch.q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1),
                       head_major(batch.kv_cache), batch.md)
    assert rel_err(out.view_as(batch.q), reference_attention(batch, head_size**-0.5)) < 1e-5


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(9, 3, 64), (12, 1, 72)], ids=["gqa3", "group12-tail"])
def test_kernel_widens_a_reduced_cache_under_float32_queries(cache_dtype, num_heads, num_kv_heads, head_size):
    # --kv-cache-dtype under a float32 model: the cache's values are exact in float32, so with float32 queries and
    # float32 arithmetic the result must match the float64 reference to float32 accuracy (a kernel that rounded
    # the queries or the output to the cache dtype would be off by about 1e-2).
    seq_lens = [1, 15, 16, 17, 33, 100]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=16, dtype=cache_dtype)
    q = torch.randn(batch.q.shape, generator=torch.Generator().manual_seed(3))
    batch.q = q
    scale = head_size**-0.5
    out = kernels.paged_decode(q, head_major(batch.kv_cache), batch.md.block_table, batch.md.seq_lens, scale)
    assert out.dtype == torch.float32
    assert rel_err(out.view_as(q), reference_attention(batch, scale)) < 1e-5


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch-fallback"])
def test_cpu_backend_float32_model_with_a_bfloat16_cache(use_kernel):
    num_heads, num_kv_heads, head_size, block_size = 8, 2, 16, 8
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=block_size, fill_cache=False, poison=1.0e4,
                       dtype=torch.bfloat16)  # keys and values exact in bfloat16, so the reference is exact
    batch.q = torch.randn(batch.q.shape, generator=torch.Generator().manual_seed(5))
    impl = CpuPagedAttentionBackend.get_impl_cls()(num_heads, head_size, head_size**-0.5, num_kv_heads)
    impl.use_kernel = use_kernel
    k, v = new_kv(batch)
    cache = head_major(batch.kv_cache)
    out = impl.forward(batch.q.reshape(len(batch.q), -1), k.float().reshape(len(k), -1),
                       v.float().reshape(len(v), -1), cache, batch.md)
    assert out.dtype == torch.float32 and cache.dtype == torch.bfloat16
    assert rel_err(out.view_as(batch.q), reference_attention(batch, head_size**-0.5)) < 1e-5
    written = cache[0].view(num_kv_heads, -1, head_size)[:, batch.md.slot_mapping].transpose(0, 1)
    assert torch.equal(written, k)  # the step's keys went into the cache, rounded to its dtype


def test_cpu_platform_picks_the_kernel_backend():
    from tokenmill.attention.selector import select_attn_backend
    from tokenmill_cpu.attention import CpuPagedAttentionBackend

    assert CpuPlatform.get_attn_backend_cls(None) == "CPU_PAGED"
    choice = select_attn_backend(CpuPlatform, None)  # the name goes through the registry
    assert choice.backend_cls is CpuPagedAttentionBackend and choice.source == "plugin tokenmill.platforms:cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window,soft_cap", [(5, None), (20, 30.0), (None, 3.0)], ids=["w5", "w20-softcap", "softcap"])
def test_kernel_sliding_window_and_soft_cap_match_fp64_reference(dtype, block_size, window, soft_cap):
    from tests.attention.paged_reference import poison_outside_window

    seq_lens = [1, 5, 6, 17, 33, 100]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads=8, num_kv_heads=2, head_size=64,
                       block_size=block_size, dtype=dtype)  # unused slots are NaN
    if window is not None:
        assert poison_outside_window(batch, window) > 0  # blocks wholly before the window: NaN too
    scale = 64**-0.5
    out = kernels.paged_decode(batch.q, head_major(batch.kv_cache), batch.md.block_table, batch.md.seq_lens, scale,
                               window, soft_cap)
    assert rel_err(out.view_as(batch.q), reference_attention(batch, scale, window, soft_cap)) < TOL[dtype]


def test_cpu_backend_passes_window_and_soft_cap_to_the_kernel():
    from tests.attention.paged_reference import poison_outside_window

    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=8, num_kv_heads=2, head_size=16, block_size=4,
                       fill_cache=False, poison=1.0e4)
    poison_outside_window(batch, 6)
    impl = CpuPagedAttentionBackend.get_impl_cls()(8, 16, 0.25, 2, sliding_window=6, logits_soft_cap=8.0)
    assert impl.use_kernel
    k, v = new_kv(batch)
    out = impl.forward(batch.q.reshape(len(batch.q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1),
                       head_major(batch.kv_cache), batch.md)
    assert rel_err(out.view_as(batch.q), reference_attention(batch, 0.25, 6, 8.0)) < 1e-5


def prefill_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
                      causal: bool = True) -> torch.Tensor:
    """Causal attention in float64 of ``L`` queries that are the last ``L`` positions of the ``S``-row context
    ``k``, ``v`` (``causal=False``: each query sees all ``S`` rows): ``[L, Hq * D]``."""
    length, num_heads, head_size = q.shape
    group = num_heads // k.shape[1]
    keys, values = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,jhd->htj", q.double(), keys) * scale
    t, j = torch.arange(length)[:, None] + k.shape[0] - length, torch.arange(k.shape[0])[None]
    visible = (j <= t) & (j > t - window) if window else j <= t
    if not causal:
        visible = torch.ones_like(visible)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("htj,jhd->thd", probs, values).reshape(length, num_heads * head_size)


def fused_qkv(length: int, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v as views of one [L, (Hq + 2 Hkv) * D] projection, as the models give them (row stride > H * D)."""
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = torch.randn(length, width, generator=torch.Generator().manual_seed(seed)).to(dtype)
    q = qkv[:, : num_heads * head_size].view(length, num_heads, head_size)
    k = qkv[:, num_heads * head_size : (num_heads + num_kv_heads) * head_size].view(length, num_kv_heads, head_size)
    v = qkv[:, (num_heads + num_kv_heads) * head_size :].view(length, num_kv_heads, head_size)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size",
    [(4, 4, 64), (9, 3, 64), (12, 1, 72), (16, 2, 16), (2, 1, 8)],
    ids=["mha", "gqa3", "group12-tail", "group8", "tiny-head"],
)
@pytest.mark.parametrize("length,window", [(1, None), (17, None), (130, None), (40, 7)], ids=["L1", "L17", "L130", "L40-w7"])
def test_prefill_kernel_matches_fp64_reference(dtype, num_heads, num_kv_heads, head_size, length, window):
    q, k, v = fused_qkv(length, num_heads, num_kv_heads, head_size, dtype)
    scale = head_size**-0.5
    out = kernels.prefill_attention(q, k, v, scale, window)
    assert out.shape == (length, num_heads * head_size) and out.dtype == dtype
    assert rel_err(out, prefill_reference(q, k, v, scale, window)) < TOL[dtype]


@pytest.mark.parametrize("window", [None, 9], ids=["full", "w9"])
def test_prefill_kernel_takes_a_chunk_after_a_cached_prefix(window):
    q, k, v = fused_qkv(70, 9, 3, 64, torch.float32, seed=2)
    chunk = q[50:]  # the last 20 positions of a 70-row context
    out = kernels.prefill_attention(chunk, k, v, 0.125, window)
    assert rel_err(out, prefill_reference(chunk, k, v, 0.125, window)) < 1e-5
    assert rel_err(out, kernels.prefill_attention(q, k, v, 0.125, window)[50:]) < 1e-6


@pytest.mark.parametrize("window", [None, 50], ids=["full", "w50"])
def test_prefill_kernel_rows_do_not_depend_on_the_chunk_they_are_computed_in(window):
    # Key blocks on a fixed grid: a query row gets the same bits alone, in any chunk, or in the whole prompt.
    q, k, v = fused_qkv(300, 9, 3, 64, torch.float32, seed=4)
    full = kernels.prefill_attention(q, k, v, 0.125, window)
    for start in (1, 37, 64, 65, 200, 299):
        assert torch.equal(kernels.prefill_attention(q[start:], k, v, 0.125, window), full[start:]), start


@pytest.mark.parametrize("window", [None, 70], ids=["full", "w70"])
def test_prefill_kernel_rescales_when_later_keys_score_higher(window):
    # Scores that grow along the context: every key block raises the running maximum of every query.
    q, k, v = fused_qkv(260, 4, 2, 32, torch.float32, seed=5)
    k = k * torch.linspace(0.1, 6.0, 260).view(-1, 1, 1)
    q = q.abs() + 0.5
    k = k.abs()
    out = kernels.prefill_attention(q, k, v, 0.2, window)
    assert rel_err(out, prefill_reference(q, k, v, 0.2, window)) < 1e-5


def test_prefill_kernel_rejects_bad_inputs_and_traces_under_torch_compile():
    q, k, v = fused_qkv(6, 4, 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.prefill_attention(q, k.double(), v, 0.2)
    with pytest.raises(RuntimeError, match="multiple"):
        kernels.prefill_attention(q[:, :3], k, v, 0.2)
    with pytest.raises(RuntimeError, match="S >= q's L"):
        kernels.prefill_attention(q, k[:5], v[:5], 0.2)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.prefill_attention(q.transpose(1, 2), k, v, 0.2)
    with pytest.raises(RuntimeError, match="sliding_window"):
        torch.ops.tokenmill_cpu.prefill_attention(q, k, v, 0.2, -1)
    assert kernels.prefill_attention(q[:0], k[:0], v[:0], 0.2).shape == (0, 128)
    compiled = torch.compile(kernels.prefill_attention, dynamic=True, fullgraph=True)
    for length in (3, 9):
        q, k, v = fused_qkv(length, 4, 2, 32, torch.float32, seed=length)
        assert rel_err(compiled(q, k, v, 0.2), prefill_reference(q, k, v, 0.2, None)) < 1e-5


@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, None), (None, 5.0)], ids=["plain", "w6", "softcap"])
def test_cpu_backend_sends_fresh_prompts_to_the_prefill_kernel(monkeypatch, window, soft_cap):
    calls = []
    real = kernels.prefill_attention
    monkeypatch.setattr(kernels, "prefill_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    impl = CpuPagedAttentionBackend.get_impl_cls()(8, 16, 0.25, 2, sliding_window=window, logits_soft_cap=soft_cap)
    assert impl.use_kernel
    q, k, v = fused_qkv(11, 8, 2, 16, torch.float32, seed=1)
    out = impl.forward_prefill(q, k, v)
    want = impl._sdpa(q, k, v, causal_offset=0).reshape(11, -1)  # torch's path
    assert rel_err(out, want) < 1e-5
    assert calls == ([] if soft_cap else [11])  # a soft cap stays on torch's path


@pytest.mark.lower_isa
@pytest.mark.slow
@pytest.mark.parametrize(("capability", "isa"), [("default", "scalar"), ("avx2", "avx2")])
def test_lower_isa_builds_match_the_fp64_reference(capability, isa):
    """The kernel's plain C++ build and its AVX2/FMA/F16C build (what CPUs without AVX-512 run; on an AVX-512
    machine built with AVX2 flags only), each checked by this file's reference tests in a subprocess."""
    from tests.lower_isa import check_lower_isa_build

    check_lower_isa_build(__file__, capability, "paged_decode", isa,
                          "16-gqa3 or w20-softcap-16 or strided or (prefill_kernel and (gqa3 or tail)) or write_kv_cache")


def test_a_lock_file_left_by_a_killed_build_does_not_hang_the_next_start():
    """torch's build lock (a plain file) survives a killed build; the next load must remove it, not wait."""
    import os
    import subprocess
    import sys

    _, build_dir = kernels.build_directory(torch.backends.cpu.get_cpu_capability())
    (build_dir / "lock").write_text("")  # what a build killed by Ctrl-C leaves behind
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    check = "from tokenmill_cpu import kernels; assert kernels.load()"
    result = subprocess.run([sys.executable, "-c", check], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "interrupted build" in result.stderr
    assert not (build_dir / "lock").exists()


def test_torch_extensions_dir_chooses_where_the_kernels_build(monkeypatch, tmp_path):
    """``TORCH_EXTENSIONS_DIR`` is torch's documented build root; the kernels (and a cold-start measurement that
    empties it) must use it too."""
    capability = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name, build_dir = kernels.build_directory(capability)
    assert build_dir == tmp_path / name and name.startswith(f"tokenmill_cpu_kernels_{capability.lower()}_")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    _, default_dir = kernels.build_directory(capability)
    assert tmp_path not in default_dir.parents and default_dir.parent.name.endswith("_cpu")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_the_background_build_and_its_compilers_run_at_lower_priority(monkeypatch):
    """A cold start serves eagerly while the kernels compile; the build thread and the compiler processes it
    starts must yield the CPU to the serving thread (nice + BUILD_NICENESS), which keeps its own priority."""
    import subprocess
    import threading

    seen = {}

    def fake_load() -> bool:
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        stat = subprocess.run(["cat", "/proc/self/stat"], capture_output=True, text=True).stdout
        seen["child"] = int(stat.rsplit(")", 1)[1].split()[16])  # field 19: nice
        return True

    monkeypatch.setattr(kernels, "load", fake_load)
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker = threading.Thread(target=kernels._load_at_low_priority)
    worker.start()
    worker.join(60)
    expected = min(main + kernels.BUILD_NICENESS, 19)
    assert seen == {"thread": expected, "child": expected}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_write_kv_cache_kernel_matches_the_torch_write_and_skips_negative_slots(cache_dtype):
    from tokenmill.plugin_api import write_kv_cache

    q, k, v = fused_qkv(40, 9, 3, 64, torch.float32, seed=4)  # k, v: strided views of one projection
    cache = torch.randn(2, 3, 10, 16, 64).to(cache_dtype)
    slots = torch.randperm(160, generator=torch.Generator().manual_seed(1))[:40]
    slots[[3, 17]] = -1
    want = cache.clone()
    keep = slots >= 0
    write_kv_cache(k[keep], v[keep], want, slots[keep])
    got = cache.clone()
    kernels.write_kv_cache(k, v, got, slots)
    assert torch.equal(got, want)


def test_write_kv_cache_kernel_rejects_bad_slots_before_writing_and_traces_under_torch_compile():
    _, k, v = fused_qkv(5, 4, 2, 32, torch.float32)
    cache = torch.zeros(2, 2, 3, 4, 32)
    with pytest.raises(RuntimeError, match="outside the cache's 12 slots"):
        kernels.write_kv_cache(k, v, cache, torch.tensor([0, 1, 2, 3, 12]))
    assert not cache.any()  # nothing written by the failed call
    with pytest.raises(RuntimeError, match="int64"):
        kernels.write_kv_cache(k, v, cache, torch.arange(5, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="one slot for each"):
        kernels.write_kv_cache(k, v, cache, torch.arange(6))
    with pytest.raises(RuntimeError, match="KV heads and head size"):
        kernels.write_kv_cache(k, v, torch.zeros(2, 1, 3, 4, 32), torch.arange(5))
    with pytest.raises(RuntimeError, match="k's dtype"):
        kernels.write_kv_cache(k.double(), v.double(), cache, torch.arange(5))

    # Only the op in the graph (no Inductor loops, which the plain build's lower-ISA run cannot compile).
    compiled = torch.compile(kernels.write_kv_cache, dynamic=True, fullgraph=True)
    slots = torch.tensor([0, 5, 6, 11, -1])
    compiled(k, v, cache, slots)
    assert torch.equal(cache[0].view(2, -1, 32)[:, 0], k[0])
    assert torch.equal(cache[1].view(2, -1, 32)[:, 11], v[3])  # the cache itself was written in place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(9, 3, 64), (12, 1, 72)], ids=["gqa3", "tail"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "w7"])
@pytest.mark.parametrize("lengths", [[17, 1, 130, 40], [300] + [8] * 12], ids=["mixed", "long-and-short"])
def test_prefill_kernel_varlen_matches_each_prompt_alone(dtype, num_heads, num_kv_heads, head_size, window, lengths):
    q, k, v = fused_qkv(sum(lengths) + 5, num_heads, num_kv_heads, head_size, dtype, seed=6)
    starts = [5 + sum(lengths[:i]) for i in range(len(lengths))]  # rows 0-4: a decode's rows, not to be touched
    ranges = torch.tensor([[s, s + n] for s, n in zip(starts, lengths)], dtype=torch.int32)
    out = torch.full((q.shape[0], num_heads * head_size), 7.0, dtype=dtype)
    kernels.prefill_attention_varlen(q, k, v, ranges, head_size**-0.5, window, out)
    assert (out[:5] == 7.0).all()
    for s, n in zip(starts, lengths):
        want = prefill_reference(q[s:s + n], k[s:s + n], v[s:s + n], head_size**-0.5, window)
        assert rel_err(out[s:s + n], want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(9, 3, 64), (12, 1, 72), (12, 12, 32)],
                         ids=["gqa3", "tail", "bert32"])
@pytest.mark.parametrize("layout", ["fused", "contiguous"])
def test_prefill_kernel_varlen_bidirectional_matches_each_sequence_alone(dtype, num_heads, num_kv_heads, head_size,
                                                                        layout):
    """Encoder-only attention (causal=False): tiles over a fused projection's rows, single rows over contiguous
    keys and values; lengths around the kernel's key blocks of 64 and its groups of four."""
    lengths = [17, 1, 130, 64, 3]
    q, k, v = fused_qkv(sum(lengths), num_heads, num_kv_heads, head_size, dtype, seed=8)
    if layout == "contiguous":
        k, v = k.contiguous(), v.contiguous()
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    ranges = torch.tensor([[s, s + n] for s, n in zip(starts, lengths)], dtype=torch.int32)
    out = torch.empty(q.shape[0], num_heads * head_size, dtype=dtype)
    kernels.prefill_attention_varlen(q, k, v, ranges, head_size**-0.5, None, out, causal=False)
    for s, n in zip(starts, lengths):
        want = prefill_reference(q[s:s + n], k[s:s + n], v[s:s + n], head_size**-0.5, None, causal=False)
        assert rel_err(out[s:s + n], want) < TOL[dtype]
    with pytest.raises(RuntimeError, match="sliding window needs causal"):
        kernels.prefill_attention_varlen(q, k, v, ranges, 0.2, 4, out, causal=False)


def test_cpu_backend_sends_an_encoder_steps_short_sequences_to_the_kernel_in_one_call(monkeypatch):
    from tokenmill.attention.encoder_batches import bidirectional_attention

    calls = []
    real = kernels.prefill_attention_varlen
    monkeypatch.setattr(kernels, "prefill_attention_varlen",
                        lambda *a, **kw: calls.append((a[3].tolist(), kw)) or real(*a, **kw))
    impl = CpuPagedAttentionBackend.get_impl_cls()(8, 16, 0.25, 2)
    q, k, v = fused_qkv(170, 8, 2, 16, torch.float32, seed=3)
    ranges = [(0, 7), (7, 8), (8, 148), (148, 170)]  # 140 rows: above the kernel's bound, on SDPA
    got = impl.forward_bidirectional(q, k, v, ranges)
    assert rel_err(got, bidirectional_attention(q, k, v, ranges, 0.25).reshape(170, -1)) < 1e-5
    assert calls == [([[0, 7], [7, 8], [148, 170]], {"causal": False})]
    calls.clear()
    got = impl.forward_bidirectional(q, k, v, ranges[:2])
    assert rel_err(got[:8], bidirectional_attention(q, k, v, ranges[:2], 0.25).reshape(170, -1)[:8]) < 1e-5
    assert calls == [([[0, 7], [7, 8]], {"causal": False})]


def test_prefill_kernel_varlen_rejects_bad_ranges():
    q, k, v = fused_qkv(6, 4, 2, 32, torch.float32)
    out = torch.empty(6, 128)
    for bad in ([[0, 7]], [[3, 3]], [[-1, 2]]):
        with pytest.raises(RuntimeError, match="not a non-empty range"):
            kernels.prefill_attention_varlen(q, k, v, torch.tensor(bad, dtype=torch.int32), 0.2, None, out)
    with pytest.raises(RuntimeError, match="int32"):
        kernels.prefill_attention_varlen(q, k, v, torch.tensor([[0, 2]]), 0.2, None, out)
    with pytest.raises(RuntimeError, match="in order and disjoint"):
        kernels.prefill_attention_varlen(q, k, v, torch.tensor([[0, 4], [3, 6]], dtype=torch.int32), 0.2, None, out)
    with pytest.raises(RuntimeError, match="rows must not overlap"):
        kernels.prefill_attention_varlen(q, k, v, torch.tensor([[0, 2]], dtype=torch.int32), 0.2, None,
                                         torch.empty(128).expand(6, 128))
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.prefill_attention_varlen(q, k, v, torch.tensor([[0, 2]], dtype=torch.int32), 0.2, None, out[:, :64])


@pytest.mark.parametrize("soft_cap", [None, 5.0], ids=["plain", "softcap"])
def test_cpu_backend_sends_a_steps_fresh_prompts_to_the_kernel_in_one_call(monkeypatch, soft_cap):
    calls = []
    real = kernels.prefill_attention_varlen
    monkeypatch.setattr(kernels, "prefill_attention_varlen", lambda *a: calls.append(a[3].tolist()) or real(*a))
    num_heads, num_kv_heads, head_size = 8, 2, 16
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=8, fill_cache=False, poison=1.0e4)
    impl = CpuPagedAttentionBackend.get_impl_cls()(num_heads, head_size, head_size**-0.5, num_kv_heads,
                                                    logits_soft_cap=soft_cap)
    k, v = new_kv(batch)
    out = impl.forward(batch.q.reshape(len(batch.q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1),
                       head_major(batch.kv_cache), batch.md)
    assert rel_err(out.view_as(batch.q), reference_attention(batch, head_size**-0.5, None, soft_cap)) < 1e-5
    # requests 0 and 4 are fresh prompts (rows 0-6 and 14-16); request 2 continues a cached prefix
    assert calls == ([] if soft_cap else [[[0, 7], [14, 17]]])


def test_cpu_backend_writes_the_cache_with_the_kernel(monkeypatch):
    writes = []
    real = kernels.write_kv_cache
    monkeypatch.setattr(kernels, "write_kv_cache", lambda *a: writes.append(a[0].shape[0]) or real(*a))
    num_heads, num_kv_heads, head_size = 8, 2, 16
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=8, fill_cache=False, poison=1.0e4)
    impl = CpuPagedAttentionBackend.get_impl_cls()(num_heads, head_size, head_size**-0.5, num_kv_heads)
    k, v = new_kv(batch)
    cache = head_major(batch.kv_cache)
    impl.forward(batch.q.reshape(len(batch.q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), cache, batch.md)
    assert writes == [len(batch.q)]
    written = cache[1].view(num_kv_heads, -1, head_size)[:, batch.md.slot_mapping].transpose(0, 1)
    assert torch.equal(written, v)
