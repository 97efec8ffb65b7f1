"""Batched bidirectional attention (tokenmill.attention.encoder_batches) against a float64 reference, one
sequence at a time: equal lengths back to back (the view path), mixed lengths (padded buckets), grouped-query
heads."""

from __future__ import annotations

import pytest
import torch

from tokenmill.attention.encoder_batches import bidirectional_attention, length_buckets


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges, scale: float) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for start, end in ranges:
        qs, ks, vs = (t[start:end].double().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        probs = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out[start:end] = (probs @ vs).transpose(0, 1)
    return out


@pytest.mark.parametrize("lengths", [[16, 16, 16, 16], [7, 30, 1, 29, 16, 16, 3], [5]])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_bidirectional_attention_equals_float64_reference(lengths, heads) -> None:
    torch.manual_seed(0)
    hq, hkv = heads
    total = sum(lengths)
    q, k, v = torch.randn(total, hq, 16), torch.randn(total, hkv, 16), torch.randn(total, hkv, 16)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    ranges = [(s, s + n) for s, n in zip(starts, lengths)]
    got = bidirectional_attention(q, k, v, ranges, 0.25)
    torch.testing.assert_close(got.double(), _reference(q, k, v, ranges, 0.25), atol=1e-5, rtol=1e-5)


def test_length_buckets_bound_the_padding() -> None:
    lengths = [7, 30, 1, 29, 16, 16, 3]
    buckets = length_buckets(lengths)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for bucket in buckets:
        longest = max(lengths[i] for i in bucket)
        assert len(bucket) == 1 or len(bucket) * longest <= 1.25 * sum(lengths[i] for i in bucket)
    assert any({1, 3} <= set(b) for b in buckets)  # 30 and 29 share one call
