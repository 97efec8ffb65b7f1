"""tokenmill-cpu's float32 and bfloat16 panel matmuls (``csrc/dense_gemm.cpp``, ``torch.ops.tokenmill_cpu.dense_gemm``
and ``dense_gemm_bf16``) and how ``tokenmill_cpu.dense_linear`` uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill_cpu import dense_linear, kernels

pytestmark = pytest.mark.skipif(not kernels.load(), reason="tokenmill-cpu's C++ kernels cannot be built here")


def _width() -> int:
    return int(torch.ops.tokenmill_cpu.dense_gemm_panel())


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-12))


@pytest.mark.parametrize(("n", "k"), [(48, 64), (100, 33), (7, 5), (960, 576), (17, 1)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 9, 13, 32, 70])
def test_panel_product_matches_the_fp64_reference(n: int, k: int, rows: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k * 10 + rows)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    got = torch.ops.tokenmill_cpu.dense_gemm(x, dense_linear.pack_panels(w, _width()), n)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert _rel_err(got, F.linear(x.double(), w.double())) < 1e-5


@pytest.mark.parametrize(("n", "k"), [(100, 33), (7, 5), (960, 576)])
@pytest.mark.parametrize("rows", [1, 7, 13, 70])
def test_bias_epilogue_matches_the_fp64_reference(n: int, k: int, rows: int) -> None:
    """The bias added while each row group's outputs are in L1 (panel columns past N included: 100 and 7)."""
    g = torch.Generator().manual_seed(n + k + rows)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    got = torch.ops.tokenmill_cpu.dense_gemm(x, dense_linear.pack_panels(w, _width()), n, b)
    assert _rel_err(got, F.linear(x.double(), w.double(), b.double())) < 1e-5
    empty = torch.ops.tokenmill_cpu.dense_gemm(torch.empty(0, k), dense_linear.pack_panels(w, _width()), n, b)
    assert empty.shape == (0, n)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.tokenmill_cpu.dense_gemm(x, dense_linear.pack_panels(w, _width()), n, b[:-1])


