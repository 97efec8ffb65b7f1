"""Weight-only int8 quantization: the matmul is close to full precision and engines agree on greedy tokens."""

from __future__ import annotations

import torch

from tests.models.test_llama_correctness import PROMPTS, run_engine
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs
from tokenmill.layers.linear import ColumnParallelLinear
from tokenmill.layers.quantization import Int8WeightOnly, quantize_model


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
    assert torch.equal(layer(small), layer.int8.matmul(small))
    assert torch.allclose(layer(large), large @ layer.weight.T)


def test_int8_engine_greedy_mostly_agrees_with_full_precision(tiny_llama_dir):
    args = dict(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=128)
    full = run_engine(EngineCore(EngineArgs(**args).create_engine_config()), PROMPTS, max_tokens=8)
    quant = run_engine(EngineCore(EngineArgs(quantization="int8", **args).create_engine_config()), PROMPTS, max_tokens=8)
    first_tokens_equal = sum(a[0] == b[0] for a, b in zip(full, quant))
    assert first_tokens_equal >= len(PROMPTS) - 1
