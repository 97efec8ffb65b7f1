"""Activations of MLPs: gated ones, ``act(x[..., :d]) * x[..., d:]`` for input ``[..., 2d]``
(:func:`get_act_and_mul`), and plain elementwise ones for MLPs without a gate (:func:`get_act_fn`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """``silu(x[..., :d]) * x[..., d:]`` for input ``[..., 2d]`` (SwiGLU, Shazeer 2020). Custom op
    ``silu_and_mul``."""

    op_name = "silu_and_mul"

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(CustomOp):
    """``gelu(x[..., :d]) * x[..., d:]`` (GeGLU, Shazeer 2020). Custom op ``gelu_and_mul``.

    Args:
        approximate: ``"tanh"`` (Gemma's ``gelu_pytorch_tanh``) or ``"none"`` (exact erf GELU).
    """

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"GeluAndMul: approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    op_name = "gelu_and_mul"

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


# transformers' activation names (``hidden_act`` / ``hidden_activation``) -> gated activation
_GATED = {
    "silu": lambda: SiluAndMul(),
    "swish": lambda: SiluAndMul(),
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    "gelu_new": lambda: GeluAndMul("tanh"),
    "gelu_fast": lambda: GeluAndMul("tanh"),
    "gelu_tanh": lambda: GeluAndMul("tanh"),
    "gelu": lambda: GeluAndMul("none"),
}


def get_act_and_mul(name: str) -> nn.Module:
    """The gated activation for a transformers ``hidden_act`` name.

    Raises:
        ValueError: the name is not a supported activation (the message lists the supported ones).
    """
    factory = _GATED.get(name)
    if factory is None:
        raise ValueError(f"hidden_act: activation {name!r} is not supported for gated MLPs "
                         f"(supported: {', '.join(sorted(_GATED))})")
    return factory()


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` (So et al. 2021, "Primer"; transformers' ``relu2``, Nemotron-H's MLPs and experts)."""
    return torch.square(F.relu(x))


# transformers' activation names -> elementwise activation of an MLP without a gate
_PLAIN = {
    "relu2": relu_squared,
    "relu": F.relu,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise activation for a transformers activation name, for MLPs without a gate.

    Raises:
        ValueError: the name is not a supported activation (the message lists the supported ones).
    """
    fn = _PLAIN.get(name)
    if fn is None:
        raise ValueError(f"activation {name!r} is not supported for MLPs without a gate "
                         f"(supported: {', '.join(sorted(_PLAIN))})")
    return fn
