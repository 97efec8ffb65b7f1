"""tokenmill's torch dequantization of GGUF blocks gives exactly what the ``gguf`` package gives."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.models.gguf_writer import random_k_blocks
from tokenmill.model_loader.gguf_dequant import BLOCK_TYPES, dequantize_gguf

Q = gguf.GGMLQuantizationType
# What gguf can write from float values (its quantize_blocks); the k-quants it can only read.
WRITABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
READ_ONLY = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
def test_every_block_type_is_covered() -> None:
    assert {t.name for t in WRITABLE + READ_ONLY} == set(BLOCK_TYPES)


@pytest.mark.parametrize("qtype", WRITABLE + [Q.F16, Q.F32])
def test_torch_dequantization_is_bit_identical_to_gguf(qtype: gguf.GGMLQuantizationType) -> None:
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    values[3] = 0.0  # an all-zero row: d = 0
    values[5, :32] = 7.5  # a constant block: m carries it
    data = gguf.quants.quantize(values, qtype)
    got = dequantize_gguf(data, qtype)
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32))
    assert got.dtype == torch.float32 and got.is_contiguous() and tuple(got.shape) == values.shape
    assert torch.equal(got, want)
    ref = torch.from_numpy(values)
    row_range = ref.abs().amax(dim=1, keepdim=True)
    assert ((got - ref).abs() <= 0.2 * row_range + 1e-6).all()  # and it is the tensor that was quantized


@pytest.mark.parametrize("qtype", READ_ONLY)
def test_k_quants_are_bit_identical_to_gguf(qtype: gguf.GGMLQuantizationType) -> None:
    data = random_k_blocks(qtype, 32, 512, int(qtype))
    got = dequantize_gguf(data, qtype)
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32))
    assert tuple(got.shape) == (32, 512) and torch.isfinite(want).all()
    assert torch.equal(got, want)
    assert (got != 0).float().mean() > 0.5  # the random blocks are not degenerate


def test_the_result_is_a_copy_not_a_view_of_the_file(tmp_path) -> None:
    values = np.arange(64, dtype=np.float32).reshape(2, 32)
    data = gguf.quants.quantize(values, Q.Q8_0)
    mapped = np.memmap(tmp_path / "t.bin", dtype=np.uint8, mode="w+", shape=data.shape)
    mapped[:] = data
    readonly = np.memmap(tmp_path / "t.bin", dtype=np.uint8, mode="r", shape=data.shape)
    out = dequantize_gguf(readonly, Q.Q8_0)
    out += 1  # writable, and the file is untouched
    assert np.array_equal(np.asarray(readonly), data)
    f32 = dequantize_gguf(np.asarray(values), Q.F32)
    f32 += 1
    assert values[0, 0] == 0