def test_the_result_does_not_depend_on_the_row_count_or_the_threads() -> None:
    """Each output is one ordered sum over the input channels: a row's product is the same alone or in a batch."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(200, 96, generator=g), torch.randn(37, 96, generator=g)
    packed = dense_linear.pack_panels(w, _width())
    batch = torch.ops.tokenmill_cpu.dense_gemm(x, packed, 200)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.cat([torch.ops.tokenmill_cpu.dense_gemm(x[i:i + 1], packed, 200) for i in range(37)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, one)


@pytest.mark.parametrize(("rows", "k"), [(150, 1536), (300, 576), (45, 2001)])
def test_row_blocks_give_the_products_of_one_pass(rows: int, k: int) -> None:
    """Products of more rows than one row block (256 KiB of activations: 40-42 rows of 1,536 channels, 108-112 of
    576, 30-32 of 2,001) and of a K that is not a multiple of the 8-channel prefetch step (2,001): against float64,
    and row by row."""
    g = torch.Generator().manual_seed(rows + k)
    w, x = torch.randn(70, k, generator=g), torch.randn(rows, k, generator=g)
    packed = dense_linear.pack_panels(w, _width())
    batch = torch.ops.tokenmill_cpu.dense_gemm(x, packed, 70)
    assert _rel_err(batch, F.linear(x.double(), w.double())) < 1e-5
    one = torch.cat([torch.ops.tokenmill_cpu.dense_gemm(x[i:i + 1], packed, 70) for i in range(rows)])
    assert torch.equal(batch, one)


def test_zero_rows_and_pack_layout() -> None:
    w = torch.arange(3 * 4, dtype=torch.float32).view(3, 4)
    packed = dense_linear.pack_panels(w, 2)
    assert packed.shape == (2, 4, 2)
    assert torch.equal(packed[0], w[:2].T) and torch.equal(packed[1, :, 0], w[2]) and not packed[1, :, 1].any()
    ones = dense_linear.pack_panels(torch.ones(10, 64), _width())
    out = torch.ops.tokenmill_cpu.dense_gemm(torch.empty(0, 64), ones, 10)
    assert out.shape == (0, 10)


def test_bad_inputs_raise_errors_not_crashes() -> None:
    width = _width()
    w = torch.randn(40, 16)
    packed = dense_linear.pack_panels(w, width)
    x = torch.randn(3, 16)
    gemm = torch.ops.tokenmill_cpu.dense_gemm
    with pytest.raises(RuntimeError, match="float32"):
        gemm(x.double(), packed, 40)
    with pytest.raises(RuntimeError, match="contiguous"):
        gemm(torch.randn(16, 3).T, packed, 40)
    with pytest.raises(RuntimeError, match="input channels"):
        gemm(torch.randn(3, 17), packed, 40)
    with pytest.raises(RuntimeError, match="do not fit"):
        gemm(x, packed, packed.shape[0] * width + 1)
    with pytest.raises(RuntimeError, match="packed weight must be"):
        gemm(x, dense_linear.pack_panels(w, width * 2), 40)


@pytest.mark.skipif(dense_linear.PANEL_WIDTH is None, reason="float32 weights are not packed for the panel kernel here")
@pytest.mark.parametrize("panel_faster", [False, True])
def test_float32_layers_use_the_panel_kernel_up_to_the_bound_and_above_it_when_measured_faster(
        monkeypatch: pytest.MonkeyPatch, panel_faster: bool) -> None:
    top = dense_linear.PANEL_MAX_ROWS
    assert dense_linear.packed_rows(torch.float32) == (1, top) and top in (64, 256)
    monkeypatch.setattr(dense_linear, "_panel_large", None)
    monkeypatch.setattr(dense_linear, "_PANEL_LARGE_FIGURES", [])
    assert "measured at first use" in dense_linear.describe()
    timed = []
    monkeypatch.setattr(dense_linear, "_time_large_rows",
                        lambda entry, weight: timed.append(weight.shape) or ((1.0, 2.0) if panel_faster else (2.0, 1.0)))
    w = torch.randn(64, 32)
    assert dense_linear.pack(w) and dense_linear._TABLE[w.data_ptr()].library == dense_linear.PANEL
    calls = []
    real = torch.ops.tokenmill_cpu.dense_gemm
    monkeypatch.setattr(torch.ops.tokenmill_cpu, "dense_gemm",
                        lambda x, p, n, bias=None: calls.append(len(x)) or real(x, p, n, bias))
    for rows in (1, 31, top, top + 1, 600):
        x = torch.randn(rows, 32)
        assert _rel_err(dense_linear.dense_linear(x, w), F.linear(x.double(), w.double())) < 1e-5
    assert timed == [(64, 32)]  # measured once, at the first product above the bound
    assert calls == ([1, 31, top, top + 1, 600] if panel_faster else [1, 31, top])
    assert f"panel sgemm for 1-{top} rows" in dense_linear.describe()
    assert ("and above (measured faster" if panel_faster else "(above: F.linear, measured faster") \
        in dense_linear.describe()


@pytest.mark.skipif(dense_linear.PANEL_WIDTH is None, reason="float32 weights are not packed for the panel kernel here")
def test_the_large_row_measurement_times_both_paths_on_the_weight() -> None:
    w = torch.randn(96, 64)
    assert dense_linear.pack(w)
    panel_ms, linear_ms = dense_linear._time_large_rows(dense_linear._TABLE[w.data_ptr()], w)
    assert 0 < panel_ms < 1e4 and 0 < linear_ms < 1e4


@pytest.mark.skipif(dense_linear.PANEL_WIDTH is None, reason="float32 weights are not packed for the panel kernel here")
def test_the_large_row_measurement_does_not_count_a_slow_start(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both paths are slow (20 ms) for the first 150 ms of the measurement and fast (1 ms) afterwards, as a
    # process's first products were in an engine's first prefill step; only the fast ones may count.
    import time

    w = torch.randn(96, 64)
    assert dense_linear.pack(w)
    start = time.perf_counter()

    def product(*_args: object) -> torch.Tensor:
        time.sleep(0.02 if time.perf_counter() - start < 0.15 else 0.001)
        return torch.zeros(1)

    monkeypatch.setattr(dense_linear.F, "linear", product)
    monkeypatch.setattr(torch.ops.tokenmill_cpu, "dense_gemm", product)
    panel_ms, linear_ms = dense_linear._time_large_rows(dense_linear._TABLE[w.data_ptr()], w)
    assert panel_ms < 10 and linear_ms < 10


def test_an_explicit_panel_row_bound_skips_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dense_linear.PANEL_ROWS_ENV, "4096")
    assert dense_linear._panel_max_rows() == (4096, True)
    monkeypatch.setenv(dense_linear.PANEL_ROWS_ENV, "lots")
    assert dense_linear._panel_max_rows()[1] is False
    monkeypatch.delenv(dense_linear.PANEL_ROWS_ENV)
    assert dense_linear._panel_max_rows()[1] is False


@pytest.mark.skipif(dense_linear.PANEL_WIDTH is None, reason="float32 weights are not packed for the panel kernel here")
def test_until_the_kernels_are_loaded_products_use_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine serves while the kernels build (``kernels.load_async``): the panel copies wait for them."""
    w = torch.randn(48, 16)
    assert dense_linear.pack(w)
    monkeypatch.setattr(dense_linear, "_panel_ready", False)
    monkeypatch.setattr(kernels, "ready", lambda: False)
    monkeypatch.setattr(torch.ops.tokenmill_cpu, "dense_gemm", lambda *a: pytest.fail("kernel called before load"))
    x = torch.randn(4, 16)
    assert torch.equal(dense_linear.dense_linear(x, w), F.linear(x, w))
    assert "until the kernels are loaded" in dense_linear.describe()


