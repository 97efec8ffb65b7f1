"""EncoderCacheManager: the scheduler's ledger of the workers' encoder cache (vLLM's name and role).

A vision encoder's output for an image (``[placeholder.num_embeds, hidden]`` rows) is computed once and kept in the
workers, keyed by the image's ``mm_hash``, until every scheduled chunk that needs it has run: a prompt whose
image placeholder is split across prefill chunks, or several requests with the same image, encode it once. The
scheduler decides here which images each step encodes (within a per-step budget of embedding rows) and tells
the workers which entries to drop. Entries no request needs stay cached (least recently released first out)
until their room is wanted.
"""

from __future__ import annotations

from collections import OrderedDict

from tokenmill.core.request import Request


class EncoderCacheManager:
    """Which images' encoder outputs the workers hold, who still needs them, and what to evict.

    Args:
        cache_size: embedding rows the workers keep at most (also the most one image may have).
    """

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_rows = cache_size  # rows held by no entry
        self.sizes: dict[str, int] = {}  # mm_hash -> rows, for every entry the workers hold
        self.refs: dict[str, set[tuple[str, int]]] = {}  # mm_hash -> (request id, image index) still needing it
        self.freeable: OrderedDict[str, int] = OrderedDict()  # entries nobody needs, released order
        self.num_freeable_rows = 0
        self._freed: list[str] = []

    def check_and_update_cache(self, request: Request, index: int) -> bool:
        """Whether image ``index`` of ``request`` is cached; if so the request now holds a reference to it."""
        mm_hash = request.mm_features[index].mm_hash
        if mm_hash not in self.sizes:
            return False
        if mm_hash in self.freeable:
            self.num_freeable_rows -= self.freeable.pop(mm_hash)
        self.refs[mm_hash].add((request.request_id, index))
        return True

    def can_allocate(self, num_rows: int, budget: int) -> bool:
        """Whether an image of ``num_rows`` rows fits this step's remaining encoder ``budget`` and the cache
        (evicting unneeded entries if it must)."""
        return num_rows <= budget and num_rows <= self.num_free_rows + self.num_freeable_rows

    def allocate(self, request: Request, index: int) -> None:
        """Reserve room for image ``index`` of ``request`` (to be encoded this step), evicting unneeded entries
        oldest first. Call :meth:`can_allocate` first."""
        feature = request.mm_features[index]
        rows = feature.placeholder.num_embeds
        while self.num_free_rows < rows:
            old, size = self.freeable.popitem(last=False)
            self.num_freeable_rows -= size
            self.num_free_rows += size
            del self.sizes[old], self.refs[old]
            self._freed.append(old)
        self.num_free_rows -= rows
        self.sizes[feature.mm_hash] = rows
        self.refs[feature.mm_hash] = {(request.request_id, index)}

    def cancel(self, request: Request, index: int) -> None:
        """Undo :meth:`allocate` of image ``index`` of ``request`` when its chunk is not scheduled after all (the
        workers never computed it, so nothing goes to them)."""
        mm_hash = request.mm_features[index].mm_hash
        self.refs[mm_hash].discard((request.request_id, index))
        if not self.refs[mm_hash]:
            self.num_free_rows += self.sizes.pop(mm_hash)
            del self.refs[mm_hash]

    def free_encoder_input(self, request: Request, index: int) -> None:
        """``request`` no longer needs image ``index`` (its placeholder is computed, or it left the batch)."""
        mm_hash = request.mm_features[index].mm_hash
        holders = self.refs.get(mm_hash)
        if holders is None:
            return
        holders.discard((request.request_id, index))
        if not holders and mm_hash not in self.freeable:
            self.freeable[mm_hash] = self.sizes[mm_hash]
            self.num_freeable_rows += self.sizes[mm_hash]

    def free(self, request: Request) -> None:
        """Drop every reference of ``request`` (finished, aborted or preempted)."""
        for index in range(len(request.mm_features)):
            self.free_encoder_input(request, index)

    def get_freed_mm_hashes(self) -> list[str]:
        """The entries evicted since the last call: the workers drop them before the next step's encoding."""
        freed, self._freed = self._freed, []
        return freed
