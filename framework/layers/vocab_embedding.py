"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear_method import DEFAULT_METHOD, UnquantizedLinearMethod
from tokenmill.layers.quantization import QuantizedWeight, WeightRowSink
from tokenmill.distributed import get_tp_rank, get_tp_size, tp_all_gather_last_dim, tp_all_reduce


class VocabParallelEmbedding(nn.Module):
    """Embedding of ``num_embeddings`` tokens, each rank holding a contiguous slice of the (padded) vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp_size)
        self.start = self.tp_rank * self.per_rank
        # empty, not zeros: a table written by the loader (or kept in GGUF blocks, never written) must not
        # be touched first, which would make the whole float table resident for nothing; the padding rows past
        # the vocabulary on the last rank are zeroed
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.data[max(0, min(self.per_rank, num_embeddings - self.start)):].zero_()
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # Set while weights are loaded quantized (tokenmill.model_loader.quantized_loading): the table then
        # stays in its GGUF blocks (``qblocks``, a buffer, never written) and ``weight`` is a meta-device
        # parameter.
        self.keep_blocks = False
        self.qtype: str | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[1] != param.shape[1]:
            raise ValueError(f"shape mismatch: embedding {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
        part = loaded[self.start : self.start + self.per_rank]
        if self.keep_blocks and param is self.weight:
            if not isinstance(part, torch.Tensor) and part.shape[0] == self.per_rank:
                # a view of the file's read-only map when it is one (GGUF tensors are aligned): the rows never
                # looked up are never read, and the kernel may drop clean pages under memory pressure
                self.register_buffer("qblocks", part.blocks.contiguous(), persistent=False)
                self.qtype = part.type_name
                return
            # float rows (or a shard padded past the vocabulary): a float table after all, in place of the meta one
            self.weight = param = nn.Parameter(torch.zeros(param.shape, dtype=param.dtype), requires_grad=False)
            self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if not isinstance(part, torch.Tensor):
            part = part.dequantize()
        param.data[: part.shape[0]].copy_(part)

    def _table_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the table, ``[T, embedding_dim]`` in the default dtype (from GGUF blocks: only the
        rows looked up are dequantized)."""
        if self.qtype is None:
            return F.embedding(ids, self.weight)
        from tokenmill.model_loader.gguf_dequant import dequantize_blocks

        return dequantize_blocks(self.qblocks.index_select(0, ids), self.qtype).to(torch.get_default_dtype())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int -> ``[T, embedding_dim]``."""
        if self.tp_size == 1:
            return self._table_rows(input_ids)
        local = input_ids - self.start
        valid = (local >= 0) & (local < self.per_rank)
        out = self._table_rows(local.clamp(0, self.per_rank - 1)) * valid.unsqueeze(-1)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to vocabulary logits; shares the embedding's layout (and weights when tied)."""

    is_lm_head = True  # quantize_model gives it the method's lm_head_method

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.quant: QuantizedWeight | None = None  # a submodule once attached: never a class attribute (it shadows)
        self.quant_max_tokens = 0
        self.quant_only = False  # as LinearBase.quant_only
        self.quant_loader: WeightRowSink | None = None  # as LinearBase.quant_loader
        self.linear_method: UnquantizedLinearMethod = DEFAULT_METHOD  # set by the model loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.quant_loader is None or param is not self.weight:
            return super().weight_loader(param, loaded)
        if tuple(loaded.shape) != (self.num_embeddings, param.shape[1]) or self.tp_size != 1:
            raise ValueError(f"shape mismatch: LM head {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
        self.quant_loader.add_rows(0, loaded)

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
        if self.quant is not None and (self.quant_only or hidden_states.shape[0] <= self.quant_max_tokens):
            logits = self.quant.matmul(hidden_states)
        else:
            logits = self.linear_method.apply(self, hidden_states)
        logits = tp_all_gather_last_dim(logits)
        return logits[:, : self.num_embeddings]
