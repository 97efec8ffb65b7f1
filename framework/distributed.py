"""Parallel groups of this process (tensor- and pipeline-parallel) and the communication layers need.

One engine core runs ``world_size = pipeline_parallel_size * tensor_parallel_size`` ranks. Global rank ``r``
is tensor-parallel rank ``r % tp`` of pipeline stage ``r // tp`` (vLLM's layout):

* a **tensor-parallel group** is the ``tp`` ranks of one stage: they split every layer of the stage and
  all-reduce / all-gather activations (``tp_all_reduce``, ``tp_all_gather_last_dim``);
* a **pipeline-parallel group** is the ``pp`` ranks with the same tensor-parallel rank, one per stage: stage
  ``s`` sends its :class:`~tokenmill.layers.pipeline.IntermediateTensors` to stage ``s + 1`` point to point
  (``send_tensor_dict`` / ``recv_tensor_dict``).

Everything is single-rank (no ``torch.distributed`` at all) until a worker calls
:func:`init_distributed_environment` and :func:`initialize_model_parallel`, after which layers built in that
process read their shard from :func:`get_tp_group` and models their layer range from :func:`get_pp_group`.
The collectives use ``torch.distributed`` with the platform's backend (gloo on CPU, nccl on CUDA/ROCm), so
this module holds no device-specific call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class GroupCoordinator:
    """One parallel group as seen from this process.

    Attributes:
        ranks: global ranks of the group's members, in group order.
        rank: this process's global rank.
        device_group: the ``torch.distributed`` group (``None`` when the group has one member).
    """

    ranks: list[int]
    rank: int
    device_group: Any = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (wraps around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous member (wraps around)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group (in place when the group has more than one member)."""
        if self.world_size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each member's ``x`` along the last dimension, in group order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def send_tensor_dict(self, tensors: dict[str, torch.Tensor], dst: int | None = None) -> None:
        """Send ``tensors`` to global rank ``dst`` (default: the next member), in key order.

        The receiver must post :meth:`recv_tensor_dict` with buffers of the same names, shapes and dtypes
        (a pipeline stage derives them from the step's token count, see
        ``make_empty_intermediate_tensors``), so no metadata travels. Blocks until the data is handed to the
        backend.
        """
        dst = self.next_rank if dst is None else dst
        for name in sorted(tensors):
            torch.distributed.send(tensors[name].contiguous(), dst=dst)

    def recv_tensor_dict(self, buffers: dict[str, torch.Tensor], src: int | None = None) -> dict[str, torch.Tensor]:
        """Fill ``buffers`` (in key order) from global rank ``src`` (default: the previous member) and return
        them. Blocks until every tensor arrived."""
        src = self.prev_rank if src is None else src
        for name in sorted(buffers):
            torch.distributed.recv(buffers[name], src=src)
        return buffers


_TP: GroupCoordinator = GroupCoordinator([0], 0)
_PP: GroupCoordinator = GroupCoordinator([0], 0)


def init_distributed_environment(world_size: int, rank: int, init_method: str, backend: str) -> None:
    """Join the engine core's ``torch.distributed`` world (a no-op for one rank).

    Args:
        world_size: ranks of the engine core (tensor x pipeline).
        rank: this process's global rank.
        init_method: rendezvous URL, e.g. ``tcp://10.0.0.1:29500`` (rank 0's node).
        backend: the platform's ``dist_backend`` (``"gloo"``, ``"nccl"``, ...).
    """
    if world_size == 1 or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    torch.distributed.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size)


def tp_pp_layout(world_size: int, tensor_parallel_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The tensor-parallel groups (one per stage) and pipeline-parallel groups (one per TP rank) as lists
    of global ranks.

    Raises:
        ValueError: ``world_size`` is not a multiple of ``tensor_parallel_size``.
    """
    if world_size % tensor_parallel_size:
        raise ValueError(f"world size {world_size} is not a multiple of tensor_parallel_size {tensor_parallel_size}")
    pp = world_size // tensor_parallel_size
    tp_groups = [[s * tensor_parallel_size + t for t in range(tensor_parallel_size)] for s in range(pp)]
    pp_groups = [[s * tensor_parallel_size + t for s in range(pp)] for t in range(tensor_parallel_size)]
    return tp_groups, pp_groups


def initialize_model_parallel(tensor_parallel_size: int, pipeline_parallel_size: int, rank: int) -> None:
    """Set this process's groups. Every rank must call it (group creation is collective) after
    :func:`init_distributed_environment`."""
    global _TP, _PP
    world = tensor_parallel_size * pipeline_parallel_size
    tp_groups, pp_groups = tp_pp_layout(world, tensor_parallel_size)
    _TP = _make_group(tp_groups, rank, whole_world=pipeline_parallel_size == 1)
    _PP = _make_group(pp_groups, rank, whole_world=tensor_parallel_size == 1)


def _make_group(groups: Sequence[list[int]], rank: int, whole_world: bool) -> GroupCoordinator:
    mine = next(g for g in groups if rank in g)
    if len(mine) == 1:  # every group has the same size, so every rank skips creation alike
        return GroupCoordinator(mine, rank)
    if whole_world:
        return GroupCoordinator(mine, rank, torch.distributed.group.WORLD)
    # torch.distributed.new_group is collective over the world: every rank creates every group, in order.
    device_group = None
    for g in groups:
        created = torch.distributed.new_group(g)
        if rank in g:
            device_group = created
    return GroupCoordinator(mine, rank, device_group)


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def get_tp_rank() -> int:
    return _TP.rank_in_group


def get_tp_size() -> int:
    return _TP.world_size


def get_pp_size() -> int:
    return _PP.world_size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place when more than one rank)."""
    return _TP.all_reduce(x)


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each tensor-parallel rank's ``x`` along the last dimension, in rank order."""
    return _TP.all_gather_last_dim(x)
