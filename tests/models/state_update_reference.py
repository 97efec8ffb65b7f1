"""Float64 references of the state layers' decode step (the one-step definitions written out) and the error
bounds a float32 kernel's results must meet, shared by the CPU kernels' and the Triton kernels' tests.

The bounds are forward error bounds, not guesses: a float32 result computed by a chain of ``c`` roundings from
float32 inputs is within ``c * u * m`` of the exact value (``u = 2**-24``), ``m`` being the same expression
evaluated on the absolute values of its terms (every subtraction an addition). Each reference returns ``m`` (or the
bound) next to its result, with ``c`` counted from the longest chain of the kernels (a sum of ``n`` terms counts
``n`` whatever its order, ``exp``, ``log1p``, a division or square root a few units each: glibc's and Triton's float
functions are within 2 ulp). bfloat16 and float16 outputs add their own rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

U32 = 2.0**-24  # float32 unit roundoff
U_BF16 = 2.0**-8


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """``|got - want| <= bound`` elementwise (float64), with the worst ratio in the message."""
    err = (got.double() - want).abs()
    ratio = (err / bound.clamp(min=1e-300)).max().item()
    assert ratio <= 1.0, f"{what}: error {err.max().item():.3g} is {ratio:.2f}x its bound"


def output_bound(want: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype, truncated: bool = False
                 ) -> torch.Tensor:
    """The float32 bound plus the output's own rounding (bfloat16: ``2**-8`` of the value, float16: ``2**-11``;
    twice that where the conversion truncates, ``truncated``)."""
    if dtype == torch.float32:
        return bound
    unit = (U_BF16 if dtype == torch.bfloat16 else 2.0**-11) * (2 if truncated else 1)
    return bound + unit * (want.abs() + bound)


def ref_conv_update(x, state, w, b, silu: bool):
    """float64: ``pre = b + sum_j w[:, j] * [state, x][:, j]``; returns (out, |terms| sum, new state)."""
    full = torch.cat([state, x.unsqueeze(-1)], dim=-1)
    pre = (full * w).sum(-1) + (b if b is not None else 0.0)
    mag = (full * w).abs().sum(-1) + (b.abs() if b is not None else 0.0)
    return (F.silu(pre) if silu else pre), mag, full[..., 1:]


def ref_ssm_update(state, x, dt, A, B, C, D, dt_bias, lo, hi):
    """float64 one step, and the elementwise error bound of a float32 evaluation (see the module docstring)."""
    heads, groups, n = x.shape[1], B.shape[1], B.shape[2]
    step = F.softplus(dt + (dt_bias if dt_bias is not None else 0.0)).clamp(min=lo, max=hi)  # [b, H]
    decay = torch.exp(step * A)
    Bh, Ch = B.repeat_interleave(heads // groups, 1), C.repeat_interleave(heads // groups, 1)  # [b, H, N]
    kept = state * decay[..., None, None]
    written = (x * step[..., None])[..., None] * Bh[:, :, None, :]
    new = kept + written
    skip = x * D[:, None] if D is not None else torch.zeros_like(x)
    y = (new * Ch[:, :, None, :]).sum(-1) + skip
    rel_step = 8 * U32  # bias add, exp, log1p, clamp
    rel_decay = (step * A).abs() * rel_step + 4 * U32  # product, exp
    new_err = kept.abs() * (rel_decay + 2 * U32)[..., None, None] + written.abs() * (rel_step + 3 * U32)
    y_err = (new_err * Ch.abs()[:, :, None, :]).sum(-1) + (n + 2) * U32 * (
        (new * Ch[:, :, None, :]).abs().sum(-1) + skip.abs())
    return y, new, y_err, new_err


def ref_delta_update(state, q, k, v, g, beta, l2: bool):
    """float64 one step and the magnitude ``m`` of its terms (see the module docstring)."""
    dk = q.shape[-1]
    if l2:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * dk**-0.5
    decay = torch.exp(g)[..., None, None]
    mem = torch.einsum("bhkv,bhk->bhv", state * decay, k)
    mem_abs = torch.einsum("bhkv,bhk->bhv", (state * decay).abs(), k.abs())
    delta = beta[..., None] * (v - mem)
    delta_abs = beta[..., None] * (v.abs() + mem_abs)
    new = state * decay + k[..., :, None] * delta[..., None, :]
    new_abs = (state * decay).abs() + k.abs()[..., :, None] * delta_abs[..., None, :]
    o = torch.einsum("bhkv,bhk->bhv", new, q)
    o_abs = torch.einsum("bhkv,bhk->bhv", new_abs, q.abs())
    return o, new, o_abs, new_abs
