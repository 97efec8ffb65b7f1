"""Weight-only int8/int4 quantization: matmuls close to full precision, engines agree on greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_llama_correctness import PROMPTS, run_engine
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs
from tokenmill.layers.linear import ColumnParallelLinear
from tokenmill.layers.vocab_embedding import ParallelLMHead
from tokenmill.layers.quantization import Int8WeightOnly, UnsupportedShapeError, get_quantized_weight_cls, quantize_model
from tokenmill_cpu.int4 import Int4WeightOnly
from tokenmill_cpu.quant_linear import Q4Weight, Q8Weight


def test_int8_matmul_close_to_float():
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    x = torch.randn(5, 64)
    q = Int8WeightOnly(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() <= 127
    ref = x @ w.T
    rel = (q.matmul(x) - ref).norm() / ref.norm()
    assert rel < 0.02


def test_layer_uses_int8_only_for_small_batches():
    layer = ColumnParallelLinear(64, 32)
    torch.nn.init.normal_(layer.weight)
    quantize_model(torch.nn.Sequential(layer), "int8", max_tokens=4)
    small, large = torch.randn(4, 64), torch.randn(5, 64)
    assert torch.equal(layer(small), layer.quant.matmul(small))
    assert torch.allclose(layer(large), large @ layer.weight.T)


def test_int4_matmul_close_to_float_and_exact_on_q4_1_grid():
    torch.manual_seed(0)
    w = torch.randn(48, 96)
    x = torch.randn(3, 96)
    q = Int4WeightOnly(w)
    ref = x @ w.T
    assert (q.matmul(x) - ref).norm() / ref.norm() < 0.12  # 4 bits of a Gaussian: ~8% error
    # weights already on a Q4_1 grid (scale d, minimum m per 32 inputs, codes 0 and 15 used) come back up to
    # the bfloat16 rounding of the scales, far inside the 4-bit error above
    codes = torch.randint(0, 16, (48, 96))
    codes[:, ::32], codes[:, 1::32] = 0, 15
    grid = (codes.view(48, 3, 32) * (torch.rand(48, 3, 1) * 0.1 + 0.01) - torch.rand(48, 3, 1)).view(48, 96)
    dequantized = Int4WeightOnly(grid).matmul(torch.eye(96, dtype=torch.bfloat16)).float().T  # I @ W^T = W^T
    assert (dequantized - grid).abs().max() < 0.01 * grid.abs().max()
    assert q.nbytes < w.numel()  # under a byte per weight


def test_int4_rejects_unpackable_shapes_and_model_keeps_them_full_precision():
    with pytest.raises(UnsupportedShapeError):
        Int4WeightOnly(torch.randn(16, 40))  # input features not a multiple of 32
    with pytest.raises(UnsupportedShapeError):
        Int4WeightOnly(torch.randn(8, 64))  # output features not a multiple of 16
    odd, even = ColumnParallelLinear(40, 16), ColumnParallelLinear(64, 16)
    assert quantize_model(torch.nn.Sequential(odd, even), "int4") == 1
    assert odd.quant is None and isinstance(even.quant, Q4Weight)


def test_methods_come_from_the_platform(monkeypatch):
    assert get_quantized_weight_cls("int8") is Q8Weight  # the CPU plugin's VNNI kernels
    assert get_quantized_weight_cls("int4") is Q4Weight
    from tokenmill_cpu import kernels

    monkeypatch.setattr(kernels, "load", lambda: False)  # no compiler: torch's packed ops
    assert get_quantized_weight_cls("int8") is Int8WeightOnly
    assert get_quantized_weight_cls("int4") is Int4WeightOnly
    with pytest.raises(ValueError, match="quantization"):
        get_quantized_weight_cls("int3")


def test_int4_keeps_the_lm_head_at_int8():
    head = ParallelLMHead(64, 32)
    layer = ColumnParallelLinear(32, 64)
    torch.nn.init.normal_(head.weight)
    torch.nn.init.normal_(layer.weight)
    assert quantize_model(torch.nn.ModuleList([layer, head]), "int4") == 2
    assert isinstance(layer.quant, Q4Weight) and isinstance(head.quant, Q8Weight)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_greedy_mostly_agrees_with_full_precision(tiny_llama_dir, method):
    args = dict(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=128)
    full = run_engine(EngineCore(EngineArgs(**args).create_engine_config()), PROMPTS, max_tokens=8)
    quant = run_engine(EngineCore(EngineArgs(quantization=method, **args).create_engine_config()), PROMPTS, max_tokens=8)
    first_tokens_equal = sum(a[0] == b[0] for a, b in zip(full, quant))
    assert first_tokens_equal >= len(PROMPTS) - 1
