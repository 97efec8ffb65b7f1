"""MambaManager: the state slots of a hybrid model's state layers, one per running request.

A state layer (Mamba2, linear attention) keeps a fixed-size state per request instead of a KV block per
``block_size`` tokens, so the scheduler hands each request one slot when it is first scheduled and takes it
back when the request finishes, is aborted or is preempted (a preempted request is recomputed from its tokens
into a fresh slot). Slot ``i`` indexes the first dimension of every state layer's cache tensors.
"""

from __future__ import annotations


class MambaManager:
    """Free list and request -> slot map of ``num_slots`` state slots.

    Args:
        num_slots: slots in the state cache (at least 1).

    Raises:
        ValueError: ``num_slots < 1``.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_state_slots: must be at least 1, got {num_slots}")
        self.num_slots = num_slots
        # popped from the end: the lowest slot ids go out first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.req_to_slot: dict[str, int] = {}

    def get_num_free_slots(self) -> int:
        return len(self._free)

    def has_slot(self, request_id: str) -> bool:
        return request_id in self.req_to_slot

    def allocate(self, request_id: str) -> int | None:
        """The request's slot, taking a free one if it has none; ``None`` when none is free."""
        slot = self.req_to_slot.get(request_id)
        if slot is not None:
            return slot
        if not self._free:
            return None
        slot = self._free.pop()
        self.req_to_slot[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        """Return the request's slot (if it holds one) to the free list."""
        slot = self.req_to_slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def get_slot(self, request_id: str) -> int:
        """Raises:
        KeyError: the request holds no slot.
        """
        return self.req_to_slot[request_id]
