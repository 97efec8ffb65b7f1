"""Idefics3 / SmolVLM (Laurençon et al. 2024; transformers' ``Idefics3ForConditionalGeneration``): a SigLIP-style
vision tower run on each tile of an image, a connector that folds ``scale_factor^2`` neighbouring patches into
one token (pixel shuffle) and projects it, and a Llama decoder.

The processor resizes an image, splits it into ``max_image_size`` tiles plus a global (downscaled) image and
writes, per tile, ``<fake_token_around_image><row_i_col_j>`` then ``image_seq_len`` ``<image>`` tokens (the
global image: ``<fake_token_around_image><global-img>`` + ``<image>`` tokens + ``<fake_token_around_image>``).
So an image's placeholder range holds text tokens between its tiles' runs, and its ``is_embed`` marks the
``<image>`` positions (docs/multimodal.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tokenmill.layers import ReplicatedLinear
from tokenmill.models.llava import WrappedCausalLM, split_pixel_rows, text_model
from tokenmill.models.siglip import SiglipVisionTransformer

# transformers' checkpoint names -> this module's tree
_CHECKPOINT_RENAMES = (
    ("model.text_model.", "language_model.model."),
    ("model.vision_model.", "vision_model."),
    ("model.connector.", "connector."),
)


class Idefics3Connector(nn.Module):
    """Pixel shuffle (each ``scale x scale`` block of patches becomes one token of ``scale^2`` times the width)
    and a bias-free projection to the text width."""

    def __init__(self, vision_hidden: int, text_hidden: int, scale_factor: int) -> None:
        super().__init__()
        self.scale = scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = ReplicatedLinear(vision_hidden * scale_factor**2, text_hidden, bias=False)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """``[tiles, side^2, D]`` -> ``[tiles, (side / s)^2, D * s^2]``; the output token for block (i, j) holds
        its rows' patches in transformers' order (row-major over the block's rows, then columns)."""
        tiles, seq, dim = x.shape
        side, s = int(round(seq**0.5)), self.scale
        if side * side != seq or side % s:
            raise ValueError(f"Idefics3 connector: {seq} patches per tile is not a square grid divisible by {s}")
        x = x.view(tiles, side, side // s, dim * s)  # s neighbouring columns side by side
        x = x.permute(0, 2, 1, 3).reshape(tiles, side // s, side // s, dim * s * s)  # then s neighbouring rows
        return x.permute(0, 2, 1, 3).reshape(tiles, seq // (s * s), dim * s * s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(self.pixel_shuffle(x))


class Idefics3PromptProcessor:
    """transformers' ``Idefics3Processor`` plus ``image_num_tiles`` (``[num_images]`` int64: tiles of each
    image, the global image included), counted from the expanded prompt: each image's last run of
    ``<image>`` tokens follows ``<global-img>``. The processor drops the row/column counts it computes, and the
    batched ``pixel_values`` ``[1, tiles, 3, S, S]`` do not say which tiles belong to which image."""

    def __init__(self, hf_processor: Any) -> None:
        self.hf_processor = hf_processor
        self.image_token_id = int(hf_processor.image_token_id)
        self.global_image_token_id = int(hf_processor.global_image_token_id)

    def __call__(self, *, text: Sequence[str], images: Sequence[Any] | None = None, **kwargs: Any) -> Any:
        out = self.hf_processor(text=text, images=images, **kwargs)
        if images:
            ids = [int(t) for t in out["input_ids"][0]]
            counts, tiles = [], 0
            for p, t in enumerate(ids):
                if t == self.image_token_id and (p == 0 or ids[p - 1] != self.image_token_id):
                    tiles += 1
                    if p > 0 and ids[p - 1] == self.global_image_token_id:
                        counts.append(tiles)
                        tiles = 0
            out["image_num_tiles"] = torch.tensor(counts, dtype=torch.int64)
        return out


class Idefics3ForConditionalGeneration(WrappedCausalLM, nn.Module):
    """The model contract plus :class:`tokenmill.model_contract.SupportsMultiModal`; the text decoder is the
    registered causal LM of ``text_config`` (Llama in released checkpoints)."""

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        cfg = config.hf_config
        self.config = cfg
        vcfg = cfg.vision_config
        self.vision_model = SiglipVisionTransformer(vcfg)
        self.connector = Idefics3Connector(vcfg.hidden_size, cfg.text_config.hidden_size, int(cfg.scale_factor))
        self.language_model = text_model(config, cfg.text_config, type(self).__name__)

    # ---------------------------------------------------------------- SupportsMultiModal (front end)

    @classmethod
    def build_hf_processor(cls, model_config: Any) -> Idefics3PromptProcessor:
        from transformers import AutoProcessor

        return Idefics3PromptProcessor(AutoProcessor.from_pretrained(
            model_config.tokenizer, trust_remote_code=model_config.trust_remote_code))

    @classmethod
    def tokens_per_tile(cls, hf_config: Any) -> int:
        v = hf_config.vision_config
        return (v.image_size // v.patch_size) ** 2 // int(hf_config.scale_factor) ** 2

    @classmethod
    def split_image_inputs(cls, hf_config: Any, processed: Mapping[str, torch.Tensor], num_images: int
                           ) -> list[dict[str, torch.Tensor]]:
        """One dict per image: ``pixel_values`` ``[tiles, 3, S, S]``.

        Raises:
            ValueError: the tile counts do not match the pixel values, or a tile is padded (only a batch of
                several prompts pads tiles; the engine processes one prompt at a time).
        """
        counts = [int(n) for n in processed["image_num_tiles"]]
        pixels = processed["pixel_values"][0]
        mask = processed.get("pixel_attention_mask")
        if mask is not None and not bool(mask[0].all()):
            raise ValueError("Idefics3: padded image tiles are not supported")
        return split_pixel_rows(pixels, counts, num_images, "tiles")

    @classmethod
    def get_num_image_tokens(cls, hf_config: Any, item: Mapping[str, torch.Tensor]) -> int:
        return item["pixel_values"].shape[0] * cls.tokens_per_tile(hf_config)

    # ---------------------------------------------------------------- SupportsMultiModal (worker)

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` ``[tiles, 3, S, S]`` -> ``[tiles * tokens_per_tile, text hidden]`` (tile order as in
        the prompt: row-major tiles, then the global image)."""
        features = self.connector(self.vision_model(pixel_values))
        return features.reshape(-1, features.shape[-1])

    # ---------------------------------------------------------------- CausalLM

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a transformers Idefics3 checkpoint.

        Raises:
            KeyError: a tensor matches no parameter.
        """
        return self.load_renamed_weights(weights, _CHECKPOINT_RENAMES)
