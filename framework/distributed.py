"""Tensor-parallel group state of this process (rank, world size) and the collectives layers need.

Single-rank by default; ``init_tensor_parallel`` is called by a worker after ``torch.distributed`` is set up
with the platform's backend (gloo on CPU, nccl on CUDA/ROCm).
"""

from __future__ import annotations

import torch

_TP_RANK = 0
_TP_SIZE = 1


def init_tensor_parallel(rank: int, world_size: int) -> None:
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, world_size


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place when more than one rank)."""
    if _TP_SIZE == 1:
        return x
    torch.distributed.all_reduce(x)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's ``x`` along the last dimension, in rank order."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
