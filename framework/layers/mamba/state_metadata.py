"""What the state layers of a hybrid model read each step: which state slot each request of the batch uses.

The model runner builds one :class:`StateMetadata` per step (shared by every state layer) and passes it in the
forward context (``ForwardContext.state_metadata``); model code never passes it around.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StateMetadata:
    """The step's requests in batch order.

    Attributes:
        query_start_loc: ``B + 1`` host ints, request ``r``'s tokens are rows ``[q[r], q[r + 1])`` of the batch.
        state_slots: ``B`` host ints, the state slot of each request.
        has_initial_state: ``B`` bools, whether the request's slot holds the state after its earlier tokens
            (a later prefill chunk or a decode) rather than stale contents (its first chunk starts from zeros).
        decode_rows: batch indices ``r`` of the requests that run one token from an existing state, run
            together through the one-step ops; every other request runs its tokens through the prefill ops.
        decode_token_index: ``[len(decode_rows)]`` int64 on the device, the batch row of each decode token.
        decode_slots: ``[len(decode_rows)]`` int64 on the device, their state slots.
    """

    query_start_loc: list[int]
    state_slots: list[int]
    has_initial_state: list[bool]
    decode_rows: list[int]
    decode_token_index: torch.Tensor
    decode_slots: torch.Tensor

    @classmethod
    def build(cls, query_start_loc: list[int], state_slots: list[int], num_computed_tokens: list[int],
              device: torch.device) -> StateMetadata:
        """From the batch layout, each request's slot and its tokens computed before this step."""
        has_init = [n > 0 for n in num_computed_tokens]
        decode_rows = [r for r in range(len(state_slots))
                       if has_init[r] and query_start_loc[r + 1] - query_start_loc[r] == 1]
        return cls(
            query_start_loc=list(query_start_loc),
            state_slots=list(state_slots),
            has_initial_state=has_init,
            decode_rows=decode_rows,
            decode_token_index=torch.tensor([query_start_loc[r] for r in decode_rows], dtype=torch.int64,
                                            device=device),
            decode_slots=torch.tensor([state_slots[r] for r in decode_rows], dtype=torch.int64, device=device),
        )
