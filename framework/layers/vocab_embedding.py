"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear_method import DEFAULT_METHOD, UnquantizedLinearMethod
from tokenmill.layers.quantization import QuantizedWeight
from tokenmill.distributed import get_tp_rank, get_tp_size, tp_all_gather_last_dim, tp_all_reduce


class VocabParallelEmbedding(nn.Module):
    """Embedding of ``num_embeddings`` tokens, each rank holding a contiguous slice of the (padded) vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp_size)
        self.start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[1] != param.shape[1]:
            raise ValueError(f"shape mismatch: embedding {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
        part = loaded[self.start : self.start + self.per_rank]
        param.data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int -> ``[T, embedding_dim]``."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        valid = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * valid.unsqueeze(-1)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to vocabulary logits; shares the embedding's layout (and weights when tied)."""

    is_lm_head = True  # quantize_model gives it the method's lm_head_method

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.quant: QuantizedWeight | None = None  # a submodule once attached: never a class attribute (it shadows)
        self.quant_max_tokens = 0
        self.linear_method: UnquantizedLinearMethod = DEFAULT_METHOD  # set by the model loader

    def attach_quantized(self, cls: type[QuantizedWeight], max_tokens: int) -> None:
        """Use a ``cls`` copy of the head for at most ``max_tokens`` rows (see layers.quantization).

        Raises:
            UnsupportedShapeError: ``cls`` cannot pack this weight.
        """
        self.quant = cls(self.weight)
        self.quant_max_tokens = max_tokens

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` logits in the weights' dtype (the sampler widens them to float32
        where it needs to: a plain greedy batch takes the argmax of these directly)."""
        if self.quant is not None and hidden_states.shape[0] <= self.quant_max_tokens:
            logits = self.quant.matmul(hidden_states)
        else:
            logits = self.linear_method.apply(self, hidden_states)
        logits = tp_all_gather_last_dim(logits)
        return logits[:, : self.num_embeddings]
