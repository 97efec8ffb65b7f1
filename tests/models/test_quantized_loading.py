"""GGUF weights loaded straight into the CPU plugin's quantized layers (``tokenmill.model_loader.quantized_loading``):
the layers hold the file's values (exactly, or within the requantization bound), the kernels multiply them
within the bound of their activation quantization, greedy tokens equal the dequantized float32 model's, and
the load's peak memory stays near the file size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import gguf
import pytest
import torch

from tests.models.gguf_writer import llama_config, write_random_llama_gguf
from tests.models.test_llama_correctness import PROMPTS, run_engine
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs
from tokenmill.layers.linear import LinearBase
from tokenmill.model_loader.loader import get_model
from tokenmill_cpu.quant_linear import ROWS, Q4Weight, Q8Weight

Q = gguf.GGMLQuantizationType
CFG = llama_config(hidden=256, layers=1, intermediate=512, heads=4, kv_heads=2, vocab=512)
# The format each type lands in, and how close to the file's values (tokenmill.model_loader.quantized_loading's
# rule): "exact", "scales" (the same codes, scales rounded to float16) or "requantized".
LANDS_IN = {
    Q.Q4_0: (Q4Weight, "exact"), Q.Q4_1: (Q4Weight, "exact"), Q.Q8_0: (Q8Weight, "exact"),
    Q.Q5_0: (Q8Weight, "exact"), Q.Q4_K: (Q4Weight, "exact"), Q.Q5_1: (Q8Weight, "requantized"),
    Q.Q2_K: (Q4Weight, "requantized"), Q.Q3_K: (Q4Weight, "requantized"), Q.Q5_K: (Q8Weight, "requantized"),
    Q.Q6_K: (Q8Weight, "requantized"),
}


def _model(path: str, quantization: str | None) -> torch.nn.Module:
    config = EngineArgs(model=path, dtype="float32", quantization=quantization).create_engine_config()
    return get_model(config.model_config, torch.device("cpu"))


def _linear_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LinearBase) or n == "lm_head"}


def _weight_error_bound(q: Q4Weight | Q8Weight, kind: str) -> torch.Tensor:
    """``[N, K]``: how far the weight may be from the file's values: for ``"requantized"`` half a step, plus
    the float16 rounding (relative 2^-11, absolute 2^-25 below 2^-14) of the step times the largest code
    (codes clamp to the range) and of a 4-bit block's minimum; for ``"scales"`` only the roundings."""
    n, k = q.out_features, q.in_features
    p = n // ROWS

    def f16_rounding(t: torch.Tensor) -> torch.Tensor:
        return 2.0 ** -11 * t + 2.0 ** -25

    d = q.block_scales().permute(0, 2, 1).reshape(n, -1).abs() if isinstance(q, Q4Weight) else \
        q.scales.permute(0, 2, 1).reshape(n, -1).float().abs()
    codes = 15 if isinstance(q, Q4Weight) else 127
    bound = (0.5 * d if kind == "requantized" else 0) + codes * f16_rounding(d)
    if kind == "exact":
        bound = torch.zeros_like(d)
    elif isinstance(q, Q4Weight):
        bound = bound + f16_rounding(q.block_mins().permute(0, 2, 1).reshape(n, -1).abs())
    return bound.repeat_interleave(32, dim=1).reshape(p * ROWS, k)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[gguf.GGMLQuantizationType, str]:
    folder = tmp_path_factory.mktemp("quantized_gguf")
    return {t: write_random_llama_gguf(str(folder / f"{t.name}.gguf"), CFG, t, seed=int(t)) for t in LANDS_IN}


@pytest.mark.parametrize("qtype", list(LANDS_IN), ids=lambda t: t.name)
def test_layers_hold_the_files_values_and_the_kernels_multiply_them(files, qtype) -> None:
    reference, quantized = _model(files[qtype], None), _model(files[qtype], "int4")
    fmt, kind = LANDS_IN[qtype]
    ref_layers, layers = _linear_layers(reference), _linear_layers(quantized)
    assert set(layers) == set(ref_layers) and len(layers) == 5  # qkv, o, gate_up, down, tied head
    for name, layer in layers.items():
        w = ref_layers[name].weight  # the dequantized float32 model: bit-identical to gguf.quants
        assert layer.quant_only and layer.weight.is_meta, name
        q = layer.quant
        assert type(q) is fmt, name
        got = q.dequantize()
        if kind == "exact":
            assert torch.equal(got, w), name
        else:
            assert ((got - w).abs() <= _weight_error_bound(q, kind)).all(), name
    # the embedding keeps its blocks and dequantizes the rows it looks up: the same values
    ids = torch.tensor([0, 5, 511, 5, 77])
    embed = quantized.model.embed_tokens
    assert embed.qtype == qtype.name and embed.weight.is_meta
    assert torch.equal(embed(ids), reference.model.embed_tokens(ids))
    # the kernel's product against the float64 product of the file's values, within the bound of its 14-bit
    # activation blocks (scale max|x| / 8191, half a step each) and of the weight's requantization
    torch.manual_seed(int(qtype))
    for name in ("model.layers.0.mlp.gate_up_proj", "model.layers.0.self_attn.qkv_proj"):
        layer, w = layers[name], ref_layers[name].weight.double()
        x = torch.randn(7, w.shape[1])
        x[2, :32] *= 40  # an outlier block
        y = layer(x).double()
        want = x.double() @ w.T
        half_step = x.double().abs().reshape(7, -1, 32).amax(dim=-1) / 8191 / 2
        act = half_step @ w.abs().reshape(w.shape[0], -1, 32).sum(dim=-1).T
        weight_err = x.double().abs() @ _weight_error_bound(layer.quant, kind).double().T
        rounding = 1e-5 * (x.double().abs() @ w.abs().T)
        assert ((y - want).abs() <= act + weight_err + rounding).all(), name


