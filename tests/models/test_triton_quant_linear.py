"""The CUDA and ROCm platforms' quantized weights (``tokenmill.layers.triton_quant_linear``), under the Triton
interpreter (``TRITON_INTERPRET=1``, tests/conftest.py): the kernel against the float64 product of the values it
holds, each format holding exactly the values its source defines (checkpoint codes, GGUF blocks), and a GPTQ and a
GGUF checkpoint served on an emulated CUDA device giving the CPU platform's greedy tokens."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # not imported here: see tests/conftest.py
    pytest.skip("triton is not installed", allow_module_level=True)

from tokenmill.layers.triton_quant_linear import (  # noqa: E402
    TritonGroupQuantWeight,
    TritonInt4Weight,
    TritonInt8Weight,
    pack_codes,
)
from tokenmill.model_loader.group_quant_tensor import GroupQuantTensor  # noqa: E402

U32 = 2.0 ** -24  # unit roundoff of float32
U16 = 2.0 ** -8  # of bfloat16


def accumulation_bound(x: torch.Tensor, w: torch.Tensor, unit: float) -> torch.Tensor:
    """``|x| @ |w|^T * (K + 2) * unit``: products and a sum of ``K`` terms each rounded to ``unit`` (any order of
    summation, tiles included), and the output's own rounding."""
    return (x.double().abs() @ w.double().abs().T) * (x.shape[1] + 2) * unit


def random_groups(n: int, k: int, bits: int, group: int, zeros: bool, seed: int) -> GroupQuantTensor:
    """Random codes, float16 scales and zero points (per group, or the symmetric ``2**(bits-1)`` for all)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.1 + 0.001).half()
    z = torch.randint(0, 2 ** bits, (n, k // group), generator=g, dtype=torch.int16) if zeros else \
        torch.full((n, k // group), 2 ** (bits - 1), dtype=torch.int16)
    return GroupQuantTensor(codes, scales, z, bits, group)


@pytest.mark.parametrize("zeros", [True, False], ids=["zero-points", "symmetric"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_matches_the_float64_product_of_the_values(bits: int, group: int, zeros: bool) -> None:
    """Checkpoint rows (``from_zero_point``) hold the exact values; the kernel's product is within float32
    accumulation of the float64 one, for 1, 3 and 17 rows, 80 output rows (not a multiple of the 64-row tile)
    and ``K`` of three groups (96 channels: not a multiple of the 64-channel tile)."""
    n, k = 80, group * 3
    rows = random_groups(n, k, bits, group, zeros, seed=bits * 1000 + group + zeros)
    cls = TritonInt4Weight if bits == 4 else TritonInt8Weight
    q = cls.from_zero_point(rows.codes, rows.scales, rows.zeros, bits)
    assert q is not None and hasattr(q, "zeros") == zeros
    w = rows.dequantize()
    assert torch.equal(q.dequantize(), w)
    assert q.nbytes < w.numel() * (bits / 8 + 0.5)  # codes packed, one scale per group
    for m in (1, 3, 17):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = q.matmul(x).double()
        want = x.double() @ w.double().T
        assert ((got - want).abs() <= accumulation_bound(x, w, U32)).all(), (m, (got - want).abs().max())


def test_kernel_with_ragged_groups_and_minimums() -> None:
    """The kernel alone on ``K`` not a multiple of the group nor the tile (last group short), float minimums and
    a float32 scale per group (GGUF ``Q4_1``/k-quant style), and bfloat16 activations: the tile rounded to
    bfloat16 on a GPU is half a bfloat16 step per weight, and the output's rounding one more."""
    from tokenmill.layers.triton_group_quant import group_quant_matmul

    g = torch.Generator().manual_seed(7)
    n, k, group = 70, 104, 32  # 4 groups, the last of 8 channels
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, 4, generator=g) * 0.05
    mins = -torch.rand(n, 4, generator=g) * 0.2
    idx = torch.arange(k) // group
    w = codes.float() * scales[:, idx] + mins[:, idx]
    x = torch.randn(17, k, generator=g)
    for dtype, unit in ((torch.float32, U32), (torch.bfloat16, U16)):
        xd = x.to(dtype)
        got = group_quant_matmul(xd, pack_codes(codes, 4), scales, None, mins, in_features=k, bits=4,
                                 group_size=group, zero_offset=0)
        assert got.dtype == dtype
        want = xd.double() @ w.double().T
        bound = accumulation_bound(xd, w, unit) + unit * want.abs()
        assert ((got.double() - want).abs() <= bound).all(), (dtype, (got.double() - want).abs().max())


