"""Multimodal rotary position embedding (M-RoPE, Qwen2-VL: Wang et al. 2024).

Each token has three positions (temporal, height, width); text tokens have three equal ones. The rotary
frequencies are split into ``mrope_section`` consecutive groups (sizes summing to ``rotary_dim // 2``), and group
``i`` rotates by position component ``i % 3`` (transformers' ``Qwen2VLRotaryEmbedding``). With 1-D positions it is
plain RoPE.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tokenmill.layers.rotary import RotaryEmbedding, rope_parameters_of


class MRotaryEmbedding(RotaryEmbedding):
    """:class:`RotaryEmbedding` whose positions may be ``[3, T]`` int64.

    Args:
        head_size, rotary_dim, max_position, base, scaling: as :class:`RotaryEmbedding` (``max_position`` must
            exceed every component of every position).
        mrope_section: frequency counts per group, summing to ``rotary_dim // 2``.

    Raises:
        ValueError: ``mrope_section`` does not sum to ``rotary_dim // 2``.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None, mrope_section: Sequence[int]) -> None:
        super().__init__(head_size, rotary_dim, max_position, base, scaling)
        if sum(mrope_section) != rotary_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to rotary_dim // 2 = {rotary_dim // 2}")
        self.mrope_section = [int(s) for s in mrope_section]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows ``[T, 1, rotary_dim // 2]`` for ``positions`` ``[T]`` or ``[3, T]``."""
        if positions.dim() == 1:
            return super().lookup(positions)

        def pick(table: torch.Tensor) -> torch.Tensor:
            rows = table[positions]  # [3, T, rotary_dim // 2]
            parts = rows.split(self.mrope_section, dim=-1)
            return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1).unsqueeze(1)

        return pick(self.cos_cache), pick(self.sin_cache)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # never a platform's rotary kernel: those take 1-D positions
        return self.forward_native(positions, query, key)


_MROPE_CACHE: dict[tuple, MRotaryEmbedding] = {}


def get_mrope(head_size: int, max_position: int, hf_config: Any) -> MRotaryEmbedding:
    """The M-RoPE of a text config whose ``rope_parameters`` hold ``mrope_section`` (one module per setting,
    shared by the layers).

    Raises:
        ValueError: the config has no ``mrope_section``.
    """
    params = rope_parameters_of(hf_config)
    section = params.get("mrope_section")
    if not section:
        raise ValueError("M-RoPE: the text config's rope_parameters have no mrope_section")
    theta = float(params.get("rope_theta") or 10000.0)
    key = (head_size, max_position, theta, repr(sorted(params.items())), torch.get_default_device())
    rope = _MROPE_CACHE.get(key)
    if rope is None:
        scaling = {k: v for k, v in params.items() if k not in ("mrope_section", "mrope_interleaved")}
        scaling["rope_type"] = "default" if scaling.get("rope_type") in (None, "mrope") else scaling["rope_type"]
        rope = MRotaryEmbedding(head_size, head_size, max_position, theta, scaling, section)
        _MROPE_CACHE[key] = rope
    return rope
