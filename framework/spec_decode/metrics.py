"""Speculative-decoding counters: drafts proposed and accepted (vLLM's ``spec_decode_*`` metrics).

Definitions (per engine core, since the last stats message):

* ``num_drafts``: verification steps of requests that had draft tokens (one per request and step);
* ``num_draft_tokens``: draft tokens verified;
* ``num_accepted_tokens``: of those, accepted;
* ``num_accepted_tokens_per_pos[j]``: drafts accepted at position ``j`` (0-based) of their step.

Derived: acceptance rate ``num_accepted_tokens / num_draft_tokens``; mean acceptance length
``1 + num_accepted_tokens / num_drafts`` (tokens a verification step yields, the bonus or replacement token
counted, as vLLM reports it).
"""

from __future__ import annotations

import msgspec


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        return cls(num_spec_tokens=num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification step: ``num_draft_tokens`` drafts, the first ``num_accepted_tokens`` taken."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for j in range(min(num_accepted_tokens, len(per_pos))):
            per_pos[j] += 1

    def take(self) -> SpecDecodingStats:
        """These counts, resetting this object to zero."""
        out = SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        return out

    def add(self, other: SpecDecodingStats) -> None:
        """Accumulate ``other`` into this object."""
        self.num_spec_tokens = max(self.num_spec_tokens, other.num_spec_tokens)
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for j, v in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[j] += v

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
