"""Building blocks for models; a model built only from these runs on every platform."""

from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.attention import Attention
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from tokenmill.layers.pipeline import (
    IntermediateTensors,
    PPMissingLayer,
    get_pp_indices,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    make_layers,
)
from tokenmill.layers.rotary import RotaryEmbedding, get_rope
from tokenmill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "IntermediateTensors",
    "MergedColumnParallelLinear",
    "PPMissingLayer",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "default_weight_loader",
    "get_pp_indices",
    "get_rope",
    "is_pp_missing_parameter",
    "make_empty_intermediate_tensors_factory",
    "make_layers",
]
