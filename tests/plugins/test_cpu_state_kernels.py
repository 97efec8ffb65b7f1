"""tokenmill-cpu's decode-step kernels of the state layers (``csrc/state_update.cpp``) against float64 references
with derived error bounds (tests/models/state_update_reference.py), and how ``tokenmill_cpu.state_ops`` uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.mamba import ops
from tokenmill.layers.mamba.state_ops import CausalConv1d, GatedDeltaRule, MambaSSD
from tests.models.state_update_reference import (
    U32,
    assert_within,
    output_bound,
    ref_conv_update,
    ref_delta_update,
    ref_ssm_update,
)
from tokenmill_cpu import kernels, state_ops

pytestmark = pytest.mark.skipif(not kernels.load(), reason="tokenmill-cpu's C++ kernels cannot be built here")

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- causal conv1d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bias,silu", [(True, True), (False, False)], ids=["bias-silu", "plain"])
def test_causal_conv1d_update_matches_the_fp64_reference(dtype, bias, silu):
    g = _gen(1)
    batch, dim, width = 3, 37, 4
    x = torch.randn(batch, dim + 5, generator=g).to(dtype)[:, 2:dim + 2]  # strided rows, as a slice of in_proj
    state = torch.randn(batch, dim, width - 1, generator=g).to(dtype)
    w = (torch.randn(dim, width, generator=g) * 0.5).to(dtype)
    b = (torch.randn(dim, generator=g) * 0.1).to(dtype) if bias else None
    out, new = state_ops.causal_conv1d_update(x, state, w, b, silu)
    want, mag, want_state = ref_conv_update(x.double(), state.double(), w.double(), None if b is None else b.double(),
                                            silu)
    # width + 1 roundings in the sum (silu's slope is below 1.1); silu itself: exp within 10 units (the vector
    # builds' range-reduced polynomial: 6 Horner roundings, truncation under 2, the reduction and the scaling 1
    # each; glibc's within 2), then an add and a divide
    bound = 1.1 * (width + 1) * U32 * mag + 12 * U32 * want.abs()
    assert out.dtype == dtype and new.dtype == dtype
    assert_within(out, want, output_bound(want, bound, dtype), "out")
    assert torch.equal(new.double(), want_state)


# ---------------------------------------------------------------- Mamba2 selective state update


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n", [16, 20, 3], ids=["n16", "n20", "n3"])
@pytest.mark.parametrize("options", ["full", "bare-clamped"])
def test_selective_state_update_matches_the_fp64_reference(dtype, n, options):
    g = _gen(n)
    batch, heads, head_dim, groups = 3, 4, 5, 2
    conv_dim = heads * head_dim + 2 * groups * n
    xbc = torch.randn(batch, conv_dim, generator=g).to(dtype)  # x, B, C as views of one row, as the mixer splits it
    x = xbc[:, :heads * head_dim].reshape(batch, heads, head_dim)
    B = xbc[:, heads * head_dim:heads * head_dim + groups * n].reshape(batch, groups, n)
    C = xbc[:, heads * head_dim + groups * n:].reshape(batch, groups, n)
    state = (torch.randn(batch, heads, head_dim, n, generator=g) * 0.5).to(dtype)
    dt = torch.randn(batch, heads, generator=g) * 0.5
    A = -torch.rand(heads, generator=g) - 0.2
    full = options == "full"
    D = torch.randn(heads, generator=g) if full else None
    dt_bias = torch.randn(heads, generator=g) * 0.3 if full else None
    lo, hi = (float("-inf"), float("inf")) if full else (0.2, 0.6)
    y, new = state_ops.selective_state_update(state, x, dt, A, B, C, D, dt_bias, True, lo, hi)
    d64 = [None if t is None else t.double() for t in (state, x, dt, A, B, C, D, dt_bias)]
    want_y, want_new, y_err, new_err = ref_ssm_update(*d64, lo, hi)
    assert y.dtype == dtype and new.dtype == torch.float32
    assert_within(new, want_new, new_err, "state")
    assert_within(y, want_y, output_bound(want_y, y_err, dtype), "y")


def test_selective_state_update_without_softplus_keeps_negative_steps():
    """``dt_softplus=False`` and no limit: the step is ``dt + dt_bias`` as it is (the class passes ``-inf`` as the
    lower limit then, as the portable version clamps only for a limit)."""
    g = _gen(5)
    state, x = torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 2, 3, generator=g)
    dt, A, B, C = torch.randn(2, 2, generator=g), -torch.rand(2, generator=g), torch.randn(2, 1, 8, generator=g), \
        torch.randn(2, 1, 8, generator=g)
    want = ops.selective_state_update(state.double(), x.double(), dt.double(), A.double(), B.double(), C.double(),
                                      dt_softplus=False)
    got = state_ops.CpuMambaSSD().update(state, x, dt, A, B, C, dt_softplus=False)
    for a, b in zip(got, want):  # float32 against float64: within float32 rounding of values near 1
        assert (a.double() - b).abs().max() < 1e-5


# ---------------------------------------------------------------- gated delta rule


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dk,dv", [(16, 16), (8, 20), (5, 3)], ids=["16x16", "8x20", "5x3"])
@pytest.mark.parametrize("l2", [True, False], ids=["l2norm", "raw"])
def test_gated_delta_rule_update_matches_the_fp64_reference(dtype, dk, dv, l2):
    gen = _gen(dk * 100 + dv)
    batch, heads = 2, 3
    q = torch.randn(batch, heads, dk, generator=gen).to(dtype)
    k = torch.randn(batch, heads, dk, generator=gen).to(dtype)
    v = torch.randn(batch, heads * dv + 4, generator=gen).to(dtype)[:, 4:].reshape(batch, heads, dv)  # strided rows
    state = (torch.randn(batch, heads, dk, dv, generator=gen) * 0.3).to(dtype)
    g = -torch.rand(batch, heads, generator=gen)
    beta = torch.rand(batch, heads, generator=gen)
    o, new = state_ops.gated_delta_rule_update(state, q, k, v, g, beta, l2)
    want_o, want_new, o_abs, new_abs = ref_delta_update(state.double(), q.double(), k.double(), v.double(), g.double(),
                                                        beta.double(), l2)
    # q and k: a sum of dk squares, sqrt, divide, scale (dk + 6 roundings, relative); delta: dk + 4 more; the new
    # state: 2 more; the output: dk more
    chain = 3 * dk + 16
    assert o.dtype == dtype and new.dtype == torch.float32
    assert_within(new, want_new, chain * U32 * new_abs, "state")
    assert_within(o, want_o, output_bound(want_o, chain * U32 * o_abs, dtype), "o")


# ---------------------------------------------------------------- prefill: the decode step token by token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("carried", [True, False], ids=["carried", "fresh"])
def test_prefill_kernels_give_the_bits_of_decoding_token_by_token(dtype, carried):
    """The prefill kernels run the decode kernels' per-token step in place, so a prompt's outputs and final state
    equal the decode kernels' applied one token at a time (checked above against float64) bit for bit."""
    g = _gen(11)
    length, dim, width, heads, head_dim, groups, n, dk, dv = 9, 70, 4, 4, 3, 2, 20, 8, 20
    # conv: 70 channels (a block of 64 and a tail)
    x = torch.randn(length, dim, generator=g).to(dtype)
    w, b = (torch.randn(dim, width, generator=g) * 0.5).to(dtype), (torch.randn(dim, generator=g) * 0.1).to(dtype)
    s0 = torch.randn(dim, width - 1, generator=g).to(dtype) if carried else None
    out, state = torch.ops.tokenmill_cpu.causal_conv1d_fn(x, w, b, s0, True)
    s = s0 if carried else torch.zeros(dim, width - 1, dtype=dtype)
    for t in range(length):
        y, s = state_ops.causal_conv1d_update(x[t:t + 1], s[None], w, b, True)
        s = s[0]
        assert torch.equal(out[t], y[0]), t
    assert torch.equal(state, s)
    # Mamba2 scan
    xs, dt = torch.randn(length, heads, head_dim, generator=g).to(dtype), torch.randn(length, heads, generator=g)
    B, C = torch.randn(length, groups, n, generator=g).to(dtype), torch.randn(length, groups, n, generator=g).to(dtype)
    A, D, bias = -torch.rand(heads, generator=g) - 0.2, torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    h0 = torch.randn(heads, head_dim, n, generator=g) if carried else None
    ys, hs = torch.ops.tokenmill_cpu.selective_scan(xs, dt, A, B, C, D, bias, h0, True, float("-inf"), float("inf"))
    h = (h0 if carried else torch.zeros(heads, head_dim, n))[None]
    for t in range(length):
        y, h = state_ops.selective_state_update(h, xs[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, bias, True,
                                                float("-inf"), float("inf"))
        assert torch.equal(ys[t], y[0]), t
    assert torch.equal(hs, h[0])
    # gated delta rule scan
    q, k = torch.randn(length, heads, dk, generator=g).to(dtype), torch.randn(length, heads, dk, generator=g).to(dtype)
    v = torch.randn(length, heads, dv, generator=g).to(dtype)
    gate, beta = -torch.rand(length, heads, generator=g), torch.rand(length, heads, generator=g)
    S0 = torch.randn(heads, dk, dv, generator=g) if carried else None
    os_, Ss = torch.ops.tokenmill_cpu.gated_delta_rule_scan(q, k, v, gate, beta, S0, True)
    S = (S0 if carried else torch.zeros(heads, dk, dv))[None]
    for t in range(length):
        o, S = state_ops.gated_delta_rule_update(S, q[t:t + 1], k[t:t + 1], v[t:t + 1], gate[t:t + 1],
                                                 beta[t:t + 1], True)
        assert torch.equal(os_[t], o[0]), t
    assert torch.equal(Ss, S[0])


def test_prefill_kernels_take_empty_prompts():
    """No tokens: no outputs, and the state passes through (widened to float32 where the op returns float32)."""
    s0 = torch.randn(6, 3)
    out, state = torch.ops.tokenmill_cpu.causal_conv1d_fn(torch.zeros(0, 6), torch.randn(6, 4), None, s0, True)
    assert out.shape == (0, 6) and torch.equal(state, s0)
    h0 = torch.randn(2, 3, 4).bfloat16()
    y, h = torch.ops.tokenmill_cpu.selective_scan(torch.zeros(0, 2, 3), torch.zeros(0, 2), -torch.ones(2),
                                                  torch.zeros(0, 1, 4), torch.zeros(0, 1, 4), None, None, h0, True,
                                                  0.0, float("inf"))
    assert y.shape == (0, 2, 3) and h.dtype == torch.float32 and torch.equal(h, h0.float())


# ---------------------------------------------------------------- the replacement classes


def test_the_cpu_platform_declares_the_state_ops_and_they_use_the_kernels(monkeypatch):
    """Building the built-in classes gives the CPU replacements; ``update`` calls the kernel for float32 and
    bfloat16, the portable method for float64 (the references' dtype) and while the kernels are not loaded."""
    from tokenmill_cpu.platform import CpuPlatform

    for name, cls in (("causal_conv1d", state_ops.CpuCausalConv1d), ("mamba_ssd", state_ops.CpuMambaSSD),
                      ("gated_delta_rule", state_ops.CpuGatedDeltaRule)):
        assert CpuPlatform.get_custom_op_cls(name) == f"tokenmill_cpu.state_ops:{cls.__name__}"
    calls: list[str] = []
    for fn in ("causal_conv1d_update", "selective_state_update", "gated_delta_rule_update"):
        real = getattr(state_ops, fn)
        monkeypatch.setattr(state_ops, fn, lambda *a, _real=real, _fn=fn: calls.append(_fn) or _real(*a))
    g = _gen(7)
    conv = state_ops.CpuCausalConv1d()
    x, s, w = torch.randn(2, 6, generator=g), torch.randn(2, 6, 3, generator=g), torch.randn(6, 4, generator=g)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        out, new = conv.update(x.to(dtype), s.to(dtype), w.to(dtype), None)
        want, want_new = CausalConv1d.update_native(conv, x.double(), s.double(), w.double(), None)
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-5  # values of a few units: bfloat16 keeps 8 bits
        assert (out.double() - want).abs().max() < tol and (new.double() - want_new).abs().max() < tol
    assert calls == ["causal_conv1d_update"] * 2
    monkeypatch.setattr(kernels, "ready", lambda: False)
    conv.update(x, s, w, None)
    assert len(calls) == 2


def test_the_state_layers_build_the_cpu_replacements():
    """What the engine's models get on the CPU platform: the mixers' ops are the kernel classes (the hybrid models'
    greedy tests, tests/models/test_hybrid_models.py, then run their decode steps through the kernels)."""
    from tokenmill.layers.mamba import GatedDeltaNet, MambaMixer2

    mixer = MambaMixer2(16, 4, 4, 32, 4, 8, 2)
    assert type(mixer.conv_op) is state_ops.CpuCausalConv1d and type(mixer.ssd_op) is state_ops.CpuMambaSSD
    delta = GatedDeltaNet(16, 2, 4, 4, 4, 4)
    assert type(delta.delta_op) is state_ops.CpuGatedDeltaRule


def test_the_kernels_reject_bad_layouts_with_a_clear_error():
    state = torch.zeros(2, 3, 4, 5)
    with pytest.raises(RuntimeError, match="state must be"):
        state_ops.gated_delta_rule_update(state, torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 3, 6),
                                          torch.zeros(2, 3), torch.zeros(2, 3), True)
    with pytest.raises(RuntimeError, match="conv_state must be"):
        state_ops.causal_conv1d_update(torch.zeros(2, 6), torch.zeros(2, 6, 2), torch.zeros(6, 4), None, True)
    with pytest.raises(RuntimeError, match="G dividing the heads"):
        state_ops.selective_state_update(torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2), torch.zeros(1, 3),
                                         torch.zeros(3), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), None, None, True,
                                         0.0, float("inf"))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        f64 = torch.float64
        state_ops.causal_conv1d_update(torch.zeros(2, 6, dtype=f64), torch.zeros(2, 6, 3, dtype=f64),
                                       torch.zeros(6, 4, dtype=f64), None, True)


