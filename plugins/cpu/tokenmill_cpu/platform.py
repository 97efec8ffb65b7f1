"""CpuPlatform: torch on the host CPU, gloo for tensor parallelism."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from tokenmill.platforms import Platform
from tokenmill_cpu import memory

if TYPE_CHECKING:
    import torch

    from tokenmill.config import EngineConfig

GiB = 1 << 30
DEFAULT_KV_CACHE_CAP_BYTES = 4 * GiB
CPU_ATTN_BACKEND = "tokenmill_cpu.attention:CpuPagedAttentionBackend"


class CpuPlatform(Platform):
    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    default_dtype: ClassVar[str] = "float32"  # correctness first; bfloat16 with --dtype bfloat16
    supports_graph_capture: ClassVar[bool] = False
    supports_compile: ClassVar[bool] = True  # fused pointwise work; per-op overhead dominates small steps on a CPU

    @classmethod
    def get_attn_backend_cls(cls, config: EngineConfig) -> str:
        """The torch paged backend with decode attention in this plugin's C++ kernel (``tokenmill_cpu.attention``)."""
        return CPU_ATTN_BACKEND

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
        and this plugin's kernels with the code path each runs (``tokenmill_cpu.kernels.isa``)."""
        import torch

        from tokenmill_cpu import kernels

        isa = kernels.isa()
        info = {
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "dense_matmul": "oneDNN (torch)" if torch.backends.mkldnn.is_available() else "torch",
        }
        if kernels.ready():
            info["decode_attention"] = f"tokenmill_cpu.paged_decode ({isa['paged_decode']})"
            info["quantized_matmul"] = f"tokenmill_cpu.q4_linear/q8_linear ({isa['quant_linear']})"
        else:
            info["decode_attention"] = "torch (tokenmill-cpu kernels not loaded)"
            info["quantized_matmul"] = "torch packed int8/int4 ops"
        return info

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return memory.cpu_model_name()

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return memory.total_memory_bytes()

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def determine_kv_cache_bytes(
        cls, config: EngineConfig, *, model_memory_bytes: int = 0, peak_activation_bytes: int = 0
    ) -> int:
        """``--kv-cache-memory`` when given, else min(4 GiB, a quarter of the available RAM).

        Raises:
            ValueError: ``--kv-cache-memory`` is not positive.
            RuntimeError: available RAM cannot be determined (see ``memory.available_memory_bytes``).
        """
        explicit = config.cache_config.kv_cache_memory
        if explicit is not None:
            if explicit <= 0:
                raise ValueError(f"--kv-cache-memory must be positive, got {explicit} bytes")
            return int(explicit)
        return min(DEFAULT_KV_CACHE_CAP_BYTES, memory.available_memory_bytes() // 4)

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"the cpu platform cannot use device {device}")

    @classmethod
    def synchronize(cls) -> None:
        return None  # CPU ops run synchronously

    @classmethod
    def make_device(cls, local_rank: int) -> torch.device:
        import torch

        return torch.device("cpu")
