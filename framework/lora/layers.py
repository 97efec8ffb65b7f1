"""Linear layers with LoRA slots: a wrapper around a tensor-parallel linear layer of ``tokenmill.layers``.

A wrapped layer keeps its base layer (``base_layer``; the model's weights are untouched) and adds, for every
slot ``s`` of ``max_loras``, ``lora_a[s] [n*R, in]`` and ``lora_b[s] [out, n*R]`` (``R = max_lora_rank``,
``n`` = the packed sub-projections: 3 for ``qkv_proj``, 2 for ``gate_up_proj``, else 1). Sub-projection ``i``
of an adapter occupies rows / columns ``i*R .. i*R + r`` (block diagonal), so one shrink and one expand cover
q, k and v together and an adapter that leaves some of them out simply has zeros there.

Tensor parallelism (as the base weights, Megatron style): a column-parallel layer (``qkv_proj``,
``gate_up_proj``) holds the full ``lora_a`` and this rank's rows of ``lora_b``, sliced by the base layer's own
weight loader (so q/k/v heads and gate/up halves land where the base layer's rows are); a row-parallel layer
(``o_proj``, ``down_proj``) holds this rank's input columns of ``lora_a`` and the full ``lora_b``, and its
LoRA output is added to the partial sum before the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.distributed import tp_all_reduce
from tokenmill.layers.linear import LinearBase, RowParallelLinear
from tokenmill.lora.ops import LoRABatchMapping, LoRAMethod
from tokenmill.lora.peft import LoRAModuleWeights
from tokenmill.lora.request import LoRALoadError


@dataclass(frozen=True)
class LoRASlice:
    """One sub-projection of a (possibly packed) layer.

    Attributes:
        name: its checkpoint module name (``q_proj``).
        shard_id: the base layer's weight-loader shard id (``"q"``, ``0``; ``None`` for an unpacked layer).
        out_features: its output rows over all ranks.
    """

    name: str
    shard_id: str | int | None
    out_features: int


class LoRAStepState:
    """Shared by every LoRA layer of a model: the current step's token -> slot mapping (``None``: no adapter)."""

    def __init__(self) -> None:
        self.mapping: LoRABatchMapping | None = None


class LinearWithLoRA(nn.Module):
    """``base_layer(x)`` plus the LoRA update of each token's adapter slot.

    Args:
        base_layer: a ``ColumnParallelLinear`` (or packed subclass) or ``RowParallelLinear``.
        slices: its sub-projections, in packing order.
        fused_name: the checkpoint name of the whole packed layer (``qkv_proj``), which fused adapters use.
        max_loras: S.
        max_rank: R.
        method: the LoRA kernel (see ``tokenmill.lora.ops``).
        state: the model's shared step state.
    """

    def __init__(self, base_layer: LinearBase, slices: list[LoRASlice], fused_name: str, max_loras: int,
                 max_rank: int, method: LoRAMethod, state: LoRAStepState) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.slices = slices
        self.fused_name = fused_name
        self.max_rank = max_rank
        self.row_parallel = isinstance(base_layer, RowParallelLinear)
        self.method = method
        self.state = state
        n = len(slices) * max_rank
        w = base_layer.weight
        device = torch.device("cpu") if w.is_meta else w.device  # meta: weights kept quantized, on the CPU
        self.register_buffer("lora_a", torch.zeros(max_loras, n, base_layer.in_features, dtype=w.dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, base_layer.out_features, n, dtype=w.dtype,
                                                   device=device), persistent=False)

    @property
    def full_in_features(self) -> int:
        """Input features over all ranks (what an adapter's ``lora_A`` has)."""
        tp = getattr(self.base_layer, "tp_size", 1)
        return self.base_layer.in_features * (tp if self.row_parallel else 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in]`` -> ``[T, out]``."""
        mapping = self.state.mapping
        if self.row_parallel:
            y = self.base_layer.matmul(x)
            if mapping is not None:
                self.method.add_lora(y, x, self.lora_a, self.lora_b, mapping)
            y = tp_all_reduce(y)
            return y if self.base_layer.bias is None else y + self.base_layer.bias
        y = self.base_layer(x)
        if mapping is not None:
            self.method.add_lora(y, x, self.lora_a, self.lora_b, mapping)
        return y

    def pack(self, modules: dict[str, LoRAModuleWeights], where: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(lora_a [n*R, in], lora_b [out, n*R])`` for one adapter, on the host in the layer dtype.

        Args:
            modules: sub-projection name (or ``fused_name``) -> the adapter's weights for it.
            where: the layer's name, for error messages.

        Raises:
            LoRALoadError: a shape does not match the layer, or the adapter has both the fused layer and
                some of its parts.
        """
        n, big_r = len(self.slices), self.max_rank
        a = torch.zeros(n * big_r, self.base_layer.in_features)
        b = torch.zeros(self.base_layer.out_features, n * big_r)
        if self.fused_name in modules and len(modules) > 1:
            raise LoRALoadError(f"lora_path: the adapter has both {where} and its parts {sorted(set(modules) - {self.fused_name})}")
        if self.fused_name in modules and n > 1:
            parts = [(0, LoRASlice(self.fused_name, None, sum(s.out_features for s in self.slices)),
                      modules[self.fused_name])]
        else:
            parts = [(i, s, modules[s.name]) for i, s in enumerate(self.slices) if s.name in modules]
        for i, piece, w in parts:
            r, name = w.rank, f"{where.rsplit('.', 1)[0]}.{piece.name}"
            if w.lora_a.shape[1] != self.full_in_features or w.lora_b.shape[0] != piece.out_features:
                raise LoRALoadError(
                    f"lora_path: module {name!r}: lora_A {tuple(w.lora_a.shape)} / lora_B {tuple(w.lora_b.shape)} do "
                    f"not fit the model's layer ({self.full_in_features} inputs, {piece.out_features} outputs); the "
                    "adapter was trained for another model")
            cols = slice(i * big_r, i * big_r + r)
            loader = self.base_layer.weight_loader
            if self.row_parallel:
                a_full = torch.zeros(n * big_r, self.full_in_features)
                a_full[cols] = w.lora_a
                loader(a, a_full)
                b[:, cols] = w.lora_b
            else:
                a[cols] = w.lora_a
                b_full = torch.zeros(piece.out_features, n * big_r)
                b_full[:, cols] = w.lora_b
                if piece.shard_id is None and n == 1:
                    loader(b, b_full)
                else:
                    loader(b, b_full, piece.shard_id)
        dtype = self.lora_a.dtype
        return a.to(dtype), b.to(dtype)

    def set_slot(self, slot: int, packed: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copy an adapter's packed weights into ``slot`` (``None``: zeros, the adapter leaves this layer out)."""
        if packed is None:
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
        else:
            self.lora_a[slot].copy_(packed[0])
            self.lora_b[slot].copy_(packed[1])
