"""Bidirectional (encoder-only) attention of a step's whole sequences in a few batched SDPA calls.

A step of an encoder model holds many whole sequences, flattened into ``[T, H, D]``. One SDPA call per sequence
spends more time in per-call overhead and copies than in the products for short sequences, so the sequences are
grouped into *buckets* of similar length: sorted longest first, a bucket takes sequences while its padded size
(``count x longest``) stays within :data:`MAX_PADDING` of its real tokens. A bucket of equal lengths that lie
back to back in the batch is a plain view (``[n, L, H, D]``, no copy, no mask); any other bucket is gathered
into a padded batch with a key-padding mask. Padding query rows are computed and dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tokenmill.attention.backend import AttentionMetadata

MAX_PADDING = 1.25  # a bucket's padded tokens / real tokens


def sequence_ranges(attn_metadata: AttentionMetadata | None, num_tokens: int) -> list[tuple[int, int]]:
    """``(start, end)`` rows of each sequence of an encoder step (``None`` metadata, the profiling pass: the whole
    batch is one sequence).

    Raises:
        ValueError: a sequence continues a previous step (a chunked prompt: bidirectional attention needs the
            whole sequence at once).
    """
    if attn_metadata is None:
        return [(0, num_tokens)]
    qsl, seq_lens = attn_metadata.query_start_loc_cpu, attn_metadata.seq_lens_cpu
    ranges = [(int(qsl[i]), int(qsl[i + 1])) for i in range(len(seq_lens))]
    if any(end - start != seq_lens[i] for i, (start, end) in enumerate(ranges)):
        raise ValueError("encoder-only attention needs each sequence whole in one step (chunked prefill must be "
                         "off for encoder models)")
    return ranges


def length_buckets(lengths: Sequence[int], max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Group sequence indices so that each group's ``len(group) * max(length)`` is at most ``max_padding`` times
    its summed lengths (a single sequence always forms a group). Groups are longest first; inside a group the
    indices are ascending (their order in the batch)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for i in order:
        if current and (len(current) + 1) * longest > max_padding * (total + lengths[i]):
            buckets.append(sorted(current))
            current, total = [], 0
        if not current:
            longest = lengths[i]
        current.append(i)
        total += lengths[i]
    if current:
        buckets.append(sorted(current))
    return buckets


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges: Sequence[tuple[int, int]],
                            scale: float) -> torch.Tensor:
    """Each sequence's queries attend to all of that sequence's keys, and to no other sequence's.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (``Hq`` a multiple of ``Hkv``: grouped-query attention), one
            dtype.
        ranges: ``(start, end)`` rows of each sequence, disjoint and non-empty.
        scale: the softmax scale.

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype; rows outside every range are left uninitialized.
    """
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    lengths = [end - start for start, end in ranges]
    for bucket in length_buckets(lengths):
        starts = [ranges[i][0] for i in bucket]
        longest = max(lengths[i] for i in bucket)
        n = len(bucket)
        if all(lengths[i] == longest for i in bucket) and all(
                starts[j + 1] == starts[j] + longest for j in range(n - 1)):
            rows = slice(starts[0], starts[0] + n * longest)
            qb, kb, vb = (t[rows].view(n, longest, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qb, kb, vb, scale=scale, enable_gqa=gqa)
            out[rows].view(n, longest, *q.shape[1:]).copy_(o.transpose(1, 2))
            continue
        offsets = torch.arange(longest)
        lens = torch.tensor([lengths[i] for i in bucket])
        valid = offsets[None, :] < lens[:, None]  # [n, longest]
        # padding positions point at the sequence's first row; the mask hides them as keys
        index = torch.tensor(starts)[:, None] + torch.where(valid, offsets[None, :], 0)
        index, valid = index.to(q.device), valid.to(q.device)
        qb, kb, vb = (t[index].transpose(1, 2) for t in (q, k, v))  # [n, H, longest, D]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=valid[:, None, None, :], scale=scale,
                                           enable_gqa=gqa)
        out[index[valid]] = o.transpose(1, 2)[valid]
    return out
