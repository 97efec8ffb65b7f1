"""tokenmill-cpu's prepacked linear layers (``tokenmill_cpu.dense_linear``, custom op ``unquantized_linear``)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers import ReplicatedLinear
from tokenmill.layers.linear_method import DEFAULT_METHOD, attach_linear_method, get_unquantized_linear_method
from tokenmill_cpu import dense_linear, kernels
from tokenmill_cpu.dense_linear import CpuUnquantizedLinearMethod


# float32 weights are packed for the kernels' panel matmul; products before the (background) build finishes use
# F.linear, so load them first: every test then sees one path.
kernels.load()


def _layer(n: int = 48, k: int = 64, dtype: torch.dtype = torch.float32, seed: int = 0) -> ReplicatedLinear:
    g = torch.Generator().manual_seed(seed)
    layer = ReplicatedLinear(k, n, bias=False).to(dtype)
    layer.weight.data.copy_((torch.randn(n, k, generator=g) * 0.1).to(dtype))
    return layer


def _can_pack(dtype: torch.dtype) -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def test_the_cpu_platform_chooses_the_prepacking_method() -> None:
    assert isinstance(get_unquantized_linear_method(), CpuUnquantizedLinearMethod)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 4, 9, 32, 257])
def test_packed_product_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    if not _can_pack(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    layer = _layer(dtype=dtype)
    method = CpuUnquantizedLinearMethod()
    assert method.process_weights_after_loading(layer) == dense_linear.packed_bytes(layer.weight)
    if dtype == torch.bfloat16 and dense_linear.small_copy_wanted(layer.weight):
        assert dense_linear.packed_bytes(layer.weight) == 2 * layer.weight.numel() * 2
    assert layer.weight.data_ptr() in dense_linear._TABLE
    x = (torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)) * 0.5).to(dtype)
    want = F.linear(x.double(), layer.weight.double())
    got = method.apply(layer, x)
    assert got.shape == (rows, 48) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.double(), want, atol=tol, rtol=tol)
    assert torch.equal(dense_linear.dense_linear(x, layer.weight), got) or rows < dense_linear.packed_rows(dtype)[0]
    bias = torch.randn(48, generator=torch.Generator().manual_seed(7)).to(dtype)
    got = method.apply_with_bias(layer, x, bias)  # the bias inside the product (or in place after it)
    assert got.shape == (rows, 48) and got.dtype == dtype
    assert torch.allclose(got.double(), want + bias.double(), atol=tol, rtol=tol)


def test_an_entry_leaves_the_table_when_its_weight_is_freed() -> None:
    layer = _layer(seed=1)
    assert dense_linear.pack(layer.weight)
    key = layer.weight.data_ptr()
    assert key in dense_linear._TABLE
    del layer
    gc.collect()
    assert key not in dense_linear._TABLE


@pytest.mark.parametrize("amx", [True, False])
def test_packing_float32_on_a_cpu_with_amx_suggests_bfloat16_once(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture, amx: bool) -> None:
    monkeypatch.setattr(dense_linear, "has_amx_bf16", lambda: amx)
    dense_linear._log_amx_hint.cache_clear()
    with caplog.at_level("INFO", logger="tokenmill_cpu.dense_linear"):
        if _can_pack(torch.bfloat16):  # bfloat16 weights never log it
            assert dense_linear.pack(_layer(dtype=torch.bfloat16, seed=13).weight)
            assert "--dtype bfloat16" not in caplog.text
        layers = [_layer(seed=seed) for seed in (11, 12)]
        assert all(dense_linear.pack(layer.weight) for layer in layers)
    hints = [r for r in caplog.records if "--dtype bfloat16" in r.getMessage()]
    assert len(hints) == amx
    assert ("oneDNN packed (AMX)" in dense_linear.describe()) == amx


@pytest.mark.parametrize(("flags", "isa_cap", "expected"), [
    ({"avx512f", "amx_tile", "amx_bf16"}, None, True),
    ({"avx512f", "amx_tile", "amx_bf16"}, "AVX512_CORE_AMX", True),
    ({"avx512f", "amx_tile", "amx_bf16"}, "AVX2", False),  # oneDNN capped below AMX
    ({"avx2", "fma"}, None, False),
])
def test_amx_counts_only_where_onednn_may_use_it(monkeypatch: pytest.MonkeyPatch, flags: set[str],
                                                 isa_cap: str | None, expected: bool) -> None:
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    if isa_cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa_cap)
    dense_linear.has_amx_bf16.cache_clear()
    try:
        assert dense_linear.has_amx_bf16() is expected
    finally:
        dense_linear.has_amx_bf16.cache_clear()


def test_a_weight_that_cannot_be_packed_stays_on_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(weight: torch.Tensor, batch_size: int | None) -> torch.Tensor:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    layer = _layer(seed=2)
    monkeypatch.setattr(dense_linear, "PANEL_WIDTH", None)  # float32 on the libraries' packers
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    monkeypatch.setattr(torch.ops.mkl, "_mkl_reorder_linear_weight", refuse)
    method = CpuUnquantizedLinearMethod()
    assert method.process_weights_after_loading(layer) == 0
    assert layer.weight.data_ptr() not in dense_linear._TABLE
    x = torch.randn(8, 64)
    assert torch.equal(method.apply(layer, x), F.linear(x, layer.weight))


def test_float32_uses_mkl_and_checks_each_row_count_once(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.backends.mkl.is_available():
        pytest.skip("torch without MKL")
    monkeypatch.setattr(dense_linear, "PANEL_WIDTH", None)  # MKL's packed GEMM, as without the panel kernel
    layer = _layer(n=80, k=48, seed=5)
    assert dense_linear.pack(layer.weight)
    assert dense_linear._TABLE[layer.weight.data_ptr()].library == dense_linear.MKL
    calls = []
    real = torch.ops.mkl._mkl_linear

    def spy(x, packed, weight, bias, rows):
        calls.append(rows)
        return real(x, packed, weight, bias, rows)

    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", spy)
    for rows in (3, 3, 40):
        x = torch.randn(rows, 48)
        assert torch.allclose(dense_linear.dense_linear(x, layer.weight), F.linear(x, layer.weight), atol=1e-5)
    bias = torch.randn(80)
    assert torch.allclose(dense_linear.dense_linear(x, layer.weight, bias), F.linear(x, layer.weight, bias), atol=1e-5)
    calls.pop()  # the biased product's call
    # the first product at 3 and at 40 rows is checked against F.linear on random data (one extra MKL call each)
    assert calls == [3, 3, 3, 40, 40]
    assert dense_linear._MKL_VERIFIED[(80, 48, 3)] and dense_linear._MKL_VERIFIED[(80, 48, 40)]


def test_a_wrong_mkl_product_sends_that_shape_and_row_count_to_f_linear(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    if not torch.backends.mkl.is_available():
        pytest.skip("torch without MKL")
    monkeypatch.setattr(dense_linear, "PANEL_WIDTH", None)  # MKL's packed GEMM, as without the panel kernel
    layer = _layer(n=96, k=48, seed=6)
    assert dense_linear.pack(layer.weight)
    real = torch.ops.mkl._mkl_linear

    def wrong_at_5(x, packed, weight, bias, rows):
        y = real(x, packed, weight, bias, rows)
        return y + 1.0 if rows == 5 else y

    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", wrong_at_5)
    x5, x6 = torch.randn(5, 48), torch.randn(6, 48)
    with caplog.at_level("WARNING", logger="tokenmill_cpu.dense_linear"):
        assert torch.equal(dense_linear.dense_linear(x5, layer.weight), F.linear(x5, layer.weight))
    assert dense_linear._MKL_VERIFIED[(96, 48, 5)] is False and "wrong product at 5 rows" in caplog.text
    assert torch.allclose(dense_linear.dense_linear(x6, layer.weight), F.linear(x6, layer.weight), atol=1e-5)
    assert dense_linear._MKL_VERIFIED[(96, 48, 6)] is True


def test_float32_on_mkl_uses_the_packed_copy_from_1_to_64_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.backends.mkl.is_available():
        pytest.skip("torch without MKL")
    monkeypatch.setattr(dense_linear, "PANEL_WIDTH", None)  # MKL's packed GEMM, as without the panel kernel
    assert dense_linear.packed_rows(torch.float32) == (1, 64)
    assert dense_linear.packed_rows(torch.bfloat16)[0] == 1
    layer = _layer(n=64, k=32, seed=7)
    assert dense_linear.pack(layer.weight)
    calls = []
    real = torch.ops.mkl._mkl_linear
    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", lambda *a: calls.append(a[-1]) or real(*a))
    for rows in (1, 64, 65, 300):
        x = torch.randn(rows, 32)
        assert torch.allclose(dense_linear.dense_linear(x, layer.weight), F.linear(x, layer.weight), atol=1e-5)
    assert set(calls) == {1, 64}


def test_packing_stops_at_the_memory_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = [_layer(seed=10 + i) for i in range(3)]
    per_layer = layers[0].weight.numel() * 4
    # budget = half the available RAM: room for two of the three copies
    monkeypatch.setattr(dense_linear.memory, "available_memory_bytes", lambda: int(4.5 * per_layer))
    method = CpuUnquantizedLinearMethod()
    added = [method.process_weights_after_loading(layer) for layer in layers]
    assert added == [per_layer, per_layer, 0]
    assert layers[2].weight.data_ptr() not in dense_linear._TABLE


def test_a_bfloat16_panel_copy_is_made_only_where_both_copies_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    if not _can_pack(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bfloat16 on this CPU")
    monkeypatch.setattr(dense_linear, "BF16_PANEL_MAX_ROWS", 4)
    monkeypatch.setattr(dense_linear, "_bf16_panel_ready", None)
    layers = [_layer(dtype=torch.bfloat16, seed=20 + i) for i in range(3)]
    per_copy = layers[0].weight.numel() * 2
    # budget = half the available RAM: 4 copies; panel copies only from its first half: both copies for the first
    # layer, then the main copies alone, so every layer keeps its main copy
    monkeypatch.setattr(dense_linear.memory, "available_memory_bytes", lambda: 8 * per_copy)
    method = CpuUnquantizedLinearMethod()
    assert [method.process_weights_after_loading(layer) for layer in layers] == [2 * per_copy, per_copy, per_copy]
    assert dense_linear._TABLE[layers[0].weight.data_ptr()].small is not None
    assert all(dense_linear._TABLE[layer.weight.data_ptr()].small is None for layer in layers[1:])
    x = torch.randn(2, 64).bfloat16()
    for layer in layers:  # every layer right, whichever copies it has
        want = F.linear(x.double(), layer.weight.double())
        assert torch.allclose(method.apply(layer, x).double(), want, atol=2e-2, rtol=2e-2)


def test_tokenmill_cpu_prepack_onednn_packs_float32_with_onednn() -> None:
    import os
    import subprocess
    import sys

    code = ("import torch; from tokenmill_cpu import dense_linear as d; w = torch.randn(32, 16); d.pack(w); "
            "print(d.HAS_MKL, d._TABLE[w.data_ptr()].library)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TOKENMILL_CPU_PREPACK": "onednn"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "oneDNN", "packed"]


def test_tokenmill_cpu_prepack_0_turns_packing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CPU_PREPACK", "0")
    layer = _layer(seed=3)
    assert CpuUnquantizedLinearMethod().process_weights_after_loading(layer) == 0
    assert layer.weight.data_ptr() not in dense_linear._TABLE
    assert "not prepacked" in dense_linear.describe()


def test_a_graph_with_symbolic_rows_calls_the_opaque_op_and_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    # float32 on oneDNN (as without MKL): packed from 4 rows, so a 2-row trace is below the packed range
    monkeypatch.setattr(dense_linear, "HAS_MKL", False)
    monkeypatch.setattr(dense_linear, "PANEL_WIDTH", None)
    assert dense_linear.packed_rows(torch.float32)[0] > 2
    layer = _layer(seed=4)
    method = CpuUnquantizedLinearMethod()
    method.process_weights_after_loading(layer)
    layer.linear_method = method
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm.code)
        return gm.forward

    compiled = torch.compile(layer, backend=backend, dynamic=True, fullgraph=True)
    with torch.inference_mode():
        for rows in (2, 33):  # traced with 2 rows (below the packed path's minimum), run with 33
            x = torch.randn(rows, 64)
            assert torch.allclose(compiled(x), F.linear(x, layer.weight), atol=1e-5)
    assert graphs and all("tokenmill_cpu.dense_linear" in code for code in graphs)

    # a graph of one row (static), below the packed range: F.linear directly
    torch._dynamo.reset()
    graphs.clear()
    static = torch.compile(layer, backend=backend, dynamic=False, fullgraph=True)
    with torch.inference_mode():
        x = torch.randn(1, 64)
        assert torch.allclose(static(x), F.linear(x, layer.weight), atol=1e-6)
    assert graphs and not any("tokenmill_cpu.dense_linear" in code for code in graphs)


def test_attach_without_processing_packs_nothing_but_uses_the_op(tiny_llama_dir: str) -> None:
    from tokenmill.model_loader.loader import get_model
    from tokenmill.engine_args import EngineArgs

    config = EngineArgs(model=tiny_llama_dir, dtype="float32").create_engine_config()
    model = get_model(config.model_config, torch.device("cpu"))
    assert all(m.linear_method is DEFAULT_METHOD for m in model.modules() if hasattr(m, "linear_method"))
    before = dense_linear.packed_count()
    assert attach_linear_method(model, process=False) == 0
    assert dense_linear.packed_count() == before
    methods = {type(m.linear_method) for m in model.modules() if hasattr(m, "linear_method")}
    assert methods == {CpuUnquantizedLinearMethod}
    assert attach_linear_method(model) > 0
    assert dense_linear.packed_count() > before


def test_engine_output_is_the_same_with_and_without_prepacking(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.models.test_llama_correctness import PROMPTS, run_engine
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine_args import EngineArgs

    def run() -> tuple[list[list[int]], int]:
        args = EngineArgs(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64, enforce_eager=True)
        core = EngineCore(args.create_engine_config())
        return run_engine(core, PROMPTS, max_tokens=8), dense_linear.packed_count()

    gc.collect()
    before = dense_linear.packed_count()
    packed, count = run()
    assert count >= before + 2 * 4 + 1  # every linear layer of the two decoder layers and the LM head
    monkeypatch.setenv("TOKENMILL_CPU_PREPACK", "0")
    gc.collect()
    plain, _ = run()
    assert packed == plain
