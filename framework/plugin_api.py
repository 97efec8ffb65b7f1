"""tokenmill's public plugin API: everything a platform plugin or a model plugin may import, in one module.

A plugin imports only from here (and from :mod:`tokenmill.conformance` in its tests); any other ``tokenmill.*``
module is internal and may change without notice (a test of tokenmill fails if an in-tree plugin or example
imports one). The API is versioned: :data:`VERSION` is ``"MAJOR.MINOR"`` (minor: additions; major: a change or
removal), and a plugin declares what it needs in the module its entry point names::

    TOKENMILL_PLUGIN_API = ">=1.0,<2"

A plugin whose requirement this tokenmill does not meet is refused at start-up with an error naming it.
``docs/plugins.md`` walks through a platform plugin and a model plugin built on this module.

Names are imported on first use, so ``from tokenmill.plugin_api import PlatformSpec, hookimpl`` in a
platform plugin's entry-point module stays cheap (no torch, no layers).

Contents, by what a plugin does with them:

* hooks: :data:`hookimpl`, :func:`resolve_qualname`, :class:`PluginLoadError`;
* platforms: :class:`Platform`, :class:`PlatformSpec`, the platform errors, :func:`get_current_platform`,
  the config classes (:class:`EngineConfig`, :class:`ModelConfig`, :class:`CacheConfig`, ...);
* attention: :class:`AttentionBackend`, :class:`AttentionImpl`, :class:`AttentionMetadata`,
  :class:`AttentionBackendRegistry`, the portable :class:`TorchPagedAttentionBackend` /
  :class:`TorchPagedAttentionImpl` (subclass it and override ``forward_decode`` for a decode kernel), the
  Triton backend, and the paged-cache helpers :func:`write_kv_cache`, :func:`gather_kv`,
  :func:`compute_slot_mapping`, and the quantized-cache rows' :func:`quantize_kv`, :func:`dequantize_kv`,
  :func:`kv_cache_row_size`, :func:`is_quantized_kv_dtype`;
* device graphs: :class:`GraphCapture` (what a platform implements), :class:`EmulatedGraphCapture` (the CPU
  emulator tests use), :class:`GraphCaptureError`;
* kernels a platform may replace: :class:`QuantizedWeight` (``--quantization``; the Triton formats
  :class:`TritonInt8Weight` / :class:`TritonInt4Weight` the CUDA and ROCm plugins name),
  :class:`UnquantizedLinearMethod`
  (how full-precision linear layers multiply; custom op ``unquantized_linear``), :class:`FusedMoEMethod`,
  :class:`CustomOp` / :class:`CustomOpRegistry` / :data:`CUSTOM_OPS` (RMSNorm, rotary, activations, ...),
  the state-layer ops :class:`CausalConv1d`, :class:`MambaSSD`, :class:`RMSNormGated`, :class:`GatedDeltaRule`,
  :class:`LoRAMethod` (the batched LoRA shrink/expand ``Platform.get_lora_method_cls`` names; the portable
  :class:`TorchLoRAMethod`; its step mapping :class:`LoRABatchMapping`);
* tool calling: :class:`ToolParser` (subclass it; ``parse(text, final)`` returns a :class:`PartialParse` of
  :class:`PartialToolCall`), :class:`ToolParserManager` (the registry of ``tokenmill_register_tool_parsers``);
* reasoning: :class:`ReasoningParser` (subclass it, or :class:`MarkerReasoningParser` for thinking between two
  text markers; streaming steps return a :class:`ReasoningDelta`), :class:`ReasoningParserManager` (the registry
  of ``tokenmill_register_reasoning_parsers``);
* sampling: :class:`LogitsProcessor`, :class:`LogitsProcessorBatch`, :class:`LogitsProcessorRegistry`,
  :class:`SamplingParams` (its ``extra_args`` reach the processors), :class:`LoRARequest` (a request's adapter);
* models: :class:`ModelRegistry`, the contract :class:`CausalLM` (and :class:`SupportsMultiModal`,
  :func:`supports_multimodal`, :func:`merge_multimodal_embeddings` for models that take images), every layer of ``tokenmill.layers``
  (:class:`Attention`, the tensor-parallel linear layers, :class:`RMSNorm`, :func:`get_rope`, the decoder
  blocks), the state layers of hybrid models (:class:`MambaBase`, :class:`MambaMixer2`, :class:`GatedDeltaNet`,
  :class:`StateMetadata`), the weight loader (:func:`load_checkpoint_weights`, :func:`default_weight_loader`,
  :data:`DEFAULT_STACKED_PARAMS`), the tensor-parallel helpers (:func:`get_tp_rank`, :func:`get_tp_size`,
  :func:`tp_all_reduce`, :func:`tp_all_gather_last_dim`) and the forward context
  (:func:`get_forward_context`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tokenmill.platforms.interface import DetectResult, Platform, PlatformSpec
from tokenmill.plugins.api_version import PLUGIN_API_VERSION, REQUIREMENT_ATTR
from tokenmill.plugins.hookspecs import hookimpl

VERSION = PLUGIN_API_VERSION

_LAYERS = (
    "DEFAULT_STACKED_PARAMS", "Attention", "ColumnParallelLinear", "DecoderAttention", "DecoderForCausalLM",
    "DecoderLayer", "DecoderModel", "FusedMoE", "FusedMoEMethod", "GatedMLP", "GeluAndMul",
    "MergedColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear", "RMSNorm", "ReplicatedLinear",
    "RotaryEmbedding", "RowParallelLinear", "ShardedRMSNorm", "SiluAndMul", "SparseMoeBlock",
    "TorchFusedMoEMethod", "VocabParallelEmbedding", "attention_args", "default_weight_loader",
    "get_act_and_mul", "get_rope", "layer_sliding_window", "layer_type_of", "rope_parameters_of",
)

_LAZY: dict[str, str] = {
    # plugins
    "resolve_qualname": "tokenmill.plugins.qualname",
    "PluginLoadError": "tokenmill.plugins.manager",
    # platforms
    "UnspecifiedPlatform": "tokenmill.platforms.interface",
    "PlatformError": "tokenmill.platforms.errors",
    "PlatformConflictError": "tokenmill.platforms.errors",
    "NoPlatformError": "tokenmill.platforms.errors",
    "PlatformDetectionError": "tokenmill.platforms.errors",
    "UnknownPlatformError": "tokenmill.platforms.errors",
    "get_current_platform": "tokenmill.platforms.current",
    "current_platform": "tokenmill.platforms.current",
    # configuration
    "EngineConfig": "tokenmill.config",
    "ModelConfig": "tokenmill.config",
    "CacheConfig": "tokenmill.config",
    "SchedulerConfig": "tokenmill.config",
    "ParallelConfig": "tokenmill.config",
    "DeviceConfig": "tokenmill.config",
    # attention
    "AttentionBackend": "tokenmill.attention.backend",
    "AttentionImpl": "tokenmill.attention.backend",
    "AttentionMetadata": "tokenmill.attention.backend",
    "AttentionBackendRegistry": "tokenmill.attention.registry",
    "UnknownAttentionBackendError": "tokenmill.attention.registry",
    "TorchPagedAttentionBackend": "tokenmill.attention.backends.torch_paged",
    "TorchPagedAttentionImpl": "tokenmill.attention.backends.torch_paged",
    "write_kv_cache": "tokenmill.attention.backends.torch_paged",
    "gather_kv": "tokenmill.attention.backends.torch_paged",
    "TritonPagedAttentionBackend": "tokenmill.attention.backends.triton_paged",
    "TritonPagedAttentionImpl": "tokenmill.attention.backends.triton_paged",
    "compute_slot_mapping": "tokenmill.attention.paged_cache",
    "is_quantized_kv_dtype": "tokenmill.attention.kv_cache_quant",
    "kv_cache_row_size": "tokenmill.attention.kv_cache_quant",
    "quantize_kv": "tokenmill.attention.kv_cache_quant",
    "dequantize_kv": "tokenmill.attention.kv_cache_quant",
    # device graphs
    "GraphCapture": "tokenmill.worker.graph_runner",
    "EmulatedGraphCapture": "tokenmill.worker.graph_emulator",
    "GraphCaptureError": "tokenmill.worker.graph_emulator",
    # replaceable kernels
    "QuantizedWeight": "tokenmill.layers.quantization",
    "UnsupportedShapeError": "tokenmill.layers.quantization",
    "Int8WeightOnly": "tokenmill.layers.quantization",
    "TritonGroupQuantWeight": "tokenmill.layers.triton_quant_linear",
    "TritonInt8Weight": "tokenmill.layers.triton_quant_linear",
    "TritonInt4Weight": "tokenmill.layers.triton_quant_linear",
    "UnquantizedLinearMethod": "tokenmill.layers.linear_method",
    "CustomOp": "tokenmill.layers.custom_op",
    "CustomOpRegistry": "tokenmill.layers.custom_op",
    "CUSTOM_OPS": "tokenmill.layers.custom_op",
    # state layers of hybrid models and their ops (custom ops causal_conv1d, mamba_ssd, rms_norm_gated,
    # gated_delta_rule, selective_scan)
    **{name: "tokenmill.layers.mamba" for name in (
        "MambaBase", "MambaMixer", "MambaMixer2", "GatedDeltaNet", "StateMetadata", "CausalConv1d", "MambaSSD",
        "RMSNormGated", "GatedDeltaRule", "SelectiveScan")},
    "LoRAMethod": "tokenmill.lora.ops",
    "TorchLoRAMethod": "tokenmill.lora.ops",
    "LoRABatchMapping": "tokenmill.lora.ops",
    # tool calling
    "ToolParser": "tokenmill.tool_parsers",
    "ToolParserManager": "tokenmill.tool_parsers",
    "PartialParse": "tokenmill.tool_parsers",
    "PartialToolCall": "tokenmill.tool_parsers",
    # reasoning parsers
    "ReasoningParser": "tokenmill.reasoning",
    "ReasoningDelta": "tokenmill.reasoning",
    "MarkerReasoningParser": "tokenmill.reasoning",
    "ReasoningParserManager": "tokenmill.reasoning",
    # sampling
    "LogitsProcessor": "tokenmill.worker.logits_processor",
    "LogitsProcessorBatch": "tokenmill.worker.logits_processor",
    "LogitsProcessorRegistry": "tokenmill.worker.logits_processor",
    "SamplingParams": "tokenmill.sampling_params",
    "LoRARequest": "tokenmill.lora.request",
    # models
    "ModelRegistry": "tokenmill.model_loader.registry",
    "CausalLM": "tokenmill.model_contract",
    "SupportsMultiModal": "tokenmill.model_contract",
    "supports_multimodal": "tokenmill.model_contract",
    "merge_multimodal_embeddings": "tokenmill.model_contract",
    "load_checkpoint_weights": "tokenmill.model_loader.weight_utils",
    "get_tp_rank": "tokenmill.distributed",
    "get_tp_size": "tokenmill.distributed",
    "tp_all_reduce": "tokenmill.distributed",
    "tp_all_gather_last_dim": "tokenmill.distributed",
    "ForwardContext": "tokenmill.forward_context",
    "get_forward_context": "tokenmill.forward_context",
    **{name: "tokenmill.layers" for name in _LAYERS},
}

__all__ = sorted(["VERSION", "REQUIREMENT_ATTR", "DetectResult", "Platform", "PlatformSpec", "hookimpl", *_LAZY])

if TYPE_CHECKING:
    from tokenmill.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata
    from tokenmill.attention.backends.torch_paged import (
        TorchPagedAttentionBackend,
        TorchPagedAttentionImpl,
        gather_kv,
        write_kv_cache,
    )
    from tokenmill.attention.backends.triton_paged import TritonPagedAttentionBackend, TritonPagedAttentionImpl
    from tokenmill.attention.kv_cache_quant import dequantize_kv, is_quantized_kv_dtype, kv_cache_row_size, quantize_kv
    from tokenmill.attention.paged_cache import compute_slot_mapping
    from tokenmill.attention.registry import AttentionBackendRegistry, UnknownAttentionBackendError
    from tokenmill.config import (
        CacheConfig,
        DeviceConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from tokenmill.distributed import get_tp_rank, get_tp_size, tp_all_gather_last_dim, tp_all_reduce
    from tokenmill.forward_context import ForwardContext, get_forward_context
    from tokenmill.layers import *  # noqa: F403
    from tokenmill.layers.custom_op import CUSTOM_OPS, CustomOp, CustomOpRegistry
    from tokenmill.layers.mamba import (
        CausalConv1d,
        GatedDeltaNet,
        GatedDeltaRule,
        MambaBase,
        MambaMixer,
        MambaMixer2,
        MambaSSD,
        RMSNormGated,
        SelectiveScan,
        StateMetadata,
    )
    from tokenmill.layers.quantization import Int8WeightOnly, QuantizedWeight, UnsupportedShapeError
    from tokenmill.layers.triton_quant_linear import TritonGroupQuantWeight, TritonInt4Weight, TritonInt8Weight
    from tokenmill.lora.ops import LoRABatchMapping, LoRAMethod, TorchLoRAMethod
    from tokenmill.lora.request import LoRARequest
    from tokenmill.model_contract import CausalLM, SupportsMultiModal, merge_multimodal_embeddings, supports_multimodal
    from tokenmill.model_loader.registry import ModelRegistry
    from tokenmill.model_loader.weight_utils import load_checkpoint_weights
    from tokenmill.platforms.current import current_platform, get_current_platform
    from tokenmill.platforms.errors import (
        NoPlatformError,
        PlatformConflictError,
        PlatformDetectionError,
        PlatformError,
        UnknownPlatformError,
    )
    from tokenmill.platforms.interface import UnspecifiedPlatform
    from tokenmill.reasoning import MarkerReasoningParser, ReasoningDelta, ReasoningParser, ReasoningParserManager
    from tokenmill.plugins.manager import PluginLoadError
    from tokenmill.plugins.qualname import resolve_qualname
    from tokenmill.worker.graph_emulator import EmulatedGraphCapture, GraphCaptureError
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.tool_parsers import PartialParse, PartialToolCall, ToolParser, ToolParserManager
    from tokenmill.worker.graph_runner import GraphCapture
    from tokenmill.worker.logits_processor import LogitsProcessor, LogitsProcessorBatch, LogitsProcessorRegistry


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenmill.plugin_api' has no attribute {name!r} (the public plugin API is "
                             f"what tokenmill.plugin_api.__all__ lists)")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
