"""The state-space ops of ``tokenmill.layers.mamba`` (Mamba2, Mamba-1, gated DeltaNet) against float64 references
written as plain per-token loops (the definitions, not the chunked forms), in float32 and float64, and through their
custom-op classes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.mamba import ops
from tokenmill.layers.mamba.state_ops import CausalConv1d, MambaSSD, RMSNormGated, SelectiveScan

L, D, K, H, P, G, N = 23, 12, 4, 4, 3, 2, 5


def ref_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
    """``out[t, d] = silu(b[d] + sum_k w[d, k] * in[t - (K - 1) + k, d])`` over ``init`` then ``x``."""
    seq = torch.cat([init.t(), x], dim=0)
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        window = seq[t : t + K]  # [K, D]
        out[t] = F.silu(b + (window.t() * w).sum(-1))
    return out


def ref_scan(x, dt, A, B, C, D_, dt_bias, h0):
    """``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t``, ``y_t = C_t . h_t + D x_t``, one token at a time."""
    h = h0.clone()
    ys = []
    per = H // G
    for t in range(x.shape[0]):
        d = F.softplus(dt[t] + dt_bias)  # [H]
        Bh, Ch = B[t].repeat_interleave(per, 0), C[t].repeat_interleave(per, 0)  # [H, N]
        h = h * torch.exp(d * A)[:, None, None] + (d[:, None] * x[t])[..., None] * Bh[:, None, :]
        ys.append((h * Ch[:, None, :]).sum(-1) + D_[:, None] * x[t])
    return torch.stack(ys), h


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    return dict(x=r(L, H, P), dt=r(L, H, scale=0.5), A=-torch.rand(H, generator=g, dtype=torch.float64) - 0.2,
                B=r(L, G, N), C=r(L, G, N), D=r(H), dt_bias=r(H, scale=0.3), h0=r(H, P, N, scale=0.5),
                cx=r(L, D), cw=r(D, K, scale=0.5), cb=r(D, scale=0.1), cs=r(D, K - 1))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("chunk", [1, 5, 8, 64])
def test_chunk_scan_matches_recurrence(inputs, dtype, tol, chunk):
    i = inputs
    want_y, want_h = ref_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"], i["h0"])
    args = [i[k].to(dtype) for k in ("x", "dt", "A", "B", "C")]
    y, h = MambaSSD()(*args, chunk, i["D"].to(dtype), i["dt_bias"].to(dtype), i["h0"].to(dtype))
    torch.testing.assert_close(y.double(), want_y, atol=tol, rtol=tol)
    torch.testing.assert_close(h.double(), want_h, atol=tol, rtol=tol)


def test_chunk_scan_from_zero_state_and_split_prompt(inputs):
    """A prompt split in two prefill calls (state carried) equals one call from a zero state."""
    i = inputs
    whole_y, whole_h = ops.mamba_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], 4, i["D"], i["dt_bias"])
    want_y, want_h = ref_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"], torch.zeros_like(i["h0"]))
    torch.testing.assert_close(whole_y, want_y)
    torch.testing.assert_close(whole_h, want_h)
    cut = 9
    y1, h1 = ops.mamba_chunk_scan(*(i[k][:cut] for k in ("x", "dt")), i["A"], i["B"][:cut], i["C"][:cut], 4, i["D"],
                                  i["dt_bias"])
    y2, h2 = ops.mamba_chunk_scan(*(i[k][cut:] for k in ("x", "dt")), i["A"], i["B"][cut:], i["C"][cut:], 4, i["D"],
                                  i["dt_bias"], h1)
    torch.testing.assert_close(torch.cat([y1, y2]), want_y)
    torch.testing.assert_close(h2, want_h)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_selective_state_update_batch_matches_recurrence(inputs, dtype, tol):
    """Each token of a batch of 3 sequences advances its own state (batched, one step)."""
    i = inputs
    state = torch.stack([i["h0"], i["h0"] * 0.5, -i["h0"]])
    rows = [0, 7, 15]
    y, new = MambaSSD().update(state.to(dtype), i["x"][rows].to(dtype), i["dt"][rows].to(dtype), i["A"].to(dtype),
                               i["B"][rows].to(dtype), i["C"][rows].to(dtype), i["D"].to(dtype),
                               i["dt_bias"].to(dtype))
    for j, t in enumerate(rows):
        want_y, want_h = ref_scan(i["x"][t : t + 1], i["dt"][t : t + 1], i["A"], i["B"][t : t + 1], i["C"][t : t + 1],
                                  i["D"], i["dt_bias"], state[j])
        torch.testing.assert_close(y[j].double(), want_y[0], atol=tol, rtol=tol)
        torch.testing.assert_close(new[j].double(), want_h, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_causal_conv1d_prefill_and_update(inputs, dtype, tol):
    i = inputs
    conv = CausalConv1d()
    want = ref_conv(i["cx"], i["cw"], i["cb"], i["cs"])
    out, state = conv(i["cx"].to(dtype), i["cw"].to(dtype), i["cb"].to(dtype), i["cs"].to(dtype), "silu")
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(state.double(), i["cx"][-(K - 1):].t())
    # fresh sequence (zeros before it), then the last tokens one at a time through the decode op
    fresh = ref_conv(i["cx"], i["cw"], i["cb"], torch.zeros_like(i["cs"]))
    cut = L - 3
    out, state = conv(i["cx"][:cut].to(dtype), i["cw"].to(dtype), i["cb"].to(dtype), None, "silu")
    torch.testing.assert_close(out.double(), fresh[:cut], atol=tol, rtol=tol)
    for t in range(cut, L):
        y, state = conv.update(i["cx"][t : t + 1].to(dtype), state[None], i["cw"].to(dtype), i["cb"].to(dtype), "silu")
        state = state[0]
        torch.testing.assert_close(y[0].double(), fresh[t], atol=tol, rtol=tol)


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_rms_norm_gated_per_group(norm_before_gate):
    g = torch.Generator().manual_seed(1)
    x, z = torch.randn(5, 12, generator=g, dtype=torch.float64), torch.randn(5, 12, generator=g, dtype=torch.float64)
    norm = RMSNormGated(12, 1e-6, group_size=4, norm_before_gate=norm_before_gate).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(12, generator=g, dtype=torch.float64))
    h = x if norm_before_gate else x * F.silu(z)
    want = torch.cat([c / torch.sqrt((c * c).mean(-1, keepdim=True) + 1e-6) for c in h.split(4, dim=-1)], dim=-1)
    want = norm.weight * (want * F.silu(z) if norm_before_gate else want)
    torch.testing.assert_close(norm(x, z), want)
    with pytest.raises(ValueError, match="group_size"):
        RMSNormGated(12, group_size=5)


def ref_delta_rule(q, k, v, g, beta, s0):
    """``S <- exp(g) S``; ``S <- S + k (beta (v - S^T k))^T``; ``o = S^T q / sqrt(Dk)``, q and k L2-normalised."""
    s = s0.clone()
    outs = []
    for t in range(q.shape[0]):
        qt = q[t] / q[t].norm(dim=-1, keepdim=True) / q.shape[-1] ** 0.5
        kt = k[t] / k[t].norm(dim=-1, keepdim=True)
        s = s * torch.exp(g[t])[:, None, None]
        err = v[t] - torch.einsum("hkv,hk->hv", s, kt)
        s = s + kt[:, :, None] * (beta[t][:, None] * err)[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, qt))
    return torch.stack(outs), s


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-4)])
def test_gated_delta_rule_prefill_split_and_decode(dtype, tol):
    from tokenmill.layers.mamba.state_ops import GatedDeltaRule

    g_ = torch.Generator().manual_seed(2)
    length, heads, dk, dv = 11, 3, 4, 5
    q, k = torch.randn(length, heads, dk, generator=g_, dtype=torch.float64), torch.randn(
        length, heads, dk, generator=g_, dtype=torch.float64)
    v = torch.randn(length, heads, dv, generator=g_, dtype=torch.float64)
    g = -torch.rand(length, heads, generator=g_, dtype=torch.float64)
    beta = torch.rand(length, heads, generator=g_, dtype=torch.float64)
    s0 = torch.randn(heads, dk, dv, generator=g_, dtype=torch.float64) * 0.3
    want_o, want_s = ref_delta_rule(q, k, v, g, beta, s0)
    op = GatedDeltaRule()
    cut = 7  # a prompt in two prefill chunks, then the last tokens one at a time (decode of a batch of one)
    o1, s = op(*(x[:cut].to(dtype) for x in (q, k, v, g, beta)), s0.to(dtype))
    o2, s = op(*(x[cut:9].to(dtype) for x in (q, k, v, g, beta)), s)
    outs = [o1, o2]
    for t in range(9, length):
        o, s = op.update(s[None], *(x[t : t + 1].to(dtype) for x in (q, k, v, g, beta)))
        s = s[0]
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs).double(), want_o, atol=tol, rtol=tol)
    torch.testing.assert_close(s.double(), want_s, atol=tol, rtol=tol)


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_gated_delta_rule_chunks_match_the_recurrence(chunk):
    g_ = torch.Generator().manual_seed(3)
    length, heads, dk, dv = 21, 2, 4, 3
    q, k = (torch.randn(length, heads, dk, generator=g_, dtype=torch.float64) for _ in range(2))
    v = torch.randn(length, heads, dv, generator=g_, dtype=torch.float64)
    g = -torch.rand(length, heads, generator=g_, dtype=torch.float64) * 2
    beta = torch.rand(length, heads, generator=g_, dtype=torch.float64)
    s0 = torch.randn(heads, dk, dv, generator=g_, dtype=torch.float64)
    want_o, want_s = ref_delta_rule(q, k, v, g, beta, s0)
    o, s = ops.gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk)
    torch.testing.assert_close(o, want_o, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s, want_s, atol=1e-6, rtol=1e-6)


def ref_selective_scan(x, dt, A, B, C, D_, z, dt_bias, h0):
    """Mamba-1: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t`` per channel (``A [D, N]``), ``y_t = (h_t C_t + D
    x_t) silu(z_t)``, one token at a time."""
    h, ys = h0.clone(), []
    for t in range(x.shape[0]):
        d = F.softplus(dt[t] + dt_bias)  # [D]
        h = h * torch.exp(d[:, None] * A) + (d * x[t])[:, None] * B[t][None, :]
        ys.append(((h * C[t][None, :]).sum(-1) + D_ * x[t]) * F.silu(z[t]))
    return torch.stack(ys), h


@pytest.fixture(scope="module")
def mamba1_inputs():
    g = torch.Generator().manual_seed(1)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    return dict(x=r(L, D), dt=r(L, D, scale=0.5), A=-torch.rand(D, N, generator=g, dtype=torch.float64) * 2 - 0.2,
                B=r(L, N), C=r(L, N), D=r(D), z=r(L, D), dt_bias=r(D, scale=0.3), h0=r(D, N, scale=0.5))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("chunk", [1, 5, 8, 64])
def test_selective_scan_matches_recurrence_whole_split_and_decoded(mamba1_inputs, dtype, tol, chunk):
    """Mamba-1's chunked prefill scan equals the per-token loop over a whole prompt, over a prompt split in two
    (the first part's state carried), and the one-step update, batched over three sequences, equals one loop
    step of each."""
    i = {k: v.to(dtype) for k, v in mamba1_inputs.items()}

    def reference(tokens):  # the loop over the first ``tokens`` tokens
        m = {k: v[:tokens] if k in ("x", "dt", "B", "C", "z") else v for k, v in mamba1_inputs.items()}
        return ref_selective_scan(*(m[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "h0")))

    want_y, want_h = reference(L)
    op = SelectiveScan()

    def prefill(start, end, h):
        return op(i["x"][start:end], i["dt"][start:end], i["A"], i["B"][start:end], i["C"][start:end], i["D"],
                  i["z"][start:end], i["dt_bias"], h, True, chunk)

    y, h = prefill(0, L, i["h0"])
    torch.testing.assert_close(y.double(), want_y, atol=tol, rtol=tol)
    torch.testing.assert_close(h.double(), want_h, atol=tol, rtol=tol)
    y1, h1 = prefill(0, 9, i["h0"])
    y2, h2 = prefill(9, L, h1.to(dtype))
    torch.testing.assert_close(torch.cat([y1, y2]).double(), want_y, atol=tol, rtol=tol)
    torch.testing.assert_close(h2.double(), want_h, atol=tol, rtol=tol)
    rows = [3, 11, 17]  # one decode step of three sequences, from the states the loop reaches before those tokens
    states = torch.stack([reference(t)[1] for t in rows]).to(dtype)
    y_d, h_d = op.update(states, i["x"][rows], i["dt"][rows], i["A"], i["B"][rows], i["C"][rows], i["D"],
                         i["z"][rows], i["dt_bias"])
    want = [reference(t + 1) for t in rows]
    torch.testing.assert_close(y_d.double(), torch.stack([w[0][-1] for w in want]), atol=tol, rtol=tol)
    torch.testing.assert_close(h_d.double(), torch.stack([w[1] for w in want]), atol=tol, rtol=tol)
