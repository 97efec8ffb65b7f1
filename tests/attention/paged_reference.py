"""Helpers shared by the attention tests: random paged batches and a float64 reference attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionMetadata


@dataclass
class PagedBatch:
    """A random batch of requests whose whole context (cached prefix + new tokens) is in a paged cache.

    Attributes:
        q: ``[T, Hq, D]`` queries of the new tokens.
        k_full, v_full: per request, ``[seq_len, Hkv, D]`` keys/values of every position (prefix + new).
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]``; every slot not holding a request's token is NaN.
        md: the step's metadata.
    """

    q: torch.Tensor
    k_full: list[torch.Tensor]
    v_full: list[torch.Tensor]
    kv_cache: torch.Tensor
    md: AttentionMetadata


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    fill_cache: bool = True,
    poison: float = float("nan"),
) -> PagedBatch:
    """Random requests; request ``r`` has ``seq_lens[r]`` tokens of which the last ``q_lens[r]`` are new.

    Blocks are assigned in random order; every cache slot that holds no token of a request is ``poison``
    (NaN by default, so reading one shows in the output) and block-table padding points at such a block. With ``fill_cache`` the
    new tokens' keys/values are in the cache too (as after ``reshape_and_cache``); otherwise only the prefix.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 stays poison (padding target)
    max_blocks = max(blocks_per_req) + 2
    block_table = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), poison, dtype=dtype)
    k_full, v_full, slots = [], [], []
    used = 0
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        assert 1 <= q_len <= seq_len
        ids = perm[used : used + blocks_per_req[r]]
        used += blocks_per_req[r]
        block_table[r, : len(ids)] = ids.int()
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=g).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=g).to(dtype)
        pos = torch.arange(seq_len)
        slot = ids.long()[pos // block_size] * block_size + pos % block_size
        keep = seq_len if fill_cache else seq_len - q_len
        kv_cache[0].view(-1, num_kv_heads, head_size)[slot[:keep]] = k[:keep]
        kv_cache[1].view(-1, num_kv_heads, head_size)[slot[:keep]] = v[:keep]
        k_full.append(k)
        v_full.append(v)
        slots.append(slot[seq_len - q_len :])
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], num_heads, head_size, generator=g).to(dtype)
    md = AttentionMetadata(
        num_actual_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.cat(slots),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
        block_size=block_size,
    )
    return PagedBatch(q=q, k_full=k_full, v_full=v_full, kv_cache=kv_cache, md=md)


def new_kv(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the new tokens, flattened like the queries: ``[T, Hkv, D]`` each."""
    qsl, sl = batch.md.query_start_loc_cpu, batch.md.seq_lens_cpu
    ks, vs = [], []
    for r in range(len(sl)):
        q_len = qsl[r + 1] - qsl[r]
        ks.append(batch.k_full[r][sl[r] - q_len :])
        vs.append(batch.v_full[r][sl[r] - q_len :])
    return torch.cat(ks), torch.cat(vs)


def reference_attention(
    batch: PagedBatch, scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    spans: list[list[tuple[int, int]]] | None = None,
) -> torch.Tensor:
    """Plain softmax attention in float64 from the full per-request keys/values: ``[T, Hq, D]`` float64.

    Query ``i`` of a request with ``q_len`` new and ``seq_len`` total tokens sits at ``p = seq_len - q_len + i``
    and sees keys ``0 .. p`` (with ``sliding_window`` W: keys ``j`` with ``p - W < j <= p``). With ``soft_cap``
    c the scaled scores become ``c * tanh(s / c)`` before the mask (Gemma 2). ``spans``: per request,
    ``(start, end)`` positions within which every query also sees the later keys (still within the window:
    transformers' Gemma 3 image mask).
    """
    qsl, sl = batch.md.query_start_loc_cpu, batch.md.seq_lens_cpu
    num_heads = batch.q.shape[1]
    out = torch.empty(batch.q.shape, dtype=torch.float64)
    for r in range(len(sl)):
        s, e, seq_len = qsl[r], qsl[r + 1], sl[r]
        q = batch.q[s:e].double()
        group = num_heads // batch.k_full[r].shape[1]
        k = batch.k_full[r].double().repeat_interleave(group, dim=1)
        v = batch.v_full[r].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        pos = torch.arange(e - s) + seq_len - (e - s)
        hidden = torch.arange(seq_len)[None, None, :] > pos[None, :, None]
        for a, b in spans[r] if spans else ():
            keys = torch.arange(seq_len)
            hidden &= ~(((pos >= a) & (pos < b))[None, :, None] & ((keys >= a) & (keys < b))[None, None, :])
        if sliding_window is not None:
            hidden |= torch.arange(seq_len)[None, None, :] <= pos[None, :, None] - sliding_window
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|`` (NaN-propagating)."""
    return float((out.double() - ref).abs().max() / ref.abs().max())


# A mixed batch: pure prefill, decodes, a chunk on a cached prefix, a one-token sequence, a short prefill.
MIXED_Q_LENS = [7, 1, 5, 1, 3, 1]
MIXED_SEQ_LENS = [7, 19, 40, 1, 3, 33]


def poison_outside_window(batch: PagedBatch, sliding_window: int, value: float = float("nan")) -> int:
    """Fill every cache block that lies wholly before the sliding window of all of its request's queries with
    ``value`` (NaN: a kernel that reads one shows it in its output). Returns how many blocks were poisoned.

    The cache here is make_batch's ``[2, num_blocks, block_size, Hkv, D]``.
    """
    md, poisoned = batch.md, 0
    for r, seq_len in enumerate(md.seq_lens_cpu):
        q_len = md.query_start_loc_cpu[r + 1] - md.query_start_loc_cpu[r]
        oldest = max(0, seq_len - q_len - sliding_window + 1)  # oldest key the first query sees
        for j in range(oldest // md.block_size):
            batch.kv_cache[:, int(md.block_table[r, j])] = value
            poisoned += 1
    return poisoned
