"""Prompt + images -> token ids with each image's placeholder expanded, and the per-image features.

The Hugging Face processor of the checkpoint (``transformers.AutoProcessor``, read from the model folder) resizes
and normalizes the images and repeats the model's image token once per embedding row; the model class
(:class:`tokenmill.model_contract.SupportsMultiModal`) says which token that is, how the processor's batched
tensors split per image and how many rows each image takes. Each image's placeholder run is found in prompt
order and its content hash (``mm_hash``) computed from the processed tensors.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tokenmill.config import ModelConfig, MultiModalConfig
from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.inputs import MultiModalFeature, PlaceholderRange, TensorData


def image_list(multi_modal_data: Mapping[str, Any] | None, param: str) -> list[Any]:
    """The images of vLLM's ``multi_modal_data`` (``{"image": PIL image or list of them}``) as a list.

    Raises:
        InvalidRequestError: another modality, or an entry that is not a ``PIL.Image.Image``.
    """
    if not multi_modal_data:
        return []
    from PIL import Image

    unknown = sorted(set(multi_modal_data) - {"image"})
    if unknown:
        raise InvalidRequestError(f"{param}: unsupported modalities {unknown} (only 'image')", param=param)
    images = multi_modal_data.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else [] if images is None else [images]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(f"{param}: image {i} is a {type(image).__name__}, not a PIL.Image.Image",
                                      param=param)
    return [image.convert("RGB") if image.mode != "RGB" else image for image in images]


def feature_hash(arch: str, item: Mapping[str, torch.Tensor]) -> str:
    """BLAKE2b (128-bit) of one image's processed tensors, keyed by the architecture: equal hashes mean the
    encoder sees equal inputs."""
    h = hashlib.blake2b(arch.encode(), digest_size=16)
    for name in sorted(item):
        t = item[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def find_placeholders(token_ids: Sequence[int], image_token_id: int, lengths: Sequence[int]) -> list[PlaceholderRange]:
    """The placeholder range of each image, in order: image ``i`` takes the next ``lengths[i]`` image tokens.

    The range runs from the image's first image token to its last; when other tokens lie between them (Idefics3
    puts ``<fake_token_around_image><row_1_col_2>`` between the runs of an image's tiles) its ``is_embed``
    marks the image tokens.

    Raises:
        ValueError: the prompt holds another number of image tokens than the images need.
    """
    positions = [p for p, t in enumerate(token_ids) if t == image_token_id]
    if len(positions) != sum(lengths):
        raise ValueError(f"the prompt holds {len(positions)} image tokens but the images need {sum(lengths)}")
    ranges: list[PlaceholderRange] = []
    at = 0
    for length in lengths:
        mine = positions[at : at + length]
        start, end = mine[0], mine[-1] + 1
        if end - start == length:
            ranges.append(PlaceholderRange(start, length))
        else:
            taken = set(mine)
            ranges.append(PlaceholderRange(start, end - start, tuple(p in taken for p in range(start, end))))
        at += length
    return ranges


class MultiModalProcessor:
    """Runs the checkpoint's processor for prompts with images (thread-safe; the processor loads on first use).

    Args:
        model_config: the model (its class must declare ``supports_multimodal``; else every image is refused).
        mm_config: limits and processor options.
    """

    def __init__(self, model_config: ModelConfig, mm_config: MultiModalConfig) -> None:
        from tokenmill.model_contract import supports_multimodal
        from tokenmill.model_loader.registry import ModelRegistry

        self.model_config = model_config
        self.mm_config = mm_config
        try:
            self.model_cls: Any = ModelRegistry.resolve_model_cls(model_config.architectures)
        except Exception:  # noqa: BLE001 - an engine without a resolvable class takes no images either
            self.model_cls = None
        self.is_multimodal = self.model_cls is not None and supports_multimodal(self.model_cls)
        self._processor: Any = None
        self._lock = threading.Lock()

    def check_images(self, num_images: int, param: str) -> None:
        """Raises: InvalidRequestError (``param``) when the model takes no images or ``num_images`` exceeds
        ``--limit-mm-per-prompt``."""
        if num_images == 0:
            return
        if not self.is_multimodal:
            archs = ", ".join(self.model_config.architectures) or "this model"
            raise InvalidRequestError(f"{param}: {archs} is a text-only model; it does not take images", param=param)
        limit = self.mm_config.limit_per_prompt.get("image")
        if limit is not None and num_images > limit:
            raise InvalidRequestError(f"{param}: {num_images} images in one prompt, more than the limit of {limit} "
                                      "(--limit-mm-per-prompt)", param=param)

    def processor(self) -> Any:
        if self._processor is None:
            with self._lock:
                if self._processor is None:
                    build = getattr(self.model_cls, "build_hf_processor", None)
                    if build is not None:  # the model's own prompt processor (SupportsMultiModal, optional)
                        self._processor = build(self.model_config)
                    else:
                        from transformers import AutoProcessor

                        self._processor = AutoProcessor.from_pretrained(
                            self.model_config.tokenizer, trust_remote_code=self.model_config.trust_remote_code)
        return self._processor

    def process(self, prompt: str, images: Sequence[Any], *, add_special_tokens: bool, param: str,
                mm_processor_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[MultiModalFeature]]:
        """Token ids of ``prompt`` with each image placeholder expanded, and one feature per image.

        The prompt holds the model's image placeholder once per image (Llava: ``<image>``), as the chat template
        renders it.

        Raises:
            InvalidRequestError (``param``): a text-only model, too many images, a prompt given as token ids, or
                the processor refused the prompt and images (e.g. fewer placeholders than images).
        """
        self.check_images(len(images), param)
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"{param}: a prompt with images must be text (with the model's image "
                                      "placeholders), not token ids", param=param)
        kwargs = {**self.mm_config.mm_processor_kwargs, **(mm_processor_kwargs or {})}
        cls, hf_config = self.model_cls, self.model_config.hf_config
        try:
            out = self.processor()(text=[prompt], images=list(images), return_tensors="pt",
                                   add_special_tokens=add_special_tokens, **kwargs)
            token_ids = [int(t) for t in out["input_ids"][0].tolist()]
            items = cls.split_image_inputs(hf_config, out, len(images))
            lengths = [int(cls.get_num_image_tokens(hf_config, item)) for item in items]
            ranges = find_placeholders(token_ids, int(cls.get_image_token_id(hf_config)), lengths)
        except InvalidRequestError:
            raise
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise InvalidRequestError(f"{param}: the model's processor could not prepare the prompt and its "
                                      f"{len(images)} image(s): {exc}", param=param) from exc
        arch = self.model_config.architectures[0]
        features = [
            MultiModalFeature("image", feature_hash(arch, item), placeholder,
                              {name: TensorData.from_tensor(t) for name, t in item.items()})
            for item, placeholder in zip(items, ranges)
        ]
        return token_ids, features
