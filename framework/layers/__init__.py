"""Building blocks for models; a model built only from these runs on every platform.

Decoder families compose :class:`DecoderAttention`, :class:`GatedMLP` (:class:`MLP` without a gate) or
:class:`SparseMoeBlock`, :class:`DecoderLayer`, :class:`DecoderModel` and :class:`DecoderForCausalLM` (see
``docs/models.md``).
"""

from tokenmill.layers.activation import GeluAndMul, SiluAndMul, get_act_and_mul
from tokenmill.layers.attention import Attention
from tokenmill.layers.decoder import DEFAULT_STACKED_PARAMS, DecoderForCausalLM, DecoderLayer, DecoderModel
from tokenmill.layers.fused_moe import FusedMoE, FusedMoEMethod, SparseMoeBlock, TorchFusedMoEMethod
from tokenmill.layers.layernorm import RMSNorm, ShardedRMSNorm
from tokenmill.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from tokenmill.layers.mlp import MLP, GatedMLP
from tokenmill.layers.pipeline import (
    IntermediateTensors,
    PPMissingLayer,
    get_pp_indices,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    make_layers,
)
from tokenmill.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_of
from tokenmill.layers.self_attention import DecoderAttention, attention_args, layer_sliding_window, layer_type_of
from tokenmill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "DEFAULT_STACKED_PARAMS",
    "Attention",
    "ColumnParallelLinear",
    "DecoderAttention",
    "DecoderForCausalLM",
    "DecoderLayer",
    "DecoderModel",
    "FusedMoE",
    "FusedMoEMethod",
    "GatedMLP",
    "GeluAndMul",
    "IntermediateTensors",
    "MLP",
    "MergedColumnParallelLinear",
    "PPMissingLayer",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "ShardedRMSNorm",
    "SiluAndMul",
    "SparseMoeBlock",
    "TorchFusedMoEMethod",
    "VocabParallelEmbedding",
    "attention_args",
    "default_weight_loader",
    "get_act_and_mul",
    "get_pp_indices",
    "get_rope",
    "is_pp_missing_parameter",
    "layer_sliding_window",
    "layer_type_of",
    "make_empty_intermediate_tensors_factory",
    "make_layers",
    "rope_parameters_of",
]
