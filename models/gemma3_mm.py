"""Gemma 3 with images (Gemma Team 2025; transformers' ``Gemma3ForConditionalGeneration``): a SigLIP vision tower
at a fixed image size, a projector that average-pools the patch grid down to ``mm_tokens_per_image`` tokens,
normalises them (Gemma's ``(1 + w)`` RMSNorm) and maps them to the text width, and the Gemma 3 text decoder.

``Gemma3Processor`` resizes each image to the tower's size and replaces each ``<start_of_image>`` of the prompt
by ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` image tokens + ``<end_of_image>\\n\\n``. The decoder attends
bidirectionally among one image's tokens in prefill, as transformers does with ``token_type_ids``: the model is
a multimodal prefix-LM (``is_mm_prefix_lm``; docs/multimodal.md says how the scheduler and attention backends
honour it). With pan-and-scan (``do_pan_and_scan``) a wide or tall image also gets crops, each its own run of
image tokens after the original's, with text between them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.layers import RMSNorm
from tokenmill.models.gemma3 import Gemma3ForCausalLM
from tokenmill.models.llava import CHECKPOINT_RENAMES, WrappedCausalLM, split_pixel_rows
from tokenmill.models.siglip import SiglipVisionTransformer


class Gemma3MultiModalProjector(nn.Module):
    """``[patches, vision hidden]`` of a ``side x side`` grid -> ``[mm_tokens_per_image, text hidden]``: average
    pooling over ``k x k`` patches (``k = side / sqrt(mm_tokens_per_image)``), RMSNorm with ``(1 + w)`` in float32,
    then a product with ``mm_input_projection_weight`` ``[vision hidden, text hidden]`` (transformers'
    ``Gemma3MultiModalProjector``; replicated across tensor-parallel ranks)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        vcfg = cfg.vision_config
        self.side = vcfg.image_size // vcfg.patch_size
        tokens_per_side = int(round(cfg.mm_tokens_per_image**0.5))
        if tokens_per_side**2 != cfg.mm_tokens_per_image or self.side % tokens_per_side:
            raise ValueError(f"Gemma3: mm_tokens_per_image {cfg.mm_tokens_per_image} is not a square dividing the "
                             f"{self.side}x{self.side} patch grid")
        self.kernel = self.side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vcfg.hidden_size, cfg.text_config.hidden_size), requires_grad=False)
        self.mm_soft_emb_norm = RMSNorm(vcfg.hidden_size, eps=vcfg.layer_norm_eps, offset=1.0,
                                        multiply_in_float32=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[side^2, vision hidden]`` -> ``[mm_tokens_per_image, text hidden]`` (row-major pooled grid)."""
        grid = x.transpose(0, 1).reshape(1, x.shape[1], self.side, self.side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2)[0].transpose(0, 1)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).to(x.dtype)


class Gemma3PromptProcessor:
    """transformers' ``Gemma3Processor`` plus ``image_num_crops`` (``[num_images]`` int64: pan-and-scan crops of
    each image, after its original in ``pixel_values``), which the processor computes but drops. The counts come
    from the image processor run with the processor's image options (call keyword arguments over the image
    processor's own settings over ``Gemma3Processor.images_kwargs``), only when pan-and-scan is on."""

    def __init__(self, hf_processor: Any) -> None:
        self.hf_processor = hf_processor

    def __call__(self, *, text: Sequence[str], images: Sequence[Any] | None = None, **kwargs: Any) -> Any:
        out = self.hf_processor(text=text, images=images, **kwargs)
        if images:
            options = {}
            for name, default in type(self.hf_processor).images_kwargs.items():
                own = getattr(self.hf_processor.image_processor, name, None)
                options[name] = kwargs.get(name, default if own is None else own)
            crops = [0] * len(images)
            if options["do_pan_and_scan"]:
                crops = list(self.hf_processor.image_processor(images=list(images), **options)["num_crops"])
            out["image_num_crops"] = torch.tensor(crops, dtype=torch.int64)
        return out


class Gemma3ForConditionalGeneration(WrappedCausalLM, nn.Module):
    """The model contract plus :class:`tokenmill.model_contract.SupportsMultiModal`; the text decoder is
    :class:`tokenmill.models.gemma3.Gemma3ForCausalLM` built from ``text_config``."""

    # an image's tokens attend to each other in both directions (transformers' token_type_ids mask)
    is_mm_prefix_lm: ClassVar[bool] = True

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        cfg = config.hf_config
        self.config = cfg
        self.vision_tower = SiglipVisionTransformer(cfg.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg)
        self.language_model = Gemma3ForCausalLM(dataclasses.replace(config, hf_config=cfg.text_config))

    # ---------------------------------------------------------------- SupportsMultiModal (front end)

    @classmethod
    def build_hf_processor(cls, model_config: Any) -> Gemma3PromptProcessor:
        from transformers import AutoProcessor

        return Gemma3PromptProcessor(AutoProcessor.from_pretrained(
            model_config.tokenizer, trust_remote_code=model_config.trust_remote_code))

    @classmethod
    def split_image_inputs(cls, hf_config: Any, processed: Mapping[str, torch.Tensor], num_images: int
                           ) -> list[dict[str, torch.Tensor]]:
        """One dict per image: ``pixel_values`` ``[1 + crops, 3, S, S]`` (the original, then its pan-and-scan
        crops).

        Raises:
            ValueError: the crop counts do not match the pixel values.
        """
        pixels = processed["pixel_values"]
        crops = processed.get("image_num_crops")
        counts = [1] * num_images if crops is None else [1 + int(n) for n in crops]
        return split_pixel_rows(pixels, counts, num_images, "images and crops")

    @classmethod
    def get_num_image_tokens(cls, hf_config: Any, item: Mapping[str, torch.Tensor]) -> int:
        return item["pixel_values"].shape[0] * int(hf_config.mm_tokens_per_image)

    # ---------------------------------------------------------------- SupportsMultiModal (worker)

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` ``[1 + crops, 3, S, S]`` -> ``[(1 + crops) * mm_tokens_per_image, text hidden]`` (the
        original's tokens, then each crop's)."""
        features = self.vision_tower(pixel_values)
        return torch.cat([self.multi_modal_projector(f) for f in features])

    # ---------------------------------------------------------------- CausalLM

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a transformers Gemma 3 checkpoint (either naming scheme).

        Raises:
            KeyError: a tensor matches no parameter.
        """
        return self.load_renamed_weights(weights, CHECKPOINT_RENAMES)
