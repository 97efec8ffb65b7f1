"""The Platform contract: what the engine asks of the hardware a platform plugin supports.

A platform plugin ships a :class:`Platform` subclass (class attributes + classmethods, never instantiated)
and a :class:`PlatformSpec` that names it by ``"module:Class"`` path, so choosing a platform imports nothing
heavy. Methods that touch the device are only called from workers, after platform selection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from tokenmill.platforms.errors import NoPlatformError

if TYPE_CHECKING:
    import torch

    from tokenmill.config import EngineConfig

DetectResult = bool | tuple[bool, str]

DEFAULT_ATTN_BACKEND = "tokenmill.attention.backends.torch_paged:TorchPagedAttentionBackend"
DEFAULT_WORKER = "tokenmill.worker.worker:Worker"


@dataclass(frozen=True)
class PlatformSpec:
    """What a platform plugin's ``tokenmill_platform()`` hook returns.

    Attributes:
        name: the platform's name, as given to ``--platform`` / ``TOKENMILL_PLATFORM`` (e.g. ``"cuda"``).
        detect: cheap check whether this machine has the hardware. Must not initialise a device (no CUDA
            context: workers fork later). Returns ``True``/``False``, or ``(active, reason)`` where
            ``reason`` says why it declined (shown to the user when no platform is active).
        platform_cls: ``"module:Class"`` path of the :class:`Platform` subclass, imported only if chosen.
        description: one line for listings, e.g. ``"NVIDIA GPUs (CUDA)"``.
    """

    name: str
    detect: Callable[[], DetectResult]
    platform_cls: str
    description: str = ""


class Platform:
    """Base class of every platform: class attributes and classmethods, never instantiated.

    Subclasses set the attributes and implement the device methods (the defaults raise
    ``NotImplementedError`` naming the class).
    """

    name: ClassVar[str] = "base"
    device_type: ClassVar[str] = "cpu"  # torch device type: "cpu", "cuda", ...
    dist_backend: ClassVar[str] = "gloo"  # torch.distributed backend: "gloo", "nccl", ...
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    default_dtype: ClassVar[str] = "float32"
    supports_graph_capture: ClassVar[bool] = False
    # torch.compile the forward pass of every step (tokenmill.worker.compiled_runner)
    supports_compile: ClassVar[bool] = False
    worker_cls: ClassVar[str] = DEFAULT_WORKER

    @classmethod
    def get_attn_backend_cls(cls, config: EngineConfig) -> str:
        """``"module:Class"`` of the attention backend to use for ``config``."""
        return DEFAULT_ATTN_BACKEND

    @classmethod
    def get_quant_method_cls(cls, method: str) -> str | None:
        """``"module:Class"`` of the :class:`tokenmill.layers.quantization.QuantizedWeight` implementing
        ``--quantization method`` here, or ``None`` when unsupported. The default offers ``int8`` (torch's
        ``aten._weight_int8pack_mm``)."""
        return {"int8": "tokenmill.layers.quantization:Int8WeightOnly"}.get(method)

    @classmethod
    def get_fused_moe_cls(cls) -> str:
        """``"module:Class"`` of the :class:`tokenmill.layers.fused_moe.FusedMoEMethod` that computes the
        experts of mixture-of-experts layers here. The default is the portable torch implementation (tokens
        grouped by expert, grouped matrix multiplies); a platform with its own kernel returns its class.
        Read by every ``FusedMoE`` layer when the model is built."""
        return "tokenmill.layers.fused_moe:TorchFusedMoEMethod"

    @classmethod
    def get_lora_method_cls(cls) -> str:
        """``"module:Class"`` of the :class:`tokenmill.lora.ops.LoRAMethod` that adds the batched LoRA update
        (shrink/expand per adapter slot) to the outputs of LoRA layers here. The default is the portable torch
        implementation (tokens grouped by adapter); a platform with a Punica-style kernel returns its class.
        Read once per worker when ``--enable-lora`` wraps the model's layers."""
        return "tokenmill.lora.ops:TorchLoRAMethod"

    @classmethod
    def graph_capture_cls(cls) -> str | None:
        """``"module:Class"`` of the platform's device-graph capture (a
        :class:`tokenmill.worker.graph_runner.GraphCapture` subclass), or ``None`` (default): no graphs.

        Only consulted when :attr:`supports_graph_capture` is true; decode steps are then captured per batch
        size bucket and replayed unless ``--enforce-eager`` (see ``tokenmill.worker.graph_runner``).
        """
        return None

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        """Human-readable name of device ``device_id`` (e.g. the GPU or CPU model)."""
        raise cls._not_implemented("get_device_name")

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        """Total memory of device ``device_id`` in bytes."""
        raise cls._not_implemented("get_device_total_memory")

    @classmethod
    def device_count(cls) -> int:
        """Number of devices of this platform visible to the process."""
        raise cls._not_implemented("device_count")

    @classmethod
    def determine_kv_cache_bytes(
        cls, config: EngineConfig, *, model_memory_bytes: int = 0, peak_activation_bytes: int = 0
    ) -> int:
        """Bytes of device memory the KV cache of one worker may use.

        Args:
            config: the engine config (``cache_config.kv_cache_memory``, ``gpu_memory_utilization``).
            model_memory_bytes: bytes the loaded weights take on the device.
            peak_activation_bytes: peak bytes of a profiling forward pass beyond the weights.

        Raises:
            ValueError: the settings leave no memory for the KV cache.
        """
        raise cls._not_implemented("determine_kv_cache_bytes")

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """Make ``device`` the current device of this process."""
        raise cls._not_implemented("set_device")

    @classmethod
    def synchronize(cls) -> None:
        """Wait until all queued work on the current device has finished."""
        raise cls._not_implemented("synchronize")

    @classmethod
    def kernel_info(cls) -> dict[str, str]:
        """Which kernels and instruction sets this platform's steps use now (benchmarks print and record it),
        e.g. ``{"attention": ..., "quantized_matmul": ...}``; default: nothing to report."""
        return {}

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        """Seed the random generators of torch on the host and on every device of this platform."""
        import torch

        torch.manual_seed(seed)

    @classmethod
    def make_device(cls, local_rank: int) -> torch.device:
        """The torch device a worker of local rank ``local_rank`` uses."""
        import torch

        return torch.device(cls.device_type, local_rank)

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        """Validate ``config`` for this platform and fill in what the platform decides.

        Resolves ``model_config.dtype == "auto"`` to :attr:`default_dtype` and records the platform in
        ``config.device_config``.

        Raises:
            ValueError: ``dtype`` is not one of :attr:`supported_dtypes` (the message names ``dtype``).
        """
        model_config = config.model_config
        if model_config.dtype == "auto":
            model_config.dtype = cls.default_dtype
        if model_config.dtype not in cls.supported_dtypes:
            raise ValueError(
                f"dtype={model_config.dtype!r} is not supported on platform {cls.name!r}; "
                f"choose one of {', '.join(cls.supported_dtypes)} (or 'auto' for {cls.default_dtype})"
            )
        config.device_config.platform = cls.name
        config.device_config.device_type = cls.device_type

    @classmethod
    def is_cpu(cls) -> bool:
        return cls.device_type == "cpu"

    @classmethod
    def is_cuda_alike(cls) -> bool:
        """True for CUDA and ROCm (both use torch's ``"cuda"`` device type)."""
        return cls.device_type == "cuda"

    @classmethod
    def _not_implemented(cls, method: str) -> NotImplementedError:
        return NotImplementedError(f"platform {cls.name!r} ({cls.__qualname__}) does not implement {method}()")


class UnspecifiedPlatform(Platform):
    """Placeholder when no platform plugin is active; anything that needs a device fails clearly."""

    name: ClassVar[str] = "unspecified"
    device_type: ClassVar[str] = ""
    dist_backend: ClassVar[str] = ""
    supported_dtypes: ClassVar[tuple[str, ...]] = ()
    default_dtype: ClassVar[str] = ""

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        """Raises:
        NoPlatformError: always; install a platform plugin or pass ``--platform``.
        """
        raise NoPlatformError(
            "no tokenmill platform is active; install one (e.g. `pip install tokenmill-cpu`) "
            "or choose one with --platform NAME / TOKENMILL_PLATFORM=NAME"
        )