def test_a_float_file_is_quantized_and_an_unpackable_layer_stays_float(tmp_path) -> None:
    # down_proj has 40 input features: not a whole number of 32-value blocks
    cfg = llama_config(hidden=64, layers=1, intermediate=40, heads=2, kv_heads=1, vocab=512)
    path = write_random_llama_gguf(str(tmp_path / "f32.gguf"), cfg, Q.F32)
    reference, quantized = _model(path, None), _model(path, "int8")
    layers, ref_layers = _linear_layers(quantized), _linear_layers(reference)
    down = layers["model.layers.0.mlp.down_proj"]
    assert down.quant is None and not down.quant_only
    assert torch.equal(down.weight, ref_layers["model.layers.0.mlp.down_proj"].weight)
    gate_up = layers["model.layers.0.mlp.gate_up_proj"]
    assert type(gate_up.quant) is Q8Weight and gate_up.quant_only
    w = ref_layers["model.layers.0.mlp.gate_up_proj"].weight
    assert ((gate_up.quant.dequantize() - w).abs() <= _weight_error_bound(gate_up.quant, "requantized")).all()
    embed = quantized.model.embed_tokens  # float32 in the file: a float table, the head quantized from it
    assert embed.qtype is None and torch.equal(embed.weight, reference.model.embed_tokens.weight)
    assert type(quantized.lm_head.quant) is Q8Weight and quantized.lm_head.quant_only


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda t: t.name)
def test_greedy_tokens_equal_the_dequantized_float32_models(files, qtype) -> None:
    args = dict(model=files[qtype], dtype="float32", num_gpu_blocks_override=64, enforce_eager=True)
    reference = run_engine(EngineCore(EngineArgs(**args).create_engine_config()), PROMPTS, max_tokens=24)
    quantized = run_engine(EngineCore(EngineArgs(quantization="int4", **args).create_engine_config()), PROMPTS,
                           max_tokens=24)
    assert quantized == reference


def test_default_model_keeps_its_q4_1_and_q8_0_weights(default_model_path) -> None:
    from tokenmill.model_loader.gguf_cache import read_gguf_tensors
    from tokenmill.model_loader.gguf_dequant import dequantize_gguf

    quantized = _model(default_model_path, "int4")
    layers = _linear_layers(quantized)
    assert type(layers["lm_head"].quant) is Q8Weight and quantized.model.embed_tokens.qtype == "Q8_0"  # tied, Q8_0
    assert all(layer.quant_only and (name == "lm_head" or type(layer.quant) is Q4Weight)
               for name, layer in layers.items())
    file = {t.name: t for t in read_gguf_tensors(default_model_path)[1]}
    for gguf_name, layer in (("token_embd.weight", layers["lm_head"]),
                             ("blk.0.ffn_down.weight", layers["model.layers.0.mlp.down_proj"])):
        t = file[gguf_name]
        assert torch.equal(layer.quant.dequantize(), dequantize_gguf(t.data, t.tensor_type)), gguf_name


# Peak RSS of a load in a fresh interpreter: the maximum resident size after loading a tiny model (imports,
# kernels, allocator arenas) and after loading the measured one.
_MEASURE = textwrap.dedent("""
    import json, resource, sys, torch
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model_loader.loader import get_model
    def load(path):
        config = EngineArgs(model=path, dtype="float32", quantization="int4").create_engine_config()
        return get_model(config.model_config, torch.device("cpu"))
    load(sys.argv[1])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = load(sys.argv[2])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"before_kib": before, "after_kib": after}))
""")


def measure_load_rss_kib(tiny: str, path: str) -> int:
    """How much a quantized load of ``path`` raises the peak resident size of a process that loaded ``tiny``."""
    for p in (tiny, path):  # the config / tokenizer cache is filled here, so the child only loads
        EngineArgs(model=p, quantization="int4").create_engine_config()
    out = subprocess.run([sys.executable, "-c", _MEASURE, tiny, path], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    return rss["after_kib"] - rss["before_kib"]


def test_load_peak_memory_stays_near_the_file_size(files, tmp_path) -> None:
    # 4 layers of 768 x 2048: 25 M weights, a 14 MiB Q4_0 file, 100 MiB as float32
    cfg = llama_config(hidden=768, layers=4, intermediate=2048, heads=12, kv_heads=4, vocab=2048)
    path = write_random_llama_gguf(str(tmp_path / "m.gguf"), cfg, Q.Q4_0)
    size_kib = os.path.getsize(path) / 1024
    grown = measure_load_rss_kib(files[Q.Q4_0], path)
    # The int4 layout holds Q4_0's blocks at their 4.5 bits (codes centred, no minimums); 8 MiB for allocator slack, code pages
    # of kernels first used here and the tensors in flight (measured: 19.1 MiB in all for a 14.4 MiB file)
    assert grown <= 1.3 * size_kib + 8 * 1024, (grown, size_kib)
    assert grown < 25e6 * 4 / 1024 / 3  # a third of the float32 weights (a float32 load: 130 MiB)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_repacking_blocks_at_an_odd_address_gives_the_same_weight(qtype) -> None:
    data = gguf.quants.quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).numpy(), qtype)
    buffer = torch.zeros(data.size + 1, dtype=torch.uint8)
    buffer[1:] = torch.from_numpy(data.reshape(-1))
    fmt = LANDS_IN[qtype][0]
    odd = fmt.from_gguf(qtype.name, buffer[1:].view(32, -1))
    assert torch.equal(odd.dequantize(), fmt.from_gguf(qtype.name, torch.from_numpy(data)).dequantize())
