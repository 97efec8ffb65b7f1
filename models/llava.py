"""LLaVA (Liu et al. 2023): a CLIP vision tower, a two-layer projector and a decoder-only language model
(transformers' ``LlavaForConditionalGeneration``). The text decoder is the registered causal LM of
``text_config.model_type`` (Llama, Mistral, Qwen2, ...), built from the shared decoder blocks; an image's
placeholder tokens (``image_token_index``, repeated once per feature by ``LlavaProcessor``) take the projected
vision features as their embeddings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.layers import ColumnParallelLinear, RowParallelLinear
from tokenmill.model_loader.registry import ModelRegistry
from tokenmill.model_loader.weight_utils import load_checkpoint_weights
from tokenmill.models.clip import CLIPVisionModel, vision_activation
from tokenmill.layers.decoder import DEFAULT_STACKED_PARAMS

# text_config.model_type -> the architecture the registry builds for the language model
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "granite": "GraniteForCausalLM", "phi3": "Phi3ForCausalLM",
}

# transformers >= 4.52 names (model.language_model.*, ...) -> the older names this module's tree uses (Gemma 3
# shares them)
CHECKPOINT_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_tower.vision_model.", "vision_tower."),
)


def text_model(config: Any, text_config: Any, owner: str) -> nn.Module:
    """The registered causal LM for ``text_config``, built with a copy of the engine's ModelConfig.

    Raises:
        ValueError: no known decoder for ``text_config.model_type``.
    """
    archs = list(getattr(text_config, "architectures", None) or [])
    arch = TEXT_ARCHITECTURES.get(getattr(text_config, "model_type", ""))
    if arch is not None:
        archs.append(arch)
    if not archs:
        raise ValueError(f"{owner}: no decoder for text_config.model_type {text_config.model_type!r} (known: "
                         f"{', '.join(sorted(TEXT_ARCHITECTURES))})")
    return ModelRegistry.resolve_model_cls(archs)(dataclasses.replace(config, hf_config=text_config))


def split_pixel_rows(pixels: torch.Tensor, counts: list[int], num_images: int, what: str
                     ) -> list[dict[str, torch.Tensor]]:
    """``pixels`` ``[rows, 3, H, W]`` cut into one ``{"pixel_values": [counts[i], 3, H, W]}`` per image, in order
    (an image's tiles or crops are consecutive rows).

    Raises:
        ValueError: ``counts`` is not one count per image adding up to the rows (``what`` names the rows).
    """
    if len(counts) != num_images or sum(counts) != pixels.shape[0]:
        raise ValueError(f"the processor gave {pixels.shape[0]} {what}, not the {sum(counts)} {what} of "
                         f"{num_images} images")
    items, at = [], 0
    for n in counts:
        items.append({"pixel_values": pixels[at : at + n]})
        at += n
    return items


class WrappedCausalLM:
    """The causal-LM half of a vision-language model whose ``language_model`` is a registered causal LM: text
    embeddings, the forward pass and logits are the decoder's, and its checkpoint loader renames
    transformers' names to this tree's (a mixin for the ``nn.Module`` model classes, which add the
    ``SupportsMultiModal`` methods; no pipeline parallelism)."""

    supports_multimodal: ClassVar[bool] = True
    supports_pp: ClassVar[bool] = False
    language_model: Any

    @classmethod
    def get_image_token_id(cls, hf_config: Any) -> int:
        """``hf_config.image_token_id`` (transformers' name in most configurations)."""
        return int(hf_config.image_token_id)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``[T]`` ids and positions (and optionally ``[T, hidden]`` embeddings with image rows) -> ``[T, hidden]``."""
        return self.language_model.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def load_renamed_weights(self, weights: Iterable[tuple[str, torch.Tensor]], renames: Iterable[tuple[str, str]],
                             skip: Callable[[str], bool] = lambda name: False) -> set[str]:
        """Load ``weights`` after replacing each name's prefixes by ``renames`` (in order, every match applied;
        ``lm_head.`` becomes ``language_model.lm_head.``), leaving out ``position_ids`` buffers, a tied
        ``lm_head`` and the (renamed) names ``skip`` selects.

        Raises:
            KeyError: a tensor matches no parameter.
        """
        tied = bool(getattr(self.language_model, "tie_word_embeddings", False))
        renames = tuple(renames)

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for old, new in renames:
                    if name.startswith(old):
                        name = new + name[len(old):]
                if name.startswith("lm_head."):
                    name = "language_model." + name
                if name.endswith("position_ids") or (tied and name == "language_model.lm_head.weight") or skip(name):
                    continue
                yield name, tensor

        loaded = load_checkpoint_weights(self, renamed(),  # type: ignore[arg-type]
                                         stacked_params_mapping=DEFAULT_STACKED_PARAMS)
        if tied:
            loaded.add("language_model.lm_head.weight")
        return loaded


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = ColumnParallelLinear(vision_hidden, text_hidden, bias=bias)
        self.act = vision_activation(act)
        self.linear_2 = RowParallelLinear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(WrappedCausalLM, nn.Module):
    """The model contract plus :class:`tokenmill.model_contract.SupportsMultiModal`.

    ``vision_feature_layer`` (an index, or a list whose features are concatenated) picks the vision tower's
    hidden states; ``vision_feature_select_strategy`` ``"default"`` drops the class token, ``"full"`` keeps it.
    """

    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = CHECKPOINT_RENAMES

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        cfg = config.hf_config
        self.config = cfg
        vcfg = cfg.vision_config
        layers = cfg.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        total = vcfg.num_hidden_layers
        needed = max(i if i >= 0 else total + 1 + i for i in self.feature_layers)
        self.vision_tower = CLIPVisionModel(vcfg, num_layers=needed)
        self.num_vision_layers = needed
        self.multi_modal_projector = LlavaMultiModalProjector(
            vcfg.hidden_size * len(self.feature_layers), cfg.text_config.hidden_size, cfg.projector_hidden_act,
            bool(getattr(cfg, "multimodal_projector_bias", True)))
        self.language_model = text_model(config, cfg.text_config, type(self).__name__)

    # ---------------------------------------------------------------- SupportsMultiModal (front end)

    @classmethod
    def get_image_token_id(cls, hf_config: Any) -> int:
        return int(hf_config.image_token_index)

    @classmethod
    def split_image_inputs(cls, hf_config: Any, processed: Mapping[str, torch.Tensor], num_images: int
                           ) -> list[dict[str, torch.Tensor]]:
        pixels = processed["pixel_values"]
        if pixels.shape[0] != num_images:
            raise ValueError(f"the processor gave pixel values for {pixels.shape[0]} images, not {num_images}")
        return [{"pixel_values": pixels[i]} for i in range(num_images)]

    @classmethod
    def get_num_image_tokens(cls, hf_config: Any, item: Mapping[str, torch.Tensor]) -> int:
        patch = hf_config.vision_config.patch_size
        _, height, width = item["pixel_values"].shape
        cls_token = 1 if hf_config.vision_feature_select_strategy == "full" else 0
        return (height // patch) * (width // patch) + cls_token

    # ---------------------------------------------------------------- SupportsMultiModal (worker)

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` ``[3, S, S]`` -> ``[(S / patch)^2 (+1 with "full"), text hidden]``."""
        states = self.vision_tower(pixel_values)
        total = self.config.vision_config.num_hidden_layers
        picked = [states[i if i >= 0 else total + 1 + i] for i in self.feature_layers]
        features = torch.cat(picked, dim=-1)
        if self.config.vision_feature_select_strategy == "default":
            features = features[1:]
        return self.multi_modal_projector(features)

    # ---------------------------------------------------------------- CausalLM

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a transformers Llava checkpoint (either naming scheme); vision layers past the last one used
        and the unused vision post-norm are skipped.

        Raises:
            KeyError: a tensor matches no parameter.
        """

        def unused(name: str) -> bool:
            return (name.startswith("vision_tower.encoder.layers.")
                    and int(name.split(".")[3]) >= self.num_vision_layers)

        return self.load_renamed_weights(weights, self.checkpoint_renames, unused)
