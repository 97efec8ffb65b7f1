"""The contract of a layer that keeps a fixed-size state per request (Mamba2, linear attention) instead of a
growing KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.forward_context import get_forward_context
from tokenmill.layers.mamba.state_metadata import StateMetadata

States = tuple[torch.Tensor, ...]  # one request's (or a decode batch's) state tensors, get_state_shapes order


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

    def run_with_states(
        self,
        num_tokens: int,
        prefill: Callable[[int, int, States | None], States],
        decode: Callable[[torch.Tensor, States], States],
    ) -> None:
        """:meth:`run_requests` with the state slots read and written here, in :meth:`get_state_shapes` order.

        ``prefill(start, end, states)`` runs rows ``[start, end)`` of one request from ``states`` (its slot's
        tensors, ``[*shape]`` each, when it continues from them; ``None`` for a fresh sequence) and returns its
        new states, which go to its slot (a dummy run has none and keeps nothing). ``decode(rows, states)`` runs
        the decode rows (``[B]`` int64) from the states gathered from their slots (``[B, *shape]`` each) and
        returns the new ones, written back in the cache dtype.
        """

        def run_prefill(start: int, end: int, slot: int | None, init: bool) -> None:
            new = prefill(start, end, tuple(cache[slot] for cache in self.state_cache) if init else None)
            if slot is not None:
                for cache, state in zip(self.state_cache, new, strict=True):
                    cache[slot] = state

        def run_decode(md: StateMetadata) -> None:
            slots = md.decode_slots
            new = decode(md.decode_token_index, tuple(cache[slots] for cache in self.state_cache))
            for cache, state in zip(self.state_cache, new, strict=True):
                cache[slots] = state.to(cache.dtype)

        self.run_requests(num_tokens, run_prefill, run_decode)


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
