"""Tensor-parallel-aware linear layers (Megatron-LM style splits, Shoeybi et al. 2019).

``ColumnParallelLinear`` splits the output dimension across ranks, ``RowParallelLinear`` the input dimension
(its partial results are summed across ranks). Each parameter carries a ``weight_loader(param, loaded[, shard])``
that copies this rank's slice of a full checkpoint tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed import get_tp_rank, get_tp_size, tp_all_reduce
from tokenmill.layers.linear_method import DEFAULT_METHOD, UnquantizedLinearMethod
from tokenmill.layers.quantization import QuantizedWeight, WeightRowSink


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a full tensor into ``param`` (a GGUF block tensor, ``tokenmill.model_loader.gguf_tensor``, is
    dequantized first).

    Raises:
        ValueError: the shapes differ.
    """
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    if not isinstance(loaded, torch.Tensor):
        loaded = loaded.dequantize()
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` ``[out_per_rank, in_per_rank]`` in the default dtype.

    Attributes:
        linear_method: how the full-precision product is computed (``tokenmill.layers.linear_method``; the
            model loader sets the platform's choice).
        quant: a quantized copy used for inputs of at most ``quant_max_tokens`` rows, or ``None``.
        quant_only: ``quant`` is the only copy of the weight, used for every input (``weight`` is then a
            parameter on the meta device): weights loaded quantized (``tokenmill.model_loader.quantized_loading``).
        quant_loader: while such a load runs, what collects this layer's weight rows (``None`` otherwise).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.quant: QuantizedWeight | None = None
        self.quant_max_tokens = 0
        self.quant_only = False
        self.quant_loader: WeightRowSink | None = None
        self.linear_method: UnquantizedLinearMethod = DEFAULT_METHOD

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        self.load_rows(param, None, loaded)

    def load_rows(self, param: nn.Parameter, offset: int | None, loaded: torch.Tensor) -> None:
        """Fill rows ``offset:offset + len(loaded)`` of ``param`` (the weight or the bias; ``offset`` ``None``:
        all of it) with ``loaded``, or hand the weight's rows to :attr:`quant_loader` while weights are loaded
        quantized.

        Raises:
            ValueError: the shapes differ.
        """
        rows = param.shape[0] if offset is None else loaded.shape[0]
        if loaded.shape[1:] != param.shape[1:] or loaded.shape[0] != rows or (offset or 0) + rows > param.shape[0]:
            where = "" if offset is None else f" rows {offset}:{offset + loaded.shape[0]} of"
            raise ValueError(f"shape mismatch: parameter{where} {tuple(param.shape)} vs checkpoint "
                             f"{tuple(loaded.shape)}")
        if self.quant_loader is not None and param is self.weight:
            self.quant_loader.add_rows(offset or 0, loaded)
        elif offset is None:
            default_weight_loader(param, loaded)
        else:
            default_weight_loader(param.data.narrow(0, offset, rows), loaded)

    def attach_quantized(self, cls: type[QuantizedWeight], max_tokens: int) -> None:
        """Use a ``cls`` copy of the weight for inputs of at most ``max_tokens`` rows (see layers.quantization).

        Raises:
            UnsupportedShapeError: ``cls`` cannot pack this weight.
        """
        self.quant = cls(self.weight)
        self.quant_max_tokens = max_tokens

    def _quantized_for(self, x: torch.Tensor) -> bool:
        return self.quant is not None and (self.quant_only or x.shape[0] <= self.quant_max_tokens)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in] -> x W^T [T, out]`` (no bias, no cross-rank reduction)."""
        if self._quantized_for(x):
            return self.quant.matmul(x)  # type: ignore[union-attr]
        return self.linear_method.apply(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None or self._quantized_for(x):
            y = self.matmul(x)
            return y if self.bias is None else y + self.bias
        # the method may add the bias inside its product (addmm, a GEMM epilogue) instead of in a second pass
        return self.linear_method.apply_with_bias(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """Full weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice (no gather)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(input_size, _divide(output_size, self.tp_size, "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = param.shape[0]
        self.load_rows(param, None, loaded.narrow(0, self.tp_rank * shard, shard))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stored as one (e.g. gate and up projections).

    The loader takes ``shard_id`` = index into ``output_sizes``, or no shard id for a checkpoint tensor that is
    already fused (Phi-3's ``gate_up_proj``): it is split into ``output_sizes`` and each part sharded.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            if len(self.output_sizes) == 1:
                return super().weight_loader(param, loaded)
            if loaded.shape[0] != sum(self.output_sizes):
                raise ValueError(f"shape mismatch: fused checkpoint tensor {tuple(loaded.shape)} vs output sizes "
                                 f"{self.output_sizes}")
            for i, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return None
        sizes = [s // self.tp_size for s in self.output_sizes]
        offset, size = sum(sizes[:shard_id]), sizes[shard_id]
        self.load_rows(param, offset, loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections as one matrix; heads split across ranks.

    Key/value heads are replicated when there are fewer of them than ranks. The loader takes
    ``shard_id`` in ``{"q", "k", "v"}``, or no shard id for an already fused ``qkv_proj`` checkpoint tensor
    (Phi-3), which is split into its query, key and value rows first.
    """

    def __init__(
        self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = get_tp_size()
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp, "number of attention heads")
        self.num_kv_heads = max(1, total_num_kv_heads // tp)
        self.kv_replicas = max(1, tp // total_num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:
            sizes = [self.total_num_heads * self.head_size] + [self.total_num_kv_heads * self.head_size] * 2
            if loaded.shape[0] != sum(sizes):
                raise ValueError(f"shape mismatch: fused qkv checkpoint tensor {tuple(loaded.shape)} vs q/k/v rows "
                                 f"{sizes}")
            for sid, part in zip("qkv", loaded.split(sizes, dim=0)):
                self.weight_loader(param, part, sid)
            return None
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        head_rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        self.load_rows(param, offset, loaded.narrow(0, head_rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed across ranks (bias added once)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(_divide(input_size, self.tp_size, "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:
            return default_weight_loader(param, loaded)
        shard = param.shape[1]
        self.load_rows(param, None, loaded.narrow(1, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias
