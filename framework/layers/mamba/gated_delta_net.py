"""GatedDeltaNet: the linear-attention layer of Qwen3-Next (Yang et al. 2024, gated delta rule), parameter names
as in transformers' ``Qwen3NextGatedDeltaNet`` (``in_proj_qkvz``, ``in_proj_ba``, ``conv1d``, ``dt_bias``,
``A_log``, ``norm``, ``out_proj``).

Per step: ``in_proj_qkvz`` gives ``q``, ``k`` (``Hk`` heads of ``Dk``), ``v`` and the gate ``z`` (``Hv`` heads of
``Dv``), grouped per key head in the checkpoint's layout; ``in_proj_ba`` gives ``b`` and ``a`` per value head.
``q``, ``k``, ``v`` go through the causal conv1d (SiLU, no bias); ``beta = sigmoid(b)``,
``g = -exp(A_log) softplus(a + dt_bias)``; the gated delta rule (``q``, ``k`` L2-normalised, key heads repeated
to the value heads) gives ``o``; then ``norm(o) * silu(z)`` per value head and ``out_proj``. Each request's conv
state and recurrent state (``[Hv, Dk, Dv]``) live in its state slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import get_tp_size
from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.layers.mamba.abstract import MambaBase, States
from tokenmill.layers.mamba.mamba_mixer2 import MambaConv1d
from tokenmill.layers.mamba.state_ops import CausalConv1d, GatedDeltaRule, RMSNormGated


class GatedDeltaNet(MambaBase):
    """Args:
    hidden_size: model width.
    num_k_heads, num_v_heads: ``Hk``, ``Hv`` (``Hv % Hk == 0``).
    head_k_dim, head_v_dim: ``Dk``, ``Dv``.
    conv_kernel_size: ``K``.
    rms_norm_eps: the gated norm's epsilon.
    activation: of the conv (``"silu"``).

    Raises:
        ValueError: tensor parallelism, or ``Hv % Hk != 0``.
    """

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel_size: int, *, rms_norm_eps: float = 1e-6, activation: str = "silu") -> None:
        super().__init__()
        if get_tp_size() > 1:
            raise ValueError("tensor_parallel_size: gated DeltaNet layers run on one rank only")
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_key_heads {num_k_heads} does not divide linear_num_value_heads {num_v_heads}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_kernel_size = conv_kernel_size
        self.activation = activation
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = ReplicatedLinear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = ReplicatedLinear(hidden_size, 2 * num_v_heads, bias=False)
        self.conv1d = MambaConv1d(self.conv_dim, conv_kernel_size, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(num_v_heads), requires_grad=False)
        self.norm = RMSNormGated(head_v_dim, rms_norm_eps, norm_before_gate=True)
        self.out_proj = ReplicatedLinear(self.value_dim, hidden_size, bias=False)
        self.conv_op = CausalConv1d()
        self.delta_op = GatedDeltaRule()

    def get_state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((2 Dk Hk + Dv Hv, K - 1), (Hv, Dk, Dv))``: the conv state and the recurrent state."""
        return ((self.conv_dim, self.conv_kernel_size - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim))

    def _split_projections(self, qkvz: torch.Tensor, ba: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The checkpoint groups each key head's ``q, k`` with its value heads' ``v, z`` (and ``b, a``):
        -> ``mixed_qkv [T, conv_dim]`` (all q, all k, all v), ``z [T, Hv, Dv]``, ``b``, ``a`` ``[T, Hv]``."""
        t = qkvz.shape[0]
        per = self.num_v_heads // self.num_k_heads
        qkvz = qkvz.view(t, self.num_k_heads, -1)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, per * self.head_v_dim, per * self.head_v_dim],
                                dim=-1)
        b, a = ba.view(t, self.num_k_heads, 2 * per).split([per, per], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return (mixed, z.reshape(t, self.num_v_heads, self.head_v_dim), b.reshape(t, self.num_v_heads),
                a.reshape(t, self.num_v_heads))

    def _qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        per = self.num_v_heads // self.num_k_heads
        q = q.reshape(t, self.num_k_heads, self.head_k_dim).repeat_interleave(per, dim=1)
        k = k.reshape(t, self.num_k_heads, self.head_k_dim).repeat_interleave(per, dim=1)
        return q, k, v.reshape(t, self.num_v_heads, self.head_v_dim)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` (state slots from the forward context, as :class:`MambaMixer2`)."""
        mixed, z, b, a = self._split_projections(self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states))
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        weight = self.conv1d.weight.squeeze(1)
        out = torch.empty(hidden_states.shape[0], self.num_v_heads, self.head_v_dim, dtype=hidden_states.dtype,
                          device=hidden_states.device)

        def prefill(start: int, end: int, states: States | None) -> States:
            conv_state, rec_state = states or (None, None)
            conv_out, conv_state = self.conv_op(mixed[start:end], weight, None, conv_state, self.activation)
            q, k, v = self._qkv(conv_out)
            out[start:end], rec_state = self.delta_op(q, k, v, g[start:end], beta[start:end], rec_state)
            return conv_state, rec_state

        def decode(rows: torch.Tensor, states: States) -> States:
            conv_out, conv_state = self.conv_op.update(mixed[rows], states[0], weight, None, self.activation)
            q, k, v = self._qkv(conv_out)
            out[rows], rec_state = self.delta_op.update(states[1], q, k, v, g[rows], beta[rows])
            return conv_state, rec_state

        self.run_with_states(hidden_states.shape[0], prefill, decode)
        t = hidden_states.shape[0]
        normed = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(normed.reshape(t, -1))
