"""Tiny random vision-language checkpoints saved with their processors (built here, no downloads), and test
images; shared by the model tests and the server test."""

from __future__ import annotations

import base64
import io
import os
from typing import Any

# Renders image parts as the model's placeholder; text-only content as it is.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def random_image(seed: int, width: int, height: int) -> Any:
    """A random RGB ``PIL.Image.Image``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def data_url(image: Any, fmt: str = "PNG") -> str:
    """``image`` as a base64 ``data:`` URL."""
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def randomize(model: Any, projection: Any) -> None:
    """Random norms and biases too (so a wrong placement shows), and image embeddings as large as text ones
    (random init leaves them ~50x smaller, and answers would not depend on them): ``projection`` is the last
    weight before the text decoder."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
        projection.mul_(50.0)


def llava_parts() -> tuple[Any, Any, Any]:
    """The byte-level test tokenizer plus ``<image>`` (with the chat template), a 3-layer CLIP tower config (28 px
    images, 7 px patches: 16 image tokens) and a 2-layer Llama config: shared by the Llava builders."""
    from transformers import CLIPVisionConfig, LlamaConfig

    from tests.engine.engine_fakes import byte_level_tokenizer

    tok = byte_level_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<special>", "<image>"]})
    tok.chat_template = CHAT_TEMPLATE
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=28, patch_size=7)
    text = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return tok, vision, text


def save_llava(path: str, model: Any, image_processor: Any, tok: Any, processor_cls: Any) -> str:
    """Randomize ``model`` (a Llava-family model) and save it with its processor at ``path``."""
    randomize(model, model.model.multi_modal_projector.linear_2.weight)
    processor = processor_cls(image_processor=image_processor, tokenizer=tok, patch_size=7,
                              vision_feature_select_strategy="default", image_token="<image>",
                              num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def build_llava(path: str) -> str:
    """:func:`llava_parts`' CLIP tower + projector + Llama, float32, saved with a ``LlavaProcessor`` and a chat
    template."""
    import torch
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tok, vision, text = llava_parts()
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         image_seq_length=16, architectures=["LlavaForConditionalGeneration"])
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    image_processor = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return save_llava(path, model, image_processor, tok, LlavaProcessor)


QWEN2_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_qwen2_vl(path: str) -> str:
    """A 2-block vision tower (7 px patches, 2x2 merge, images resized to 28..56 px) + a 2-layer Qwen2 decoder
    with M-RoPE (sections 2/3/3 of head_dim 16), float32, saved with its image processor and the byte-level test
    tokenizer plus Qwen2-VL's vision tokens."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.engine.engine_fakes import byte_level_tokenizer

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tok = byte_level_tokenizer()
    specials = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens({"additional_special_tokens": ["<special>", *specials]})
    tok.chat_template = QWEN2_VL_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=2,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=7,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], bos_token_id=None, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    randomize(model, model.model.visual.merger.mlp[2].weight)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=7, merge_size=2,
                             temporal_patch_size=2).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_qwen2_5_vl(path: str) -> str:
    """:func:`build_qwen2_vl`'s sizes with Qwen2.5-VL's tower: 3 blocks, windows of 28 px (2x2 merged units,
    so images above 28 px have several windows), block 1 with full attention."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    build_qwen2_vl(path)  # tokenizer, image processor and the text config's sizes
    with open(os.path.join(path, "config.json")) as f:
        import json

        saved = json.load(f)
    vision = dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=4, patch_size=7,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=28, fullatt_block_indexes=[1],
                  hidden_act="silu")
    config = Qwen2_5_VLConfig(text_config=saved["text_config"], vision_config=vision,
                              image_token_id=saved["image_token_id"], video_token_id=saved["video_token_id"],
                              vision_start_token_id=saved["vision_start_token_id"],
                              vision_end_token_id=saved["vision_end_token_id"], bos_token_id=None, eos_token_id=2)
    torch.manual_seed(2)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    randomize(model, model.model.visual.merger.mlp[2].weight)
    for name in os.listdir(path):
        if name.endswith(".safetensors") or name == "config.json":
            os.remove(os.path.join(path, name))
    model.save_pretrained(path)
    return path


