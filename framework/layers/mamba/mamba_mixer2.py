"""MambaMixer2: the Mamba2 state-space layer (Dao & Gu 2024) on the hybrid cache, parameter names as in
transformers' ``Mamba2Mixer`` (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``).

Per step: ``in_proj`` splits into the gate ``z``, ``xBC`` (conv channels) and ``dt``; ``xBC`` goes through the
causal conv1d (SiLU), splits into ``x``, ``B``, ``C``; the selective scan gives ``y``; then the gated RMSNorm
``norm(y * silu(z))`` and ``out_proj``. The conv state (last ``K - 1`` conv inputs) and the SSM state
(``[heads, head_dim, state_size]``) of each request live in its state slot
(:class:`~tokenmill.layers.mamba.abstract.MambaBase`); decode requests of a step run together through the
one-step ops, every other request (a prompt or a prompt chunk) through the prefill ops, continuing from its
slot's state when an earlier chunk left one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import get_tp_size
from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.layers.mamba.abstract import MambaBase, States
from tokenmill.layers.mamba.state_ops import CausalConv1d, MambaSSD, RMSNormGated


class MambaConv1d(nn.Module):
    """The depthwise conv's parameters, in ``nn.Conv1d``'s layout (``weight [D, 1, K]``, ``bias [D]``)."""

    def __init__(self, channels: int, kernel_size: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(channels), requires_grad=False) if bias else None


class MambaMixer2(MambaBase):
    """Args:
    hidden_size: model width.
    ssm_state_size: ``N``.
    conv_kernel_size: ``K``.
    intermediate_size: ``H * P`` (``expand * hidden_size``).
    num_heads, head_dim: ``H``, ``P``.
    n_groups: ``G`` groups of ``B`` / ``C``.
    use_conv_bias, use_bias: conv bias; ``in_proj`` / ``out_proj`` bias.
    rms_norm_eps: the gated norm's epsilon.
    chunk_size: the prefill scan's chunk length.
    time_step_limit: ``dt`` is clamped to it after softplus.
    activation: of the conv (``"silu"``).
    norm_before_gate: see :class:`~tokenmill.layers.mamba.state_ops.RMSNormGated`.
    use_rms_norm: ``False``: no gated norm, ``y * silu(z)`` instead (Falcon-H1's ``mamba_rms_norm=False``).
    in_multiplier: the input is scaled by it before ``in_proj`` (Falcon-H1's ``ssm_in_multiplier``).
    proj_multipliers: five factors on ``in_proj``'s output sections ``z``, ``x``, ``B``, ``C``, ``dt``
        (Falcon-H1's ``ssm_multipliers``, its "mup vector"); ``None``: all one.

    Raises:
        ValueError: tensor parallelism (state layers run on one rank), or sizes that do not divide.
    """

    def __init__(
        self,
        hidden_size: int,
        ssm_state_size: int,
        conv_kernel_size: int,
        intermediate_size: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        *,
        use_conv_bias: bool = True,
        use_bias: bool = False,
        rms_norm_eps: float = 1e-5,
        chunk_size: int = 256,
        time_step_limit: Sequence[float] = (0.0, float("inf")),
        activation: str = "silu",
        norm_before_gate: bool = False,
        use_rms_norm: bool = True,
        in_multiplier: float = 1.0,
        proj_multipliers: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        if get_tp_size() > 1:
            raise ValueError("tensor_parallel_size: Mamba2 state layers run on one rank only")
        if num_heads * head_dim != intermediate_size:
            raise ValueError(f"num_heads * head_dim ({num_heads * head_dim}) != intermediate size {intermediate_size}")
        if num_heads % n_groups:
            raise ValueError(f"n_groups: {n_groups} does not divide num_heads {num_heads}")
        self.hidden_size = hidden_size
        self.ssm_state_size = ssm_state_size
        self.conv_kernel_size = conv_kernel_size
        self.intermediate_size = intermediate_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.n_groups = n_groups
        self.chunk_size = chunk_size
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.activation = activation
        self.conv_dim = intermediate_size + 2 * n_groups * ssm_state_size
        self.in_proj = ReplicatedLinear(hidden_size, intermediate_size + self.conv_dim + num_heads, bias=use_bias)
        self.conv1d = MambaConv1d(self.conv_dim, conv_kernel_size, use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(num_heads), requires_grad=False)
        self.norm = (RMSNormGated(intermediate_size, rms_norm_eps, group_size=intermediate_size // n_groups,
                                  norm_before_gate=norm_before_gate) if use_rms_norm else None)
        self.in_multiplier = float(in_multiplier)
        vector = None
        if proj_multipliers is not None and any(float(m) != 1.0 for m in proj_multipliers):
            if len(proj_multipliers) != 5:
                raise ValueError(f"proj_multipliers: need 5 factors (z, x, B, C, dt), got {len(proj_multipliers)}")
            gn = n_groups * ssm_state_size
            sizes = (intermediate_size, intermediate_size, gn, gn, num_heads)
            vector = torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, proj_multipliers)])
        self.proj_multipliers: torch.Tensor | None
        self.register_buffer("proj_multipliers", vector, persistent=False)
        self.out_proj = ReplicatedLinear(intermediate_size, hidden_size, bias=use_bias)
        self.conv_op = CausalConv1d()
        self.ssd_op = MambaSSD()

    def get_state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((conv_dim, K - 1), (H, P, N))``: the conv state and the SSM state of one request."""
        return ((self.conv_dim, self.conv_kernel_size - 1),
                (self.num_heads, self.head_dim, self.ssm_state_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` for the step's flattened batch (state slots from the forward
        context; without state metadata, a dummy run, the whole batch is one fresh sequence and no state is
        kept)."""
        if self.in_multiplier != 1.0:
            hidden_states = hidden_states * self.in_multiplier
        proj = self.in_proj(hidden_states)
        if self.proj_multipliers is not None:
            proj = proj * self.proj_multipliers.to(proj.dtype)
        gate, xbc, dt = proj.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        A = -torch.exp(self.A_log.float())
        weight = self.conv1d.weight.squeeze(1)
        y = torch.empty(hidden_states.shape[0], self.intermediate_size, dtype=hidden_states.dtype,
                        device=hidden_states.device)

        def prefill(start: int, end: int, states: States | None) -> States:
            y[start:end], conv_state, ssm_state = self._prefill(xbc[start:end], dt[start:end], A, weight,
                                                                *(states or (None, None)))
            return conv_state, ssm_state

        def decode(rows: torch.Tensor, states: States) -> States:
            return self._decode(xbc, dt, A, weight, rows, *states, y)

        self.run_with_states(hidden_states.shape[0], prefill, decode)
        if self.norm is None:
            return self.out_proj(y * F.silu(gate))
        return self.out_proj(self.norm(y, gate))

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gn = self.n_groups * self.ssm_state_size
        x, B, C = xbc.split([self.intermediate_size, gn, gn], dim=-1)
        lead = xbc.shape[0]
        return (x.reshape(lead, self.num_heads, self.head_dim), B.reshape(lead, self.n_groups, self.ssm_state_size),
                C.reshape(lead, self.n_groups, self.ssm_state_size))

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, weight: torch.Tensor,
                 conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence's tokens -> (``[L, H * P]`` scan output, new conv state, new SSM state)."""
        xbc, conv_state = self.conv_op(xbc, weight, self.conv1d.bias, conv_state, self.activation)
        x, B, C = self._split_xbc(xbc)
        y, ssm_state = self.ssd_op(x, dt, A, B, C, self.chunk_size, self.D, self.dt_bias, ssm_state, True,
                                   self.time_step_limit)
        return y.reshape(y.shape[0], -1), conv_state, ssm_state

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, weight: torch.Tensor,
                rows: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, y: torch.Tensor) -> States:
        """The decode rows ``rows`` from their states (``[B, D, K - 1]``, ``[B, H, P, N]``): outputs into ``y``,
        returns the new states."""
        xbc_d, conv_state = self.conv_op.update(xbc[rows], conv_state, weight, self.conv1d.bias, self.activation)
        x, B, C = self._split_xbc(xbc_d)
        out, ssm_state = self.ssd_op.update(ssm_state, x, dt[rows], A, B, C, self.D, self.dt_bias, True,
                                            self.time_step_limit)
        y[rows] = out.reshape(out.shape[0], -1)
        return conv_state, ssm_state