@pytest.mark.skipif(dense_linear.PANEL_WIDTH is None or not torch.backends.mkl.is_available(),
                    reason="needs the panel path and MKL")
def test_a_failed_kernel_build_repacks_the_weights_for_mkl(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(80, 48)
    assert dense_linear.pack(w) and dense_linear._TABLE[w.data_ptr()].library == dense_linear.PANEL
    monkeypatch.setattr(dense_linear, "_panel_ready", False)
    monkeypatch.setattr(kernels, "ready", lambda: False)
    monkeypatch.setattr(kernels, "failed", lambda: True)
    for rows in (8, 200):  # MKL's copy at up to 64 rows, F.linear above
        x = torch.randn(rows, 48)
        assert _rel_err(dense_linear.dense_linear(x, w), F.linear(x.double(), w.double())) < 1e-5
    entry = dense_linear._TABLE[w.data_ptr()]
    assert entry.library == dense_linear.MKL
    assert "kernels unavailable" in dense_linear.describe()


def _bf16_rel_err(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    return _rel_err(got, F.linear(x.double(), w.double()))


@pytest.mark.parametrize(("n", "k"), [(48, 64), (100, 30), (7, 2), (960, 576), (50, 1538)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17, 70])
def test_bf16_panel_product_matches_the_fp64_reference(n: int, k: int, rows: int) -> None:
    """``dense_gemm_bf16`` (AVX-512 BF16 pair dot products, or the plain loops of other builds): float32 sums of
    exact bfloat16 products, rounded once to bfloat16, so within bfloat16's rounding of the float64 product."""
    g = torch.Generator().manual_seed(n * 1000 + k * 10 + rows)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    got = torch.ops.tokenmill_cpu.dense_gemm_bf16(x, dense_linear.pack_panels_bf16(w), n)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert _bf16_rel_err(got, x, w) < 8e-3
    exact = F.linear(x.double(), w.double())
    assert float((got.double() - exact).abs().max()) <= float((F.linear(x, w).double() - exact).abs().max()) * 2 + 1e-6


def test_bf16_panel_rows_do_not_depend_on_the_row_count() -> None:
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(130, 96, generator=g).bfloat16(), torch.randn(21, 96, generator=g).bfloat16()
    packed = dense_linear.pack_panels_bf16(w)
    batch = torch.ops.tokenmill_cpu.dense_gemm_bf16(x, packed, 130)
    one = torch.cat([torch.ops.tokenmill_cpu.dense_gemm_bf16(x[i:i + 1], packed, 130) for i in range(21)])
    assert torch.equal(batch, one)


def test_bf16_pack_layout_and_bad_inputs() -> None:
    w = torch.arange(3 * 4, dtype=torch.float32).view(3, 4).bfloat16()
    packed = dense_linear.pack_panels_bf16(w, 2)
    assert packed.shape == (2, 2, 4)
    assert packed[0, 1].tolist() == [w[0, 2], w[0, 3], w[1, 2], w[1, 3]]
    assert packed[1, 0].tolist() == [w[2, 0], w[2, 1], 0, 0]
    with pytest.raises(ValueError, match="even input size"):
        dense_linear.pack_panels_bf16(torch.zeros(4, 5, dtype=torch.bfloat16))
    good = dense_linear.pack_panels_bf16(torch.randn(40, 16).bfloat16())
    x = torch.randn(3, 16).bfloat16()
    gemm = torch.ops.tokenmill_cpu.dense_gemm_bf16
    assert gemm(torch.empty(0, 16, dtype=torch.bfloat16), good, 40).shape == (0, 40)
    with pytest.raises(RuntimeError, match="bfloat16"):
        gemm(x.float(), good, 40)
    with pytest.raises(RuntimeError, match="contiguous"):
        gemm(torch.randn(16, 3).bfloat16().T, good, 40)
    with pytest.raises(RuntimeError, match="even count"):
        gemm(torch.randn(3, 18).bfloat16(), good, 40)
    with pytest.raises(RuntimeError, match="do not fit"):
        gemm(x, good, 49)
    with pytest.raises(RuntimeError, match="packed weight must be"):
        gemm(x, dense_linear.pack_panels_bf16(torch.randn(40, 16).bfloat16(), 24), 40)


@pytest.fixture
def packed_bf16(monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """A bfloat16 weight packed with a panel copy for up to 4 rows (the bound set here, on any CPU); skips where
    oneDNN cannot pack bfloat16 (it needs AVX-512 or AVX-NE-CONVERT)."""
    monkeypatch.setattr(dense_linear, "BF16_PANEL_MAX_ROWS", 4)
    monkeypatch.setattr(dense_linear, "_bf16_panel_ready", None)
    w = torch.randn(100, 64).bfloat16()
    if not dense_linear.pack(w):
        pytest.skip("oneDNN cannot pack bfloat16 weights here")
    return w


def test_bf16_layers_use_the_panel_copy_up_to_the_bound_and_onednn_above(
        monkeypatch: pytest.MonkeyPatch, packed_bf16: torch.Tensor) -> None:
    w = packed_bf16
    entry = dense_linear._TABLE[w.data_ptr()]
    assert entry.small is not None and dense_linear.packed_bytes(w) == 2 * w.numel() * 2
    calls = []
    real = torch.ops.tokenmill_cpu.dense_gemm_bf16
    monkeypatch.setattr(torch.ops.tokenmill_cpu, "dense_gemm_bf16",
                        lambda x, p, n: calls.append(len(x)) or real(x, p, n))
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 64).bfloat16()
        assert _bf16_rel_err(dense_linear.dense_linear(x, w), x, w) < 8e-3
    if str(torch.ops.tokenmill_cpu.dense_gemm_bf16_isa()) == "avx512_bf16":
        assert calls == [1, 4] and "panel bf16 dot for 1-4 rows" in dense_linear.describe()
    else:  # a build without AVX-512 BF16: the copies are dropped at the first product and oneDNN serves all rows
        assert calls == [] and entry.small is None and dense_linear._bf16_panel_ready is False
        assert "panel bf16" not in dense_linear.describe()


def test_bf16_products_wait_for_the_kernels(monkeypatch: pytest.MonkeyPatch, packed_bf16: torch.Tensor) -> None:
    w = packed_bf16
    monkeypatch.setattr(kernels, "ready", lambda: False)
    monkeypatch.setattr(kernels, "failed", lambda: False)
    monkeypatch.setattr(torch.ops.tokenmill_cpu, "dense_gemm_bf16", lambda *a: pytest.fail("kernel called before load"))
    x = torch.randn(2, 64).bfloat16()
    assert _bf16_rel_err(dense_linear.dense_linear(x, w), x, w) < 8e-3
    assert dense_linear._bf16_panel_ready is None  # asked again at the next product


def test_an_odd_input_size_gets_no_bf16_panel_copy(packed_bf16: torch.Tensor) -> None:
    w = torch.randn(40, 63).bfloat16()
    assert not dense_linear.small_copy_wanted(w) and dense_linear.packed_bytes(w) == w.numel() * 2
    assert dense_linear.pack(w) and dense_linear._TABLE[w.data_ptr()].small is None
    x = torch.randn(2, 63).bfloat16()
    assert _bf16_rel_err(dense_linear.dense_linear(x, w), x, w) < 8e-3


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512" or "avx512_bf16" not in kernels.cpu_flags(),
                    reason="the bfloat16 panel copy is only made on CPUs with AVX-512 BF16")
def test_the_bf16_row_bound_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dense_linear.BF16_PANEL_ROWS_ENV, raising=False)
    assert dense_linear._bf16_panel_max_rows() == 4
    for value, rows in (("3", 3), ("0", 0), ("lots", 4)):
        monkeypatch.setenv(dense_linear.BF16_PANEL_ROWS_ENV, value)
        assert dense_linear._bf16_panel_max_rows() == rows


@pytest.mark.lower_isa
@pytest.mark.slow
@pytest.mark.parametrize(("capability", "isa"), [("default", "scalar"), ("avx2", "avx2")])
def test_lower_isa_builds_match_the_fp64_reference(capability: str, isa: str) -> None:
    """The plain C++ loops and the AVX2/FMA build (CPUs without AVX-512; on an AVX-512 machine built with AVX2
    flags only), each checked by this file's tests in a subprocess."""
    from tests.lower_isa import check_lower_isa_build

    check_lower_isa_build(__file__, capability, "dense_gemm", isa, "not lower_isa")
