"""AWQ and GPTQ checkpoints (``quantization_config``) loaded into the CPU plugin's packed formats
(``tokenmill.model_loader.hf_quant_weights``): each layer holds the format's values exactly (in the int4 or int8
layout, or in float where neither can), the kernels multiply them within the bound of their activation
quantization, and greedy tokens equal the float32 model of the dequantized weights."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from tests.conftest import build_tiny_llama
from tests.models.hf_quant_writer import TINY, Case, Quantized, write_checkpoints
from tests.models.test_llama_correctness import PROMPTS, run_engine
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs
from tokenmill.layers.linear import LinearBase
from tokenmill.layers.quantization import PermutedInput
from tokenmill.model_loader.loader import get_model
from tokenmill_cpu.quant_linear import Q4Weight, Q8Weight

CASES = [
    Case("awq", 4, 32), Case("awq", 4, 64), Case("awq", 4, 128),
    Case("gptq", 4, 32), Case("gptq", 4, 128), Case("gptq", 4, 64, fmt="gptq_v2"),
    Case("gptq", 4, 64, act_order="channels"), Case("gptq", 4, 32, act_order="channels-own"),
    Case("gptq", 4, 64, act_order="blocks"),
    Case("gptq", 8, 32), Case("gptq", 8, 64, narrow=True), Case("gptq", 8, 128, act_order="channels"),
]
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
         "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str, dict[str, Quantized]]]:
    root = tmp_path_factory.mktemp("hf_quant")
    base = build_tiny_llama(str(root / "base"), **TINY)
    return {c.name: write_checkpoints(str(root / c.name), c, seed=i, base=base) for i, c in enumerate(CASES)}


def _model(path: str) -> torch.nn.Module:
    config = EngineArgs(model=path, dtype="float32").create_engine_config()
    return get_model(config.model_config, torch.device("cpu"))


def expected_format(parts: list[Quantized], bits: int) -> tuple[type | None, bool]:
    """The format the loader must choose for a layer made of ``parts`` and whether it permutes the input
    channels: float (``None``) when neighbouring input channels are in different groups, unless every part has
    the same order of channels sorted by group (then permuted); 4 bits: int4 when every ``-z * s`` is a
    float16, else int8; 8 bits: int8 when every ``q - z`` is in -127..127."""
    permuted = False
    for q in parts:
        runs = q.groups.reshape(-1, 32)
        if (runs != runs[:, :1]).any():
            orders = [torch.argsort(p.groups, stable=True) for p in parts]
            if not all(torch.equal(o, orders[0]) for o in orders):
                return None, False
            permuted = True
    fmt = _values_format(parts, bits)
    return fmt, permuted and fmt is not None


def _values_format(parts: list[Quantized], bits: int) -> type | None:
    if bits == 4:
        exact = all(torch.equal((-(q.zeros * q.scales.float())).half().float(), -(q.zeros * q.scales.float()))
                    for q in parts)
        return Q4Weight if exact else Q8Weight
    ok = all(((q.codes - q.zeros[:, q.groups]).abs() <= 127).all() for q in parts)
    return Q8Weight if ok else None


def check_layers(qdir: str, fdir: str, modules: dict[str, Quantized], bits: int) -> list[str]:
    """Load both checkpoints and check every linear layer of the quantized one: in the format
    :func:`expected_format` gives, holding the format's values exactly (the reference model's weights), its kernel
    within the bound of its activation quantization of the float64 product; a layer with no format (or whose
    modules are not in ``modules``: left in float by the checkpoint) has a float weight equal to the reference's.

    Returns:
        the layers left in float.
    """
    quantized, reference = _model(qdir), _model(fdir)
    layers = {n: m for n, m in quantized.named_modules() if isinstance(m, LinearBase)}
    ref_layers = dict(reference.named_modules())
    assert len(layers) == 4
    torch.manual_seed(0)
    in_float = []
    for suffix, sources in FUSED.items():
        name = f"model.layers.0.{suffix}"
        layer, w = layers[name], ref_layers[name].weight
        parts = [modules.get(f"model.layers.0.{name.split('.')[-2]}.{s}") for s in sources]
        if all(parts):  # the reference model's weights are the format's values, as the test computed them
            assert torch.equal(w, torch.cat([q.values for q in parts])), name
        fmt, permuted = expected_format(parts, bits) if all(parts) else (None, False)
        if fmt is None:
            assert layer.quant is None and torch.equal(layer.weight, w), name
            in_float.append(name)
            continue
        held = layer.quant.inner if permuted else layer.quant
        assert type(layer.quant) is (PermutedInput if permuted else fmt) and type(held) is fmt, name
        assert layer.quant_only and layer.weight.is_meta, name
        assert torch.equal(layer.quant.dequantize(), w), name
        # the kernel against the float64 product: its 14-bit activation blocks (scale max|x| / 8191, half a
        # step each) and float32 accumulation are the only errors
        x = torch.randn(5, w.shape[1])
        x[1, :32] *= 40  # an outlier block
        want = x.double() @ w.double().T
        # activation blocks are 32 channels of the order the weight is stored in
        order = layer.quant.perm if permuted else torch.arange(w.shape[1])
        xs, ws = x.double()[:, order], w.double()[:, order]
        half_step = xs.abs().reshape(5, -1, 32).amax(dim=-1) / 8191 / 2
        bound = half_step @ ws.abs().reshape(w.shape[0], -1, 32).sum(dim=-1).T
        bound += 1e-5 * (x.double().abs() @ w.double().abs().T)
        assert ((layer(x).double() - want).abs() <= bound).all(), name
    assert torch.equal(quantized.lm_head.weight, reference.lm_head.weight)  # not quantized in the checkpoint
    return in_float


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_layers_hold_the_formats_values_and_the_kernels_multiply_them(checkpoints, case) -> None:
    qdir, fdir, modules = checkpoints[case.name]
    in_float = check_layers(qdir, fdir, modules, case.bits)
    assert not in_float or case.act_order == "channels-own" or (case.bits == 8 and not case.narrow), in_float


def test_quantization_flag_quantizes_only_the_float_lm_head(checkpoints) -> None:
    qdir, fdir, _ = checkpoints["gptq4-g32"]
    config = EngineArgs(model=qdir, dtype="float32", quantization="int4").create_engine_config()
    model, reference = get_model(config.model_config, torch.device("cpu")), _model(fdir)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    assert all(type(m.quant) is Q4Weight for m in layers.values())
    assert all(torch.equal(m.quant.dequantize(), dict(reference.named_modules())[n].weight) for n, m in layers.items())
    assert type(model.lm_head.quant) is Q8Weight and model.lm_head.quant_only  # int4's head method, from float


@pytest.mark.parametrize("name", ["awq4-g128", "gptq4-g32", "gptq4-g64-channels", "gptq8-g64-narrow"])
def test_greedy_tokens_equal_the_dequantized_float32_models(checkpoints, name) -> None:
    check_greedy_tokens(*checkpoints[name][:2])


def check_greedy_tokens(qdir: str, fdir: str) -> None:
    """Greedy tokens of the quantized checkpoint over 24 tokens for :data:`PROMPTS` equal those of the float32
    model of its dequantized values."""
    args = dict(dtype="float32", num_gpu_blocks_override=64, enforce_eager=True)
    reference = run_engine(EngineCore(EngineArgs(model=fdir, **args).create_engine_config()), PROMPTS, max_tokens=24)
    quantized = run_engine(EngineCore(EngineArgs(model=qdir, **args).create_engine_config()), PROMPTS, max_tokens=24)
    assert all(len(t) == 24 for t in reference) and len({tok for t in reference for tok in t}) > 5
    assert quantized == reference


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported; supported: awq (4-bit), "
                                       "gptq (4/8-bit), compressed-tensors (4/8-bit: pack-quantized int4/int8, "
                                       "int-quantized int8 (W8A8), float-quantized fp8), fp8 (8-bit: per-tensor or "
                                       "block-wise scales)"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with bits=3 is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
])
def test_unsupported_quantization_fails_at_start_up(checkpoints, tmp_path, config, message) -> None:
    check_start_up_error(checkpoints["gptq4-g32"][0], tmp_path, config, message)


def check_start_up_error(qdir: str, tmp_path, config: dict, message: str) -> None:
    """The checkpoint ``qdir`` with ``config`` as its ``quantization_config`` fails when the engine starts, with
    ``message`` after ``quantization_config: ``."""
    for file in os.listdir(qdir):
        os.symlink(os.path.join(qdir, file), tmp_path / file)
    os.unlink(tmp_path / "config.json")
    with open(os.path.join(qdir, "config.json")) as f:
        hf = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "quantization_config": config}))
    with pytest.raises(ValueError, match="quantization_config: .*" + re.escape(message)):
        EngineArgs(model=str(tmp_path), dtype="float32").create_engine_config()
