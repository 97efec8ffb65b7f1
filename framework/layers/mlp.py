"""The feed-forward blocks of decoder layers: gated (SwiGLU / GeGLU, Shazeer 2020, "GLU Variants Improve
Transformer") and plain (one activation between two projections)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.activation import get_act_and_mul, get_act_fn
from tokenmill.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with gate and up stored as one ``gate_up_proj``.

    Args:
        hidden_size: H.
        intermediate_size: I (split across tensor-parallel ranks).
        hidden_act: transformers' activation name (``"silu"``: SwiGLU; ``"gelu_pytorch_tanh"``: GeGLU).
        bias: biases on the three projections (Granite's ``mlp_bias``).

    Checkpoint names: ``gate_proj`` / ``up_proj`` (stacked into ``gate_up_proj``) or a fused ``gate_up_proj``,
    and ``down_proj``.

    Raises:
        ValueError: unsupported activation.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = get_act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]``."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class MLP(nn.Module):
    """``down_proj(act(up_proj(x)))``: a feed-forward block without a gate (Nemotron-H's ``relu2`` MLPs).

    Args:
        hidden_size: H.
        intermediate_size: I (split across tensor-parallel ranks).
        hidden_act: transformers' activation name (see :func:`~tokenmill.layers.activation.get_act_fn`).
        bias: biases on both projections.

    Raises:
        ValueError: unsupported activation.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = get_act_fn(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]``."""
        return self.down_proj(self.act_fn(self.up_proj(x)))
