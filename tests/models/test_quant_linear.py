"""tokenmill-cpu's quantized matmuls (VNNI, AVX2 and scalar builds) (``csrc/quant_linear.cpp``) against a float64 reference that quantizes
the activations the same way, so the kernel's own error (not the 8-bit rounding) is what is bounded."""

from __future__ import annotations

import pytest
import torch

import gguf

from tests.models.gguf_writer import random_k_blocks
from tokenmill.layers.quantization import UnsupportedShapeError
from tokenmill_cpu import kernels
from tokenmill_cpu.quant_linear import Q4Weight, Q8Weight


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    assert kernels.load(), "tokenmill-cpu's C++ kernels did not build (see the log)"


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation rounding: per row, blocks of 32, 14-bit codes, scale max|x| / 8191 (float32).

    Returns:
        the dequantized activations ``[M, K]`` float64 and the exact float block sums ``[M, K / 32]`` float64.
    """
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(8191.0) / amax, torch.zeros_like(amax))
    codes = torch.round(xb * inv).clamp(-8191, 8191)
    deq = (codes.double() * (amax / 8191.0).double()).reshape(x.shape)
    return deq, xb.double().sum(dim=-1)


def reference(q: Q8Weight | Q4Weight, x: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` in float64 with the kernel's quantized activations (Q4_1's minimum uses exact sums; codes
    centred at 8 are multiplied as they are)."""
    deq, sums = quantized_activations(x)
    w = q.dequantize().double()
    if isinstance(q, Q8Weight) or q.centred:
        return deq @ w.T
    n, k = w.shape
    mins = q.block_mins().permute(0, 2, 1).reshape(n, k // 32).double()
    return deq @ (w - mins.repeat_interleave(32, dim=1)).T + sums @ mins.T


def q4_0(w: torch.Tensor) -> Q4Weight:
    """``w`` written as GGUF ``Q4_0`` blocks and loaded back: a :class:`Q4Weight` with codes centred at 8."""
    blocks = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.Q4_0)
    q = Q4Weight.from_gguf("Q4_0", torch.from_numpy(blocks))
    assert q.centred and q.mins.numel() == 0
    return q


def q4_k(w: torch.Tensor) -> Q4Weight:
    """Random GGUF ``Q4_K`` blocks of ``w``'s shape (``gguf`` cannot quantize to it; ``w``'s scale sets theirs):
    a :class:`Q4Weight` with 8-bit factors of super-block scales."""
    n, k = w.shape
    blocks = random_k_blocks(gguf.GGMLQuantizationType.Q4_K, n, k, seed=n + k, scale=float(w.std()) / 30)
    q = Q4Weight.from_gguf("Q4_K", torch.from_numpy(blocks))
    assert q.super_blocked
    return q


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # output rounding of the dtype


