"""Qwen2.5-VL (Qwen team 2025), transformers' ``Qwen2_5_VLForConditionalGeneration``: Qwen2-VL's design
(``tokenmill.models.qwen2_vl``: M-RoPE decoder, merged 2x2 patches, the same prompt processing and 3-D positions)
with a tower of RMSNorm / SwiGLU blocks that attend within windows of ``window_size`` pixels, except the blocks of
``fullatt_block_indexes``, which see the whole image. Patches are reordered window by window before the blocks
(in units of merged 2x2 patches) and the merged tokens put back in image order after the merger.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tokenmill.layers import GatedMLP, RMSNorm
from tokenmill.models.qwen2_vl import Qwen2VisionAttention, Qwen2VisionTransformer, Qwen2VLForConditionalGeneration


def window_order(grid_thw: Sequence[int], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merged-patch units of an image in window order, and the window boundaries in patches.

    Each frame's ``(h / merge) x (w / merge)`` grid of units is cut into ``window x window`` tiles (smaller at the
    right and bottom edges), visited row by row, units row-major inside each tile.

    Returns:
        ``(order [t*h*w / merge^2] int64, bounds)``: unit ``order[i]`` goes to place ``i``; patches
        ``[bounds[j], bounds[j + 1])`` of the reordered sequence form window ``j``.
    """
    t, h, w = (int(v) for v in grid_thw)
    rows, cols = h // merge, w // merge
    units = merge * merge
    order: list[torch.Tensor] = []
    bounds = [0]
    grid = torch.arange(t * rows * cols).reshape(t, rows, cols)
    for frame in range(t):
        for top in range(0, rows, window):
            for left in range(0, cols, window):
                tile = grid[frame, top : top + window, left : left + window].flatten()
                order.append(tile)
                bounds.append(bounds[-1] + tile.numel() * units)
    return torch.cat(order), bounds


class Qwen2_5VisionBlock(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, 1e-6)
        self.norm2 = RMSNorm(cfg.hidden_size, 1e-6)
        self.attn = Qwen2VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class Qwen2_5VisionTransformer(Qwen2VisionTransformer):
    """transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` for one image at a time."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.full_attention_blocks = frozenset(cfg.fullatt_block_indexes)
        self.window = cfg.window_size // self.merge // cfg.patch_size

    @staticmethod
    def dims(cfg: Any) -> tuple[int, int]:
        return cfg.hidden_size, cfg.out_hidden_size

    def make_block(self, cfg: Any) -> nn.Module:
        return Qwen2_5VisionBlock(cfg)

    def make_norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim, 1e-6)

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[int]) -> torch.Tensor:
        """``pixel_values`` ``[t*h*w, C*T*P*P]``, ``grid_thw`` ``(t, h, w)`` -> ``[t*h*w / merge^2, text hidden]``."""
        units = self.merge * self.merge
        order, window_bounds = window_order(grid_thw, self.merge, self.window)
        order = order.to(pixel_values.device)

        def reorder(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, units, t.shape[-1])[order].reshape(-1, t.shape[-1])

        x = reorder(self.embed_patches(pixel_values))
        cos, sin = (reorder(t) for t in self.rotary(grid_thw, x.device))
        frame = int(grid_thw[1]) * int(grid_thw[2])
        full_bounds = list(range(0, x.shape[0] + 1, frame))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full_bounds if i in self.full_attention_blocks else window_bounds)
        return self.merger(x)[torch.argsort(order)]


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2-VL's model contract, M-RoPE and prompt processing, with the Qwen2.5-VL vision tower."""

    vision_tower_cls = Qwen2_5VisionTransformer
