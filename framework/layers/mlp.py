"""The gated feed-forward block of decoder layers: SwiGLU / GeGLU (Shazeer 2020, "GLU Variants Improve
Transformer")."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.activation import SiluAndMul, get_act_and_mul
from tokenmill.layers.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with gate and up stored as one ``gate_up_proj``.

    Args:
        hidden_size: H.
        intermediate_size: I (split across tensor-parallel ranks).
        hidden_act: transformers' activation name (``"silu"``: SwiGLU; ``"gelu_pytorch_tanh"``: GeGLU).
        bias: biases on the three projections (Granite's ``mlp_bias``).

    Checkpoint names: ``gate_proj`` / ``up_proj`` (stacked into ``gate_up_proj``) or a fused ``gate_up_proj``,
    and ``down_proj``.

    With the built-in ``SiluAndMul`` (not a platform's or plugin's replacement) and no bias, ``gate_up_proj`` is
    marked ``silu_and_mul`` and, unless it has a quantized copy or a LoRA wrapper, the first half runs as one call
    of the linear method's ``apply_silu_and_mul``, which a platform may fuse (``tokenmill.layers.linear_method``).

    Raises:
        ValueError: unsupported activation.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = get_act_and_mul(hidden_act)
        self.gate_up_proj.silu_and_mul = type(self.act_fn) is SiluAndMul and not bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]``."""
        gate_up = self.gate_up_proj
        if isinstance(gate_up, LinearBase) and gate_up.silu_and_mul and gate_up.quant is None:
            return self.down_proj(gate_up.linear_method.apply_silu_and_mul(gate_up, x))
        return self.down_proj(self.act_fn(gate_up(x)))
