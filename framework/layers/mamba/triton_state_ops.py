"""The state layers' decode step in Triton (:mod:`tokenmill.layers.mamba.triton_state_update`): replacements of
the custom ops ``causal_conv1d``, ``mamba_ssd`` and ``gated_delta_rule`` that the CUDA and ROCm platforms declare
(``Platform.get_custom_op_cls``) when triton is installed.

Each overrides ``update`` (one token per sequence) and keeps the portable ``forward`` (prefill). The kernel runs
for device tensors (and CPU tensors under ``TRITON_INTERPRET=1``, the tests) in float32, bfloat16 or float16;
float64 (the reference tests' dtype) and CPU tensors otherwise take the portable ``update_native``.
"""

from __future__ import annotations

import os

import torch

from tokenmill.layers.mamba.state_ops import CausalConv1d, GatedDeltaRule, MambaSSD

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_takes(*tensors: torch.Tensor | None) -> bool:
    """Whether every given tensor is one Triton runs on (a device tensor, or any under the interpreter) in a
    dtype the kernels take."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return all(t is None or ((interpreted or t.device.type != "cpu") and t.dtype in KERNEL_DTYPES) for t in tensors)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _param(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


class TritonCausalConv1d(CausalConv1d):
    """``causal_conv1d`` with the decode step in Triton."""

    def update(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
        if activation not in (None, "silu", "swish") or not _kernel_takes(x, conv_state, weight, bias):
            return self.update_native(x, conv_state, weight, bias, activation)
        from tokenmill.layers.mamba import triton_state_update

        return triton_state_update.causal_conv1d_update(
            _rows(x), conv_state.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(),
            activation is not None)


class TritonMambaSSD(MambaSSD):
    """``mamba_ssd`` with the decode step in Triton."""

    def update(self, state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
               dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, float("inf"))
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _kernel_takes(state, x, dt, A, B, C, D, dt_bias):
            return self.update_native(state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit)
        from tokenmill.layers.mamba import triton_state_update

        lo, hi = float(dt_limit[0]), float(dt_limit[1])
        if not (lo > 0.0 or hi != float("inf")):  # the portable version clamps only then
            lo = float("-inf")
        return triton_state_update.selective_state_update(
            state.contiguous(), _rows(x), _rows(dt), _param(A), _rows(B), _rows(C), _param(D), _param(dt_bias),
            dt_softplus, lo, hi)


class TritonGatedDeltaRule(GatedDeltaRule):
    """``gated_delta_rule`` with the decode step in Triton."""

    def update(self, state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        if not _kernel_takes(state, q, k, v, g, beta):
            return self.update_native(state, q, k, v, g, beta, use_qk_l2norm)
        from tokenmill.layers.mamba import triton_state_update

        return triton_state_update.gated_delta_rule_update(state.contiguous(), _rows(q), _rows(k), _rows(v), _rows(g),
                                                           _rows(beta), use_qk_l2norm)
