"""PoolerConfig: how a pooling model turns hidden states into its output (vLLM's ``PoolerConfig`` names)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.pooling_params import PoolingParams, PoolingParamsError

POOLING_TYPES: tuple[str, ...] = ("LAST", "MEAN", "CLS", "ALL")


@dataclass
class PoolerConfig:
    """Resolved pooler settings of a model served with the pooling runner.

    Attributes:
        pooling_type: ``"LAST"`` (the last prompt token's hidden state), ``"MEAN"`` (mean over the prompt),
            ``"CLS"`` (the first token's), or ``"ALL"`` (every token's, ``[num_tokens, hidden]``).
        normalize: L2-normalize embeddings unless a request says otherwise.
        matryoshka_dimensions: the ``dimensions`` values a request may ask for; ``None``: the model declares
            no Matryoshka support, so ``dimensions`` is refused (except its full size). An empty list means
            any size up to the hidden size.
        prompts: sentence-transformers named prompts (``config_sentence_transformers.json`` ``prompts``).
        default_prompt_name: the prompt prepended when a request names none (``None``: no prompt).
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka_dimensions: list[int] | None = None
    prompts: dict[str, str] | None = None
    default_prompt_name: str | None = None

    def __post_init__(self) -> None:
        self.pooling_type = self.pooling_type.upper()
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type: must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")


def supported_pooling_tasks(convert: str) -> tuple[str, ...]:
    """The pooling tasks a model served with ``--convert convert`` runs (``score`` on a classifier is
    ``classify`` of a text pair; a bi-encoder's scores are cosines of ``embed`` outputs, computed by the caller)."""
    if convert == "classify":
        return ("classify", "score", "encode")
    return ("embed", "encode")


def check_pooling_params(params: PoolingParams, config: PoolerConfig, convert: str, hidden_size: int,
                         num_labels: int) -> None:
    """Refuse what the model cannot do for ``params`` (its task resolved).

    Raises:
        PoolingParamsError: the task is not one the model serves, ``score`` on a classifier with more than one
            label, or ``dimensions`` asked of a model without Matryoshka support (or a size it does not list,
            or above the hidden size).
    """
    tasks = supported_pooling_tasks(convert)
    if params.task not in tasks:
        raise PoolingParamsError("task", f"this model serves {', '.join(tasks)}, not {params.task!r}")
    if params.task == "score" and num_labels != 1:
        raise PoolingParamsError("task", f"scoring needs a classifier with one label; this one has {num_labels}")
    dims = params.dimensions
    if dims is None or dims == hidden_size:
        return
    if params.task != "embed":
        raise PoolingParamsError("dimensions", "is only for embeddings")
    allowed = config.matryoshka_dimensions
    if allowed is None:
        raise PoolingParamsError(
            "dimensions", "this model does not support Matryoshka embeddings (it declares no is_matryoshka / "
            "matryoshka_dimensions), so its embeddings cannot be shortened"
        )
    if dims > hidden_size or (allowed and dims not in allowed):
        sizes = ", ".join(map(str, allowed)) if allowed else f"1..{hidden_size}"
        raise PoolingParamsError("dimensions", f"{dims} is not supported; this model allows {sizes}")
