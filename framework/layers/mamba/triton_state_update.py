"""Triton kernels for the decode step of the state layers, one token per sequence of the batch:
:func:`causal_conv1d_update`, :func:`selective_state_update` (Mamba2) and :func:`gated_delta_rule_update`.

The definitions and argument conventions are those of :mod:`tokenmill.layers.mamba.ops` (the portable torch
versions): states are read in any float dtype and the new states returned in float32, outputs in the input's dtype,
arithmetic in float32. Portable Triton only, so the same code runs on NVIDIA and AMD GPUs and, with
``TRITON_INTERPRET=1``, on CPU tensors (slowly; that is how the tests run it).

Why: the portable decode step is a chain of eager torch ops, each a pass over the state with its own temporary and
kernel launch; here each op is one launch, and each state element is read once and written once.

Work split: the conv is one program per (sequence, block of channels); the Mamba2 step one per (sequence, head,
block of head channels ``P``), each holding a ``[BLOCK_P, N]`` tile of the state; the delta rule one per
(sequence, head, block of value channels): its columns are independent (``S^T k`` and ``S'^T q`` are per column),
so a program holds a ``[Dk, BLOCK_V]`` tile and reads ``q``, ``k`` whole.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_update_kernel(x_ptr, state_ptr, w_ptr, bias_ptr, out_ptr, new_ptr, dim, stride_x, stride_s_b,
                        WIDTH: tl.constexpr, WIDTH_P2: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                        SILU: tl.constexpr):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, WIDTH_P2)
    d_ok = d < dim
    keep = WIDTH - 1
    in_state = d_ok[:, None] & (j[None, :] < keep)
    # the window [state, x]: columns 0 .. K - 2 from the state, column K - 1 is the new input
    s = tl.load(state_ptr + b * stride_s_b + d[:, None] * keep + j[None, :], mask=in_state, other=0.0)
    x = tl.load(x_ptr + b * stride_x + d, mask=d_ok, other=0.0)
    window = tl.where(j[None, :] == keep, x[:, None].to(tl.float32), s.to(tl.float32))
    w = tl.load(w_ptr + d[:, None] * WIDTH + j[None, :], mask=d_ok[:, None] & (j[None, :] < WIDTH), other=0.0)
    acc = tl.sum(window * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * dim + d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)
    # the new state is the window shifted by one: column j takes window column j + 1
    shifted = tl.load(state_ptr + b * stride_s_b + d[:, None] * keep + j[None, :] + 1,
                      mask=d_ok[:, None] & (j[None, :] < keep - 1), other=0.0)
    new = tl.where(j[None, :] == keep - 1, x[:, None].to(tl.float32), shifted.to(tl.float32))
    tl.store(new_ptr + b * dim * keep + d[:, None] * keep + j[None, :], new.to(new_ptr.dtype.element_ty),
             mask=in_state)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the depthwise causal conv1d (:func:`tokenmill.layers.mamba.ops.causal_conv1d_update`).

    Args:
        x: ``[B, D]`` with contiguous rows; conv_state: ``[B, D, K - 1]``, each sequence's ``[D, K - 1]``
            contiguous; weight: ``[D, K]`` contiguous; bias: ``[D]`` contiguous or ``None``.
        silu: apply SiLU to the outputs.

    Returns:
        ``([B, D]`` outputs in ``x``'s dtype, ``[B, D, K - 1]`` new states in ``weight``'s dtype); sums in float32.
    """
    batch, dim = x.shape
    width = weight.shape[1]
    out = torch.empty(batch, dim, dtype=x.dtype, device=x.device)
    new = torch.empty(batch, dim, width - 1, dtype=weight.dtype, device=x.device)
    if batch == 0:
        return out, new
    block = min(256, triton.next_power_of_2(dim))
    _conv_update_kernel[(batch, triton.cdiv(dim, block))](
        x, conv_state, weight, bias if bias is not None else weight, out, new, dim, x.stride(0),
        conv_state.stride(0), WIDTH=width, WIDTH_P2=triton.next_power_of_2(width), BLOCK_D=block,
        HAS_BIAS=bias is not None, SILU=silu)
    return out, new


