"""The model contract: what a model class registered in :class:`tokenmill.ModelRegistry` must provide.

Written out for plugin authors in ``docs/plugins.md`` ("The model contract"). The engine builds the model as
``model_cls(model_config)`` under ``torch.device(device)`` with the default dtype set to the model dtype, feeds it
the checkpoint through :meth:`CausalLM.load_weights`, then calls :meth:`CausalLM.forward` once per step and
:meth:`CausalLM.compute_logits` on the rows that sample.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

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


@runtime_checkable
class SupportsMultiModal(Protocol):
    """A model that also takes images (vLLM's ``SupportsMultiModal``), on top of :class:`CausalLM`.

    The engine calls the class methods in the front end (before any model is built) to turn the Hugging Face
    processor's output into per-image inputs and placeholder ranges, and the instance methods in the worker. Its
    :meth:`forward` takes ``inputs_embeds`` (``[T, hidden]``) instead of looking ``input_ids`` up when given.
    Optional: a class method ``build_hf_processor(model_config)`` (a callable taking ``text=[prompt],
    images=[...]`` and returning ``input_ids`` ``[1, L]`` plus the image tensors) replaces
    ``transformers.AutoProcessor``; ``uses_mrope = True`` with ``get_mrope_input_positions(token_ids, mm_features)
    -> ([3, P] int64 positions, delta)`` makes the worker pass ``[3, T]`` positions (M-RoPE). Documented for
    plugin authors in ``docs/multimodal.md``.
    """

    supports_multimodal: ClassVar[bool]

    @classmethod
    def get_image_token_id(cls, hf_config: Any) -> int:
        """The token id the processor repeats for each of an image's embeddings (Llava's ``<image>``)."""
        ...

    @classmethod
    def split_image_inputs(cls, hf_config: Any, processed: Mapping[str, torch.Tensor], num_images: int
                           ) -> list[dict[str, torch.Tensor]]:
        """The processor's batched image tensors (``pixel_values`` ``[N, 3, H, W]``, ...) -> one dict per image,
        in prompt order, of what :meth:`get_multimodal_embeddings` takes for it.

        Raises:
            ValueError: the tensors do not hold ``num_images`` images.
        """
        ...

    @classmethod
    def get_num_image_tokens(cls, hf_config: Any, item: Mapping[str, torch.Tensor]) -> int:
        """How many placeholder tokens (= embedding rows) the image ``item`` takes in the prompt."""
        ...

    def get_multimodal_embeddings(self, **item: torch.Tensor) -> torch.Tensor:
        """Run the vision encoder and projector on one image (its tensors from :meth:`split_image_inputs`, on the
        model's device): ``[get_num_image_tokens(item), hidden]`` in the model dtype."""
        ...

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 -> ``[T, hidden]`` text embeddings (what :meth:`forward` would look up)."""
        ...


def supports_multimodal(model: Any) -> bool:
    """Whether a model class or instance declares the :class:`SupportsMultiModal` contract."""
    return bool(getattr(model, "supports_multimodal", False))


def merge_multimodal_embeddings(inputs_embeds: torch.Tensor, rows: torch.Tensor,
                                embeddings: Sequence[torch.Tensor]) -> torch.Tensor:
    """Write image embeddings over the text embeddings of their placeholder tokens.

    Args:
        inputs_embeds: ``[T, hidden]`` the step's text embeddings (changed in place and returned).
        rows: ``[N]`` int64, the batch rows the embeddings fill, in order.
        embeddings: pieces whose rows, concatenated, are ``[N, hidden]``.

    Raises:
        ValueError: the embeddings do not have ``N`` rows.
    """
    if not embeddings:
        return inputs_embeds
    values = torch.cat(list(embeddings)) if len(embeddings) > 1 else embeddings[0]
    if values.shape[0] != rows.shape[0]:
        raise ValueError(f"{values.shape[0]} image embedding rows for {rows.shape[0]} placeholder positions")
    inputs_embeds[rows] = values.to(inputs_embeds.dtype)
    return inputs_embeds


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
