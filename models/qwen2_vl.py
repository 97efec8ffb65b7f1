"""Qwen2-VL (Wang et al. 2024, "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any
Resolution"), transformers' ``Qwen2VLForConditionalGeneration``: a ViT over 14-px patches of the image at its own
resolution (2-D rotary positions inside the tower, 2x2 patches merged into one token by an MLP) in front of a
Qwen2 decoder whose rotary positions are 3-D (M-RoPE: temporal, height, width; text tokens have three equal
positions and continue after an image from its largest position + 1).

The image's placeholder (``<|image_pad|>`` between ``<|vision_start|>`` and ``<|vision_end|>``) is expanded to
``t * h * w / merge^2`` tokens here, with the checkpoint's image processor and tokenizer (what transformers'
``Qwen2VLProcessor`` does; that class also needs torchvision for video, which image input does not).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import get_tp_size
from tokenmill.layers import (
    ColumnParallelLinear,
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    GatedMLP,
    QKVParallelLinear,
    RowParallelLinear,
    attention_args,
)
from tokenmill.layers.mrope import get_mrope
from tokenmill.models.clip import VisionMLP


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def vision_positions(grid_thw: Sequence[int], merge: int) -> torch.Tensor:
    """``[t*h*w, 2]`` (row, column) of each patch, in the processor's order: merge-size blocks, row-major."""
    t, h, w = (int(v) for v in grid_thw)
    rows = torch.arange(h).unsqueeze(1).expand(h, w)
    cols = torch.arange(w).unsqueeze(0).expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(1, 2).flatten()
    cols = cols.reshape(shape).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


class Qwen2VisionAttention(nn.Module):
    """Bidirectional attention within runs of patches (a frame, or a window) with 2-D rotary positions (fused
    ``qkv``, ``proj``)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.qkv = QKVParallelLinear(dim, self.head_dim, num_heads, num_heads, bias=True)
        self.proj = RowParallelLinear(dim, dim, bias=True)
        self.num_heads = num_heads // get_tp_size()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
        """``x`` ``[N, dim]``; ``cos``/``sin`` ``[N, head_dim]`` float32; each patch attends to the patches of
        its run ``[bounds[i], bounds[i + 1])``."""
        n = x.shape[0]
        q, k, v = (t.reshape(n, self.num_heads, self.head_dim) for t in self.qkv(x).chunk(3, dim=-1))
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(n, -1))


class Qwen2VisionBlock(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.attn = Qwen2VisionAttention(cfg.embed_dim, cfg.num_heads)
        self.mlp = VisionMLP(cfg.embed_dim, int(cfg.embed_dim * cfg.mlp_ratio), cfg.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class Qwen2PatchMerger(nn.Module):
    """``norm``, then each ``merge x merge`` block of patches (consecutive rows) -> one text-sized token."""

    def __init__(self, dim: int, context_dim: int, merge: int, norm: nn.Module) -> None:
        super().__init__()
        self.hidden = context_dim * merge * merge
        self.ln_q = norm
        self.mlp = nn.Sequential(ColumnParallelLinear(self.hidden, self.hidden, bias=True), nn.GELU(),
                                 RowParallelLinear(self.hidden, dim, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.hidden))


class Qwen2VisionTransformer(nn.Module):
    """transformers' ``Qwen2VisionTransformerPretrainedModel`` for one image at a time."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        embed_dim, out_dim = self.dims(cfg)
        self.merge = cfg.spatial_merge_size
        self.patch_embed = nn.Module()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, embed_dim, kernel, kernel, bias=False)
        self.kernel = (cfg.in_channels, *kernel)
        self.blocks = nn.ModuleList(self.make_block(cfg) for _ in range(cfg.depth))
        self.merger = Qwen2PatchMerger(out_dim, embed_dim, self.merge, self.make_norm(embed_dim))
        head_dim = embed_dim // cfg.num_heads
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = float(params.get("rope_theta", 10000.0))
        spatial = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial),
                             persistent=False)

    @staticmethod
    def dims(cfg: Any) -> tuple[int, int]:
        """(the tower's width, the text model's hidden size)."""
        return cfg.embed_dim, cfg.hidden_size

    def make_block(self, cfg: Any) -> nn.Module:
        return Qwen2VisionBlock(cfg)

    def make_norm(self, dim: int) -> nn.Module:
        return nn.LayerNorm(dim, eps=1e-6)

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[int]) -> torch.Tensor:
        """``pixel_values`` ``[t*h*w, C*T*P*P]`` (the processor's patch rows), ``grid_thw`` ``(t, h, w)`` ->
        ``[t*h*w / merge^2, text hidden]``."""
        x = self.embed_patches(pixel_values)
        cos, sin = self.rotary(grid_thw, x.device)
        frame = int(grid_thw[1]) * int(grid_thw[2])
        bounds = list(range(0, x.shape[0] + 1, frame))
        for block in self.blocks:
            x = block(x, cos, sin, bounds)
        return self.merger(x)

    def embed_patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C*T*P*P]`` patch rows -> ``[N, embed_dim]``."""
        weight = self.patch_embed.proj.weight
        return self.patch_embed.proj(pixel_values.to(weight.dtype).view(-1, *self.kernel)).view(pixel_values.shape[0], -1)

    def rotary(self, grid_thw: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[N, head_dim]`` float32 of each patch: the row's frequencies, then the column's, twice."""
        freqs = vision_positions(grid_thw, self.merge).to(device).unsqueeze(-1).float() * self.inv_freq
        angles = torch.cat((freqs.flatten(1), freqs.flatten(1)), dim=-1)
        return angles.cos(), angles.sin()


