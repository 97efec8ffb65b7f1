"""The batched LoRA computation of one step, and the platform hook for its kernel.

Every LoRA layer holds its adapters' weights stacked by slot: ``lora_a [S, n*R, in]`` and
``lora_b [S, out, n*R]`` (``S = max_loras`` slots, ``R = max_lora_rank``, ``n`` packed sub-projections such
as q/k/v). A step's tokens each carry a slot index (``-1``: the base model). The op adds, for every token
``t`` with slot ``s``::

    y[t] += lora_b[s] @ (lora_a[s] @ x[t])          # shrink to n*R, then expand to out

This is the semantics of Punica's SGMV/BGMV kernels (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving").
The portable :class:`TorchLoRAMethod` groups the LoRA tokens by slot once per step (a stable sort, in
:class:`LoRABatchMapping`) and runs one shrink and one expand matrix multiply per adapter in use: no Python
loop over tokens, and base-model tokens cost nothing. A platform with its own kernel returns its
:class:`LoRAMethod` subclass from ``Platform.get_lora_method_cls()``.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_LORA_METHOD = "tokenmill.lora.ops:TorchLoRAMethod"


@dataclass
class LoRABatchMapping:
    """Which adapter slot each token of a step uses, in the forms the LoRA methods need.

    Attributes:
        token_slots: ``[T]`` int64, the slot of each token (``-1``: no adapter).
        order: ``[M]`` int64, the indices of the ``M`` tokens that have an adapter, grouped by slot in slot
            order (stable: batch order within a slot).
        counts: per slot, how many of ``order`` use it (host list, ``S`` entries).
        num_slots: ``S``.
    """

    token_slots: torch.Tensor
    order: torch.Tensor
    counts: list[int]
    num_slots: int

    @property
    def num_lora_tokens(self) -> int:
        return int(self.order.shape[0])

    @classmethod
    def build(cls, request_slots: list[int], num_scheduled: list[int], num_slots: int,
              device: torch.device) -> LoRABatchMapping:
        """From each request's slot (``-1``: none) and its scheduled token count, in batch order."""
        slots = np.repeat(np.asarray(request_slots, dtype=np.int64), np.asarray(num_scheduled, dtype=np.int64))
        lora_tokens = np.nonzero(slots >= 0)[0]
        order = lora_tokens[np.argsort(slots[lora_tokens], kind="stable")]
        counts = np.bincount(slots[lora_tokens], minlength=num_slots).tolist() if len(lora_tokens) else [0] * num_slots
        return cls(
            token_slots=torch.from_numpy(slots).to(device),
            order=torch.from_numpy(order).to(device),
            counts=counts,
            num_slots=num_slots,
        )


class LoRAMethod(ABC):
    """How a platform computes the LoRA part of a layer's output (stateless; one instance per process)."""

    @abstractmethod
    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 mapping: LoRABatchMapping) -> None:
        """In place: ``y[t] += lora_b[s] @ lora_a[s] @ x[t]`` for every token ``t`` whose slot ``s >= 0``.

        Args:
            y: ``[T, out]`` the base layer's output (this rank's part), any float dtype.
            x: ``[T, in]`` the layer's input (this rank's part for row-parallel layers).
            lora_a: ``[S, n*R, in]``.
            lora_b: ``[S, out, n*R]`` (scaling already applied).
            mapping: the step's token -> slot mapping.
        """


class TorchLoRAMethod(LoRAMethod):
    """Portable torch: tokens grouped by slot (SGMV-style), one shrink and one expand per adapter in use."""

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 mapping: LoRABatchMapping) -> None:
        if mapping.num_lora_tokens == 0:
            return
        xs = x.index_select(0, mapping.order)
        out = torch.empty(xs.shape[0], y.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for slot, n in enumerate(mapping.counts):  # at most max_loras groups
            if n:
                shrunk = xs[start : start + n] @ lora_a[slot].t()  # [n, n*R]
                torch.matmul(shrunk, lora_b[slot].t(), out=out[start : start + n])  # [n, out]
            start += n
        y.index_add_(0, mapping.order, out.to(y.dtype))


@functools.cache
def _method_instance(path: str) -> LoRAMethod:
    from tokenmill.plugins import resolve_qualname

    cls = resolve_qualname(path)
    if not (isinstance(cls, type) and issubclass(cls, LoRAMethod)):
        raise TypeError(f"LoRA method {path!r} is not a LoRAMethod subclass")
    return cls()


def get_lora_method() -> LoRAMethod:
    """The current platform's :class:`LoRAMethod` (``Platform.get_lora_method_cls``; default: the torch one)."""
    from tokenmill.platforms import get_current_platform

    getter = getattr(get_current_platform(), "get_lora_method_cls", None)
    return _method_instance((getter() if getter is not None else None) or DEFAULT_LORA_METHOD)
