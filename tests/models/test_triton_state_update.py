"""The Triton decode-step kernels of the state layers (``tokenmill.layers.mamba.triton_state_update``) under the
Triton interpreter (CPU), against float64 references with derived error bounds (state_update_reference.py), and
the replacement classes the CUDA and ROCm platforms declare.

``TRITON_INTERPRET=1`` is set before triton is imported, so the kernels run on CPU tensors (slowly: shapes are
tiny). The interpreter converts float32 to bfloat16 by truncation (``cast_impl`` in
triton/runtime/interpreter.py; compiled Triton rounds to nearest), so bfloat16 outputs are allowed one unit in the
last place, not half.
"""

from __future__ import annotations

import os
import sys

# The interpreter only takes effect if it is on before triton's first import in this process.
_TRITON_IMPORTED_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tests.models.state_update_reference import (  # noqa: E402
    U32,
    assert_within,
    output_bound,
    ref_conv_update,
    ref_delta_update,
    ref_ssm_update,
)
from tokenmill.layers.mamba import triton_state_ops  # noqa: E402
from tokenmill.layers.mamba.state_ops import CausalConv1d  # noqa: E402
from tokenmill.layers.mamba.triton_state_update import (  # noqa: E402
    causal_conv1d_update,
    gated_delta_rule_update,
    selective_state_update,
)

if _TRITON_IMPORTED_COMPILED or os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run these tests with TRITON_INTERPRET=1",
                allow_module_level=True)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


@DTYPES
@pytest.mark.parametrize("width", [4, 2])
def test_causal_conv1d_update_matches_the_fp64_reference(dtype, width):
    g = torch.Generator().manual_seed(width)
    batch, dim = 3, 37
    x = torch.randn(batch, dim + 5, generator=g).to(dtype)[:, 2:dim + 2]  # strided rows
    state = torch.randn(batch, dim, width - 1, generator=g).to(dtype)
    w = (torch.randn(dim, width, generator=g) * 0.5).to(dtype)
    b = (torch.randn(dim, generator=g) * 0.1).to(dtype)
    out, new = causal_conv1d_update(x, state, w, b, True)
    want, mag, want_state = ref_conv_update(x.double(), state.double(), w.double(), b.double(), True)
    bound = 1.1 * (width + 1) * U32 * mag + 12 * U32 * want.abs()  # as tests/plugins/test_cpu_state_kernels.py
    assert_within(out, want, output_bound(want, bound, dtype, truncated=True), "out")
    assert torch.equal(new.double(), want_state)


@DTYPES
@pytest.mark.parametrize("n,options", [(16, "full"), (20, "bare-clamped")])
def test_selective_state_update_matches_the_fp64_reference(dtype, n, options):
    g = torch.Generator().manual_seed(n)
    batch, heads, head_dim, groups = 2, 4, 5, 2
    xbc = torch.randn(batch, heads * head_dim + 2 * groups * n, generator=g).to(dtype)
    x = xbc[:, :heads * head_dim].reshape(batch, heads, head_dim)
    B = xbc[:, heads * head_dim:heads * head_dim + groups * n].reshape(batch, groups, n)
    C = xbc[:, heads * head_dim + groups * n:].reshape(batch, groups, n)
    state = (torch.randn(batch, heads, head_dim, n, generator=g) * 0.5).to(dtype)
    dt, A = torch.randn(batch, heads, generator=g) * 0.5, -torch.rand(heads, generator=g) - 0.2
    full = options == "full"
    D = torch.randn(heads, generator=g) if full else None
    dt_bias = torch.randn(heads, generator=g) * 0.3 if full else None
    lo, hi = (float("-inf"), float("inf")) if full else (0.2, 0.6)
    y, new = selective_state_update(state, x, dt, A, B, C, D, dt_bias, True, lo, hi)
    d64 = [None if t is None else t.double() for t in (state, x, dt, A, B, C, D, dt_bias)]
    want_y, want_new, y_err, new_err = ref_ssm_update(*d64, lo, hi)
    assert y.dtype == dtype and new.dtype == torch.float32
    assert_within(new, want_new, new_err, "state")
    assert_within(y, want_y, output_bound(want_y, y_err, dtype, truncated=True), "y")


