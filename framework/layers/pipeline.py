"""Pipeline-parallel building blocks for models: the layer range of a stage, placeholders for the layers a
stage does not hold, and the tensors passed from one stage to the next.

A model supports pipeline parallelism (``--pipeline-parallel-size N``) when (see docs/distributed.md):

* it sets the class attribute ``supports_pp = True``;
* it builds its decoder layers with :func:`make_layers` (layers outside this stage's range become
  :class:`PPMissingLayer`), and its embedding only on the first stage, its final norm and LM head only on
  the last (``PPMissingLayer`` elsewhere);
* ``forward(input_ids, positions, intermediate_tensors=None)`` takes the previous stage's
  :class:`IntermediateTensors` on every stage but the first, and returns ``IntermediateTensors`` on every
  stage but the last (hidden states ``[num_tokens, hidden]`` there, as without pipeline parallelism);
* ``make_empty_intermediate_tensors(num_tokens, dtype, device)`` gives receive buffers of the shapes its
  stages send (:func:`make_empty_intermediate_tensors_factory` builds one);
* ``load_weights`` skips checkpoint tensors of layers this stage does not hold
  (:func:`is_pp_missing_parameter`).

The layer split follows vLLM's default: ``num_layers // N`` layers per stage, the remainder spread one each
over the first stages, so the last stage (which also runs the LM head) is never the largest. The
environment variable ``TOKENMILL_PP_LAYER_PARTITION="5,3"`` sets the layers per stage explicitly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.distributed import get_pp_group

PP_LAYER_PARTITION_ENV = "TOKENMILL_PP_LAYER_PARTITION"


@dataclass
class IntermediateTensors:
    """What a non-last pipeline stage hands the next one: named tensors, all ``[num_tokens, ...]``.

    Attributes:
        tensors: e.g. ``{"hidden_states": [T, hidden], "residual": [T, hidden]}`` for a pre-norm decoder.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def items(self):  # noqa: ANN201 - dict view
        return self.tensors.items()


class PPMissingLayer(nn.Identity):
    """Stands in for a layer that lives on another pipeline stage: no parameters, passes its first input
    through (never called on a correct stage split)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return args[0] if args else next(iter(kwargs.values()))


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``[start, end)`` of the decoder layers on stage ``pp_rank`` of ``pp_size``.

    Raises:
        ValueError: more stages than layers, or a ``TOKENMILL_PP_LAYER_PARTITION`` that does not name
            ``pp_size`` positive counts summing to ``num_layers``.
    """
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size: {pp_size} stages but the model has only {num_layers} layers")
    text = os.environ.get(PP_LAYER_PARTITION_ENV)
    if text:
        try:
            counts = [int(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"{PP_LAYER_PARTITION_ENV}: expected comma-separated integers, got {text!r}") from None
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"{PP_LAYER_PARTITION_ENV}={text!r}: needs {pp_size} positive layer counts summing to {num_layers}"
            )
    else:
        # extra < pp_size, so the remainder lands on stages before the last one (which also runs the LM head)
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (1 if s < extra else 0) for s in range(pp_size)]
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


def make_layers(
    num_layers: int, layer_fn: Callable[[str], nn.Module], prefix: str
) -> tuple[int, int, nn.ModuleList]:
    """Build this stage's decoder layers: ``layer_fn(f"{prefix}.{i}")`` for ``i`` in the stage's range,
    :class:`PPMissingLayer` for the others (so parameter names keep their checkpoint indices).

    Returns:
        ``(start, end, layers)`` with ``layers[start:end]`` the real ones.
    """
    pp = get_pp_group()
    start, end = get_pp_indices(num_layers, pp.rank_in_group, pp.world_size)
    layers = nn.ModuleList(
        layer_fn(f"{prefix}.{i}") if start <= i < end else PPMissingLayer() for i in range(num_layers)
    )
    return start, end, layers


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    """Whether parameter ``name`` (checkpoint naming) belongs to a module this stage replaced with
    :class:`PPMissingLayer`."""
    missing = getattr(model, "_pp_missing_prefixes", None)
    if missing is None:
        missing = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, PPMissingLayer))
        model._pp_missing_prefixes = missing  # type: ignore[assignment]
    return name.startswith(missing)


def make_empty_intermediate_tensors_factory(
    keys: list[str], hidden_size: int
) -> Callable[[int, torch.dtype, torch.device], IntermediateTensors]:
    """A ``make_empty_intermediate_tensors(num_tokens, dtype, device)`` for models whose stages pass
    ``[num_tokens, hidden_size]`` tensors named ``keys``."""

    def make_empty_intermediate_tensors(
        num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        return IntermediateTensors(
            {key: torch.empty(num_tokens, hidden_size, dtype=dtype, device=device) for key in keys}
        )

    return make_empty_intermediate_tensors
