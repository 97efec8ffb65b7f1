"""Portable torch implementations of Mamba-1's selective scan (Gu & Dao 2023, "Mamba: Linear-Time Sequence
Modeling with Selective State Spaces"), the state layer of Jamba.

Unlike Mamba2 (:mod:`.ops`), every channel ``d`` has its own decay per state dimension: ``A`` is ``[D, N]`` and
the state of one request ``[D, N]``; ``B`` and ``C`` are ``[N]`` per token, shared by all channels. As in
:mod:`.ops`, each op returns the state it leaves instead of writing it, runs in float32 (float64 for float64
inputs) and returns outputs in the input dtype.

Shapes: ``L`` tokens, ``D`` channels, ``N`` state size, ``Bt`` sequences of a decode batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.mamba.ops import compute_dtype, discretize_dt

_NO_LIMIT = (0.0, float("inf"))


def _finish(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """``(y + D x) * silu(z)`` in ``y``'s dtype."""
    if D is not None:
        y = y + x.to(y.dtype) * D.to(y.dtype)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def selective_scan_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the Mamba-1 recurrence for a batch of sequences (decode).

    ``h' = exp(dt A) * h + (dt x) (x) B``, ``y = (h' C + D x) * silu(z)`` per channel, with ``dt =
    softplus(dt + dt_bias)``.

    Args:
        state: ``[Bt, D, N]`` each sequence's state.
        x: ``[Bt, D]`` the conv outputs.
        dt: ``[Bt, D]`` raw time steps (before bias and softplus).
        A: ``[D, N]`` (negative; ``-exp(A_log)``).
        B, C: ``[Bt, N]``.
        D: ``[D]`` skip connection or ``None``.
        z: ``[Bt, D]`` gate or ``None``.
        dt_bias: ``[D]`` or ``None``.

    Returns:
        ``([Bt, D]`` outputs in ``x``'s dtype, ``[Bt, D, N]`` new states in the compute dtype).
    """
    ct = compute_dtype(x.dtype)
    dt = discretize_dt(dt, dt_bias, dt_softplus, _NO_LIMIT, ct)
    xf = x.to(ct)
    new = state.to(ct) * torch.exp(dt[..., None] * A.to(ct)) + (xf * dt)[..., None] * B.to(ct)[:, None, :]
    y = torch.einsum("bdn,bn->bd", new, C.to(ct))
    return _finish(y, xf, D, z).to(x.dtype), new


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    dt_softplus: bool = True,
    chunk_size: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-1 recurrence over one sequence, chunk by chunk (prefill).

    Inside a chunk of ``Q`` tokens, with ``S_i = dt_1 A + ... + dt_i A`` (``[D, N]``, from the chunk's start):
    ``h_i = exp(S_i) h_0 + sum_{j<=i} exp(S_i - S_j) (dt_j x_j) (x) B_j``, so ``y_i = h_i C_i`` for the whole
    chunk comes from a ``[Q, Q, D, N]`` decay tensor (every exponent at most zero); the state then moves to the
    chunk's end in one update. The same result as :func:`selective_scan_update` token by token, with ``O(L / Q)``
    steps instead of ``L``.

    Args:
        x: ``[L, D]``.
        dt: ``[L, D]`` raw time steps.
        A: ``[D, N]``.
        B, C: ``[L, N]``.
        D, z, dt_bias, dt_softplus: as :func:`selective_scan_update` (``z``: ``[L, D]``).
        initial_state: ``[D, N]`` the state before the first token (``None``: zeros).
        chunk_size: ``Q`` (at least 1); memory ``Q * Q * D * N`` compute-dtype numbers.

    Returns:
        ``([L, D]`` outputs in ``x``'s dtype, ``[D, N]`` the state after the last token, compute dtype).

    Raises:
        ValueError: ``chunk_size`` below 1.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: must be at least 1, got {chunk_size}")
    ct = compute_dtype(x.dtype)
    length, channels = x.shape
    dt = discretize_dt(dt, dt_bias, dt_softplus, _NO_LIMIT, ct)
    xf, Af, Bf, Cf = x.to(ct), A.to(ct), B.to(ct), C.to(ct)
    u = xf * dt  # [L, D]
    state = initial_state.to(ct) if initial_state is not None else xf.new_zeros(channels, A.shape[-1])
    y = torch.empty(length, channels, dtype=ct, device=x.device)
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        q = end - start
        cum = torch.cumsum(dt[start:end, :, None] * Af, dim=0)  # [q, D, N]
        causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()[:, :, None, None]
        decay = torch.exp((cum[:, None] - cum[None, :]).masked_fill(~causal, float("-inf")))  # [i, j, D, N]
        b, c = Bf[start:end], Cf[start:end]
        inputs = u[start:end, :, None] * b[:, None, :]  # [j, D, N]
        y[start:end] = (torch.einsum("ijdn,jdn,in->id", decay, inputs, c)
                        + torch.einsum("idn,dn,in->id", torch.exp(cum), state, c))
        state = torch.exp(cum[-1]) * state + (torch.exp(cum[-1] - cum) * inputs).sum(0)
    return _finish(y, xf, D, z).to(x.dtype), state