@DTYPES
@pytest.mark.parametrize("dk,dv,l2", [(16, 16, True), (8, 20, False)], ids=["16x16-l2", "8x20-raw"])
def test_gated_delta_rule_update_matches_the_fp64_reference(dtype, dk, dv, l2):
    gen = torch.Generator().manual_seed(dk + dv)
    batch, heads = 2, 3
    q = torch.randn(batch, heads, dk, generator=gen).to(dtype)
    k = torch.randn(batch, heads, dk, generator=gen).to(dtype)
    v = torch.randn(batch, heads * dv + 4, generator=gen).to(dtype)[:, 4:].reshape(batch, heads, dv)
    state = (torch.randn(batch, heads, dk, dv, generator=gen) * 0.3).to(dtype)
    g, beta = -torch.rand(batch, heads, generator=gen), torch.rand(batch, heads, generator=gen)
    o, new = gated_delta_rule_update(state, q, k, v, g, beta, l2)
    want_o, want_new, o_abs, new_abs = ref_delta_update(state.double(), q.double(), k.double(), v.double(), g.double(),
                                                        beta.double(), l2)
    chain = 3 * dk + 16  # as tests/plugins/test_cpu_state_kernels.py
    assert_within(new, want_new, chain * U32 * new_abs, "state")
    assert_within(o, want_o, output_bound(want_o, chain * U32 * o_abs, dtype, truncated=True), "o")


def test_the_gpu_platforms_declare_the_triton_state_ops():
    from tokenmill_cuda.platform import CudaPlatform

    for name, cls in (("causal_conv1d", "TritonCausalConv1d"), ("mamba_ssd", "TritonMambaSSD"),
                      ("gated_delta_rule", "TritonGatedDeltaRule")):
        assert CudaPlatform.get_custom_op_cls(name) == f"tokenmill.layers.mamba.triton_state_ops:{cls}"
    assert CudaPlatform.get_custom_op_cls("rms_norm") is None
    try:
        from tokenmill_rocm.platform import RocmPlatform
    except ImportError:  # the ROCm plugin is optional in an environment
        return
    assert RocmPlatform.get_custom_op_cls("mamba_ssd") == "tokenmill.layers.mamba.triton_state_ops:TritonMambaSSD"


def test_the_classes_pass_the_conformance_kits_state_op_cases(monkeypatch):
    """The cases of the kit's ``custom_ops`` item, through the Triton kernels (float64 stays on the portable path)."""
    from tokenmill.conformance.checks_ops import _close, _tol
    from tokenmill.conformance.state_op_cases import state_op_cases
    from tokenmill.layers.mamba.state_ops import GatedDeltaRule, MambaSSD

    calls: list[str] = []
    for fn in ("causal_conv1d_update", "selective_state_update", "gated_delta_rule_update"):
        from tokenmill.layers.mamba import triton_state_update

        real = getattr(triton_state_update, fn)
        monkeypatch.setattr(triton_state_update, fn, lambda *a, _real=real, _fn=fn: calls.append(_fn) or _real(*a))
    bases = {"causal_conv1d": CausalConv1d, "mamba_ssd": MambaSSD, "gated_delta_rule": GatedDeltaRule}
    classes = {"causal_conv1d": triton_state_ops.TritonCausalConv1d, "mamba_ssd": triton_state_ops.TritonMambaSSD,
               "gated_delta_rule": triton_state_ops.TritonGatedDeltaRule}
    for name, cls in classes.items():
        for layer, method, args in state_op_cases(name, cls, torch.float32, torch.device("cpu")):
            want = getattr(bases[name], f"{method}_native")(layer, *args)
            _close(f"{name}.{method}", getattr(layer, method)(*args), want, _tol(torch.float32))
    assert sorted(calls) == ["causal_conv1d_update", "gated_delta_rule_update", "selective_state_update"]
