"""SigLIP's vision transformer (Zhai et al. 2023; transformers' ``SiglipVisionTransformer`` without the pooling
head): a patch embedding with learned positions, pre-LayerNorm encoder layers with bidirectional attention (the
CLIP layer's shape) and a final LayerNorm. Idefics3 runs it on each tile of an image (a tile of fewer patches
takes positions at its patches' fractional coordinates), Gemma 3 on the whole image at the tower's size."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.models.clip import CLIPEncoderLayer


class SiglipVisionEmbeddings(nn.Module):
    """Patch embedding (a strided convolution with bias) plus learned positions for a ``side x side`` grid; a
    tile of fewer patches takes the positions at its patches' fractional coordinates (NaViT-style, as
    transformers' ``Idefics3VisionEmbeddings`` does for an unpadded tile)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.side = cfg.image_size // cfg.patch_size
        self.position_embedding = nn.Embedding(self.side**2, cfg.hidden_size)

    def position_ids(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """``[rows * cols]`` int64: the bucket of each patch's fractional (row, column) in the position grid
        (the grid's own order for a full-size image)."""
        if rows == cols == self.side:
            return torch.arange(self.side**2, device=device)
        boundaries = torch.arange(1 / self.side, 1.0, 1 / self.side, device=device)

        def buckets(n: int) -> torch.Tensor:
            frac = (torch.arange(n, device=device, dtype=torch.float32) / n).clamp(max=1.0 - 1e-6)
            return torch.bucketize(frac, boundaries, right=True)

        return (buckets(rows)[:, None] * self.side + buckets(cols)[None, :]).reshape(-1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[tiles, 3, H, W]`` -> ``[tiles, (H / patch) * (W / patch), hidden]``."""
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        rows, cols = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)
        return x + self.position_embedding(self.position_ids(rows, cols, x.device))


class SiglipVisionTransformer(nn.Module):
    """Embeddings, SigLIP encoder layers (the CLIP layer's shape: pre-LayerNorm attention and MLP) and a final
    LayerNorm, with bidirectional attention within each image (or tile)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(cfg)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[tiles, 3, H, W]`` -> ``[tiles, patches, hidden]``."""
        x = self.embeddings(pixel_values)
        # the shared layer attends over one sequence [N, H]; each tile is its own sequence
        tiles = [t for t in x]
        for layer in self.encoder.layers:
            tiles = [layer(t) for t in tiles]
        return self.post_layernorm(torch.stack(tiles))