class Qwen2VLDecoderLayer(DecoderLayer):
    """Qwen2's layer (q/k/v bias) with M-RoPE."""

    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        cfg = config.hf_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        max_position = max(config.max_model_len, int(getattr(cfg, "max_position_embeddings", 0) or 0))
        super().__init__(
            DecoderAttention(**attention_args(config, layer_idx, f"{prefix}.self_attn", qkv_bias=True, o_bias=False,
                                              rotary_emb=get_mrope(head_dim, max_position, cfg))),
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act),
            cfg.hidden_size,
            cfg.rms_norm_eps,
        )


class Qwen2VLPromptProcessor:
    """Prompt text + images -> ``input_ids`` with each ``<|image_pad|>`` repeated once per merged patch,
    ``pixel_values`` and ``image_grid_thw`` (transformers' ``Qwen2VLProcessor`` for images)."""

    def __init__(self, image_processor: Any, tokenizer: Any, image_token: str, merge: int) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token = image_token
        self.merge = merge

    def __call__(self, text: list[str], images: list[Any], return_tensors: str = "pt",
                 add_special_tokens: bool = True, **kwargs: Any) -> dict[str, torch.Tensor]:
        """Raises: ValueError when the prompt holds fewer or more placeholders than images."""
        prompt = text[0]
        out: dict[str, torch.Tensor] = {}
        if images:
            out = dict(self.image_processor(images=images, return_tensors="pt", **kwargs))
            pieces = prompt.split(self.image_token)
            if len(pieces) - 1 != len(images):
                raise ValueError(f"the prompt holds {len(pieces) - 1} {self.image_token} placeholders for "
                                 f"{len(images)} images")
            counts = [int(g.prod()) // self.merge**2 for g in out["image_grid_thw"]]
            prompt = pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:]))
        ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        out["input_ids"] = torch.tensor([ids])
        return out


