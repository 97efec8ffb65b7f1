"""The contract of a layer that keeps a fixed-size state per request (Mamba2, linear attention) instead of a
growing KV cache."""

from __future__ import annotations

import torch
from torch import nn


class MambaBase(nn.Module):
    """A state layer. The model runner finds every instance in the model, sizes the state cache from
    :meth:`get_state_shapes` and binds the layer's slice of it to :attr:`state_cache`.

    Attributes:
        state_cache: one tensor per entry of :meth:`get_state_shapes`, ``[num_slots, *shape]`` each, in the
            state dtype; empty until the cache is allocated (a dummy forward pass without cache keeps no state).
    """

    def __init__(self) -> None:
        super().__init__()
        self.state_cache: tuple[torch.Tensor, ...] = ()

    def get_state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-request shapes of the layer's state tensors (e.g. ``((D, K - 1), (H, P, N))``: conv, SSM)."""
        raise NotImplementedError


def state_bytes_per_slot(layers: list[MambaBase], dtype: torch.dtype) -> int:
    """Bytes one request's states take across ``layers`` in ``dtype``."""
    elements = 0
    for layer in layers:
        for shape in layer.get_state_shapes():
            n = 1
            for d in shape:
                n *= d
            elements += n
    return elements * torch.tensor([], dtype=dtype).element_size()


def allocate_state_caches(layers: list[MambaBase], num_slots: int, dtype: torch.dtype,
                          device: torch.device) -> list[torch.Tensor]:
    """Zeroed state tensors of ``num_slots`` slots for every layer (through ``Platform.allocate_kv_cache``),
    bound to each layer's :attr:`MambaBase.state_cache`; returned flat, in layer order."""
    from tokenmill.platforms import get_current_platform

    platform = get_current_platform()
    out: list[torch.Tensor] = []
    for layer in layers:
        caches = tuple(platform.allocate_kv_cache((num_slots, *shape), dtype, device)
                       for shape in layer.get_state_shapes())
        layer.state_cache = caches
        out.extend(caches)
    return out
