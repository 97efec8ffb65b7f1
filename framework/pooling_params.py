"""PoolingParams: what a pooling request (embedding, classification, scoring) wants from its prompt.

Field names and meaning follow vLLM's ``PoolingParams``. A request carries either SamplingParams (it
generates) or PoolingParams (it only runs its prompt, and the model's pooler turns the hidden states into one
output). Invalid values raise :class:`PoolingParamsError`, an ``InvalidRequestError`` whose ``param`` names the
field (the OpenAI server turns it into a 400).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from tokenmill.errors import InvalidRequestError

PoolingTask = Literal["embed", "classify", "score", "encode"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "score", "encode")


class PoolingParamsError(InvalidRequestError):
    """A pooling parameter is invalid; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}", param=param)


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to pool one prompt.

    Attributes:
        task: ``"embed"`` (one normalized vector), ``"classify"`` (class probabilities), ``"score"`` (one
            relevance score of a text pair) or ``"encode"`` (the pooler's raw output, e.g. per-token states
            with ALL pooling). ``None``: the engine's default task for its model.
        normalize: L2-normalize embeddings (``None``: the model's default, normally true).
        dimensions: keep only the first ``dimensions`` values of an embedding, then normalize (Matryoshka
            representation learning). Refused for models that do not declare Matryoshka support.
        activation: apply the classifier's activation (softmax over several labels, sigmoid over one) to
            ``classify``/``score`` outputs (``None``: yes).
        truncate_prompt_tokens: keep only the last ``k`` prompt tokens (``-1``: the model's context length);
            without it, a prompt longer than the context length is refused.
    """

    task: PoolingTask | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise PoolingParamsError("task", f"must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise PoolingParamsError("dimensions", f"must be a positive integer, got {self.dimensions!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or (k < 1 and k != -1)):
            raise PoolingParamsError("truncate_prompt_tokens", f"must be -1 or a positive integer, got {k!r}")

    def with_task(self, task: PoolingTask) -> PoolingParams:
        """A copy for ``task`` (``task`` already set to something else is an error).

        Raises:
            PoolingParamsError: ``task`` was set to a different task.
        """
        if self.task is not None and self.task != task:
            raise PoolingParamsError("task", f"these parameters are for {self.task!r}, not {task!r}")
        return msgspec.structs.replace(self, task=task)
