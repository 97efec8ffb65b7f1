"""The in-tree platform plugins (tokenmill-cpu/cuda/rocm) as installed, and their detectors with torch mocked."""

from __future__ import annotations

import os
import platform
import types

import pytest
import torch

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
from tokenmill.platforms import detect_platforms, resolve_platform
from tokenmill.plugins import get_platform_specs
from tokenmill_cpu import plugin as cpu_plugin
from tokenmill_cpu.platform import CpuPlatform
from tokenmill_cuda import plugin as cuda_plugin
from tokenmill_cuda.platform import CudaPlatform
from tokenmill_rocm import plugin as rocm_plugin

GiB = 1 << 30
needs_cpu_only = pytest.mark.skipif(torch.accelerator.is_available(), reason="machine has an accelerator")


def _config(dtype: str = "auto", **cache: object) -> EngineConfig:
    model = ModelConfig(model="m", tokenizer="m", hf_config=None, dtype=dtype)
    return EngineConfig(model_config=model, cache_config=CacheConfig(**cache))  # type: ignore[arg-type]


@pytest.fixture
def cuda_build(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """torch looks like a CUDA 12.4 build with two GPUs (nothing real is touched)."""
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    return monkeypatch


@pytest.fixture
def hip_build(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """torch looks like a ROCm 6.2 build with one GPU."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    return monkeypatch


@needs_cpu_only
def test_real_resolution_on_this_machine_is_cpu(clean_plugin_state: None) -> None:
    names = {s.name: s.distribution for s in get_platform_specs()}
    names.pop("cpuref", None)  # the example platform (make test installs it); off unless TOKENMILL_CPUREF=1
    assert names == {"cpu": "tokenmill-cpu", "cuda": "tokenmill-cuda", "rocm": "tokenmill-rocm"}
    assert resolve_platform() is CpuPlatform
    active = [r.plugin.name for r in detect_platforms() if r.active]
    assert active == ["cpu"]


@needs_cpu_only
def test_gpu_detectors_decline_on_cpu_torch() -> None:
    active, reason = cuda_plugin.detect()
    assert not active and "without CUDA" in reason
    active, reason = rocm_plugin.detect()
    assert not active and "not a ROCm/HIP build" in reason
    assert cpu_plugin.detect()[0]


def test_cuda_detector_accepts_mocked_gpus(cuda_build: pytest.MonkeyPatch) -> None:
    active, reason = cuda_plugin.detect()
    assert active and "2 NVIDIA GPU(s)" in reason
    import os

    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"  # count without a CUDA context
    assert not cpu_plugin.detect()[0]  # cpu steps aside: tokenmill-cpu + tokenmill-cuda is no conflict
    assert not rocm_plugin.detect()[0]


def test_cuda_detector_declines_without_visible_gpus(cuda_build: pytest.MonkeyPatch) -> None:
    cuda_build.setattr(torch.cuda, "device_count", lambda: 0)
    active, reason = cuda_plugin.detect()
    assert not active and "sees no NVIDIA GPU" in reason
    assert cpu_plugin.detect()[0]  # a CUDA build of torch without GPUs runs on the CPU


def test_rocm_detector_accepts_mocked_gpus_and_cuda_declines(hip_build: pytest.MonkeyPatch) -> None:
    active, reason = rocm_plugin.detect()
    assert active and "1 AMD GPU(s)" in reason
    active, reason = cuda_plugin.detect()
    assert not active and "tokenmill-rocm" in reason
    assert not cpu_plugin.detect()[0]


def test_mocked_gpu_machine_resolves_to_cuda(clean_plugin_state: None, cuda_build: pytest.MonkeyPatch) -> None:
    assert resolve_platform() is CudaPlatform


def test_check_and_update_config_resolves_auto_dtype() -> None:
    config = _config()
    CpuPlatform.check_and_update_config(config)
    assert config.model_config.dtype == "float32"
    assert (config.device_config.platform, config.device_config.device_type) == ("cpu", "cpu")
    config = _config("bfloat16")
    CpuPlatform.check_and_update_config(config)
    assert config.model_config.dtype == "bfloat16"


def test_check_and_update_config_rejects_unsupported_dtype() -> None:
    with pytest.raises(ValueError, match="dtype='float8'"):
        CpuPlatform.check_and_update_config(_config("float8"))
    with pytest.raises(ValueError, match="^kv_cache_dtype='float8'.*'auto' for the model's dtype"):
        CpuPlatform.check_and_update_config(_config("float32", cache_dtype="float8"))
    config = _config("bfloat16")
    CpuPlatform.check_and_update_config(config)
    assert config.cache_config.cache_dtype == "bfloat16"  # auto: the model's dtype


def test_cpu_kv_cache_bytes() -> None:
    assert CpuPlatform.determine_kv_cache_bytes(_config(kv_cache_memory=123 * 4096)) == 123 * 4096
    default = CpuPlatform.determine_kv_cache_bytes(_config())
    assert 0 < default <= 4 * GiB
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        CpuPlatform.determine_kv_cache_bytes(_config(kv_cache_memory=0))


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s pages that are in memory (``mincore``): unlike the process's RSS, not moved by whatever
    else the test process allocates or frees meanwhile (a full suite run once saw the RSS grow by 52 MB while a
    64 MiB cache was faulted in)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = t.data_ptr() - t.data_ptr() % page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * page


@pytest.mark.skipif(platform.system() != "Linux", reason="needs Linux (mincore)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kv_cache_is_zero_and_takes_no_memory_until_written(dtype: torch.dtype) -> None:
    shape = (2, 1024, 16, 4, 64)  # 16 Mi elements: 32-64 MiB
    assert os.environ["TOKENMILL_CPU_PREFAULT"] == "0"  # tests/conftest.py: no background prefault
    cache = CpuPlatform.allocate_kv_cache(shape, dtype, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert _resident_bytes(cache) < 4 << 20, "the cache was written at allocation"
    cache[1, 1000, 3].fill_(2.0)
    cache[0, 5] = cache[1, 1000]
    assert cache[0, 5, 3].eq(2.0).all() and cache[0, 6].eq(0).all()
    assert float(cache.float().sum()) == 2.0 * 2 * 4 * 64
    with pytest.raises(ValueError, match="cannot use device"):
        CpuPlatform.allocate_kv_cache(shape, dtype, torch.device("meta"))


def _kernel_populates_writes(advice: int) -> bool:
    import ctypes
    import mmap

    buf = mmap.mmap(-1, mmap.PAGESIZE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, mmap.PAGESIZE, advice) == 0


@pytest.mark.skipif(platform.system() != "Linux", reason="needs Linux")
def test_cpu_kv_cache_pages_are_faulted_in_behind_the_engine_without_changing_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time

    from tokenmill_cpu import memory

    if not _kernel_populates_writes(memory.MADV_POPULATE_WRITE):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux before 5.14)")
    monkeypatch.setenv("TOKENMILL_CPU_PREFAULT", "1")
    monkeypatch.setattr(memory, "_prefault_failed", False)
    monkeypatch.setattr(memory, "PREFAULT_CHUNK_BYTES", 1 << 20)  # many chunks, so writes land while it runs
    shape = (2, 2048, 16, 4, 64)  # 64 MiB of float32
    cache = CpuPlatform.allocate_kv_cache(shape, torch.float32, torch.device("cpu"))
    other = CpuPlatform.allocate_kv_cache((2, 64, 16, 4, 64), torch.float32, torch.device("cpu"))
    cache[1, 2047, 15].fill_(3.0)  # written while the thread walks the mapping
    cache[0, 7].fill_(-1.0)
    del other  # a freed cache is dropped from the queue, not touched
    deadline = time.monotonic() + 60
    while (memory.prefault_pending_bytes() or memory._prefault_thread is not None) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert memory.prefault_pending_bytes() == 0 and memory._prefault_thread is None
    assert _resident_bytes(cache) == cache.numel() * cache.element_size(), "the pages were not faulted in"
    assert cache[1, 2047, 15].eq(3.0).all() and cache[0, 7].eq(-1.0).all()
    assert float(cache.sum()) == 3.0 * 4 * 64 - 16 * 4 * 64


def _claim_all(memory: types.ModuleType) -> list[tuple[int, int, bool]]:
    """Every queued prefault chunk, taken by hand: ``(address, bytes, urgent)`` in claim order."""
    claims = []
    with memory._prefault_lock:
        while (chunk := memory._claim_chunk()) is not None:
            claims.append(chunk[1:])
    return claims


@pytest.mark.skipif(platform.system() != "Linux", reason="needs Linux")
def test_the_prefault_starts_with_the_lowest_blocks_of_every_key_and_value_range(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from tokenmill_cpu import memory

    monkeypatch.setenv("TOKENMILL_CPU_PREFAULT", "1")
    monkeypatch.setattr(memory, "_prefault_failed", False)
    monkeypatch.setattr(memory, "_prefault_queue", [])
    monkeypatch.setattr(memory, "_prefault_next", 5)  # left over from an earlier tensor: reset for an empty queue
    monkeypatch.setattr(memory, "_prefault_thread", threading.Thread(target=lambda: None))  # claimed by hand here
    chunk = 64 << 10
    monkeypatch.setattr(memory, "PREFAULT_CHUNK_BYTES", chunk)
    shape = (2, 3, 50, 16, 64)  # keys and values of 3 KV heads: 6 ranges of 200 KiB (not chunk-aligned)
    cache = CpuPlatform.allocate_kv_cache(shape, torch.float32, torch.device("cpu"))
    base, region = cache.data_ptr(), cache[0, 0].numel() * 4
    starts = [base + r * region for r in range(6)]
    claims = _claim_all(memory)
    assert [addr for addr, _, _ in claims[:6]] == starts  # block 0 of each range first
    assert [addr for addr, _, _ in claims[6:12]] == [(s // chunk + 1) * chunk for s in starts]
    # Urgent (normal priority) until every chunk that begins in the first 64 KiB of its range is taken.
    begins_early = [addr < max(s for s in starts if s <= addr) + chunk for addr, _, _ in claims]
    last_early = max(i for i, early in enumerate(begins_early) if early)
    assert last_early >= 6 and [urgent for _, _, urgent in claims] == [i <= last_early for i in range(len(claims))]
    pos = base  # the chunks tile the cache: no gap, no overlap
    for addr, n, _ in sorted(claims):
        assert addr == pos and n > 0 and ((addr + n) % chunk == 0 or addr + n in {s + region for s in starts})
        pos += n
    assert pos == base + cache.numel() * 4 and memory.prefault_pending_bytes() == 0

    # The background loop drops to SCHED_IDLE right after the last urgent chunk.
    if not _kernel_populates_writes(memory.MADV_POPULATE_WRITE):
        return
    other = CpuPlatform.allocate_kv_cache(shape, torch.float32, torch.device("cpu"))
    queued = list(memory._prefault_queue)
    order = _claim_all(memory)  # what the loop below will take, in order
    memory._prefault_queue[:], memory._prefault_next = queued, 0
    pending_at_drop = []
    monkeypatch.setattr(memory, "_lower_thread_priority", lambda: pending_at_drop.append(memory.prefault_pending_bytes()) or "idle")
    memory._prefault_loop(background=True)
    first_lazy = [urgent for _, _, urgent in order].index(False)
    assert pending_at_drop == [other.numel() * 4 - sum(n for _, n, _ in order[: first_lazy + 1])]
    assert memory.prefault_pending_bytes() == 0


@pytest.mark.skipif(platform.system() != "Linux", reason="needs Linux")
def test_a_layout_with_thousands_of_leading_ranges_is_faulted_in_address_order(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from tokenmill_cpu import memory

    monkeypatch.setenv("TOKENMILL_CPU_PREFAULT", "1")
    monkeypatch.setattr(memory, "_prefault_failed", False)
    monkeypatch.setattr(memory, "_prefault_queue", [])
    monkeypatch.setattr(memory, "_prefault_thread", threading.Thread(target=lambda: None))
    monkeypatch.setattr(memory, "PREFAULT_CHUNK_BYTES", 64 << 10)
    cache = CpuPlatform.allocate_kv_cache((2, 512, 16, 2, 64), torch.float32, torch.device("cpu"))  # [2, blocks, ...]
    claims = _claim_all(memory)
    assert [addr for addr, _, _ in claims] == sorted(addr for addr, _, _ in claims)
    assert claims[0][0] == cache.data_ptr() and sum(n for _, n, _ in claims) == cache.numel() * 4


@pytest.mark.skipif(platform.system() != "Linux", reason="needs Linux")
def test_finishing_the_kv_cache_faults_in_what_the_background_thread_left(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from tokenmill_cpu import memory

    if not _kernel_populates_writes(memory.MADV_POPULATE_WRITE):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux before 5.14)")
    monkeypatch.setenv("TOKENMILL_CPU_PREFAULT", "1")
    monkeypatch.setattr(memory, "_prefault_failed", False)
    # A thread that never runs stands for a background thread starved by busy cores: the caller does it all.
    monkeypatch.setattr(memory, "_prefault_thread", threading.Thread(target=lambda: None))
    shape = (2, 2048, 16, 4, 64)  # 64 MiB of float32
    cache = CpuPlatform.allocate_kv_cache(shape, torch.float32, torch.device("cpu"))
    assert memory.prefault_pending_bytes() == cache.numel() * 4
    CpuPlatform.finish_kv_cache_allocation()
    assert memory.prefault_pending_bytes() == 0
    assert _resident_bytes(cache) == cache.numel() * cache.element_size(), "the pages were not faulted in"
    assert float(cache.abs().sum()) == 0.0


def test_the_model_runner_finishes_the_kv_caches_in_blocking_mode_only(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine_args import EngineArgs

    calls = []
    monkeypatch.setattr(CpuPlatform, "finish_kv_cache_allocation", classmethod(lambda cls: calls.append(cls)))
    for mode, expected in (("blocking", 1), ("background", 0)):
        calls.clear()
        config = EngineArgs(model=tiny_llama_dir, enforce_eager=True, compile_mode=mode,
                            kv_cache_memory="16MiB").create_engine_config()
        EngineCore(config).shutdown()
        assert len(calls) == expected, mode


@pytest.mark.skipif(platform.system() != "Linux", reason="needs Linux")
def test_a_kernel_refusing_the_prefault_leaves_the_pages_to_first_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from tokenmill_cpu import memory

    monkeypatch.setenv("TOKENMILL_CPU_PREFAULT", "1")
    monkeypatch.setattr(memory, "_prefault_failed", False)
    monkeypatch.setattr(memory, "MADV_POPULATE_WRITE", 9999)  # an advice no kernel knows: EINVAL, as before 5.14
    cache = memory.lazily_zeroed_tensor((1 << 20,), torch.float32)
    assert memory.prefault_async(cache)
    deadline = time.monotonic() + 30
    while (memory.prefault_pending_bytes() or memory._prefault_thread is not None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert memory._prefault_failed and memory._prefault_thread is None
    assert not memory.prefault_async(cache)  # not tried again in this process
    assert float(cache.sum()) == 0.0


def test_tokenmill_cpu_prefault_0_leaves_the_pages_to_first_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill_cpu import memory

    monkeypatch.setenv("TOKENMILL_CPU_PREFAULT", "0")
    assert not memory.prefault_async(torch.zeros(16))


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="needs Linux transparent huge pages")
def test_cpu_kv_cache_asks_for_transparent_huge_pages() -> None:
    # "hg": the mapping was madvise(MADV_HUGEPAGE)d, so decode attention's scattered block reads take few TLB
    # misses even where THP is only enabled on request ("madvise", a common default).
    cache = CpuPlatform.allocate_kv_cache((2, 64, 16, 4, 64), torch.float32, torch.device("cpu"))
    assert "hg" in _vm_flags(cache.data_ptr())


def test_the_model_runner_allocates_the_kv_cache_through_the_platform(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.models.test_llama_correctness import PROMPTS, run_engine
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine_args import EngineArgs

    calls = []
    original = CpuPlatform.allocate_kv_cache.__func__

    def counting(cls, shape, dtype, device):
        calls.append((shape, dtype))
        return original(cls, shape, dtype, device)

    monkeypatch.setattr(CpuPlatform, "allocate_kv_cache", classmethod(counting))
    args = EngineArgs(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64, enforce_eager=True)
    core = EngineCore(args.create_engine_config())
    layers = core.executor.worker.model_runner.attn_layers
    assert len(calls) == len(layers) > 0 and all(c[0][0] == 64 or 64 in c[0] for c in calls) and all(c[1] == torch.float32 for c in calls)
    assert run_engine(core, PROMPTS[:1], max_tokens=4)


def test_cpu_device_facts() -> None:
    assert CpuPlatform.get_device_name()
    assert CpuPlatform.get_device_total_memory() > GiB
    assert CpuPlatform.make_device(3) == torch.device("cpu")
    assert CpuPlatform.is_cpu() and not CpuPlatform.is_cuda_alike()
    CpuPlatform.manual_seed_all(0)
    CpuPlatform.synchronize()


def test_cuda_kv_cache_bytes_from_memory_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(CudaPlatform, "get_device_total_memory", classmethod(lambda cls, device_id=0: 80 * GiB))
    config = _config(gpu_memory_utilization=0.5)
    got = CudaPlatform.determine_kv_cache_bytes(config, model_memory_bytes=10 * GiB, peak_activation_bytes=GiB)
    assert got == 29 * GiB
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        CudaPlatform.determine_kv_cache_bytes(config, model_memory_bytes=40 * GiB)


def test_cuda_config_checks_tensor_parallel_size(cuda_build: pytest.MonkeyPatch) -> None:
    config = _config()
    CudaPlatform.check_and_update_config(config)
    assert config.model_config.dtype == "bfloat16"
    assert config.device_config.device_type == "cuda"
    config.parallel_config.tensor_parallel_size = 4
    with pytest.raises(ValueError, match="--tensor-parallel-size 4.*CUDA_VISIBLE_DEVICES"):
        CudaPlatform.check_and_update_config(config)


def test_cpu_platform_gives_inductor_its_own_cache_under_a_lowered_capability(monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # set, then removed: monkeypatch restores the variable's state from before the test at teardown
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "x")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "x")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    CpuPlatform.set_device(torch.device("cpu"))
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # the machine's own level: torch's default cache
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "AVX2")
    CpuPlatform.set_device(torch.device("cpu"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.abspath(default_cache_dir()) + "_avx2"
    # Inductor's own default, written into the environment by an earlier compile, is not a user's choice
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    CpuPlatform.set_device(torch.device("cpu"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("_avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/chosen")
    CpuPlatform.set_device(torch.device("cpu"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/chosen"  # a choice of the user's is kept
    with pytest.raises(ValueError, match="cannot use device"):
        CpuPlatform.set_device(torch.device("meta"))