def build_idefics3(path: str) -> str:
    """A 2-layer SigLIP-style tower (32 px tiles, 4 px patches, pixel shuffle by 2: 16 tokens per tile) + a
    2-layer Llama, float32, saved with an ``Idefics3Processor`` whose image processor resizes images to at most
    64 px and splits them into 32 px tiles plus a global image (a 40x30 image: 2x2 tiles + 1 = 80 tokens), and
    the byte-level test tokenizer plus Idefics3's tokens."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from tests.engine.engine_fakes import byte_level_tokenizer

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tok = byte_level_tokenizer()
    tiles = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *tiles]
    tok.add_special_tokens({"additional_special_tokens": ["<special>", *specials]})
    tok.chat_template = CHAT_TEMPLATE
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=4)
    text = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                            image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
                            architectures=["Idefics3ForConditionalGeneration"])
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).eval()
    randomize(model, model.model.connector.modality_projection.proj.weight)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}),
        tokenizer=tok, image_seq_len=16, chat_template=CHAT_TEMPLATE)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def build_gemma3(path: str) -> str:
    """A 2-layer SigLIP tower (42 px images, 7 px patches: a 6x6 grid pooled 2x2 to 9 image tokens) + a 2-layer
    Gemma 3 decoder (a sliding layer with a 6-token window, shorter than an image, and a global layer), float32,
    saved with a ``Gemma3Processor`` (Pillow image processor) and the byte-level test tokenizer plus Gemma 3's
    image tokens."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from tests.engine.engine_fakes import byte_level_tokenizer

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    specials = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_tokenizer().backend_tokenizer, eos_token="<eos>",
        additional_special_tokens=["<special>", *specials],
        extra_special_tokens={"boi_token": specials[0], "image_token": specials[1], "eoi_token": specials[2]})
    template = CHAT_TEMPLATE.replace("<image>", "<start_of_image>")
    tok.chat_template = template
    ids = [tok.convert_tokens_to_ids(t) for t in specials]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=42,
                  patch_size=7, vision_use_head=False)
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=6,
                layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=None,
                eos_token_id=2, tie_word_embeddings=False)
    config = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=9, boi_token_index=ids[0],
                          image_token_index=ids[1], eoi_token_index=ids[2], tie_word_embeddings=False,
                          architectures=["Gemma3ForConditionalGeneration"])
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers initialises the projection to zeros
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)
    randomize(model, model.model.multi_modal_projector.mm_input_projection_weight)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 42, "width": 42}),
                                tokenizer=tok, image_seq_length=9, chat_template=template)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def build_llava_next(path: str) -> str:
    """:func:`llava_parts`' CLIP tower (28 px tiles, 16 tokens each) and Llama with LLaVA-NeXT's any-resolution
    tiles: grid resolutions 28x56, 56x28 and 56x56 px (a 40x30 image: a 2x2 grid plus the base tile, 16 + 6 rows
    of 8 + 1 tokens after unpadding), saved with a ``LlavaNextProcessor`` (Pillow image processor)."""
    import torch
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tok, vision, text = llava_parts()
    pinpoints = [[28, 56], [56, 28], [56, 56]]
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_grid_pinpoints=pinpoints,
                             image_token_index=tok.convert_tokens_to_ids("<image>"),
                             architectures=["LlavaNextForConditionalGeneration"])
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():  # as large as the (scaled-up) projected features, so that a misplaced newline shows
        model.model.image_newline.mul_(50.0)
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                 image_grid_pinpoints=pinpoints)
    return save_llava(path, model, image_processor, tok, LlavaNextProcessor)
