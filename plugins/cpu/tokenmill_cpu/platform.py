"""CpuPlatform: torch on the host CPU, gloo for tensor parallelism."""

from __future__ import annotations

import getpass
import os
import tempfile
from typing import TYPE_CHECKING, ClassVar

from tokenmill.plugin_api import Platform
from tokenmill_cpu import memory

if TYPE_CHECKING:
    import torch

    from tokenmill.plugin_api import EngineConfig

GiB = 1 << 30
DEFAULT_KV_CACHE_CAP_BYTES = 4 * GiB
MAX_PREFAULT_RANGES = 128  # 2 * Hkv of the paged layout; more: taken for another layout (allocate_kv_cache)
CPU_ATTN_BACKEND = "CPU_PAGED"  # registered by tokenmill_cpu.plugin (tokenmill_cpu.attention:CpuPagedAttentionBackend)


_CUSTOM_OPS = {
    "unquantized_linear": "tokenmill_cpu.dense_linear:CpuUnquantizedLinearMethod",
    "causal_conv1d": "tokenmill_cpu.state_ops:CpuCausalConv1d",
    "mamba_ssd": "tokenmill_cpu.state_ops:CpuMambaSSD",
    "gated_delta_rule": "tokenmill_cpu.state_ops:CpuGatedDeltaRule",
}


