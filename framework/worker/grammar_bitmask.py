"""Applying the scheduler's structured-output bitmask to a step's logits (portable torch, any device)."""

from __future__ import annotations

import numpy as np
import torch

_NEG_INF = float("-inf")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, W]`` int32 packed masks -> ``[R, vocab_size]`` bool, True where the token is allowed.

    Bit ``t % 32`` of word ``t // 32`` stands for token ``t``; ids at or beyond ``32 * W`` are not allowed.
    """
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - bits.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([bits, pad], dim=1)


def apply_grammar_bitmask(
    logits: torch.Tensor,
    row_req_ids: list[str],
    bitmask: np.ndarray,
    bitmask_req_ids: list[str],
) -> torch.Tensor:
    """Set the logits of tokens a request's grammar forbids to -inf, in place.

    Args:
        logits: ``[B, V]`` logits of the rows that sample this step (any float dtype).
        row_req_ids: the request of each row of ``logits``, in batch order.
        bitmask: ``[K, ceil(V / 32)]`` int32 from the scheduler, one row per constrained request.
        bitmask_req_ids: the request of each row of ``bitmask``.

    Rows of requests without a bitmask row are left untouched (bit for bit). Returns ``logits``.
    """
    where = {req_id: i for i, req_id in enumerate(bitmask_req_ids)}
    logit_rows: list[int] = []
    mask_rows: list[int] = []
    for row, req_id in enumerate(row_req_ids):
        i = where.get(req_id)
        if i is not None:
            logit_rows.append(row)
            mask_rows.append(i)
    if not logit_rows:
        return logits
    packed = torch.from_numpy(np.ascontiguousarray(bitmask[mask_rows])).to(logits.device)
    allowed = unpack_bitmask(packed, logits.shape[1])
    rows = torch.tensor(logit_rows, dtype=torch.int64, device=logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, _NEG_INF)
    return logits