def test_float_weights_quantize_within_the_formats_step() -> None:
    """``--quantization int8|int4`` of a float weight (``K`` not a multiple of 32): each value within half a step
    of its group (``d / 2``), and the kernel multiplies what ``dequantize`` gives."""
    w = torch.randn(48, 100, generator=torch.Generator().manual_seed(3))
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(4))
    pad = torch.nn.functional.pad(w, (0, 28)).reshape(48, 4, 32)
    steps = {TritonInt8Weight: pad.abs().amax(-1) / 127, TritonInt4Weight: (pad.amax(-1) - pad.amin(-1)) / 15}
    for cls, step in steps.items():
        q = cls(w)
        deq = q.dequantize()
        half = (step.repeat_interleave(32, dim=1)[:, :100] / 2) * (1 + 2 ** -9) + 1e-3 * step.max()
        assert ((deq - w).abs() <= half).all(), cls
        got = q.matmul(x).double()
        assert ((got - x.double() @ deq.double().T).abs() <= accumulation_bound(x, deq, U32)).all()
    assert TritonInt4Weight.lm_head_method == "int8"


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_are_held_bit_identically(type_name: str) -> None:
    """A GGUF type's blocks give the values ``gguf_dequant`` computes (themselves bit-identical to ``gguf``),
    in the 4-bit format for 4-bit codes and the 8-bit one for 5 to 8 bits, and never in the other."""
    import gguf
    import numpy as np

    from tests.models.gguf_writer import random_k_blocks
    from tokenmill.model_loader.gguf_dequant import dequantize_blocks

    qtype = gguf.GGMLQuantizationType[type_name]
    n, k = 24, 256
    if type_name.endswith("_K"):
        data = random_k_blocks(qtype, n, k, seed=int(qtype))
    else:
        values = np.random.default_rng(int(qtype)).standard_normal((n, k)).astype(np.float32) * 0.1
        data = gguf.quants.quantize(values, qtype)
    blocks = torch.from_numpy(np.ascontiguousarray(data)).reshape(n, -1)
    cls, other = (TritonInt4Weight, TritonInt8Weight) if type_name.startswith("Q4") else (TritonInt8Weight,
                                                                                          TritonInt4Weight)
    assert other.from_gguf(type_name, blocks) is None
    q = cls.from_gguf(type_name, blocks)
    assert q is not None
    w = dequantize_blocks(blocks, type_name)
    assert torch.equal(q.dequantize(), w)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    got = q.matmul(x).double()
    assert ((got - x.double() @ w.double().T).abs() <= accumulation_bound(x, w, U32)).all()
    assert TritonInt4Weight.from_gguf("Q2_K", blocks) is None  # the loader quantizes it again


def test_row_tiles_join_and_the_platforms_name_these_formats(monkeypatch) -> None:
    rows = random_groups(40, 64, 4, 32, True, seed=1)
    parts = [TritonInt4Weight.from_zero_point(r.codes, r.scales, r.zeros, 4) for r in rows.split([16, 24])]
    joined = TritonInt4Weight.concat_rows(parts)
    assert isinstance(joined, TritonInt4Weight) and torch.equal(joined.dequantize(), rows.dequantize())
    assert TritonInt4Weight.concat_rows([parts[0], TritonInt4Weight(torch.randn(8, 64))]) is None  # mins, not zeros
    assert TritonInt4Weight.from_zero_point(rows.codes, rows.scales, rows.zeros, 8) is None

    from tokenmill.plugins.qualname import resolve_qualname
    from tokenmill_cuda.platform import CudaPlatform
    from tokenmill_rocm.platform import RocmPlatform

    for platform in (CudaPlatform, RocmPlatform):
        assert resolve_qualname(platform.get_quant_method_cls("int4")) is TritonInt4Weight
        assert resolve_qualname(platform.get_quant_method_cls("int8")) is TritonInt8Weight
        assert issubclass(TritonInt8Weight, TritonGroupQuantWeight)
    find_spec = importlib.util.find_spec  # without triton: torch's int8 only, and int4 refused by name
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))
    for platform in (CudaPlatform, RocmPlatform):
        assert platform.get_quant_method_cls("int8") == "tokenmill.layers.quantization:Int8WeightOnly"
        assert platform.get_quant_method_cls("int4") is None


# -- end to end: an emulated CUDA device serves quantized checkpoints with these kernels -------------------------


@pytest.fixture(scope="module")
def quantized_checkpoints(tmp_path_factory) -> dict[str, str]:
    from tests.conftest import build_tiny_llama
    from tests.models.gguf_writer import write_gguf
    from tests.models.hf_quant_writer import TINY, Case, write_checkpoints

    import gguf

    root = tmp_path_factory.mktemp("triton_quant")
    base = build_tiny_llama(str(root / "base"), **TINY)
    gptq, _, _ = write_checkpoints(str(root / "gptq"), Case("gptq", 4, 32), base=base)
    q4 = write_gguf(base, str(root / "tiny-q4_0.gguf"), "llama", qtype=gguf.GGMLQuantizationType.Q4_0)
    return {"gptq": gptq, "gguf": q4}


