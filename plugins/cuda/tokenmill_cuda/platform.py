"""CudaPlatform: NVIDIA GPUs through torch's CUDA backend, nccl for tensor parallelism.

Only what differs from :class:`tokenmill.plugin_api.Platform` is here: device facts (name, memory, count,
peak-memory statistics), KV-cache sizing (``total x --gpu-memory-utilization - weights - peak activations``,
after a profiled forward pass) and the device-count check come from the base class. Device queries run only in
workers (after selection), never in the process that forks them.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, ClassVar

from tokenmill.plugin_api import Platform

if TYPE_CHECKING:
    from tokenmill.plugin_api import EngineConfig

GRAPH_CAPTURE_CLS = "tokenmill_cuda.graphs:CudaGraphCapture"

TRITON_QUANT_METHODS = {"int8": "tokenmill.plugin_api:TritonInt8Weight",
                        "int4": "tokenmill.plugin_api:TritonInt4Weight"}


_TRITON_STATE_OPS = {
    "causal_conv1d": "tokenmill.layers.mamba.triton_state_ops:TritonCausalConv1d",
    "mamba_ssd": "tokenmill.layers.mamba.triton_state_ops:TritonMambaSSD",
    "gated_delta_rule": "tokenmill.layers.mamba.triton_state_ops:TritonGatedDeltaRule",
}


class CudaPlatform(Platform):
    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16", "float32")
    default_dtype: ClassVar[str] = "bfloat16"
    supports_graph_capture: ClassVar[bool] = True
    visible_devices_env: ClassVar[str] = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def get_attn_backend_cls(cls, config: EngineConfig) -> str:
        """``TRITON_PAGED`` when triton is installed, else ``TORCH_PAGED``."""
        return "TRITON_PAGED" if importlib.util.find_spec("triton") is not None else "TORCH_PAGED"

    @classmethod
    def get_custom_op_cls(cls, name: str) -> str | None:
        """When triton is installed, ``causal_conv1d``, ``mamba_ssd`` and ``gated_delta_rule``: the state layers'
        decode step in Triton (``tokenmill.layers.mamba.triton_state_ops``); every other op is the built-in."""
        if importlib.util.find_spec("triton") is None:
            return None
        return _TRITON_STATE_OPS.get(name)

    @classmethod
    def get_quant_method_cls(cls, method: str) -> str | None:
        """``int8`` and ``int4`` in the Triton group-quantized formats of the plugin API (``TritonInt8Weight``,
        ``TritonInt4Weight``: AWQ, GPTQ, compressed-tensors and GGUF weights stay quantized); without triton,
        the base class's ``int8`` (torch's packed int8 op) and no ``int4``."""
        if importlib.util.find_spec("triton") is None:
            return super().get_quant_method_cls(method)
        return TRITON_QUANT_METHODS.get(method)

    @classmethod
    def graph_capture_cls(cls) -> str | None:
        """CUDA graphs for decode steps (``tokenmill_cuda.graphs:CudaGraphCapture``)."""
        return GRAPH_CAPTURE_CLS