@triton.jit
def _ssm_update_kernel(state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, y_ptr, new_ptr,
                       heads, head_dim, n_state, per_group, dt_min, dt_max,
                       stride_s_b, stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g,
                       stride_C_b, stride_C_g, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                       HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < head_dim, n < n_state
    g = h // per_group
    step = tl.load(dt_ptr + b * stride_dt_b + h).to(tl.float32)
    if HAS_DT_BIAS:
        step += tl.load(dt_bias_ptr + h).to(tl.float32)
    if DT_SOFTPLUS:  # torch's softplus (linear above 20); log1p(e) as log(1 + e) * e / ((1 + e) - 1) (Kahan)
        e = tl.exp(tl.minimum(step, 20.0))
        one_plus = 1.0 + e
        log1p = tl.where(one_plus == 1.0, e, tl.log(one_plus) * (e / (one_plus - 1.0)))
        step = tl.where(step > 20.0, step, log1p)
    step = tl.minimum(tl.maximum(step, dt_min), dt_max)
    decay = tl.exp(step * tl.load(A_ptr + h).to(tl.float32))
    x = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + p, mask=p_ok, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + b * stride_B_b + g * stride_B_g + n, mask=n_ok, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + n, mask=n_ok, other=0.0).to(tl.float32)
    tile = (h * head_dim + p[:, None]) * n_state + n[None, :]
    mask = p_ok[:, None] & n_ok[None, :]
    s = tl.load(state_ptr + b * stride_s_b + tile, mask=mask, other=0.0).to(tl.float32)
    new = s * decay + (x * step)[:, None] * Bv[None, :]
    tl.store(new_ptr + b * heads * head_dim * n_state + tile, new, mask=mask)
    y = tl.sum(new * Cv[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(D_ptr + h).to(tl.float32)
    tl.store(y_ptr + (b * heads + h) * head_dim + p, y.to(y_ptr.dtype.element_ty), mask=p_ok)


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                           C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
                           dt_min: float, dt_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the Mamba2 recurrence (:func:`tokenmill.layers.mamba.ops.selective_state_update`); the step is
    clamped to ``[dt_min, dt_max]`` after the bias and softplus (``-inf, inf``: no clamp).

    Args:
        state: ``[B, H, P, N]``, each sequence's ``[H, P, N]`` contiguous.
        x: ``[B, H, P]``; dt: ``[B, H]``; B, C: ``[B, G, N]`` (``G`` divides ``H``): contiguous last dimensions.
        A, D, dt_bias: ``[H]`` contiguous (D, dt_bias optional).

    Returns:
        ``([B, H, P]`` outputs in ``x``'s dtype, ``[B, H, P, N]`` new states in float32).
    """
    batch, heads, head_dim = x.shape
    n_state = state.shape[-1]
    y = torch.empty(batch, heads, head_dim, dtype=x.dtype, device=x.device)
    new = torch.empty(batch, heads, head_dim, n_state, dtype=torch.float32, device=x.device)
    if batch == 0:
        return y, new
    block_n = triton.next_power_of_2(n_state)
    block_p = max(1, min(triton.next_power_of_2(head_dim), 4096 // block_n))
    grid = (batch, heads, triton.cdiv(head_dim, block_p))
    _ssm_update_kernel[grid](
        state, x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, y, new,
        heads, head_dim, n_state, heads // B.shape[1], dt_min, dt_max,
        state.stride(0), x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        BLOCK_P=block_p, BLOCK_N=block_n, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus)
    return y, new


@triton.jit
def _delta_update_kernel(state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, new_ptr, heads, dk, dv, q_scale,
                         stride_s_b, stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
                         stride_g_b, stride_beta_b, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                         L2NORM: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    r = tl.arange(0, BLOCK_K)
    r_ok, c_ok = r < dk, c < dv
    q = tl.load(q_ptr + b * stride_q_b + h * stride_q_h + r, mask=r_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_k_b + h * stride_k_h + r, mask=r_ok, other=0.0).to(tl.float32)
    if L2NORM:  # x / sqrt(sum(x^2) + 1e-6), as the portable l2norm
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * q_scale
    v = tl.load(v_ptr + b * stride_v_b + h * stride_v_h + c, mask=c_ok, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + b * stride_g_b + h).to(tl.float32))
    beta = tl.load(beta_ptr + b * stride_beta_b + h).to(tl.float32)
    tile = (h * dk + r[:, None]) * dv + c[None, :]
    mask = r_ok[:, None] & c_ok[None, :]
    s = tl.load(state_ptr + b * stride_s_b + tile, mask=mask, other=0.0).to(tl.float32) * decay
    delta = beta * (v - tl.sum(s * k[:, None], axis=0))
    new = s + k[:, None] * delta[None, :]
    tl.store(new_ptr + b * heads * dk * dv + tile, new, mask=mask)
    o = tl.sum(new * q[:, None], axis=0)
    tl.store(o_ptr + (b * heads + h) * dv + c, o.to(o_ptr.dtype.element_ty), mask=c_ok)


def gated_delta_rule_update(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the gated delta rule (:func:`tokenmill.layers.mamba.ops.gated_delta_rule_update`).

    Args:
        state: ``[B, H, Dk, Dv]``, each sequence's ``[H, Dk, Dv]`` contiguous.
        q, k: ``[B, H, Dk]``; v: ``[B, H, Dv]``; g, beta: ``[B, H]``: contiguous last dimensions.
        use_qk_l2norm: L2-normalise ``q`` and ``k`` first.

    Returns:
        ``([B, H, Dv]`` outputs in ``v``'s dtype, ``[B, H, Dk, Dv]`` new states in float32).
    """
    batch, heads, dk = q.shape
    dv = v.shape[-1]
    o = torch.empty(batch, heads, dv, dtype=v.dtype, device=v.device)
    new = torch.empty(batch, heads, dk, dv, dtype=torch.float32, device=v.device)
    if batch == 0:
        return o, new
    block_k = triton.next_power_of_2(dk)
    block_v = max(1, min(triton.next_power_of_2(dv), 4096 // block_k))
    _delta_update_kernel[(batch, heads, triton.cdiv(dv, block_v))](
        state, q, k, v, g, beta, o, new, heads, dk, dv, dk**-0.5, state.stride(0), q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=use_qk_l2norm)
    return o, new
