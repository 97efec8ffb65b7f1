"""compressed-tensors and FP8 checkpoints (``quantization_config``; ``tokenmill.model_loader.scaled_quant_weights``):
integer schemes land in the CPU plugin's formats holding the format's values exactly (or in float where neither
format can), float8 weights are dequantized exactly, ``ignore`` lists are respected, and greedy tokens equal the
float32 model of the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import build_tiny_llama
from tests.models.hf_quant_writer import TINY
from tests.models.scaled_quant_writer import ScaledCase, write_scaled_checkpoints
from tests.models.test_hf_quantized_loading import (
    FUSED,
    _model,
    check_greedy_tokens,
    check_layers,
    check_start_up_error,
)
from tokenmill.layers.linear import LinearBase

INT_CASES = [
    ScaledCase("pack", 4, 32), ScaledCase("pack", 4, 128, symmetric=False, scale_dtype=torch.bfloat16),
    ScaledCase("pack", 4, 64, symmetric=False, old_zero_points=True, ignore=("lm_head", "re:.*down_proj")),
    ScaledCase("pack", 4, 0), ScaledCase("pack", 4, 64, act_order=True),
    ScaledCase("pack", 8, 0, scale_dtype=torch.bfloat16),
    ScaledCase("pack", 8, 32, narrow=True), ScaledCase("pack", 8, 64, symmetric=False), ScaledCase("int", 8, 0),
    ScaledCase("int", 8, 0, narrow=True),
]
FP8_CASES = [ScaledCase("fp8"), ScaledCase("fp8", static=True), ScaledCase("fp8", block=(128, 128)),
             ScaledCase("ct-fp8")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str, dict]]:
    root = tmp_path_factory.mktemp("scaled_quant")
    base = build_tiny_llama(str(root / "base"), **TINY)
    return {c.name: write_scaled_checkpoints(str(root / c.name), c, base) for c in INT_CASES + FP8_CASES}


@pytest.mark.parametrize("case", INT_CASES, ids=lambda c: c.name)
def test_integer_schemes_hold_the_formats_values(checkpoints, case) -> None:
    qdir, fdir, modules = checkpoints[case.name]
    in_float = check_layers(qdir, fdir, modules, case.bits)
    ignored = ["model.layers.0.mlp.down_proj"] if case.ignored("model.layers.0.mlp.down_proj") else []
    if case.bits == 4:  # every 4-bit row fits int4 or int8 exactly
        assert in_float == ignored
    elif case.narrow:  # every q - z in -127..127: int8
        assert in_float == []


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: c.name)
def test_float8_weights_are_dequantized_exactly(checkpoints, case) -> None:
    qdir, fdir, modules = checkpoints[case.name]
    quantized, reference = _model(qdir), _model(fdir)
    ref_layers = dict(reference.named_modules())
    for name, layer in quantized.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        sources = FUSED[name.split(".", 3)[3]]
        values = torch.cat([modules[f"model.layers.0.{name.split('.')[-2]}.{s}"] for s in sources])
        assert layer.quant is None and layer.weight.dtype == torch.float32, name
        assert torch.equal(layer.weight, values) and torch.equal(ref_layers[name].weight, values), name
    assert torch.equal(quantized.lm_head.weight, reference.lm_head.weight)


# float8 layers equal their reference's exactly (above), so one FP8 model stands for the rest here
@pytest.mark.parametrize("name", ["pack-w4-g32", "pack-w4-g128-asym-bf16", "int-w8-channel-narrow",
                                  "fp8-block-128x128"])
def test_greedy_tokens_equal_the_dequantized_float32_models(checkpoints, name) -> None:
    check_greedy_tokens(*checkpoints[name][:2])


def _ct(fmt: str, weights: dict, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, **extra}


@pytest.mark.parametrize("config, message", [
    (_ct("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}),
     "compressed-tensors config_groups['group_0']: format 'nvfp4-pack-quantized' with float weights is not "
     "supported; supported: awq (4-bit), gptq (4/8-bit), compressed-tensors"),
    (_ct("int-quantized", {"num_bits": 4, "type": "int", "strategy": "channel"}),
     "int-quantized int weights of 4 bits"),
    (_ct("pack-quantized", {"num_bits": 2, "type": "int", "strategy": "group", "group_size": 128}),
     "pack-quantized int weights of 2 bits"),
    (_ct("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
         sparsity_config={"format": "sparse-24-bitmask"}), "sparsity format 'sparse-24-bitmask'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "fp8 weight_block_size must be two positive integers"),
])
def test_unsupported_variants_fail_at_start_up(checkpoints, tmp_path, config, message) -> None:
    check_start_up_error(checkpoints["pack-w4-g32"][0], tmp_path, config, message)


def test_a_loader_narrowing_with_a_negative_dim_gets_dequantized_rows() -> None:
    # FusedMoE's weight loader narrows expert weights along dim -2 / -1 and copies the result into its parameter
    from tokenmill.model_loader.group_quant_tensor import GroupQuantTensor

    gen = torch.Generator().manual_seed(0)
    w = GroupQuantTensor(torch.randint(0, 16, (32, 64), dtype=torch.uint8, generator=gen),
                         torch.rand(32, 2, generator=gen).half(), torch.full((32, 2), 8, dtype=torch.int16), 4, 32)
    for dim, length in ((-2, 32), (-1, 64), (-2, 16)):
        part = w.narrow(dim, 0, length)
        assert isinstance(part, torch.Tensor) and torch.equal(part, w.dequantize().narrow(dim, 0, length))
    assert isinstance(w.narrow(0, 0, 16), GroupQuantTensor) and w.narrow(1, 0, 64) is w


def test_quantized_experts_of_a_mixture_of_experts_model_load_in_float(family_root, tmp_path) -> None:
    from tests.models.families import family_dir
    from tests.models.scaled_quant_writer import write_moe_checkpoints

    base = family_dir("qwen3_moe", family_root)  # the session's model, shared with the MoE tests
    qdir, fdir = write_moe_checkpoints(str(tmp_path / "w4"), ScaledCase("pack", 4, 32), base)
    quantized, reference = dict(_model(qdir).named_parameters()), dict(_model(fdir).named_parameters())
    experts = [n for n in reference if ".experts." in n]
    assert experts and all(torch.equal(quantized[n], reference[n]) for n in experts)
    # the values are the checkpoint's: not the random float model's
    assert not torch.equal(reference[experts[0]], dict(_model(base).named_parameters())[experts[0]])
