"""Per-request logits processors that requests name in the tests (``--logits-processor-pattern``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def only_token(token_id: int) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
    """A factory: the processor it makes leaves ``token_id`` as the only possible token."""

    def processor(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        masked = torch.full_like(logits, float("-inf"))
        masked[token_id] = logits[token_id]
        return masked

    return processor


def after_prompt(prompt_token_ids: list[int], output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """The three-argument form: repeats the prompt's last token."""
    return only_token(prompt_token_ids[-1])(output_token_ids, logits)


def failing_factory(reason: str) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
    raise ValueError(reason)