class CpuPlatform(Platform):
    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    default_dtype: ClassVar[str] = "float32"  # correctness first; bfloat16 with --dtype bfloat16
    supports_graph_capture: ClassVar[bool] = False
    supports_compile: ClassVar[bool] = True  # fused pointwise work; per-op overhead dominates small steps on a CPU
    # These override Platform's class attributes of the same names (see platforms/interface.py).
    ranks_share_device: ClassVar[bool] = True
    # KV cache: min(4 GiB, a quarter of the RAM available once the weights are loaded) unless --kv-cache-memory
    memory_accounting: ClassVar[str] = "available"
    kv_cache_available_fraction: ClassVar[float] = 0.25
    kv_cache_cap_bytes: ClassVar[int | None] = DEFAULT_KV_CACHE_CAP_BYTES

    @classmethod
    def get_attn_backend_cls(cls, config: EngineConfig) -> str:
        """``CPU_PAGED``: the torch paged backend with decode attention in this plugin's C++ kernel
        (``tokenmill_cpu.attention``)."""
        return CPU_ATTN_BACKEND

    @classmethod
    def get_custom_op_cls(cls, name: str) -> str | None:
        """``unquantized_linear``: float32 / bfloat16 linear layers on oneDNN-packed weights
        (``tokenmill_cpu.dense_linear``); ``causal_conv1d``, ``mamba_ssd`` and ``gated_delta_rule``: the state
        layers' decode step in this plugin's C++ kernels (``tokenmill_cpu.state_ops``); every other op is the
        built-in."""
        return _CUSTOM_OPS.get(name)

    @classmethod
    def get_quant_method_cls(cls, method: str) -> str | None:
        """``int8`` and ``int4`` in this plugin's VNNI kernels (``tokenmill_cpu.quant_linear``); torch's packed
        int8/int4 ops when the kernels cannot be built (or ``TOKENMILL_CPU_KERNELS=0``)."""
        from tokenmill_cpu import kernels  # imports torch; platform detection must not

        if kernels.load():
            return {"int8": "tokenmill_cpu.quant_linear:Q8Weight",
                    "int4": "tokenmill_cpu.quant_linear:Q4Weight"}.get(method)
        if method == "int4":
            return "tokenmill_cpu.int4:Int4WeightOnly"
        return super().get_quant_method_cls(method)

    @classmethod
    def kernel_info(cls) -> dict[str, str]:
        """torch's CPU capability (its own vectorized ops, ``ATEN_CPU_CAPABILITY``), the dense matmul library,
        and this plugin's kernels (decode attention, quantized matmuls, the state layers' ops) with the code path
        each runs (``tokenmill_cpu.kernels.isa``)."""
        import torch

        from tokenmill_cpu import dense_linear, kernels

        isa = kernels.isa()
        info = {
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "dense_matmul": dense_linear.describe(),
        }
        if kernels.ready():
            info["decode_attention"] = f"tokenmill_cpu.paged_decode ({isa['paged_decode']})"
            info["quantized_matmul"] = f"tokenmill_cpu.q4_linear/q8_linear ({isa['quant_linear']})"
            info["state_layers"] = f"tokenmill_cpu.state_ops ({isa['state_update']})"
        else:
            info["decode_attention"] = "torch (tokenmill-cpu kernels not loaded)"
            info["quantized_matmul"] = "torch packed int8/int4 ops"
            info["state_layers"] = "torch (tokenmill-cpu kernels not loaded)"
        return info

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return memory.cpu_model_name()

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return memory.total_memory_bytes()

    @classmethod
    def get_device_available_memory(cls, device_id: int = 0) -> int:
        """RAM available without swapping (``/proc/meminfo`` MemAvailable, or psutil).

        Raises:
            RuntimeError: neither source exists; pass ``--kv-cache-memory``.
        """
        return memory.available_memory_bytes()

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def supports_memory_profiling(cls) -> bool:
        return False  # host allocations are not tracked; "available" accounting sees the loaded weights

    @classmethod
    def allocate_kv_cache(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Zeros from anonymous pages the OS zeroes on first touch (``memory.lazily_zeroed_tensor``), so start-up
        does not write the whole cache; a background thread then faults the pages in ahead of use
        (``memory.prefault_async``), so steps do not pay for first writes. In the paged layout of this plugin's
        attention backend, ``[2, Hkv, num_blocks, block_size, D]``, that thread starts with the lowest block ids of
        each of the ``2 * Hkv`` ranges, which the block pool hands out first. The shape alone does not name the
        layout: a 5-D shape ``[2, X, ...]`` with ``2 * X`` above :data:`MAX_PREFAULT_RANGES` (another backend's
        ``[2, num_blocks, ...]``) is faulted in in address order, as is any other shape (only the order
        differs)."""
        cls.set_device(device)
        cache = memory.lazily_zeroed_tensor(shape, dtype)
        ranges = 2 * shape[1] if len(shape) == 5 and shape[0] == 2 else 1
        memory.prefault_async(cache, regions=ranges if ranges <= MAX_PREFAULT_RANGES else 1)
        return cache

    @classmethod
    def finish_kv_cache_allocation(cls) -> None:
        """Wait for the background prefault of the KV caches (``memory.wait_for_prefault``), so that an engine
        prepared in blocking mode (``LLM``, the benchmarks) never pays for first writes in its steps: a prefill
        profile's cache writes took 2.69 ms per call on fresh pages against 0.24 ms on faulted ones, 882 against
        998 prompt tok/s (docs/benchmarks-history.md, "2026-12-02 Xeon (538f577)")."""
        memory.wait_for_prefault()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """Check that ``device`` is the CPU, and give Inductor a cache of its own under a lowered instruction set
        (:func:`separate_inductor_cache`) before this worker compiles anything. Raises ``ValueError`` for
        another device."""
        if device.type != "cpu":
            raise ValueError(f"the cpu platform cannot use device {device}")
        separate_inductor_cache()

    @classmethod
    def synchronize(cls) -> None:
        return None  # CPU ops run synchronously

    @classmethod
    def make_device(cls, local_rank: int) -> torch.device:
        import torch

        return torch.device("cpu")


def separate_inductor_cache() -> str | None:
    """Under ``ATEN_CPU_CAPABILITY`` (e.g. ``avx2`` to measure an AVX-512 machine's AVX2 paths, as
    docs/benchmarks.md does), point ``TORCHINDUCTOR_CACHE_DIR`` at a directory of that capability
    (``<Inductor's default>_<capability>``), unless the variable names another directory than Inductor's default;
    returns the directory set, or ``None``.

    Why: Inductor generates its C++ loops for the capability it sees, but its cache key does not tell the
    capabilities apart, so a process at the machine's own level can load loops generated under ``avx2`` for the
    same graph. On an AVX-512 Xeon (torch 2.13.0) that aborted the process ("double free or corruption") the
    first time a graph compiled under ``ATEN_CPU_CAPABILITY=avx2`` was loaded without it.
    """
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if not capability:
        return None
    default = _default_inductor_cache()
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # Inductor writes its default into the environment when it first runs, and children inherit it: that value
    # is not a choice of the user's.
    if chosen and os.path.abspath(chosen) != default:
        return None
    path = f"{default}_{capability.lower()}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def _default_inductor_cache() -> str:
    """Inductor's default cache directory (``<tmp>/torchinductor_<user>``), absolute."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(default_cache_dir())
    except (ImportError, AttributeError):  # another torch layout: the same rule, written out
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = f"uid_{os.getuid()}"
        return os.path.abspath(os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"))
