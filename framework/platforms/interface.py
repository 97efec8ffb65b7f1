"""The Platform contract: what the engine asks of the hardware a platform plugin supports.

A platform plugin ships a :class:`Platform` subclass (class attributes + classmethods, never instantiated)
and a :class:`PlatformSpec` that names it by ``"module:Class"`` path, so choosing a platform imports nothing
heavy. Methods that touch the device are only called from workers, after platform selection.

The base class holds the logic every platform shares, so a plugin states only what differs:

* Device facts (name, memory, count, set/synchronize, peak-memory statistics) default to torch's
  device-generic API for :attr:`Platform.device_type` (``torch.get_device_module(device_type)`` and
  ``torch.accelerator``), which serves CUDA, ROCm and any accelerator torch knows as its current one (an
  out-of-tree ``PrivateUse1`` backend included). A host-memory platform overrides them.
* KV-cache sizing (:meth:`Platform.determine_kv_cache_bytes`) is one formula over those facts and a few class
  attributes (:attr:`memory_accounting`, :attr:`kv_cache_available_fraction`, :attr:`kv_cache_cap_bytes`).
* ``check_and_update_config`` resolves the dtype and checks that there are enough devices for the ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from tokenmill.config import QUANTIZED_KV_CACHE_DTYPES
from tokenmill.platforms.errors import NoPlatformError

if TYPE_CHECKING:
    import torch

    from tokenmill.config import EngineConfig

DetectResult = bool | tuple[bool, str]

DEFAULT_ATTN_BACKEND = "TORCH_PAGED"  # a name in tokenmill.attention.registry.AttentionBackendRegistry
DEFAULT_WORKER = "tokenmill.worker.worker:Worker"
GiB = 1 << 30


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

    Attributes:
        name: the platform's name (``--platform NAME``).
        device_type: torch device type (``"cpu"``, ``"cuda"``, ``"xpu"``, a ``PrivateUse1`` name, ...).
        dist_backend: torch.distributed backend of tensor-parallel ranks (``"gloo"``, ``"nccl"``, ...).
        supported_dtypes, default_dtype: model dtypes the platform runs (``"float32"``, ``"bfloat16"``,
            ``"float16"``); ``--dtype auto`` means ``default_dtype``.
        supports_graph_capture: decode steps may be captured as device graphs (with
            :meth:`graph_capture_cls`).
        supports_compile: ``torch.compile`` the forward pass of every step (``tokenmill.worker.compiled_runner``).
        worker_cls: ``"module:Class"`` of the Worker (override to customise device set-up).
        visible_devices_env: the environment variable that limits the visible devices (named in errors).
        ranks_share_device: several ranks may run on one device (always so for ``device_type == "cpu"``);
            otherwise every local rank needs its own device (checked by :meth:`check_and_update_config`).
        memory_accounting: how :meth:`determine_kv_cache_bytes` sizes the cache: ``"total"`` (a device of its
            own: ``total x gpu_memory_utilization - weights - peak activations``) or ``"available"`` (memory
            shared with the OS, like host RAM: ``available now x kv_cache_available_fraction - peak
            activations``, the weights being already loaded and so already out of "available").
        kv_cache_available_fraction: the share of available memory the cache may take (``"available"``).
        kv_cache_cap_bytes: the cache never takes more than this (``None``: no cap).
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
    visible_devices_env: ClassVar[str] = ""
    ranks_share_device: ClassVar[bool] = False
    memory_accounting: ClassVar[str] = "total"
    kv_cache_available_fraction: ClassVar[float] = 0.25
    kv_cache_cap_bytes: ClassVar[int | None] = None

    # -- what the platform runs -----------------------------------------------------------------------------

    @classmethod
    def get_attn_backend_cls(cls, config: EngineConfig) -> str:
        """The attention backend to use for ``config``: a name registered in
        :class:`tokenmill.attention.registry.AttentionBackendRegistry` (``"TORCH_PAGED"``,
        ``"TRITON_PAGED"``, or one a plugin registers with ``tokenmill_register_attention_backends``), which
        the registry resolves, so a plugin may override it. A ``"module:Class"`` path also works but bypasses
        the registry. ``--attention-backend`` (``TOKENMILL_ATTENTION_BACKEND``) overrides this choice."""
        return DEFAULT_ATTN_BACKEND

    @classmethod
    def get_quant_method_cls(cls, method: str) -> str | None:
        """``"module:Class"`` of the :class:`tokenmill.layers.quantization.QuantizedWeight` implementing
        ``--quantization method`` here, or ``None`` when unsupported. The default offers ``int8`` (torch's
        ``aten._weight_int8pack_mm``). A ``quant_linear.<method>`` custom op from a plugin takes precedence."""
        return {"int8": "tokenmill.layers.quantization:Int8WeightOnly"}.get(method)

    @classmethod
    def get_fused_moe_cls(cls) -> str:
        """``"module:Class"`` of the :class:`tokenmill.layers.fused_moe.FusedMoEMethod` that computes the
        experts of mixture-of-experts layers here. The default is the portable torch implementation (tokens
        grouped by expert, grouped matrix multiplies); a platform with its own kernel returns its class.
        Read by every ``FusedMoE`` layer when the model is built (a ``fused_moe`` custom op from a plugin
        takes precedence)."""
        return "tokenmill.layers.fused_moe:TorchFusedMoEMethod"

    @classmethod
    def get_lora_method_cls(cls) -> str:
        """``"module:Class"`` of the :class:`tokenmill.lora.ops.LoRAMethod` that adds the batched LoRA update
        (shrink/expand per adapter slot) to the outputs of LoRA layers here. The default is the portable torch
        implementation (tokens grouped by adapter); a platform with a Punica-style kernel returns its class.
        Read once per worker when ``--enable-lora`` wraps the model's layers."""
        return "tokenmill.lora.ops:TorchLoRAMethod"

    @classmethod
    def get_custom_op_cls(cls, name: str) -> str | None:
        """``"module:Class"`` replacing custom op ``name`` (``"rms_norm"``, ``"rotary_embedding"``,
        ``"silu_and_mul"``, ``"gelu_and_mul"``, ``"unquantized_linear"``; see :mod:`tokenmill.layers.custom_op`)
        on this platform, or ``None`` (default): the built-in. The class must subclass the op's built-in class;
        the conformance kit checks it against the built-in (``forward_native``; ``F.linear`` for
        ``unquantized_linear``)."""
        return None

    @classmethod
    def graph_capture_cls(cls) -> str | None:
        """``"module:Class"`` of the platform's device-graph capture (a
        :class:`tokenmill.worker.graph_runner.GraphCapture` subclass), or ``None`` (default): no graphs.

        Only consulted when :attr:`supports_graph_capture` is true; decode steps are then captured per batch
        size bucket and replayed unless ``--enforce-eager`` (see ``tokenmill.worker.graph_runner``).
        """
        return None

    # -- device facts (torch's device-generic API by default) -----------------------------------------------

    @classmethod
    def device_module(cls) -> object:
        """torch's module for :attr:`device_type` (``torch.cuda`` for ``"cuda"``, ``torch.cpu``, ...)."""
        import torch

        return torch.get_device_module(cls.device_type)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        """Human-readable name of device ``device_id`` (e.g. the GPU or CPU model)."""
        module = cls.device_module()
        if not hasattr(module, "get_device_name"):
            raise cls._not_implemented("get_device_name")
        return str(module.get_device_name(device_id))  # type: ignore[attr-defined]

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        """Total memory of device ``device_id`` in bytes."""
        module = cls.device_module()
        if not hasattr(module, "get_device_properties"):
            raise cls._not_implemented("get_device_total_memory")
        return int(module.get_device_properties(device_id).total_memory)  # type: ignore[attr-defined]

    @classmethod
    def _device_call(cls, name: str, *args: Any) -> Any:
        """``torch.<device module>.<name>(*args)``, else ``torch.accelerator.<name>`` (an accelerator whose module
        lacks the function), else ``NotImplementedError`` naming the method."""
        import torch

        fn = getattr(cls.device_module(), name, None)
        if fn is None and cls.device_type != "cpu":
            fn = getattr(torch.accelerator, name, None)
        if fn is None:
            raise cls._not_implemented(name)
        return fn(*args)

    @classmethod
    def get_device_available_memory(cls, device_id: int = 0) -> int:
        """Bytes of device ``device_id`` free for new allocations now."""
        import torch

        module = cls.device_module()
        if hasattr(module, "mem_get_info"):
            return int(module.mem_get_info(device_id)[0])  # type: ignore[attr-defined]
        if cls.device_type == "cpu":
            raise cls._not_implemented("get_device_available_memory")
        return int(torch.accelerator.get_memory_info(torch.device(cls.device_type, device_id))[0])

    @classmethod
    def device_count(cls) -> int:
        """Number of devices of this platform visible to the process (must not create a device context)."""
        return int(cls._device_call("device_count"))

    @classmethod
    def current_device_id(cls) -> int:
        """Index of this process's current device."""
        if cls.device_type == "cpu":
            return 0
        return int(cls._device_call("current_device"))

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """Make ``device`` the current device of this process."""
        if device.type != cls.device_type:
            raise ValueError(f"the {cls.name} platform cannot use device {device}")
        cls._device_call("set_device", device)

    @classmethod
    def synchronize(cls) -> None:
        """Wait until all queued work on the current device has finished."""
        if cls.device_type != "cpu":
            cls._device_call("synchronize")

    @classmethod
    def supports_memory_profiling(cls) -> bool:
        """Whether :meth:`get_peak_memory_bytes` measures this device, so the KV cache is sized after a profiled
        forward pass (default: every accelerator torch tracks allocations of)."""
        return cls.device_type != "cpu"

    @classmethod
    def reset_peak_memory_stats(cls) -> None:
        """Start a new peak-memory measurement on the current device."""
        cls._device_call("reset_peak_memory_stats")

    @classmethod
    def get_current_memory_bytes(cls) -> int:
        """Bytes torch has allocated on the current device now."""
        return int(cls._device_call("memory_allocated"))

    @classmethod
    def get_peak_memory_bytes(cls) -> int:
        """Most bytes torch had allocated on the current device since :meth:`reset_peak_memory_stats`."""
        return int(cls._device_call("max_memory_allocated"))

    @classmethod
    def empty_cache(cls) -> None:
        """Return cached, unused device memory to the device (after profiling)."""
        if cls.device_type != "cpu":
            cls._device_call("empty_cache")

    @classmethod
    def allocate_kv_cache(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zero-filled tensor for one attention layer's KV cache (called once per layer by the model runner).

        Args:
            shape: the attention backend's ``get_kv_cache_shape(num_blocks, block_size, num_kv_heads,
                head_size)``.
            dtype: the cache dtype (the model's).
            device: the worker's device.

        Returns:
            a contiguous tensor of ``shape`` and ``dtype`` on ``device``, every element zero (backends may read
            slots that were never written, masked out, so they must not hold NaN or Inf). Default:
            ``torch.zeros``. A platform whose memory can be zeroed lazily overrides this (the CPU plugin maps
            anonymous pages, which the OS zeroes on first touch, so start-up does not write gigabytes).
        """
        import torch

        return torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def finish_kv_cache_allocation(cls) -> None:
        """Block until what :meth:`allocate_kv_cache` left running in the background is done (e.g. faulting a
        lazily zeroed cache's pages in). The model runner calls it once, after every cache is allocated and the
        compiled graphs are ready, when the engine prepares fully before serving (``--compile-mode blocking``,
        the default of ``LLM`` and the benchmarks); a server in background mode answers at once instead and
        never calls it. Default: nothing to wait for."""

    @classmethod
    def kernel_info(cls) -> dict[str, str]:
        """Which kernels and instruction sets this platform's steps use now, e.g. ``{"attention": ...,
        "quantized_matmul": ...}`` (``tokenmill bench`` prints and records it); default: nothing to report."""
        return {}

    # -- shared logic ---------------------------------------------------------------------------------------

    @classmethod
    def determine_kv_cache_bytes(
        cls, config: EngineConfig, *, model_memory_bytes: int = 0, peak_activation_bytes: int = 0
    ) -> int:
        """Bytes of device memory the KV cache of one worker may use.

        ``--kv-cache-memory`` when given; otherwise, by :attr:`memory_accounting` (device facts from the
        methods above, measured on the current device):

        * ``"total"``: ``total memory x gpu_memory_utilization - model_memory_bytes - peak_activation_bytes``
          (vLLM's rule: the engine owns that share of the device);
        * ``"available"``: ``available memory x kv_cache_available_fraction - peak_activation_bytes``;

        then at most :attr:`kv_cache_cap_bytes`.

        Args:
            config: the engine config (``cache_config.kv_cache_memory``, ``gpu_memory_utilization``).
            model_memory_bytes: bytes the loaded weights take on the device.
            peak_activation_bytes: peak bytes of a profiling forward pass beyond the weights (0 when the
                platform does not profile).

        Raises:
            ValueError: ``--kv-cache-memory`` is not positive, or the settings leave no memory for the KV cache
                (the message names the setting to change).
        """
        cache = config.cache_config
        if cache.kv_cache_memory is not None:
            if cache.kv_cache_memory <= 0:
                raise ValueError(f"--kv-cache-memory must be positive, got {cache.kv_cache_memory} bytes")
            return int(cache.kv_cache_memory)
        device_id = cls.current_device_id()
        if cls.memory_accounting == "available":
            pool = cls.get_device_available_memory(device_id)
            budget = int(pool * cls.kv_cache_available_fraction)
            available = budget - peak_activation_bytes
            if available <= 0:
                raise ValueError(
                    f"no memory left for the KV cache: {cls.kv_cache_available_fraction} x "
                    f"{pool / GiB:.2f} GiB available = {budget / GiB:.2f} GiB, but activations peak at "
                    f"{peak_activation_bytes / GiB:.2f} GiB. Free memory, lower --max-num-batched-tokens, or set "
                    "--kv-cache-memory."
                )
        elif cls.memory_accounting == "total":
            total = cls.get_device_total_memory(device_id)
            budget = int(total * cache.gpu_memory_utilization)
            available = budget - model_memory_bytes - peak_activation_bytes
            if available <= 0:
                raise ValueError(
                    f"no memory left for the KV cache: {cache.gpu_memory_utilization} x {total / GiB:.2f} GiB = "
                    f"{budget / GiB:.2f} GiB, but the weights take {model_memory_bytes / GiB:.2f} GiB and "
                    f"activations peak at {peak_activation_bytes / GiB:.2f} GiB. Raise --gpu-memory-utilization, "
                    "lower --max-num-batched-tokens, or use a larger device / more tensor-parallel ranks."
                )
        else:
            raise ValueError(f"platform {cls.name!r}: memory_accounting must be 'total' or 'available', "
                             f"got {cls.memory_accounting!r}")
        if cls.kv_cache_cap_bytes is not None:
            available = min(available, int(cls.kv_cache_cap_bytes))
        return int(available)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        """Seed the random generators of torch on the host and on every device (``torch.manual_seed`` seeds
        them all)."""
        import torch

        torch.manual_seed(seed)

    @classmethod
    def make_device(cls, local_rank: int) -> torch.device:
        """The torch device a worker of local rank ``local_rank`` uses."""
        import torch

        return torch.device(cls.device_type, local_rank)

    @classmethod
    def local_ranks_needed(cls, config: EngineConfig) -> int:
        """How many devices this machine needs for ``config``: tensor-parallel x pipeline-parallel size, times
        the data-parallel size when the data-parallel engine cores are local processes; 0 with the Ray
        executor (Ray places ranks on the cluster's devices)."""
        pc = config.parallel_config
        if pc.distributed_executor_backend == "ray":
            return 0
        tp, pp = int(pc.tensor_parallel_size), int(getattr(pc, "pipeline_parallel_size", 1))
        dp = int(getattr(pc, "data_parallel_size", 1)) if getattr(pc, "data_parallel_backend", "mp") == "mp" else 1
        return tp * pp * dp

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        """Validate ``config`` for this platform and fill in what the platform decides.

        Resolves ``model_config.dtype == "auto"`` to :attr:`default_dtype` and ``cache_config.cache_dtype ==
        "auto"`` to the model's dtype (a quantized cache dtype, ``int8`` / ``fp8_*``, is left to the attention
        backend, ``AttentionBackend.supported_quantized_kv_cache_dtypes``), records the platform in
        ``config.device_config`` and, unless :attr:`ranks_share_device`, checks that at least
        :meth:`local_ranks_needed` devices are visible (without creating a device context).

        Raises:
            ValueError: ``dtype`` or the KV cache dtype is not one of :attr:`supported_dtypes` (the message names
                ``dtype`` or ``kv_cache_dtype``), or
                there are fewer visible devices than local ranks (the message names ``--tensor-parallel-size``,
                ``--pipeline-parallel-size`` and ``--data-parallel-size``).
        """
        model_config, cache_config = config.model_config, config.cache_config
        model_config.dtype = cls._resolve_dtype("dtype", model_config.dtype, cls.default_dtype, cls.default_dtype)
        if cache_config.cache_dtype not in QUANTIZED_KV_CACHE_DTYPES:  # quantized: the attention backend decides
            cache_config.cache_dtype = cls._resolve_dtype("kv_cache_dtype", cache_config.cache_dtype,
                                                          model_config.dtype, "the model's dtype")
        config.device_config.platform = cls.name
        config.device_config.device_type = cls.device_type
        if not cls.ranks_share_device and cls.device_type != "cpu":
            needed = cls.local_ranks_needed(config)
            count = cls.device_count()
            if needed > count:
                where = f" (check {cls.visible_devices_env})" if cls.visible_devices_env else ""
                pc = config.parallel_config
                raise ValueError(
                    f"--tensor-parallel-size {pc.tensor_parallel_size} x --pipeline-parallel-size "
                    f"{getattr(pc, 'pipeline_parallel_size', 1)} x --data-parallel-size "
                    f"{getattr(pc, 'data_parallel_size', 1)}: {needed} local ranks need {needed} {cls.name} "
                    f"devices but only {count} are visible{where}"
                )

    @classmethod
    def _resolve_dtype(cls, name: str, value: str, auto: str, auto_meaning: str) -> str:
        """``value`` with ``"auto"`` replaced by ``auto``.

        Raises:
            ValueError: the result is not one of :attr:`supported_dtypes` (the message starts with ``name=``).
        """
        resolved = auto if value == "auto" else value
        if resolved not in cls.supported_dtypes:
            raise ValueError(
                f"{name}={resolved!r} is not supported on platform {cls.name!r}; "
                f"choose one of {', '.join(cls.supported_dtypes)} (or 'auto' for {auto_meaning})"
            )
        return resolved

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
