"""Portable torch implementations of the state-space ops of Mamba2-style layers (Dao & Gu 2024, "Transformers
are SSMs", the state space duality).

Each op runs for one request (prefill) or a batch of requests one token each (decode), and returns the state it
leaves behind instead of writing it, so the caller decides where states live (slots of the state cache). All
arithmetic of the scan and the recurrence runs in float32 (float64 when the inputs are float64, for the
reference tests); outputs have the input dtype.

Shapes: ``L`` tokens, ``D`` conv channels, ``K`` conv kernel width, ``H`` heads of ``P`` channels, ``G`` groups of
``B``/``C`` (``H % G == 0``; head ``h`` uses group ``h // (H / G)``), ``N`` state size per head channel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"activation: only 'silu' is supported in the causal conv1d, got {activation!r}")


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor | None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over one sequence, continuing from ``conv_state``.

    Args:
        x: ``[L, D]`` the sequence's new inputs.
        weight: ``[D, K]`` per-channel kernels (the checkpoint's ``conv1d.weight [D, 1, K]`` squeezed).
        bias: ``[D]`` or ``None``.
        conv_state: ``[D, K - 1]`` the last ``K - 1`` inputs before ``x`` (``None``: zeros, a fresh sequence).
        activation: ``"silu"`` or ``None``.

    Returns:
        ``([L, D]`` outputs in ``x``'s dtype, ``[D, K - 1]`` the new conv state (the last ``K - 1`` inputs)).
    """
    dim, width = weight.shape
    xt = x.t().to(weight.dtype)
    prev = conv_state.to(weight.dtype) if conv_state is not None else xt.new_zeros(dim, width - 1)
    full = torch.cat([prev, xt], dim=-1)
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), bias, groups=dim).squeeze(0)
    return _activate(out, activation).t().to(x.dtype), full[:, full.shape[1] - (width - 1):]


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the causal convolution for a batch of sequences.

    Args:
        x: ``[B, D]`` one new input per sequence.
        conv_state: ``[B, D, K - 1]`` each sequence's last ``K - 1`` inputs.
        weight, bias, activation: as :func:`causal_conv1d_fn`.

    Returns:
        ``([B, D]`` outputs, ``[B, D, K - 1]`` new conv states).
    """
    full = torch.cat([conv_state.to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)], dim=-1)
    out = (full * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return _activate(out, activation).to(x.dtype), full[..., 1:]


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool,
                  dt_limit: tuple[float, float], dtype: torch.dtype) -> torch.Tensor:
    """``softplus(dt + dt_bias)`` (without softplus when ``dt_softplus`` is false) clamped to ``dt_limit``, in
    ``dtype``."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _per_head(t: torch.Tensor, num_heads: int, dim: int) -> torch.Tensor:
    return t.repeat_interleave(num_heads // t.shape[dim], dim=dim)


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the Mamba2 recurrence for a batch of sequences (decode).

    ``h' = exp(dt A) h + dt x (x) B``, ``y = h' . C + D x`` per head, with ``dt = softplus(dt + dt_bias)``
    clamped to ``dt_limit``.

    Args:
        state: ``[B, H, P, N]`` each sequence's SSM state.
        x: ``[B, H, P]``.
        dt: ``[B, H]`` raw time steps (before bias and softplus).
        A: ``[H]`` (negative; ``-exp(A_log)``).
        B, C: ``[B, G, N]``.
        D: ``[H]`` skip connection or ``None``.
        dt_bias: ``[H]`` or ``None``.

    Returns:
        ``([B, H, P]`` outputs in ``x``'s dtype, ``[B, H, P, N]`` new states in the compute dtype).
    """
    ct = compute_dtype(x.dtype)
    heads = x.shape[1]
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit, ct)
    decay = torch.exp(dt * A.to(ct))
    Bh, Ch = _per_head(B.to(ct), heads, 1), _per_head(C.to(ct), heads, 1)
    xf = x.to(ct)
    new = state.to(ct) * decay[..., None, None] + (xf * dt[..., None]).unsqueeze(-1) * Bh.unsqueeze(2)
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        y = y + xf * D.to(ct)[:, None]
    return y.to(x.dtype), new


def mamba_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba2 recurrence over one sequence, chunk by chunk (prefill).

    Inside a chunk of ``Q = chunk_size`` tokens the outputs come from the quadratic (attention-like) form
    ``y_i = sum_{j<=i} exp(a_j+1 + ... + a_i) (C_i . B_j) dt_j x_j`` plus the chunk's incoming state decayed to
    token ``i``; the state then moves to the end of the chunk in one update. Cost ``O(L Q)`` per head, and the
    same result as :func:`selective_state_update` applied token by token.

    Args:
        x: ``[L, H, P]``.
        dt: ``[L, H]`` raw time steps.
        A: ``[H]``.
        B, C: ``[L, G, N]``.
        chunk_size: ``Q`` (at least 1).
        D, dt_bias, dt_softplus, dt_limit: as :func:`selective_state_update`.
        initial_state: ``[H, P, N]`` the state before the first token (``None``: zeros).

    Returns:
        ``([L, H, P]`` outputs in ``x``'s dtype, ``[H, P, N]`` the state after the last token, compute dtype).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: must be at least 1, got {chunk_size}")
    ct = compute_dtype(x.dtype)
    length, heads, head_dim = x.shape
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit, ct)
    xf = x.to(ct)
    # heads first, so every product below is a batched matmul over heads
    log_decay = (dt * A.to(ct)).t().contiguous()  # [H, L]
    xdt = (xf * dt[..., None]).transpose(0, 1).contiguous()  # [H, L, P]
    Bh = _per_head(B.to(ct), heads, 1).transpose(0, 1).contiguous()  # [H, L, N]
    Ch = _per_head(C.to(ct), heads, 1).transpose(0, 1).contiguous()
    state = (initial_state.to(ct) if initial_state is not None
             else xf.new_zeros(heads, head_dim, B.shape[-1]))  # [H, P, N]
    y = torch.empty(heads, length, head_dim, dtype=ct, device=x.device)
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        cum = torch.cumsum(log_decay[:, start:end], dim=-1)  # [H, q]
        q = end - start
        causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp((cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")))  # [H, i, j]
        c, b, u = Ch[:, start:end], Bh[:, start:end], xdt[:, start:end]
        y[:, start:end] = ((c @ b.transpose(-1, -2)) * decay) @ u + (c @ state.transpose(-1, -2)) * torch.exp(
            cum)[..., None]
        to_end = torch.exp(cum[:, -1:] - cum)[..., None]  # [H, q, 1]: decay from token j to the chunk's end
        state = state * torch.exp(cum[:, -1])[:, None, None] + (u * to_end).transpose(-1, -2) @ b
    y = y.transpose(0, 1)
    if D is not None:
        y = y + xf * D.to(ct)[:, None]
    return y.to(x.dtype), state


def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """Gated RMSNorm of Mamba2's output, per group of ``group_size`` channels, in float32.

    ``norm_before_gate=False`` (Mamba2, Granite 4.0-H, transformers' ``MambaRMSNormGated``):
    ``weight * norm(x * silu(gate))``; ``True``: ``weight * norm(x) * silu(gate)``.

    Args:
        x, gate: ``[T, D]`` (``D % group_size == 0``); ``gate`` may be ``None``.
        weight: ``[D]``.

    Returns:
        ``[T, D]`` in ``x``'s dtype (the normalised value is cast before the weight multiplies it, as in
        transformers).
    """
    dtype = x.dtype
    h = x.to(compute_dtype(dtype))
    g = F.silu(gate.to(h.dtype)) if gate is not None else None
    if g is not None and not norm_before_gate:
        h = h * g
    shape = h.shape
    grouped = h.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    h = grouped.reshape(shape)
    if g is not None and norm_before_gate:
        h = h * g
    return weight * h.to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (FLA's and transformers' convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _delta_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, use_qk_l2norm: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ct = compute_dtype(v.dtype)
    q, k, v = q.to(ct), k.to(ct), v.to(ct)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v


def _delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    state = state * torch.exp(g)[..., None, None]
    delta = (v - torch.einsum("...kv,...k->...v", state, k)) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("...kv,...k->...v", state, q), state


def gated_delta_rule_update(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the gated delta rule (Yang et al. 2024, "Gated Delta Networks") for a batch (decode).

    ``S' = exp(g) S + k (beta (v - (exp(g) S)^T k))^T``, ``o = S'^T q / sqrt(Dk)`` per head, with ``q`` and
    ``k`` L2-normalised first when ``use_qk_l2norm``.

    Args:
        state: ``[B, H, Dk, Dv]``.
        q, k: ``[B, H, Dk]`` (already repeated to the value heads).
        v: ``[B, H, Dv]``.
        g: ``[B, H]`` log decay (``<= 0``).
        beta: ``[B, H]`` write strength in ``(0, 1)``.

    Returns:
        ``([B, H, Dv]`` outputs in ``v``'s dtype, ``[B, H, Dk, Dv]`` new states in the compute dtype).
    """
    qf, kf, vf = _delta_inputs(q, k, v, use_qk_l2norm)
    ct = vf.dtype
    o, new = _delta_step(state.to(ct), qf, kf, vf, g.to(ct), beta.to(ct))
    return o.to(v.dtype), new


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence (prefill), chunk by chunk from ``initial_state``.

    Per head, with ``G_t`` the cumulative log decay inside a chunk (``Gamma_t = exp(G_t)``) and ``S_0`` the
    state entering it, the state after token ``t`` is ``Gamma_t S_0 + sum_{j<=t} (Gamma_t / Gamma_j) k_j d_j^T``
    where the corrections ``d`` solve the unit lower-triangular system
    ``d_t + beta_t sum_{j<t} (Gamma_t / Gamma_j) (k_t . k_j) d_j = beta_t (v_t - Gamma_t S_0^T k_t)``; outputs
    are ``o_t = Gamma_t S_0^T q_t + sum_{j<=t} (Gamma_t / Gamma_j) (q_t . k_j) d_j``. Same result as
    :func:`gated_delta_rule_update` token by token, with one triangular solve per chunk instead of a loop.

    Args:
        q, k: ``[L, H, Dk]``; v: ``[L, H, Dv]``; g, beta: ``[L, H]`` (as :func:`gated_delta_rule_update`).
        initial_state: ``[H, Dk, Dv]`` or ``None`` (zeros).
        chunk_size: tokens per chunk (at least 1).

    Returns:
        ``([L, H, Dv]`` outputs in ``v``'s dtype, ``[H, Dk, Dv]`` the final state in the compute dtype).

    Raises:
        ValueError: ``chunk_size < 1``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: must be at least 1, got {chunk_size}")
    qf, kf, vf = (x.transpose(0, 1) for x in _delta_inputs(q, k, v, use_qk_l2norm))  # [H, L, D]
    ct = vf.dtype
    g, beta = g.to(ct).t(), beta.to(ct).t()  # [H, L]
    state = (initial_state.to(ct) if initial_state is not None
             else vf.new_zeros(v.shape[1], q.shape[-1], v.shape[-1]))
    out = torch.empty_like(vf)
    for start in range(0, q.shape[0], chunk_size):
        end = min(start + chunk_size, q.shape[0])
        qc, kc, vc, bc = qf[:, start:end], kf[:, start:end], vf[:, start:end], beta[:, start:end]
        cum = torch.cumsum(g[:, start:end], dim=-1)  # [H, c]
        n = end - start
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        diff = cum[:, :, None] - cum[:, None, :]  # [H, t, j]
        within = torch.exp(diff.masked_fill(~lower, float("-inf")))  # Gamma_t / Gamma_j for j <= t
        strict = within.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), 0.0)  # j < t only
        system = bc[..., None] * strict * (kc @ kc.transpose(-1, -2))
        decay = torch.exp(cum)[..., None]  # [H, c, 1]
        rhs = bc[..., None] * (vc - decay * (kc @ state))
        d = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, start:end] = decay * (qc @ state) + (within * (qc @ kc.transpose(-1, -2))) @ d
        to_end = torch.exp(cum[:, -1:] - cum)[..., None]  # [H, c, 1]
        state = torch.exp(cum[:, -1])[:, None, None] * state + (kc * to_end).transpose(-1, -2) @ d
    return out.transpose(0, 1).to(v.dtype), state
