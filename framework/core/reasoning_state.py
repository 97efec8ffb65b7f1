"""ReasoningState: where a reasoning model's request stands in its thinking (engine side).

The front end sends the end-of-thinking marker's token ids (:class:`tokenmill.sampling_params.ReasoningParams`).
The scheduler feeds every generated token here: until the marker has been generated the request's grammar is
neither enforced nor advanced, and once ``thinking_token_budget`` thinking tokens are spent the marker's tokens
are forced, one per step, through the request's bitmask row.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.sampling_params import ReasoningParams


class ReasoningState:
    """Args:
        params: the request's end marker and budget.

    Attributes:
        ended: the end marker has been generated (the answer is being generated).
        num_thinking_tokens: tokens generated before the end marker, the marker included.
    """

    def __init__(self, params: ReasoningParams) -> None:
        self.end_token_ids = list(params.end_token_ids)
        self.budget = params.thinking_token_budget
        self.ended = False
        self.num_thinking_tokens = 0

    def observe(self, output_token_ids: Sequence[int]) -> bool:
        """Note the output's newest token (``output_token_ids``: all generated ids, the new one last).

        Returns:
            True when this token completes the end marker (it belongs to the thinking: no grammar sees it).
        """
        if self.ended:
            return False
        self.num_thinking_tokens += 1
        n = len(self.end_token_ids)
        if len(output_token_ids) >= n and list(output_token_ids[-n:]) == self.end_token_ids:
            self.ended = True
            return True
        return False

    def forced_token(self, output_token_ids: Sequence[int]) -> int | None:
        """The token the next step must produce because the budget is spent (the next token of the end marker,
        continuing a part of it the output already ends with), else ``None``."""
        if self.ended or self.budget is None or self.num_thinking_tokens < self.budget:
            return None
        ids = self.end_token_ids
        for k in range(min(len(ids) - 1, len(output_token_ids)), 0, -1):
            if list(output_token_ids[-k:]) == ids[:k]:
                return ids[k]
        return ids[0]

    @property
    def constrains_sampling(self) -> bool:
        """Whether this state may still force tokens (a budget not yet reached its end)."""
        return not self.ended and self.budget is not None