def test_the_classes_pass_the_conformance_kits_state_op_cases():
    """The cases ``tokenmill plugins check`` runs for the CPU platform's ``custom_ops`` item, float32 and
    bfloat16 (the item's own run is tests/conformance)."""
    from tokenmill.conformance.checks_ops import _close, _tol
    from tokenmill.conformance.state_op_cases import state_op_cases

    bases = {"causal_conv1d": CausalConv1d, "mamba_ssd": MambaSSD, "gated_delta_rule": GatedDeltaRule}
    classes = {"causal_conv1d": state_ops.CpuCausalConv1d, "mamba_ssd": state_ops.CpuMambaSSD,
               "gated_delta_rule": state_ops.CpuGatedDeltaRule}
    for dtype in (torch.float32, torch.bfloat16):
        for name, cls in classes.items():
            for layer, method, args in state_op_cases(name, cls, dtype, torch.device("cpu")):
                want = getattr(bases[name], f"{method}_native")(layer, *args)
                _close(f"{name}.{method}", getattr(layer, method)(*args), want, _tol(dtype))


@pytest.mark.lower_isa
@pytest.mark.slow
@pytest.mark.parametrize(("capability", "isa"), [("default", "scalar"), ("avx2", "avx2")])
def test_lower_isa_builds_match_the_fp64_reference(capability: str, isa: str) -> None:
    """The plain C++ loops and the AVX2/FMA build (CPUs without AVX-512; on an AVX-512 machine built with AVX2
    flags only), each checked by this file's tests in a subprocess."""
    from tests.lower_isa import check_lower_isa_build

    check_lower_isa_build(__file__, capability, "state_update", isa, "not lower_isa")