def _greedy(model: str, platform: type | None, **kwargs) -> tuple[list[list[int]], list[torch.nn.Module]]:
    from tests.models.test_llama_correctness import PROMPTS, run_engine
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine_args import EngineArgs
    from tokenmill.platforms import get_current_platform
    from tokenmill.platforms.current import set_current_platform

    base = get_current_platform()
    if platform is not None:
        set_current_platform(platform)
    try:
        core = EngineCore(EngineArgs(model=model, dtype="float32", num_gpu_blocks_override=64, enforce_eager=True,
                                     **kwargs).create_engine_config())
        quants = [m.quant for m in core.executor.worker.model_runner.model.modules()
                  if getattr(m, "quant_only", False)]
        return run_engine(core, PROMPTS[:2], max_tokens=10), quants
    finally:
        set_current_platform(base)


@pytest.mark.parametrize("name, kwargs", [("gptq", {}), ("gguf", {"quantization": "int4"})])
def test_emulated_cuda_device_gives_the_cpu_platforms_greedy_tokens(quantized_checkpoints, name, kwargs) -> None:
    """The CUDA plugin's platform, its device emulated on the CPU (``tokenmill.conformance.emulation``: Triton
    interpreted), keeps the checkpoint's weights quantized in the Triton formats and generates the tokens the CPU
    platform's kernels do."""
    from tokenmill.conformance.emulation import emulated_platform
    from tokenmill_cuda.platform import CudaPlatform

    model = quantized_checkpoints[name]
    cuda_tokens, quants = _greedy(model, emulated_platform(CudaPlatform), **kwargs)
    assert len(quants) >= 4 and all(isinstance(getattr(q, "inner", q), TritonGroupQuantWeight) for q in quants)
    cpu_tokens, cpu_quants = _greedy(model, None, **kwargs)
    assert cpu_quants and not any(isinstance(q, TritonGroupQuantWeight) for q in cpu_quants)
    assert all(len(t) == 10 for t in cuda_tokens) and len({tok for t in cuda_tokens for tok in t}) > 5
    assert cuda_tokens == cpu_tokens


def test_kernel_compiles_ahead_of_time_for_sm90_and_gfx942() -> None:
    """The compiler accepts the kernel for NVIDIA Hopper and AMD MI300 (``aot_compile_quant_kernel``; a
    subprocess because compiling needs TRITON_INTERPRET unset)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.models.aot_compile_quant_kernel", "sm90", "gfx942"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode and ("ImportError" in proc.stderr or "ModuleNotFoundError" in proc.stderr):
        pytest.skip(f"this triton cannot compile ahead of time here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("OK sm90") == 3 and proc.stdout.count("OK gfx942") == 3, proc.stdout


def test_gguf_on_a_gpu_dequantizes_the_table_and_keeps_the_tied_head_quantized(tmp_path, monkeypatch) -> None:
    """Off the CPU the loader keeps no GGUF blocks in the token embedding (its lookup is CPU code) but a float
    table, and the tied LM head still gets the table's rows, held exactly in a Triton format. A GPU is stood in
    for by the emulated CUDA platform with the loader told what it does on a GPU."""
    import gguf

    from tests.conftest import build_tiny_llama
    from tests.models.gguf_writer import write_gguf
    from tokenmill.conformance.emulation import emulated_platform
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model_loader import quantized_loading
    from tokenmill.model_loader.loader import get_model
    from tokenmill.platforms import get_current_platform
    from tokenmill.platforms.current import set_current_platform
    from tokenmill_cuda.platform import CudaPlatform

    tied = build_tiny_llama(str(tmp_path / "tied"), tie=True, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=1, vocab_size=256)
    path = write_gguf(tied, str(tmp_path / "tied-q4_0.gguf"), "llama", qtype=gguf.GGMLQuantizationType.Q4_0)
    prepare = quantized_loading.prepare_quantized_loading
    monkeypatch.setattr(quantized_loading, "prepare_quantized_loading",
                        lambda model, method, embedding_blocks=True: prepare(model, method, embedding_blocks=False))

    def load(quantization: str | None) -> torch.nn.Module:
        config = EngineArgs(model=path, dtype="float32", quantization=quantization).create_engine_config()
        return get_model(config.model_config, torch.device("cpu"))

    base = get_current_platform()
    set_current_platform(emulated_platform(CudaPlatform))
    try:
        reference, model = load(None), load("int4")
    finally:
        set_current_platform(base)
    table = reference.model.embed_tokens.weight
    assert model.model.embed_tokens.qtype is None and torch.equal(model.model.embed_tokens.weight, table)
    assert type(model.lm_head.quant) is TritonInt4Weight and torch.equal(model.lm_head.quant.dequantize(), table)