@pytest.mark.parametrize("cls", [Q8Weight, Q4Weight, q4_0, q4_k], ids=["q8", "q4", "q4_0", "q4_k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 32])
def test_kernel_matches_reference_for_every_row_tile(cls, dtype, rows):
    torch.manual_seed(rows)
    w = torch.randn(48, 512 if cls is q4_k else 160) * 0.1
    w[3] = 0.0  # an all-zero row: zero scales must not produce NaN
    x = torch.randn(rows, w.shape[1]).to(dtype)
    x[0, :32] = 0.0  # an all-zero activation block
    q = cls(w)
    out = q.matmul(x)
    assert out.shape == (rows, 48) and out.dtype == dtype
    assert rel_err(out, reference(q, x)) < TOL[dtype]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("cls,bound", [(Q8Weight, 0.01), (Q4Weight, 0.12)], ids=["q8", "q4"])
def test_weight_error_and_size(cls, bound):
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    q = cls(w)
    assert rel_err(q.dequantize(), w.double()) < bound  # 8 bits: ~0.5%; 4 bits of a Gaussian: ~8%
    x = torch.randn(3, 256)
    assert rel_err(q.matmul(x), (x @ w.T).double()) < bound + 0.01
    # GGUF's sizes: Q8_0 8.5 bits per weight, Q4_1 5 bits (codes plus float16 scale / minimum per 32)
    assert q.nbytes == w.numel() * (8.5 if cls is Q8Weight else 5) / 8


def test_q4_0_blocks_stay_centred_at_their_size_and_join_uncentred_rows() -> None:
    torch.manual_seed(2)
    w = torch.randn(64, 256)
    q = q4_0(w)
    assert q.nbytes == w.numel() * 4.5 / 8  # GGUF Q4_0's size: codes plus a float16 scale per 32
    assert rel_err(q.dequantize(), w.double()) < 0.12
    # the file's values: d * (q - 8), exactly
    expected = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0),
                                      gguf.GGMLQuantizationType.Q4_0)
    assert torch.equal(q.dequantize(), torch.from_numpy(expected).float())
    other = Q4Weight(torch.randn(32, 256))
    joined = Q4Weight.concat_rows([q, other])
    assert not joined.centred
    assert torch.equal(joined.dequantize(), torch.cat((q.dequantize(), other.dequantize())))
    x = torch.randn(3, 256)
    assert rel_err(joined.matmul(x), reference(joined, x)) < 1e-5
    assert q.centred and Q4Weight.concat_rows([q, q4_0(w)]).mins.shape == (8, 0, 16)


def test_q4_k_blocks_keep_their_super_blocks_exactly() -> None:
    w = torch.randn(32, 512) * 0.05
    q = q4_k(w)
    assert q.nbytes == w.numel() * 4.625 / 8  # codes, 8-bit sc and mn per 32, float16 d and dmin per 256
    blocks = random_k_blocks(gguf.GGMLQuantizationType.Q4_K, 32, 512, seed=32 + 512, scale=float(w.std()) / 30)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)).float()
    assert torch.equal(q.dequantize(), expected)
    x = torch.randn(5, 512)
    assert rel_err(q.matmul(x), reference(q, x)) < 1e-5
    # joined with float16-scaled rows: D * sc, M * mn rounded to float16
    other = Q4Weight(torch.randn(16, 512) * 0.05)
    joined = Q4Weight.concat_rows([q, other])
    assert not joined.super_blocked and joined.super_scales.shape == (3, 0, 2, 16)
    assert rel_err(joined.dequantize()[:32], expected.double()) < 1e-3
    assert torch.equal(Q4Weight.concat_rows([q, q4_k(w)]).super_scales, torch.cat([q.super_scales] * 2))


def test_gguf_grids_come_back_exactly():
    torch.manual_seed(1)
    # Q8_0: float16 scale per 32 weights, codes -127..127 with the extreme used
    codes = torch.randint(-127, 128, (32, 64)).float()
    codes[:, ::32] = 127
    d = (torch.rand(32, 2) * 0.01 + 1e-3).half().float()
    grid = (codes.view(32, 2, 32) * d[..., None]).view(32, 64)
    assert torch.equal(Q8Weight(grid).dequantize(), grid)
    # Q4_1: float16 scale and minimum per 32 weights, codes 0..15 with both ends used
    codes = torch.randint(0, 16, (32, 64)).float()
    codes[:, ::32], codes[:, 1::32] = 0, 15
    d = (torch.rand(32, 2) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(32, 2)).half().float()
    grid = (codes.view(32, 2, 32) * d[..., None] + m[..., None]).view(32, 64)
    assert (Q4Weight(grid).dequantize() - grid).abs().max() < 1e-3 * grid.abs().max()  # d re-derived in fp16


def test_unpackable_shapes_are_rejected():
    for cls in (Q8Weight, Q4Weight):
        with pytest.raises(UnsupportedShapeError):
            cls(torch.randn(16, 40))
        with pytest.raises(UnsupportedShapeError):
            cls(torch.randn(8, 64))


