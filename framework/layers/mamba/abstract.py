"""The contract of a layer that keeps a fixed-size state per request (Mamba2, linear attention) instead of a
growing KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.forward_context import get_forward_context
from tokenmill.layers.mamba.state_metadata import StateMetadata


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

    def run_requests(
        self,
        num_tokens: int,
        prefill: Callable[[int, int, int | None, bool], None],
        decode: Callable[[StateMetadata], None],
    ) -> None:
        """Dispatch the step's requests: ``decode(md)`` once for the requests that run one token from an
        existing state (``md.decode_token_index`` / ``md.decode_slots``), then ``prefill(start, end, slot,
        has_initial_state)`` for each other request's rows ``[start, end)``. Without state metadata or cache (a
        dummy run) the whole batch is one fresh sequence with no slot (``prefill(0, num_tokens, None, False)``).
        """
        try:
            md: StateMetadata | None = get_forward_context().state_metadata
        except RuntimeError:
            md = None
        if md is None or not self.state_cache:
            prefill(0, num_tokens, None, False)
            return
        if md.decode_rows:
            decode(md)
        decode_rows = set(md.decode_rows)
        for r, slot in enumerate(md.state_slots):
            start, end = md.query_start_loc[r], md.query_start_loc[r + 1]
            if r not in decode_rows and end > start:
                prefill(start, end, slot, md.has_initial_state[r])


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
