"""Scoring helpers shared by ``LLM.score`` and the ``/score`` and ``/rerank`` routes: pairing the two sides
(1:1, 1:N, N:N, as vLLM's score API pairs them) and cosine similarity for bi-encoders."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenmill.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch


def make_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str], param_1: str = "text_1",
               param_2: str = "text_2") -> list[tuple[str, str]]:
    """The text pairs to score: one left text against every right text (1:1, 1:N), or N left texts each
    against the right text at the same index (N:N).

    Raises:
        InvalidRequestError: an empty side, or N left texts against M != N right texts.
    """
    left = [data_1] if isinstance(data_1, str) else list(data_1)
    right = [data_2] if isinstance(data_2, str) else list(data_2)
    if not left:
        raise InvalidRequestError(f"{param_1}: at least one text is needed", param=param_1)
    if not right:
        raise InvalidRequestError(f"{param_2}: at least one text is needed", param=param_2)
    if len(left) == 1:
        return [(left[0], r) for r in right]
    if len(left) != len(right):
        raise InvalidRequestError(
            f"{param_2}: {len(left)} texts in {param_1} need 1 or {len(left)} texts here, got {len(right)}",
            param=param_2,
        )
    return list(zip(left, right))


def pair_token_ids(tokenizer: Any, text_1: str, text_2: str) -> list[int]:
    """A cross-encoder's input for a pair: the tokenizer's own pair encoding (separator tokens included)."""
    return list(tokenizer(text_1, text_2)["input_ids"])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two ``[d]`` float tensors."""
    import torch  # the API server imports this module and starts without torch

    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))