def test_bad_inputs_raise_errors_not_crashes():
    q = Q4Weight(torch.randn(32, 64))
    op = torch.ops.tokenmill_cpu.q4_linear
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(2, 40), q.packed, q.scales, q.mins)
    with pytest.raises(RuntimeError, match="packed"):
        op(torch.randn(2, 96), q.packed, q.scales, q.mins)  # weight packed for K = 64
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.tokenmill_cpu.q8_linear(torch.randn(2, 64), q.packed, q.scales)  # q4's half-size panels
    with pytest.raises(RuntimeError, match="mins"):
        op(torch.randn(2, 64), q.packed, q.scales, q.mins.float())
    with pytest.raises(RuntimeError, match="mins"):
        op(torch.randn(2, 64), q.packed, q.scales, q.mins[:1])
    k = q4_k(torch.randn(16, 256))
    with pytest.raises(RuntimeError, match="super_scales"):
        op(torch.randn(2, 256), k.packed, k.scales, k.mins)
    with pytest.raises(RuntimeError, match="mins"):
        op(torch.randn(2, 256), k.packed, k.scales, k.mins.half(), k.super_scales)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        op(torch.randn(2, 64).double(), q.packed, q.scales, q.mins)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        op(torch.randn(64, 2).T, q.packed, q.scales, q.mins)
    assert op(torch.randn(0, 64), q.packed, q.scales, q.mins).shape == (0, 32)


def test_kernel_traces_under_torch_compile_with_dynamic_rows():
    q = Q8Weight(torch.randn(32, 64))
    compiled = torch.compile(lambda x: q.matmul(x) * 2.0, dynamic=True, fullgraph=True)
    for rows in (2, 7):
        x = torch.randn(rows, 64)
        assert torch.allclose(compiled(x), q.matmul(x) * 2.0)


BUILD_CHECK = """
import sys
import torch
from tokenmill_cpu import kernels
assert kernels.load()
assert kernels.isa()["quant_linear"] == sys.argv[1], kernels.isa()
from tests.models.test_quant_linear import reference, rel_err
from tests.models.test_quant_linear import q4_0, q4_k
from tokenmill_cpu.quant_linear import Q4Weight, Q8Weight
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3), (torch.float16, 1e-3)):
    for rows in (1, 2, 3, 4, 5, 9):
        w, x = torch.randn(48, 96) * 0.1, torch.randn(rows, 96).to(dtype)
        x[0, 5] = 40.0  # an outlier: the other values of its block get small codes
        for cls in (Q8Weight, Q4Weight, q4_0):
            q = cls(w)
            assert rel_err(q.matmul(x).float(), reference(q, x)) < tol, (cls, dtype, rows)
        w, x = torch.randn(32, 512) * 0.1, torch.randn(rows, 512).to(dtype)
        q = q4_k(w)
        assert rel_err(q.matmul(x).float(), reference(q, x)) < tol, ("q4_k", dtype, rows)
# the largest codes: q8 weights at -127 / 127, 14-bit activations at 8191 (16-bit pair sums at their bound)
w = torch.ones(16, 64)
w[:, ::2] = -1.0
x = torch.ones(2, 64)
x[:, 1::2] = 0.37
for cls in (Q8Weight, Q4Weight, q4_0):
    q = cls(w)
    assert rel_err(q.matmul(x), reference(q, x)) < 1e-5, cls
print("ok")
"""


@pytest.mark.lower_isa
@pytest.mark.parametrize(("capability", "isa"), [("default", "scalar"), ("avx2", "avx2")])
def test_lower_isa_builds_give_the_same_results(capability, isa):
    """The plain C++ path (ATen's default capability) and the AVX2/FMA path (CPUs without AVX-512 VNNI; on an
    AVX-512 machine built with AVX2 flags only), each checked in its build's process (tests/lower_isa.py)."""
    from tests.lower_isa import run_lower_isa_script

    assert "ok" in run_lower_isa_script(capability, isa, BUILD_CHECK, isa)
