"""Pooler: the hidden states of a prompt -> one embedding, class probabilities or per-token states.

Pooling methods (as sentence-transformers and vLLM name them): ``LAST`` takes the last prompt token's hidden
state (decoders used as embedders, e.g. Qwen3-Embedding), ``CLS`` the first token's (BERT-style), ``MEAN``
the mean over all prompt tokens (E5, all-MiniLM), ``ALL`` every token's. A classifier's ``head`` maps the
pooled vector to label logits; ``classify``/``score`` then apply softmax (several labels) or sigmoid (one
label), ``embed`` truncates to ``dimensions`` (Matryoshka) and L2-normalizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.pooler_config import PoolerConfig
from tokenmill.pooling_params import PoolingParams


class Pooler(nn.Module):
    """Turns each pooling request's hidden states into its output.

    Args:
        config: pooling method, normalization default and Matryoshka sizes.
        head: for classifiers: ``[N, hidden]`` pooled states -> ``[N, num_labels]`` logits (``None``: an
            embedding model; ``classify``/``score`` are then refused).
        default_task: the task of requests that name none (``"embed"`` or ``"classify"``).
    """

    def __init__(self, config: PoolerConfig, head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 default_task: str = "embed") -> None:
        super().__init__()
        self.config = config
        self.pooling_type = config.pooling_type
        self.head = head
        self.default_task = default_task

    def select_rows(self, start: int, end: int, num_prompt_tokens: int) -> slice | None:
        """Which rows of a prompt chunk covering positions ``[start, end)`` this pooler needs (``None``: none),
        so a long prompt split over several steps keeps only what its pooling method reads."""
        if self.pooling_type == "LAST":
            return slice(end - start - 1, end - start) if end >= num_prompt_tokens else None
        if self.pooling_type == "CLS":
            return slice(0, 1) if start == 0 else None
        return slice(0, end - start)

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` kept rows of one prompt -> ``[hidden]`` (``[n, hidden]`` for ``ALL``), float32."""
        hidden = hidden.float()
        if self.pooling_type == "MEAN":
            return hidden.mean(dim=0)
        if self.pooling_type == "ALL":
            return hidden
        return hidden[-1] if self.pooling_type == "LAST" else hidden[0]

    def forward(self, hidden: Sequence[torch.Tensor], params: Sequence[PoolingParams]) -> list[torch.Tensor]:
        """Outputs of several finished prompts.

        Args:
            hidden: per request, the rows :meth:`select_rows` kept, in prompt order (``[n_i, hidden]``).
            params: per request, its (task-resolved) PoolingParams.

        Returns:
            per request a float32 tensor: ``[d]`` for ``embed`` (``d`` = ``dimensions`` or the hidden size),
            ``[num_labels]`` for ``classify``/``score``, the pooled state (``[n_i, hidden]`` with ``ALL``)
            for ``encode``.
        """
        pooled = [self.pool(h) for h in hidden]
        out: list[torch.Tensor] = list(pooled)
        if self.pooling_type != "ALL" and pooled:
            stacked = torch.stack(pooled)  # [N, hidden]: the heads and norms below run once for the batch
        else:
            stacked = None
        cls_rows = [i for i, p in enumerate(params) if p.task in ("classify", "score")]
        if cls_rows:
            assert self.head is not None, "classify/score requests reach only a pooler with a head"
            assert stacked is not None, "classify/score requests reach only a pooler with one vector per prompt"
            logits = self.head(stacked[cls_rows]).float()
            for j, i in enumerate(cls_rows):
                row = logits[j]
                if params[i].activation is not False:
                    row = torch.sigmoid(row) if row.numel() == 1 else torch.softmax(row, dim=-1)
                out[i] = row
        groups: dict[tuple[int | None, bool], list[int]] = {}
        for i, p in enumerate(params):
            if p.task == "embed":
                normalize = self.config.normalize if p.normalize is None else p.normalize
                groups.setdefault((p.dimensions, bool(normalize)), []).append(i)
        for (dims, normalize), rows in groups.items():
            vecs = stacked[rows] if stacked is not None else [pooled[i] for i in rows]
            for i, vec in zip(rows, _embed(vecs, dims, normalize)):
                out[i] = vec
        return out


def _embed(vecs: torch.Tensor | list[torch.Tensor], dims: int | None, normalize: bool) -> list[torch.Tensor]:
    """Matryoshka truncation to ``dims`` values, then L2 normalization, of ``[N, hidden]`` vectors (or of a list
    of ``[n_i, hidden]`` tensors with ``ALL``); one tensor per input."""
    if isinstance(vecs, list):
        return [_embed(v[None], dims, normalize)[0] for v in vecs]
    if dims is not None:
        vecs = vecs[..., :dims]
    if normalize:
        vecs = F.normalize(vecs, p=2, dim=-1)
    return list(vecs.unbind(0))


def build_pooler(model: nn.Module, config: PoolerConfig, convert: str) -> Pooler:
    """The pooler of ``model``: its own ``pooler`` attribute when it defines one, else one for ``config``,
    with the model's ``classifier_head`` method as head when ``convert == "classify"``.

    Raises:
        ValueError: ``convert == "classify"`` for a model without a classification head.
    """
    own = getattr(model, "pooler", None)
    if isinstance(own, Pooler):
        return own
    if convert == "classify":
        head = getattr(model, "classifier_head", None)
        if head is None:
            raise ValueError(f"--convert classify: {type(model).__name__} has no classification head")
        return Pooler(config, head, default_task="classify")
    return Pooler(config)
