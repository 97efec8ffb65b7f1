"""The state layers' decode step in tokenmill-cpu's C++ kernels (``csrc/state_update.cpp``): replacements of the
custom ops ``causal_conv1d``, ``mamba_ssd`` and ``gated_delta_rule`` (:mod:`tokenmill.layers.mamba.state_ops`)
that :class:`tokenmill_cpu.platform.CpuPlatform` declares.

Each overrides ``update`` (one token per sequence, the decode step) and ``forward`` (one sequence's prefill, the
same step token by token: a prompt gives the same bits as its tokens decoded one at a time). The kernels run when
they are loaded (:func:`tokenmill_cpu.kernels.ready`; they build in the background at start-up), the tensors are
on the CPU and in float32, bfloat16 or float16; otherwise, and for float64 (the reference tests' dtype), the
portable ``*_native`` methods. Results agree with the portable versions to float32 rounding: the sums run in
another order (register-wide partial sums; the portable prefill is chunked), the states are float32 either way.

Why: the portable decode step is a chain of eager torch ops (each a pass over the state with its own temporary);
see docs/benchmarks.md, "State-layer kernels" (``python benchmarks/state_update_kernels.py``).
"""

from __future__ import annotations

import torch

from tokenmill.plugin_api import CausalConv1d, GatedDeltaRule, MambaSSD
from tokenmill_cpu import kernels

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_takes(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels are loaded and every given tensor is a CPU tensor of a dtype they read."""
    if not kernels.ready():
        return False
    return all(t is None or (t.device.type == "cpu" and t.dtype in KERNEL_DTYPES) for t in tensors)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous last dimension (the kernels take any stride elsewhere)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _param(t: torch.Tensor | None) -> torch.Tensor | None:
    """A per-head or per-channel parameter as the contiguous float32 vector the kernels read."""
    return None if t is None else t.float().contiguous()


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the depthwise causal conv1d (:func:`tokenmill.layers.mamba.ops.causal_conv1d_update`).

    Args:
        x: ``[B, D]`` float32, bfloat16 or float16 with contiguous rows.
        conv_state: ``[B, D, K - 1]``, ``x``'s dtype, each sequence's ``[D, K - 1]`` contiguous.
        weight: ``[D, K]`` contiguous, ``x``'s dtype; bias: ``[D]`` of that dtype or ``None``.
        silu: apply SiLU to the outputs.

    Returns:
        ``([B, D]`` outputs, ``[B, D, K - 1]`` new states), both in ``x``'s dtype.

    Raises:
        RuntimeError: shapes, dtypes or layouts are not as above.
    """
    return torch.ops.tokenmill_cpu.causal_conv1d_update(x, conv_state, weight, bias, silu)


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                           dt_softplus: bool, dt_min: float, dt_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the Mamba2 recurrence (:func:`tokenmill.layers.mamba.ops.selective_state_update`); ``dt`` is
    clamped to ``[dt_min, dt_max]`` after the bias and softplus (pass ``-inf, inf`` for no clamp).

    Args:
        state: ``[B, H, P, N]`` float32, bfloat16 or float16, each sequence's ``[H, P, N]`` contiguous.
        x: ``[B, H, P]`` float32, bfloat16 or float16 with contiguous rows; B, C: ``[B, G, N]``, ``x``'s dtype,
            contiguous rows (``G`` divides ``H``).
        dt: ``[B, H]`` float32 (contiguous rows); A, D, dt_bias: ``[H]`` contiguous float32 (D, dt_bias optional).

    Returns:
        ``([B, H, P]`` outputs in ``x``'s dtype, ``[B, H, P, N]`` new states in float32).

    Raises:
        RuntimeError: shapes, dtypes or layouts are not as above.
    """
    return torch.ops.tokenmill_cpu.selective_state_update(state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_min,
                                                          dt_max)


def gated_delta_rule_update(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the gated delta rule (:func:`tokenmill.layers.mamba.ops.gated_delta_rule_update`).

    Args:
        state: ``[B, H, Dk, Dv]`` float32, bfloat16 or float16, each sequence's ``[H, Dk, Dv]`` contiguous.
        q, k: ``[B, H, Dk]``; v: ``[B, H, Dv]``: one dtype of those three, contiguous rows.
        g, beta: ``[B, H]`` float32, contiguous rows.
        use_qk_l2norm: L2-normalise ``q`` and ``k`` first (epsilon ``1e-6``, as the portable version).

    Returns:
        ``([B, H, Dv]`` outputs in ``v``'s dtype, ``[B, H, Dk, Dv]`` new states in float32).

    Raises:
        RuntimeError: shapes, dtypes or layouts are not as above.
    """
    return torch.ops.tokenmill_cpu.gated_delta_rule_update(state, q, k, v, g, beta, use_qk_l2norm)


class _StartsKernelBuild:
    """Starts the kernels' background build when a layer is built (the attention backend usually has already)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        kernels.load_async()


class CpuCausalConv1d(_StartsKernelBuild, CausalConv1d):
    """``causal_conv1d`` in C++ (:func:`causal_conv1d_update`, ``torch.ops.tokenmill_cpu.causal_conv1d_fn``)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv_state: torch.Tensor | None, activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
        if activation not in (None, "silu", "swish") or not _kernel_takes(x, weight, bias, conv_state):
            return self.forward_native(x, weight, bias, conv_state, activation)
        dtype = weight.dtype
        out, state = torch.ops.tokenmill_cpu.causal_conv1d_fn(
            _rows(x.to(dtype)), weight.contiguous(), None if bias is None else bias.to(dtype).contiguous(),
            None if conv_state is None else conv_state.to(dtype).contiguous(), activation is not None)
        return out.to(x.dtype), state

    def update(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
        if activation not in (None, "silu", "swish") or not _kernel_takes(x, conv_state, weight, bias):
            return self.update_native(x, conv_state, weight, bias, activation)
        dtype = weight.dtype  # the portable version computes in the weight's dtype, as transformers does
        out, state = causal_conv1d_update(_rows(x.to(dtype)), conv_state.to(dtype).contiguous(),
                                          weight.contiguous(), None if bias is None else bias.to(dtype).contiguous(),
                                          activation is not None)
        return out.to(x.dtype), state


def _dt_range(dt_limit: tuple[float, float]) -> tuple[float, float]:
    """The clamp of the step as the kernels take it: the portable version clamps only for a positive lower or a
    finite upper limit."""
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    return (lo, hi) if lo > 0.0 or hi != float("inf") else (float("-inf"), hi)


class CpuMambaSSD(_StartsKernelBuild, MambaSSD):
    """``mamba_ssd`` in C++ (:func:`selective_state_update`, ``torch.ops.tokenmill_cpu.selective_scan``); the
    prefill ignores ``chunk_size`` (it runs the recurrence token by token)."""

    def forward(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                chunk_size: int, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                initial_state: torch.Tensor | None = None, dt_softplus: bool = True,
                dt_limit: tuple[float, float] = (0.0, float("inf"))) -> tuple[torch.Tensor, torch.Tensor]:
        if chunk_size < 1 or not _kernel_takes(x, dt, A, B, C, D, dt_bias, initial_state):
            return self.forward_native(x, dt, A, B, C, chunk_size, D, dt_bias, initial_state, dt_softplus, dt_limit)
        return torch.ops.tokenmill_cpu.selective_scan(
            _rows(x), _rows(dt.float()), _param(A), _rows(B.to(x.dtype)), _rows(C.to(x.dtype)), _param(D),
            _param(dt_bias), initial_state, dt_softplus, *_dt_range(dt_limit))

    def update(self, state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
               dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, float("inf"))
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _kernel_takes(state, x, dt, A, B, C, D, dt_bias):
            return self.update_native(state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit)
        return selective_state_update(state.contiguous(), _rows(x), _rows(dt.float()), _param(A),
                                      _rows(B.to(x.dtype)), _rows(C.to(x.dtype)), _param(D), _param(dt_bias),
                                      dt_softplus, *_dt_range(dt_limit))


class CpuGatedDeltaRule(_StartsKernelBuild, GatedDeltaRule):
    """``gated_delta_rule`` in C++ (:func:`gated_delta_rule_update`,
    ``torch.ops.tokenmill_cpu.gated_delta_rule_scan``)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _kernel_takes(q, k, v, g, beta, initial_state):
            return self.forward_native(q, k, v, g, beta, initial_state, use_qk_l2norm)
        dtype = v.dtype
        return torch.ops.tokenmill_cpu.gated_delta_rule_scan(_rows(q.to(dtype)), _rows(k.to(dtype)), _rows(v),
                                                            _rows(g.float()), _rows(beta.float()), initial_state,
                                                            use_qk_l2norm)

    def update(self, state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        if not _kernel_takes(state, q, k, v, g, beta):
            return self.update_native(state, q, k, v, g, beta, use_qk_l2norm)
        dtype = v.dtype
        return gated_delta_rule_update(state.contiguous(), _rows(q.to(dtype)), _rows(k.to(dtype)), _rows(v),
                                       _rows(g.float()), _rows(beta.float()), use_qk_l2norm)