class Qwen2VLForConditionalGeneration(DecoderForCausalLM):
    """The model contract plus :class:`tokenmill.model_contract.SupportsMultiModal` and M-RoPE positions
    (``uses_mrope``: the worker passes ``[3, T]`` positions from :meth:`get_mrope_input_positions`)."""

    layer_type = Qwen2VLDecoderLayer
    supports_multimodal: ClassVar[bool] = True
    uses_mrope: ClassVar[bool] = True
    supports_pp: ClassVar[bool] = False
    checkpoint_name_remap: ClassVar[Mapping[str, str]] = {"model.language_model.": "model.", "model.visual.": "visual."}
    image_token: ClassVar[str] = "<|image_pad|>"
    vision_tower_cls: ClassVar[type[nn.Module]] = Qwen2VisionTransformer

    def __init__(self, config: Any, prefix: str = "") -> None:
        full = config.hf_config
        text = getattr(full, "text_config", None) or full
        super().__init__(dataclasses.replace(config, hf_config=text), prefix)
        self.full_config = full
        self.visual = self.vision_tower_cls(full.vision_config)

    # ---------------------------------------------------------------- SupportsMultiModal (front end)

    @classmethod
    def build_hf_processor(cls, model_config: Any) -> Qwen2VLPromptProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        path, trust = model_config.tokenizer, model_config.trust_remote_code
        image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust)
        return Qwen2VLPromptProcessor(image_processor, AutoTokenizer.from_pretrained(path, trust_remote_code=trust),
                                      cls.image_token, int(model_config.hf_config.vision_config.spatial_merge_size))

    @classmethod
    def get_image_token_id(cls, hf_config: Any) -> int:
        return int(hf_config.image_token_id)

    @classmethod
    def split_image_inputs(cls, hf_config: Any, processed: Mapping[str, torch.Tensor], num_images: int
                           ) -> list[dict[str, torch.Tensor]]:
        grids = processed["image_grid_thw"]
        if grids.shape[0] != num_images:
            raise ValueError(f"the processor gave {grids.shape[0]} image grids for {num_images} images")
        items, at = [], 0
        for grid in grids:
            n = int(grid.prod())
            items.append({"pixel_values": processed["pixel_values"][at : at + n], "image_grid_thw": grid.clone()})
            at += n
        return items

    @classmethod
    def get_num_image_tokens(cls, hf_config: Any, item: Mapping[str, torch.Tensor]) -> int:
        return int(item["image_grid_thw"].prod()) // int(hf_config.vision_config.spatial_merge_size) ** 2

    # ---------------------------------------------------------------- SupportsMultiModal (worker)

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        return self.visual(pixel_values, image_grid_thw.tolist())

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def get_mrope_input_positions(self, token_ids: Sequence[int], mm_features: Sequence[Any]
                                  ) -> tuple[torch.Tensor, int]:
        """The prompt's 3-D positions ``[3, len(token_ids)]`` int64 and the offset later tokens add to their
        index (``max position + 1 - len(token_ids)``), as transformers' ``get_rope_index``: text runs count
        on from the previous position; an image's tokens get (temporal, row, column) after the text before it,
        and the text after it continues from there + ``max(rows, columns)``.

        Raises:
            ValueError: an image's grid does not match its placeholder length.
        """
        merge = int(self.full_config.vision_config.spatial_merge_size)
        chunks: list[torch.Tensor] = []
        current = at = 0
        for feature in sorted(mm_features, key=lambda f: f.placeholder.offset):
            gap = feature.placeholder.offset - at
            chunks.append(torch.arange(current, current + gap).expand(3, -1))
            current += gap
            t, h, w = (int(v) for v in feature.data["image_grid_thw"].to_tensor().tolist())
            grid = torch.meshgrid(torch.arange(t), torch.arange(h // merge) + current,
                                  torch.arange(w // merge) + current, indexing="ij")
            image = torch.stack(grid).reshape(3, -1)
            image[0] += current
            if image.shape[1] != feature.placeholder.length:
                raise ValueError(f"an image grid of {image.shape[1]} tokens for a placeholder of "
                                 f"{feature.placeholder.length}")
            chunks.append(image)
            current += max(h, w) // merge
            at = feature.placeholder.end
        chunks.append(torch.arange(current, current + len(token_ids) - at).expand(3, -1))
        positions = torch.cat(chunks, dim=1).to(torch.int64)
        return positions, int(positions.max()) + 1 - len(token_ids)
