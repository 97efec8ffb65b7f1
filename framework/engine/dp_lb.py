"""Which data-parallel engine core gets a new request.

The front end knows at once how many unfinished requests it sent to each engine core (``in_flight``); each
engine core reports with every step how many of its requests wait and how full its KV cache is. The load
of engine ``e`` is the sort key ``(in_flight[e] + waiting[e], kv_cache_usage[e], e)``: requests the front end
has sent and not seen finish, plus, counted a second time, those the engine still queues (they wait for
others to finish, so a queue is worse than a full batch); ties go to the emptier KV cache, then the lower
index. This is the policy ``least-loaded`` (vLLM's internal data-parallel balancer also scores waiting
requests above running ones).

``prefix-aware`` routing keeps requests that share a prompt prefix on the engine core that already holds
that prefix in its prefix cache: the prompt's full blocks (``block_size`` tokens) are hashed in a chain, as
the KV cache manager does, and the engine that last took the longest matching chain gets the request, unless
its load exceeds the least-loaded engine's by more than ``max_imbalance`` requests (then the least-loaded one
takes it, and from then on owns the prefix). The table is an LRU of at most ``max_entries`` block hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tokenmill.engine.messages import EngineCoreRequest, SchedulerStats

ROUTING_POLICIES = ("least-loaded", "prefix-aware")


class DPLoadBalancer:
    """Chooses an engine core per request (see the module docstring).

    Args:
        num_engines: data-parallel engine cores.
        policy: ``"least-loaded"`` or ``"prefix-aware"``.
        block_size: tokens per KV block (the prefix granularity).
        max_prefix_blocks: blocks of a prompt's start that take part in prefix routing.
        max_imbalance: extra requests the prefix owner may have over the least-loaded engine.
        max_entries: size of the prefix table.

    Raises:
        ValueError: an unknown policy or ``num_engines < 1``.
    """

    def __init__(
        self,
        num_engines: int,
        policy: str = "least-loaded",
        block_size: int = 16,
        *,
        max_prefix_blocks: int = 64,
        max_imbalance: int = 4,
        max_entries: int = 100_000,
    ) -> None:
        if num_engines < 1:
            raise ValueError(f"data_parallel_size: must be at least 1, got {num_engines}")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"data_parallel_routing: must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.num_engines = num_engines
        self.policy = policy
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.max_imbalance = max_imbalance
        self.max_entries = max_entries
        self.in_flight = [0] * num_engines
        self.waiting = [0] * num_engines
        self.kv_cache_usage = [0.0] * num_engines
        self._prefix_owner: OrderedDict[int, int] = OrderedDict()

    # -- bookkeeping -----------------------------------------------------------------------------------

    def on_sent(self, engine: int) -> None:
        self.in_flight[engine] += 1

    def on_finished(self, engine: int) -> None:
        self.in_flight[engine] = max(0, self.in_flight[engine] - 1)

    def update_stats(self, engine: int, stats: SchedulerStats) -> None:
        self.waiting[engine] = stats.num_waiting_reqs
        self.kv_cache_usage[engine] = stats.kv_cache_usage

    # -- choice ----------------------------------------------------------------------------------------

    def load(self, engine: int) -> tuple[int, float, int]:
        return (self.in_flight[engine] + self.waiting[engine], self.kv_cache_usage[engine], engine)

    def least_loaded(self) -> int:
        return min(range(self.num_engines), key=self.load)

    def choose(self, request: EngineCoreRequest) -> int:
        """The engine core for ``request`` (records its prefix under ``prefix-aware``)."""
        if self.num_engines == 1:
            return 0
        best = self.least_loaded()
        if self.policy != "prefix-aware":
            return best
        hashes = self.block_hashes(request.prompt_token_ids, request.cache_salt)
        chosen = best
        for h in reversed(hashes):
            owner = self._prefix_owner.get(h)
            if owner is not None:
                if self.load(owner)[0] - self.load(best)[0] <= self.max_imbalance:
                    chosen = owner
                break
        for h in hashes:
            self._prefix_owner[h] = chosen
            self._prefix_owner.move_to_end(h)
        while len(self._prefix_owner) > self.max_entries:
            self._prefix_owner.popitem(last=False)
        return chosen

    def block_hashes(self, token_ids: Sequence[int], salt: str | None = None) -> list[int]:
        """Chained hashes of the full blocks at the start of ``token_ids`` (at most ``max_prefix_blocks``).

        Python's ``hash`` of tuples: fast, and only compared within this process.
        """
        hashes: list[int] = []
        parent = hash(("tokenmill-prefix", salt))
        bs = self.block_size
        for start in range(0, min(len(token_ids) // bs, self.max_prefix_blocks) * bs, bs):
            parent = hash((parent, tuple(token_ids[start : start + bs])))
            hashes.append(parent)
        return hashes
