"""Paged attention written with torch operations only (scaled_dot_product_attention); runs on any device.

KV cache layout per layer: ``[2, num_kv_heads, num_blocks, block_size, head_size]`` (keys, then values).
Head-major blocks make a request's gathered context ``[Hkv, S, D]`` contiguous, so the batched decode path
multiplies it directly (no transposing copy). Decodes (one query token each) are batched into two products over
the gathered, padded context; prefill chunks run one SDPA call per request
(:meth:`TorchPagedAttentionImpl.forward_prefill`), with the causal mask shifted by the request's cached prefix
(sliding windows and logit soft caps as masks / a float32 path, see :class:`TorchPagedAttentionImpl`); the
fresh prompts of a step (nothing cached before them) go through :meth:`TorchPagedAttentionImpl.forward_prefills`
together. A pure decode step reads only device tensors of the metadata (and ``max_query_len``),
so torch.compile can trace it (``supports_compile``). A prompt chunk holding a bidirectional span
(``AttentionMetadata.mm_prefix_ranges``, ``supports_mm_prefix``) attends with an explicit mask on torch's path,
never through the extension points below (their kernels know only causal masks); one-token queries need no
span (no key of their span comes after them).

A vendor kernel for one-token queries plugs in by subclassing :class:`TorchPagedAttentionImpl` and overriding
:meth:`TorchPagedAttentionImpl.forward_decode`, one for prompt chunks by overriding
:meth:`TorchPagedAttentionImpl.forward_prefill` (or, for all fresh prompts of a step in one call,
:meth:`TorchPagedAttentionImpl.forward_prefills`), and a cache-write kernel by overriding
:meth:`TorchPagedAttentionImpl.write_kv` (their contracts are in those docstrings); the cache layout and the
gathering of a cached prefix stay the torch ones. The CPU plugin's C++ kernels are such a
subclass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata
from tokenmill.attention.encoder_batches import bidirectional_attention, sequence_ranges
from tokenmill.attention.kv_cache_quant import SCALE_BYTES, dequantize_kv, kv_cache_row_size, quantize_kv


class TorchPagedAttentionBackend(AttentionBackend):
    name = "TORCH_PAGED"
    supports_compile = True
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_encoder_only = True
    supports_mm_prefix = True
    supported_quantized_kv_cache_dtypes = ("int8", "fp8_e4m3", "fp8_e5m2")  # kv_cache_quant's torch reference

    # get_impl_cls / get_kv_cache_shape: the AttentionBackend interface, which every backend spells out.
    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchPagedAttentionImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_size)


class TorchPagedAttentionImpl(AttentionImpl):
    """See the module docstring. With ``sliding_window`` the prefill path gathers the context from the block
    holding the oldest key any query of the chunk sees, and the decode path gathers only the
    ``ceil((W - 1) / block_size) + 1`` blocks that can hold the last ``W`` positions: blocks wholly outside the
    window are never read."""

    # Same signature as AttentionImpl.forward: the interface every backend implements.
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
            return self.forward_prefill(q, k, v)
        self.write_kv(k, v, kv_cache, attn_metadata.slot_mapping)
        if attn_metadata.max_query_len == 1:  # every request decodes one token
            return self.forward_decode(q, kv_cache, attn_metadata.block_table, attn_metadata.seq_lens,
                                       attn_metadata.block_size)
        out = torch.empty_like(q)
        qsl = attn_metadata.query_start_loc_cpu
        seq_lens = attn_metadata.seq_lens_cpu
        bs = attn_metadata.block_size
        decode_idx = [i for i in range(len(seq_lens)) if qsl[i + 1] - qsl[i] == 1]
        if decode_idx:
            self._batched_decode(q, out, kv_cache, attn_metadata, decode_idx)
            done = set(decode_idx)
        else:
            done = set()
        fresh: list[tuple[int, int]] = []  # prompt chunks with nothing cached before them
        prefix_ranges = attn_metadata.mm_prefix_ranges
        for i in range(len(seq_lens)):
            if i in done:
                continue
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            offset = seq_len - (end - start)  # position of the chunk's first query
            spans = bidirectional_spans(prefix_ranges[i], offset, seq_len) if prefix_ranges else []
            if offset == 0 and not spans:  # its own keys/values are the context
                fresh.append((start, end))
                continue
            first = 0 if self.sliding_window is None else max(0, offset - self.sliding_window + 1) // bs
            if offset == 0:
                k_ctx, v_ctx = k[start:end], v[start:end]
            else:  # a cache in another dtype (--kv-cache-dtype) is read back in q's
                k_ctx, v_ctx = gather_kv(kv_cache, attn_metadata.block_table[i], seq_len, bs, first_block=first,
                                         dtype=q.dtype, head_size=self.head_size)
            if spans:
                # the kernels behind forward_prefill know only causal masks: this chunk takes the torch path
                base = first * bs if offset else 0  # position of the context's first row
                shifted = [(a - base, b - base) for a, b in spans]
                o = self._sdpa(q[start:end], k_ctx, v_ctx, causal_offset=offset - base, spans=shifted)
                out[start:end] = o
            else:
                out[start:end] = self.forward_prefill(q[start:end], k_ctx, v_ctx).view(-1, *q.shape[1:])
        if fresh:
            self.forward_prefills(q, k, v, fresh, out.view(num_tokens, -1))
        return out.reshape(num_tokens, -1)

    def forward_encoder(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> torch.Tensor:
        """Bidirectional (encoder-only) attention: each sequence's tokens see all of that sequence's tokens and
        no other's; the KV cache is neither written nor read, so every sequence must be whole in this step.

        Args:
            query: ``[T, Hq * D]``; key, value: ``[T, Hkv * D]``.
            attn_metadata: the step's metadata (``None``: the whole batch is one sequence, the profiling pass).

        Returns:
            ``[T, Hq * D]`` in ``query``'s dtype.

        Raises:
            ValueError: a sequence continues a previous step (a chunked prompt: bidirectional attention needs
                the whole sequence at once).
        """
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        ranges = sequence_ranges(attn_metadata, num_tokens)
        return self.forward_bidirectional(q, k, v, ranges).reshape(num_tokens, -1)

    def forward_bidirectional(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Bidirectional attention of an encoder step's whole sequences: the extension point for a kernel that
        takes them all in one call (override it in a subclass, as :meth:`forward_prefills`). The default groups
        sequences of similar length into batched SDPA calls (``tokenmill.attention.encoder_batches``).

        Args:
            q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]``, one dtype, rows contiguous (any row stride).
            ranges: ``(start, end)`` rows of each sequence, disjoint and non-empty (the engine's cover all ``T``
                rows); query ``j`` of a sequence sees all of that sequence's rows and no other's.

        Returns:
            ``[T, Hq, D]`` (any strides) or ``[T, Hq * D]`` in ``q``'s dtype; rows outside every range are left
            uninitialized (a subclass may pass part of the sequences here and fill the other rows itself).
        """
        return bidirectional_attention(q, k, v, ranges, self.scale)

    def forward_prefills(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges: list[tuple[int, int]], out: torch.Tensor
    ) -> None:
        """Causal attention of a step's fresh prompt chunks (nothing cached before them, so each chunk's own keys
        and values are its whole context), all at once: the extension point for a kernel that takes many prompts
        in one call (override it in a subclass, as :meth:`forward_decode`). The default runs
        :meth:`forward_prefill` per chunk. Called once per layer of a prefill or mixed step (eagerly), after the
        decodes of the step and the chunks after a cached prefix have been written to ``out``.

        Args:
            q: ``[T, Hq, D]``, the step's queries, rows contiguous (any row stride), already rotated.
            k: ``[T, Hkv, D]``, the step's keys, in ``q``'s dtype.
            v: ``[T, Hkv, D]``, likewise.
            ranges: ``(start, end)`` rows of each fresh chunk, disjoint and non-empty; query ``j`` of a chunk sees
                the chunk's rows ``0 .. j`` (only the last ``sliding_window`` of them when the impl has one).
            out: ``[T, Hq * D]`` in ``q``'s dtype: write the rows of ``ranges``, leave the others.
        """
        for start, end in ranges:
            out[start:end] = self.forward_prefill(q[start:end], k[start:end], v[start:end])

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the step's keys and values in the cache, before any attention is computed: the extension point
        for a cache-write kernel (override it in a subclass, as :meth:`forward_decode`). Called once per layer and
        step, inside the compiled graph of pure decode steps (so an override must be traceable: a custom op that
        declares its mutation of ``kv_cache``). The default is :func:`write_kv_cache`.

        Args:
            k: ``[T, Hkv, D]`` in the model's dtype, rows contiguous (any row and head stride).
            v: ``[T, Hkv, D]``, likewise.
            kv_cache: ``[2, Hkv, num_blocks, block_size, R]`` in the cache's dtype (``--kv-cache-dtype``), ``R``
                being ``kv_cache_quant.kv_cache_row_size(D, dtype)``: an override quantizes as
                :func:`tokenmill.attention.kv_cache_quant.quantize_kv` (or leaves quantized caches to this
                default).
            slot_mapping: ``[T]`` int64: token ``t`` goes to row ``slot % block_size`` of block
                ``slot // block_size``.
        """
        write_kv_cache(k, v, kv_cache, slot_mapping)

    def forward_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of one request's prompt chunk over its context: the extension point for a prefill
        kernel (override it in a subclass, as :meth:`forward_decode`).

        The ``L`` queries are the last ``L`` positions of the ``S``-row context (``S == L`` for a fresh prompt;
        with a cached prefix the context is the prefix gathered from the cache, from the first block a sliding
        window can reach, followed by the chunk's own rows). Query ``t`` at position ``p = S - L + t`` attends to
        context rows ``0 .. p`` (only the last ``sliding_window`` of them when the impl has one); scores are
        ``self.scale * q . k`` (then ``c * tanh(s / c)`` with ``self.logits_soft_cap``); grouped-query attention
        maps query head ``h`` to KV head ``h // (Hq / Hkv)``. Called once per prefilling request in prefill and
        mixed steps (eagerly: those steps run attention as an opaque op), and for the whole batch of the
        memory-profiling pass, which has no cache.

        Args:
            q: ``[L, Hq, D]``, rows contiguous (any row stride), already rotated.
            k: ``[S, Hkv, D]`` in ``q``'s dtype, likewise.
            v: ``[S, Hkv, D]``, likewise.

        Returns:
            ``[L, Hq * D]`` in ``q``'s dtype.
        """
        return self._sdpa(q, k, v, causal_offset=k.shape[0] - q.shape[0]).reshape(q.shape[0], -1)

    def _mask(self, lq: int, lk: int, causal_offset: int, device: torch.device,
              spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """``[Lq, Lk]`` bool: query ``i`` (at ``causal_offset + i``) sees key ``j``; within each ``(start, end)``
        of ``spans`` (context rows) every query sees every key (before the sliding window applies)."""
        rows = torch.arange(lq, device=device).unsqueeze(1) + causal_offset
        cols = torch.arange(lk, device=device).unsqueeze(0)
        mask = cols <= rows
        for a, b in spans or ():
            mask |= (rows >= a) & (rows < b) & (cols >= a) & (cols < b)
        if self.sliding_window is not None:
            mask &= cols > rows - self.sliding_window
        return mask

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int,
              spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """Causal attention of ``q`` ``[Lq, Hq, D]`` over ``k``/``v`` ``[Lk, Hkv, D]``; query i sits at position
        ``causal_offset + i`` of the context; ``spans``: bidirectional context rows (see :meth:`_mask`)."""
        lq, lk = q.shape[0], k.shape[0]
        if self.logits_soft_cap is not None:
            return self._softcap_attention(q, k, v, self._mask(lq, lk, causal_offset, q.device, spans))
        # 4-D inputs: torch's fused CPU kernel (flash attention) accepts only [N, H, L, D]; 3-D inputs take the
        # unfused math path, 1.6x slower on 128-token prefills.
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        gqa = self.num_heads != self.num_kv_heads
        windowed = self.sliding_window is not None and causal_offset + lq > self.sliding_window
        if causal_offset == 0 and lq == lk and not windowed and not spans:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=gqa)
        elif lq == 1 and not windowed and not spans:
            o = F.scaled_dot_product_attention(qh, kh, vh, scale=self.scale, enable_gqa=gqa)
        else:
            mask = self._mask(lq, lk, causal_offset, q.device, spans)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)

    def _softcap_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention with ``c * tanh(s / c)`` scores (SDPA has no soft cap), in float32: ``[Lq, Hq, D]``."""
        lq = q.shape[0]
        hkv, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        qg = q.float().transpose(0, 1).reshape(hkv, group, lq, self.head_size)
        kh = k.float().transpose(0, 1).unsqueeze(1)  # [Hkv, 1, Lk, D]
        scores = torch.matmul(qg, kh.transpose(-1, -2)) * self.scale  # [Hkv, G, Lq, Lk]
        cap = self.logits_soft_cap
        scores = torch.tanh(scores / cap) * cap
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        o = torch.matmul(probs, v.float().transpose(0, 1).unsqueeze(1))  # [Hkv, G, Lq, D]
        return o.reshape(self.num_heads, lq, self.head_size).transpose(0, 1).to(q.dtype)

    def forward_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """Attention of one query token per request over its cached context: the extension point for a decode
        kernel (override it in a subclass; everything else stays the torch backend's).

        Called for every pure decode step and, batched, for the one-token queries of mixed steps, after the
        step's keys and values are already in the cache (the new token's included). Request ``i`` is row ``i``;
        its context is positions ``0 .. seq_lens[i] - 1`` (only the last ``sliding_window`` of them when the
        impl has one), stored at slot ``block_table[i, p // block_size] * block_size + p % block_size`` of this
        backend's layout ``[2, Hkv, num_blocks, block_size, D]`` (keys, then values). Scores are
        ``self.scale * q . k`` (then ``c * tanh(s / c)`` with ``self.logits_soft_cap``), softmax over the
        context, weighted sum of the values; grouped-query attention maps query head ``h`` to KV head
        ``h // (Hq / Hkv)``. An override must read only these device tensors (no host lists), so the step can
        be traced by torch.compile and captured in a device graph, and must not write the cache.

        Args:
            q: ``[B, Hq, D]`` in the model dtype, already rotated.
            kv_cache: this layer's cache, in the model dtype or in the ``--kv-cache-dtype`` (an override must
                accept both, or leave the dtypes it does not read to this default, which computes in ``q``'s
                dtype); a quantized cache's rows are ``kv_cache_quant.kv_cache_row_size(D, dtype)`` wide and read
                back with :func:`tokenmill.attention.kv_cache_quant.dequantize_kv`.
            block_table: ``[B, nb]`` int32; ``nb`` may exceed what a request needs (the extra columns are
                padding); the default reads every column (only the window's with ``sliding_window``) and masks
                positions ``>= seq_lens``.
            seq_lens: ``[B]`` int32, context length of each request (>= 1).
            block_size: tokens per block.

        Returns:
            ``[B, Hq * D]`` in ``q``'s dtype.
        """
        num, nb = block_table.shape
        hkv, group, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size
        lens = seq_lens.unsqueeze(1)
        if self.sliding_window is None:
            blocks = block_table.long()
            span = nb * block_size
            pos = torch.arange(span, device=q.device).unsqueeze(0)
            valid = pos < lens  # [B, S]
        else:
            window = self.sliding_window
            width = torch.sym_min(nb, (window + block_size - 2) // block_size + 1)
            first = torch.clamp(seq_lens.long() - window, min=0) // block_size
            cols = first.unsqueeze(1) + torch.arange(width, device=q.device)  # [B, width]
            blocks = block_table.gather(1, cols.clamp(max=nb - 1)).long()
            span = width * block_size
            pos = (cols.unsqueeze(-1) * block_size + torch.arange(block_size, device=q.device)).reshape(num, span)
            valid = (pos < lens) & (pos >= lens - window)
        row = kv_cache.shape[-1]  # D, or wider for a quantized cache's rows (kv_cache_row_size)
        k_ctx = kv_cache[0][:, blocks].view(hkv, num, span, row)  # [Hkv, B, S, R]
        v_ctx = kv_cache[1][:, blocks].view(hkv, num, span, row)
        if row != d or kv_cache.dtype != q.dtype:  # a cache in another dtype (--kv-cache-dtype): compute in q's
            compute = torch.float32 if torch.compiler.is_compiling() else q.dtype
            k_ctx, v_ctx = dequantize_kv(k_ctx, d, compute), dequantize_kv(v_ctx, d, compute)
        # Masked positions get probability 0, but 0 * NaN is NaN: values outside the context (block-table padding,
        # stale slots, possibly another request's blocks) must not reach the output even if they are not finite.
        v_ctx = v_ctx.masked_fill(~valid.view(1, num, span, 1), 0)
        qh = q.reshape(num, hkv, group, d).transpose(0, 1)  # [Hkv, B, G, D]
        cap = self.logits_soft_cap
        if torch.compiler.is_compiling():
            # Traced: as broadcast products and sums the compiler fuses with the gather into loops over the
            # cache, where small batched matmuls would each pay a library call.
            scores = (qh.float().unsqueeze(-2) * k_ctx.float().unsqueeze(2)).sum(-1) * self.scale
            if cap is not None:
                scores = torch.tanh(scores / cap) * cap
            scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = (probs.unsqueeze(-1) * v_ctx.float().unsqueeze(2)).sum(-2).transpose(0, 1)
            return o.reshape(num, self.num_heads * d).to(q.dtype)
        scores = torch.matmul(qh, k_ctx.transpose(-1, -2)).float() * self.scale  # [Hkv, B, G, S]
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v_ctx.dtype)
        o = torch.matmul(probs, v_ctx).transpose(0, 1)  # [B, Hkv, G, D]
        return o.reshape(num, self.num_heads * d).to(q.dtype)

    def _batched_decode(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        decode_idx: list[int],
    ) -> None:
        """The one-token queries of a mixed step, all at once through :meth:`forward_decode`, into ``out``."""
        nb = -(-max(md.seq_lens_cpu[i] for i in decode_idx) // md.block_size)
        idx = torch.tensor(decode_idx, device=q.device)
        tokens = md.query_start_loc[idx].long()
        o = self.forward_decode(q[tokens], kv_cache, md.block_table[idx, :nb], md.seq_lens[idx], md.block_size)
        out[tokens] = o.view(-1, self.num_heads, self.head_size)


def bidirectional_spans(ranges: list[tuple[int, int]], offset: int, seq_len: int) -> list[tuple[int, int]]:
    """The ``ranges`` (``(start, end)`` positions, :attr:`AttentionMetadata.mm_prefix_ranges`) that change a
    chunk's attention: those in which some query of the chunk ``[offset, seq_len)`` has a later key, clipped to
    the sequence so far (a span's keys past ``seq_len`` do not exist yet; the scheduler keeps a span's end in
    the chunk that reaches it)."""
    return [(a, min(b, seq_len)) for a, b in ranges if max(a, offset) < min(b, seq_len) - 1]


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` ``[T, Hkv, D]`` into the cache slots ``slot_mapping`` ``[T]`` (int64) of ``kv_cache``
    ``[2, Hkv, num_blocks, block_size, R]``, quantized when the cache is
    (:func:`tokenmill.attention.kv_cache_quant.quantize_kv`; ``R = kv_cache_row_size(D, kv_cache.dtype)``)."""
    num_kv_heads, head_size = k.shape[1], k.shape[2]
    # An indexed assignment (index_put_) rather than index_copy_: under torch.compile it stays an in-place
    # scatter, where index_copy_ on a view of the cache would copy the whole cache every step.
    flat = kv_cache.view(2, num_kv_heads, -1, kv_cache_row_size(head_size, kv_cache.dtype))
    flat[:, :, slot_mapping] = quantize_kv(torch.stack((k, v)).transpose(1, 2), kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int, block_size: int, first_block: int = 0,
    dtype: torch.dtype | None = None, head_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached keys and values of one request from block ``first_block`` up to position ``seq_len``, each
    ``[seq_len - first_block * block_size, Hkv, R]`` as stored (``R``: the cache's row, ``D`` for a float cache);
    earlier blocks are not read. With ``dtype``: ``[..., Hkv, D]`` in ``dtype``, a quantized cache's rows read
    back (:func:`tokenmill.attention.kv_cache_quant.dequantize_kv`; ``head_size`` ``D`` is needed only for an
    ``int8`` cache whose ``D`` is not a multiple of 4, else it is ``R - 4``)."""
    nb = -(-seq_len // block_size)
    blocks = block_row[first_block:nb].long()
    num_kv_heads, row = kv_cache.shape[1], kv_cache.shape[-1]
    n = seq_len - first_block * block_size
    k = kv_cache[0][:, blocks].view(num_kv_heads, -1, row)[:, :n]
    v = kv_cache[1][:, blocks].view(num_kv_heads, -1, row)[:, :n]
    if dtype is not None:
        d = head_size or (row - SCALE_BYTES if kv_cache.dtype == torch.int8 else row)
        k, v = dequantize_kv(k, d, dtype), dequantize_kv(v, d, dtype)
    return k.transpose(0, 1), v.transpose(0, 1)
