"""MambaMixer: the Mamba-1 state-space layer (Gu & Dao 2023) on the hybrid cache, parameter names as in
transformers' ``JambaMambaMixer`` (``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``, ``D``,
``out_proj``; Jamba's ``dt_layernorm`` / ``b_layernorm`` / ``c_layernorm``).

Per step: ``in_proj`` splits into ``x`` and the gate ``z``; ``x`` goes through the causal conv1d (SiLU);
``x_proj`` of the conv output gives the low-rank time step and ``B``, ``C`` (each RMS-normalised in Jamba);
``dt_proj`` lifts the time step to every channel (its bias goes into the scan as ``dt_bias``); the selective scan
gives ``(h C + D x) * silu(z)``; then ``out_proj``. The conv state (last ``K - 1`` conv inputs, ``[D, K - 1]``)
and the SSM state (``[D, N]``) of each request live in its state slot, as for :class:`MambaMixer2`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import get_tp_size
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.layers.mamba.abstract import MambaBase, States
from tokenmill.layers.mamba.mamba_mixer2 import MambaConv1d
from tokenmill.layers.mamba.state_ops import CausalConv1d, SelectiveScan


class MambaMixer(MambaBase):
    """Args:
    hidden_size: model width.
    ssm_state_size: ``N``.
    conv_kernel_size: ``K``.
    intermediate_size: ``D`` channels (``expand * hidden_size``).
    time_step_rank: width of the low-rank time step.
    use_conv_bias, use_bias: conv bias; ``in_proj`` / ``out_proj`` bias.
    use_rms_norm: RMSNorm on the time step, ``B`` and ``C`` (Jamba), with ``rms_norm_eps``.
    activation: of the conv (``"silu"``).
    chunk_size: the prefill scan's chunk length.

    Raises:
        ValueError: tensor parallelism (state layers run on one rank).
    """

    def __init__(
        self,
        hidden_size: int,
        ssm_state_size: int,
        conv_kernel_size: int,
        intermediate_size: int,
        time_step_rank: int,
        *,
        use_conv_bias: bool = True,
        use_bias: bool = False,
        use_rms_norm: bool = False,
        rms_norm_eps: float = 1e-6,
        activation: str = "silu",
        chunk_size: int = 8,
    ) -> None:
        super().__init__()
        if get_tp_size() > 1:
            raise ValueError("tensor_parallel_size: Mamba state layers run on one rank only")
        self.ssm_state_size = ssm_state_size
        self.conv_kernel_size = conv_kernel_size
        self.intermediate_size = intermediate_size
        self.time_step_rank = time_step_rank
        self.activation = activation
        self.chunk_size = chunk_size
        self.in_proj = ReplicatedLinear(hidden_size, 2 * intermediate_size, bias=use_bias)
        self.conv1d = MambaConv1d(intermediate_size, conv_kernel_size, use_conv_bias)
        self.x_proj = ReplicatedLinear(intermediate_size, time_step_rank + 2 * ssm_state_size, bias=False)
        self.dt_proj = ReplicatedLinear(time_step_rank, intermediate_size, bias=True)
        self.dt_proj.quantizable = False  # its weight is used directly (the bias goes into the scan)
        self.A_log = nn.Parameter(torch.zeros(intermediate_size, ssm_state_size), requires_grad=False)
        self.D = nn.Parameter(torch.ones(intermediate_size), requires_grad=False)
        self.out_proj = ReplicatedLinear(intermediate_size, hidden_size, bias=use_bias)
        self.dt_layernorm = RMSNorm(time_step_rank, rms_norm_eps) if use_rms_norm else None
        self.b_layernorm = RMSNorm(ssm_state_size, rms_norm_eps) if use_rms_norm else None
        self.c_layernorm = RMSNorm(ssm_state_size, rms_norm_eps) if use_rms_norm else None
        self.conv_op = CausalConv1d()
        self.scan_op = SelectiveScan()

    def get_state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((D, K - 1), (D, N))``: the conv state and the SSM state of one request."""
        return ((self.intermediate_size, self.conv_kernel_size - 1), (self.intermediate_size, self.ssm_state_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` for the step's flattened batch (state slots from the forward
        context; without state metadata, a dummy run, the whole batch is one fresh sequence and no state is
        kept)."""
        x, z = self.in_proj(hidden_states).chunk(2, dim=-1)
        A = -torch.exp(self.A_log.float())
        weight = self.conv1d.weight.squeeze(1)
        y = torch.empty(hidden_states.shape[0], self.intermediate_size, dtype=hidden_states.dtype,
                        device=hidden_states.device)

        def prefill(start: int, end: int, states: States | None) -> States:
            conv_state, ssm_state = states or (None, None)
            xc, conv_state = self.conv_op(x[start:end], weight, self.conv1d.bias, conv_state, self.activation)
            dt, B, C = self._scan_inputs(xc)
            y[start:end], ssm_state = self.scan_op(xc, dt, A, B, C, self.D, z[start:end], self.dt_proj.bias,
                                                   ssm_state, True, self.chunk_size)
            return conv_state, ssm_state

        def decode(rows: torch.Tensor, states: States) -> States:
            xc, conv_state = self.conv_op.update(x[rows], states[0], weight, self.conv1d.bias, self.activation)
            dt, B, C = self._scan_inputs(xc)
            y[rows], ssm_state = self.scan_op.update(states[1], xc, dt, A, B, C, self.D, z[rows], self.dt_proj.bias,
                                                     True)
            return conv_state, ssm_state

        self.run_with_states(hidden_states.shape[0], prefill, decode)
        return self.out_proj(y)

    def _scan_inputs(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv outputs ``[L, D]`` -> ``(dt [L, D]`` before its bias, ``B [L, N]``, ``C [L, N])``."""
        dt, B, C = self.x_proj(xc).split([self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
        if self.dt_layernorm is not None:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)  # type: ignore[misc]
        return F.linear(dt, self.dt_proj.weight), B, C
