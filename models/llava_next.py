"""LLaVA-NeXT (LLaVA-1.6; Liu et al. 2024; transformers' ``LlavaNextForConditionalGeneration``): LLaVA with
any-resolution images. The image processor picks the ``image_grid_pinpoints`` resolution that fits the image
best, resizes and pads the image to it, cuts it into tiles of the tower's size and adds the whole image resized
to that size (the base tile, first). Each tile goes through the CLIP tower and the projector on its own; the
tiles' feature grids are stitched into one grid, the padding is cut off again ("spatial unpad"), a learned
``image_newline`` embedding ends each row, and the base tile's features come first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.models.llava import CHECKPOINT_RENAMES, LlavaForConditionalGeneration


def best_grid(hf_config: Any, image_size: tuple[int, int]) -> tuple[int, int]:
    """Tiles (rows, columns) of an image of ``image_size`` (height, width) in pixels: the best
    ``image_grid_pinpoints`` resolution over the tower's ``image_size`` (transformers' ``select_best_resolution``)."""
    from transformers.image_processing_utils import select_best_resolution

    tile = hf_config.vision_config.image_size
    height, width = select_best_resolution(list(image_size), hf_config.image_grid_pinpoints)
    return height // tile, width // tile


def unpadded_size(image_size: tuple[int, int], rows: int, cols: int) -> tuple[int, int]:
    """The part of a ``rows x cols`` feature grid that shows the image of ``image_size`` (height, width), the
    rest being the processor's padding to the grid's aspect ratio (transformers' ``unpad_image``: the padding is
    split evenly on both sides, rounded down)."""
    height, width = image_size
    if width / height > cols / rows:
        new = int(round(height * (cols / width), 7))
        return rows - 2 * ((rows - new) // 2), cols
    new = int(round(width * (rows / height), 7))
    return rows, cols - 2 * ((cols - new) // 2)


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """:class:`LlavaForConditionalGeneration` with any-resolution tiles and ``image_newline``.

    Raises (constructor): ValueError for ``vision_feature_select_strategy`` other than ``"default"`` (the
    released checkpoints' choice; with the class token the tiles' features do not form a grid).
    """

    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        *CHECKPOINT_RENAMES, ("model.image_newline", "image_newline"))

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__(config, prefix)
        if self.config.vision_feature_select_strategy != "default":
            raise ValueError("LlavaNextForConditionalGeneration: only vision_feature_select_strategy 'default' is "
                             f"supported, not {self.config.vision_feature_select_strategy!r}")
        self.image_newline = nn.Parameter(torch.empty(self.config.text_config.hidden_size), requires_grad=False)

    # ---------------------------------------------------------------- SupportsMultiModal (front end)

    @classmethod
    def split_image_inputs(cls, hf_config: Any, processed: Mapping[str, torch.Tensor], num_images: int
                           ) -> list[dict[str, torch.Tensor]]:
        """One dict per image: ``pixel_values`` ``[tiles, 3, S, S]`` (base tile first, the processor's padding
        tiles dropped) and ``image_sizes`` ``[2]`` (height, width of the original image).

        Raises:
            ValueError: the tensors do not hold ``num_images`` images.
        """
        pixels, sizes = processed["pixel_values"], processed["image_sizes"]
        if pixels.shape[0] != num_images or sizes.shape[0] != num_images:
            raise ValueError(f"the processor gave pixel values for {pixels.shape[0]} images, not {num_images}")
        items = []
        for i in range(num_images):
            rows, cols = best_grid(hf_config, tuple(int(v) for v in sizes[i]))
            items.append({"pixel_values": pixels[i, : rows * cols + 1], "image_sizes": sizes[i]})
        return items

    @classmethod
    def get_num_image_tokens(cls, hf_config: Any, item: Mapping[str, torch.Tensor]) -> int:
        size = tuple(int(v) for v in item["image_sizes"])
        side = hf_config.vision_config.image_size // hf_config.vision_config.patch_size
        rows, cols = best_grid(hf_config, size)
        height, width = unpadded_size(size, rows * side, cols * side)
        return side * side + height * (width + 1)

    # ---------------------------------------------------------------- SupportsMultiModal (worker)

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` ``[1 + rows * cols, 3, S, S]``, ``image_sizes`` ``[2]`` ->
        ``[side^2 + h * (w + 1), text hidden]``: the base tile's features, then the unpadded ``h x w`` grid row
        by row, each row followed by ``image_newline`` (``side = S / patch``)."""
        tiles = [super(LlavaNextForConditionalGeneration, self).get_multimodal_embeddings(t) for t in pixel_values]
        base = tiles[0]
        size = (int(image_sizes[0]), int(image_sizes[1]))
        rows, cols = best_grid(self.config, size)
        side = self.config.vision_config.image_size // self.config.vision_config.patch_size
        hidden = base.shape[-1]
        grid = torch.stack(tiles[1:]).view(rows, cols, side, side, hidden)
        grid = grid.permute(0, 2, 1, 3, 4).reshape(rows * side, cols * side, hidden)  # [H, W, hidden]
        height, width = unpadded_size(size, rows * side, cols * side)
        top, left = (rows * side - height) // 2, (cols * side - width) // 2
        grid = grid[top : top + height, left : left + width]
        newline = self.image_newline.to(grid.dtype).expand(height, 1, hidden)
        return torch.cat((base, torch.cat((grid, newline), dim=1).reshape(-1, hidden)))
