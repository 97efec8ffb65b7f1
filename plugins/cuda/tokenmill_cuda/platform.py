"""CudaPlatform: NVIDIA GPUs through torch's CUDA backend, nccl for tensor parallelism.

Device queries run only in workers (after selection), never in the process that forks them.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, ClassVar

from tokenmill.platforms import Platform
from tokenmill.platforms.interface import DEFAULT_ATTN_BACKEND

if TYPE_CHECKING:
    import torch

    from tokenmill.config import EngineConfig

TRITON_ATTN_BACKEND = "tokenmill.attention.backends.triton_paged:TritonPagedAttentionBackend"
GRAPH_CAPTURE_CLS = "tokenmill_cuda.graphs:CudaGraphCapture"


class CudaPlatform(Platform):
    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16", "float32")
    default_dtype: ClassVar[str] = "bfloat16"
    supports_graph_capture: ClassVar[bool] = True

    @classmethod
    def get_attn_backend_cls(cls, config: EngineConfig) -> str:
        """The Triton paged-attention backend when triton is installed, else the torch backend."""
        if importlib.util.find_spec("triton") is not None:
            return TRITON_ATTN_BACKEND
        return DEFAULT_ATTN_BACKEND

    @classmethod
    def graph_capture_cls(cls) -> str | None:
        """CUDA graphs for decode steps (``tokenmill_cuda.graphs:CudaGraphCapture``)."""
        return GRAPH_CAPTURE_CLS

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        import torch

        return torch.cuda.get_device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        import torch

        return int(torch.cuda.get_device_properties(device_id).total_memory)

    @classmethod
    def device_count(cls) -> int:
        import torch

        return torch.cuda.device_count()

    @classmethod
    def determine_kv_cache_bytes(
        cls, config: EngineConfig, *, model_memory_bytes: int = 0, peak_activation_bytes: int = 0
    ) -> int:
        """``--kv-cache-memory`` when given, else
        total memory x ``--gpu-memory-utilization`` - weights - peak activations (current device).

        Raises:
            ValueError: nothing is left for the KV cache (the message names --gpu-memory-utilization).
        """
        import torch

        cache = config.cache_config
        if cache.kv_cache_memory is not None:
            if cache.kv_cache_memory <= 0:
                raise ValueError(f"--kv-cache-memory must be positive, got {cache.kv_cache_memory} bytes")
            return int(cache.kv_cache_memory)
        total = cls.get_device_total_memory(torch.cuda.current_device())
        budget = int(total * cache.gpu_memory_utilization)
        available = budget - model_memory_bytes - peak_activation_bytes
        if available <= 0:
            gib = 1 << 30
            raise ValueError(
                f"no memory left for the KV cache: {cache.gpu_memory_utilization} x {total / gib:.2f} GiB = "
                f"{budget / gib:.2f} GiB, but the weights take {model_memory_bytes / gib:.2f} GiB and "
                f"activations peak at {peak_activation_bytes / gib:.2f} GiB. Raise --gpu-memory-utilization, "
                "lower --max-num-batched-tokens, or use a larger GPU / more tensor-parallel ranks."
            )
        return available

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        import torch

        torch.cuda.set_device(device)

    @classmethod
    def synchronize(cls) -> None:
        import torch

        torch.cuda.synchronize()

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        """Also checks there are enough visible GPUs for the ranks of local engine cores (no CUDA context);
        Ray places ranks on the cluster's GPUs instead.

        Raises:
            ValueError: unsupported dtype, or more local ranks than visible GPUs.
        """
        super().check_and_update_config(config)
        pc = config.parallel_config
        tp, pp = pc.tensor_parallel_size, getattr(pc, "pipeline_parallel_size", 1)
        dp = getattr(pc, "data_parallel_size", 1) if getattr(pc, "data_parallel_backend", "mp") == "mp" else 1
        ranks = tp * pp * dp
        count = cls.device_count()
        if pc.distributed_executor_backend != "ray" and ranks > count:
            raise ValueError(
                f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp} x --data-parallel-size {dp}: "
                f"{ranks} local ranks need {ranks} GPUs but only {count} are visible "
                "(check CUDA_VISIBLE_DEVICES)"
            )
