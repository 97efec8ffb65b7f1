"""Paged attention written with torch operations only (scaled_dot_product_attention); runs on any device.

KV cache layout per layer: ``[2, num_kv_heads, num_blocks, block_size, head_size]`` (keys, then values).
Head-major blocks make a request's gathered context ``[Hkv, S, D]`` contiguous, so the batched decode path
multiplies it directly (no transposing copy). Decodes (one query token each) are batched into two products over
the gathered, padded context; prefill chunks run one SDPA call per request with the causal mask shifted by the
request's cached prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata


class TorchPagedAttentionBackend(AttentionBackend):
    name = "TORCH_PAGED"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchPagedAttentionImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_size)


class TorchPagedAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        if attn_metadata is None:
            out = self._sdpa(q, k, v, causal_offset=0)
            return out.reshape(num_tokens, -1)
        write_kv_cache(k, v, kv_cache, attn_metadata.slot_mapping)
        out = torch.empty_like(q)
        qsl = attn_metadata.query_start_loc_cpu
        seq_lens = attn_metadata.seq_lens_cpu
        decode_idx = [i for i in range(len(seq_lens)) if qsl[i + 1] - qsl[i] == 1]
        if decode_idx:
            self._batched_decode(q, out, kv_cache, attn_metadata, decode_idx)
            done = set(decode_idx)
        else:
            done = set()
        for i in range(len(seq_lens)):
            if i in done:
                continue
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            if seq_len == end - start:  # nothing cached before this chunk: its own keys/values are the context
                k_ctx, v_ctx = k[start:end], v[start:end]
            else:
                k_ctx, v_ctx = gather_kv(kv_cache, attn_metadata.block_table[i], seq_len, attn_metadata.block_size)
            out[start:end] = self._sdpa(q[start:end], k_ctx, v_ctx, causal_offset=seq_len - (end - start))
        return out.reshape(num_tokens, -1)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int) -> torch.Tensor:
        """Causal attention of ``q`` ``[Lq, Hq, D]`` over ``k``/``v`` ``[Lk, Hkv, D]``; query i sits at position
        ``causal_offset + i`` of the context."""
        lq, lk = q.shape[0], k.shape[0]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        gqa = self.num_heads != self.num_kv_heads
        if causal_offset == 0 and lq == lk:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=gqa)
        elif lq == 1:
            o = F.scaled_dot_product_attention(qh, kh, vh, scale=self.scale, enable_gqa=gqa)
        else:
            rows = torch.arange(lq, device=q.device).unsqueeze(1) + causal_offset
            mask = torch.arange(lk, device=q.device).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return o.transpose(0, 1)

    def _batched_decode(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        decode_idx: list[int],
    ) -> None:
        """All one-token queries at once: gather each request's blocks, then two batched products.

        Grouped-query heads are handled by viewing the ``Hq`` query heads as ``[Hkv, Hq // Hkv]`` (no
        repetition of keys/values); positions past a request's length are masked before the softmax.
        """
        bs = md.block_size
        num = len(decode_idx)
        nb = -(-max(md.seq_lens_cpu[i] for i in decode_idx) // bs)
        if num == md.num_reqs:  # a pure decode step: request i is token i
            blocks, lens, qd = md.block_table[:, :nb], md.seq_lens, q
        else:
            idx = torch.tensor(decode_idx, device=q.device)
            tokens = md.query_start_loc[idx].long()
            blocks, lens, qd = md.block_table[idx, :nb], md.seq_lens[idx], q[tokens]
        blocks = blocks.long()
        span = nb * bs
        hkv, group, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size
        k_ctx = kv_cache[0][:, blocks].view(hkv, num, span, d)  # [Hkv, B, S, D]
        v_ctx = kv_cache[1][:, blocks].view(hkv, num, span, d)
        qh = qd.reshape(num, hkv, group, d).transpose(0, 1).to(k_ctx.dtype)  # [Hkv, B, G, D]
        scores = torch.matmul(qh, k_ctx.transpose(-1, -2)).float() * self.scale  # [Hkv, B, G, S]
        valid = torch.arange(span, device=q.device).unsqueeze(0) < lens.unsqueeze(1)  # [B, S]
        scores.masked_fill_(~valid[None, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v_ctx.dtype)
        o = torch.matmul(probs, v_ctx).transpose(0, 1).reshape(num, self.num_heads, d)  # [B, Hq, D]
        if num == md.num_reqs:
            out.copy_(o)
        else:
            out[tokens] = o.to(out.dtype)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` ``[T, Hkv, D]`` into the cache slots ``slot_mapping`` ``[T]`` (int64)."""
    num_kv_heads, head_size = k.shape[1], k.shape[2]
    kv_cache[0].view(num_kv_heads, -1, head_size).index_copy_(1, slot_mapping, k.transpose(0, 1).to(kv_cache.dtype))
    kv_cache[1].view(num_kv_heads, -1, head_size).index_copy_(1, slot_mapping, v.transpose(0, 1).to(kv_cache.dtype))


def gather_kv(
    kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` cached keys and values of one request, each ``[seq_len, Hkv, D]``."""
    nb = -(-seq_len // block_size)
    blocks = block_row[:nb].long()
    num_kv_heads, head_size = kv_cache.shape[1], kv_cache.shape[-1]
    k = kv_cache[0][:, blocks].view(num_kv_heads, nb * block_size, head_size)[:, :seq_len]
    v = kv_cache[1][:, blocks].view(num_kv_heads, nb * block_size, head_size)[:, :seq_len]
    return k.transpose(0, 1), v.transpose(0, 1)
