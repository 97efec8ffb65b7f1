"""The model contract: what a model class registered in :class:`tokenmill.ModelRegistry` must provide.

Written out for plugin authors in ``docs/plugins.md`` ("The model contract"). The engine builds the model as
``model_cls(model_config)`` under ``torch.device(device)`` with the default dtype set to the model dtype, feeds it
the checkpoint through :meth:`CausalLM.load_weights`, then calls :meth:`CausalLM.forward` once per step and
:meth:`CausalLM.compute_logits` on the rows that sample.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

REQUIRED_METHODS = ("forward", "compute_logits", "load_weights")


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model as the engine runs it (a ``torch.nn.Module``).

    ``__init__(self, config: ModelConfig, prefix: str = "")``: ``config.hf_config`` is the transformers config
    of the checkpoint, ``config.max_model_len`` the longest sequence, ``config.dtype`` the model dtype. Build every
    layer from :mod:`tokenmill.plugin_api` (``Attention`` for the paged attention itself) and the model runs on
    every platform, with tensor parallelism.
    """

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One engine step over a flattened batch.

        Args:
            input_ids: ``[T]`` int64, the scheduled tokens of every request of the step, request after request,
                no padding (prefill chunks and decode tokens mixed).
            positions: ``[T]`` int64, each token's position in its sequence.

        Returns:
            ``[T, hidden]`` hidden states in the model dtype. Attention layers read the step's paging metadata
            from the forward context, never from arguments.
        """
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` (the rows that sample or need prompt logprobs) -> ``[N, vocab]`` logits (any float
        dtype; the sampler widens them)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names, full unsharded tensors, CPU) into the parameters.

        Returns:
            The names (as in ``named_parameters()``) of every parameter filled; the loader reports the ones
            left out as an error.
        """
        ...


def check_model_class(cls: Any) -> None:
    """Raises:
    TypeError: ``cls`` is not a ``torch.nn.Module`` subclass or lacks a method of the contract (the message
        names the class and the method).
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise TypeError(f"model class {cls!r} must be a torch.nn.Module subclass (see the model contract in "
                        "docs/plugins.md)")
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(f"model class {cls.__module__}.{cls.__qualname__} lacks {', '.join(missing)} of the model "
                        "contract (see docs/plugins.md)")
