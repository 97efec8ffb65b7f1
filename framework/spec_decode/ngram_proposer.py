"""N-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method): no extra model.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens of the sequence are looked
for earlier in the sequence (prompt and outputs); the (up to K) tokens that followed the latest occurrence
with K tokens after it (else the earliest occurrence) are the proposal. The longest matching n wins. Tasks that copy from their context (quoting,
editing, summarising with citations, code changes) accept many of these drafts; free-form text accepts few.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Proposes draft tokens by n-gram lookup in the request's own tokens.

    Args:
        num_speculative_tokens: K, most tokens proposed.
        prompt_lookup_min: shortest n-gram matched.
        prompt_lookup_max: longest n-gram matched.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Draft tokens that continue ``token_ids`` (possibly none).

        Args:
            token_ids: the sequence so far (prompt + outputs).
            max_tokens: most tokens to propose (default K).

        Returns:
            0 to ``min(K, max_tokens)`` token ids.
        """
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = arr[length - n :]
            # windows starting at 0 .. length - n - 1: each is followed by at least one token
            windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                # the latest occurrence with K tokens after it; else the earliest (the longest continuation)
                full = hits[hits + n + k <= length]
                start = int(full[-1] if full.size else hits[0]) + n
                return arr[start : start + k].tolist()
        return []
