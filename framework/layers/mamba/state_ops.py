"""The state-space ops as custom ops (:mod:`tokenmill.layers.custom_op`), so a platform or plugin supplies fast
kernels without editing model code.

- ``causal_conv1d``: :class:`CausalConv1d`, ``forward`` (prefill of one sequence) and ``update`` (decode);
- ``mamba_ssd``: :class:`MambaSSD`, ``forward`` (chunked scan) and ``update`` (one-step recurrence);
- ``rms_norm_gated``: :class:`RMSNormGated`, ``forward`` (gated, grouped RMSNorm; holds ``weight``);
- ``gated_delta_rule``: :class:`GatedDeltaRule`, ``forward`` (prefill) and ``update`` (decode);
- ``selective_scan``: :class:`SelectiveScan`, Mamba-1's ``forward`` (chunked scan) and ``update`` (one step).

The portable versions are in :mod:`.ops` and :mod:`.selective_scan_ops`. A replacement subclasses the class, overrides the methods its kernels
cover and may call the ``*_native`` methods for the rest; ``tests/models/test_mamba_ops.py`` holds the float64
references they must agree with.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.custom_op import CustomOp
from tokenmill.layers.mamba import ops, selective_scan_ops


class CausalConv1d(CustomOp):
    """Depthwise causal conv1d with a carried state (no parameters: the mixer passes its own)."""

    op_name = "causal_conv1d"

    def forward_native(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       conv_state: torch.Tensor | None, activation: str | None = "silu"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill; see :func:`tokenmill.layers.mamba.ops.causal_conv1d_fn`."""
        return ops.causal_conv1d_fn(x, weight, bias, conv_state, activation)

    def update_native(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None, activation: str | None = "silu"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode; see :func:`tokenmill.layers.mamba.ops.causal_conv1d_update`."""
        return ops.causal_conv1d_update(x, conv_state, weight, bias, activation)

    def update(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.update_native(*args, **kwargs)


class MambaSSD(CustomOp):
    """Mamba2's selective state space recurrence: chunked scan for prefill, one step for decode."""

    op_name = "mamba_ssd"

    def forward_native(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       C: torch.Tensor, chunk_size: int, D: torch.Tensor | None = None,
                       dt_bias: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                       dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, float("inf"))
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill of one sequence; see :func:`tokenmill.layers.mamba.ops.mamba_chunk_scan`."""
        return ops.mamba_chunk_scan(x, dt, A, B, C, chunk_size, D, dt_bias, initial_state, dt_softplus, dt_limit)

    def update_native(self, state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                      B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                      dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
                      dt_limit: tuple[float, float] = (0.0, float("inf"))) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode of a batch; see :func:`tokenmill.layers.mamba.ops.selective_state_update`."""
        return ops.selective_state_update(state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit)

    def update(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.update_native(*args, **kwargs)


class RMSNormGated(CustomOp):
    """Gated RMSNorm over groups of ``group_size`` channels (transformers' ``MambaRMSNormGated``).

    Args:
        hidden_size: channels ``D``.
        eps: added to the mean square.
        group_size: channels per normalised group (``D // n_groups``).
        norm_before_gate: see :func:`tokenmill.layers.mamba.ops.rms_norm_gated`.
    """

    op_name = "rms_norm_gated"

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, group_size: int | None = None,
                 norm_before_gate: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.group_size = group_size or hidden_size
        if hidden_size % self.group_size:
            raise ValueError(f"group_size: {self.group_size} does not divide hidden size {hidden_size}")
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward_native(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``x``, ``gate``: ``[T, D]`` -> ``[T, D]`` in ``x``'s dtype."""
        return ops.rms_norm_gated(x, gate, self.weight, self.eps, self.group_size, self.norm_before_gate)


class GatedDeltaRule(CustomOp):
    """The gated delta rule of gated DeltaNet layers (Qwen3-Next): chunked prefill (one triangular solve per
    chunk), one-step decode."""

    op_name = "gated_delta_rule"

    def forward_native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill of one sequence; see :func:`tokenmill.layers.mamba.ops.gated_delta_rule`."""
        return ops.gated_delta_rule(q, k, v, g, beta, initial_state, use_qk_l2norm)

    def update_native(self, state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      g: torch.Tensor, beta: torch.Tensor, use_qk_l2norm: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode of a batch; see :func:`tokenmill.layers.mamba.ops.gated_delta_rule_update`."""
        return ops.gated_delta_rule_update(state, q, k, v, g, beta, use_qk_l2norm)

    def update(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.update_native(*args, **kwargs)


class SelectiveScan(CustomOp):
    """Mamba-1's selective scan (Jamba's state layers): chunked scan for prefill, one step for decode; ``A`` is
    ``[D, N]``, one decay per channel and state dimension."""

    op_name = "selective_scan"

    def forward_native(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                       dt_bias: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                       dt_softplus: bool = True, chunk_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill of one sequence; see :func:`tokenmill.layers.mamba.selective_scan_ops.selective_scan`."""
        return selective_scan_ops.selective_scan(x, dt, A, B, C, D, z, dt_bias, initial_state, dt_softplus,
                                                 chunk_size)

    def update_native(self, state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                      B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                      dt_bias: torch.Tensor | None = None, dt_softplus: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode of a batch; see :func:`tokenmill.layers.mamba.selective_scan_ops.selective_scan_update`."""
        return selective_scan_ops.selective_scan_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)

    def update(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.update_native(*args, **kwargs)
