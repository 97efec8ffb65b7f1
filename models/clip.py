"""The CLIP vision transformer (Radford et al. 2021) as vision-language models use it: patch embedding with a
class token and learned positions, a pre-norm, pre-LayerNorm encoder layers with bidirectional attention over
one image's tokens. Parameter names follow transformers' ``CLIPVisionTransformer``; the linear layers are
tokenmill's tensor-parallel ones (heads split across ranks), the attention torch's SDPA (an image's tokens never
enter the paged KV cache).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import get_tp_size
from tokenmill.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear


def vision_activation(name: str) -> nn.Module:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image's tokens (``q_proj``/``k_proj``/``v_proj`` stacked into
    ``qkv_proj``, ``out_proj``; biases on all)."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, num_heads, num_heads, bias=True)
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias=True)
        self.num_heads = num_heads // get_tp_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, H]`` (one image's tokens) -> ``[N, H]``."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(n, self.num_heads, self.head_dim).transpose(0, 1) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden_size, intermediate_size, bias=True)
        self.act = vision_activation(act)
        self.fc2 = RowParallelLinear(intermediate_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg.hidden_size, cfg.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size,
                                         bias=False)
        num_positions = (cfg.image_size // cfg.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[3, S, S]`` (the config's image size) -> ``[1 + (S / patch)^2, H]``."""
        patches = self.patch_embedding(pixel_values.unsqueeze(0).to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2)[0].transpose(0, 1)
        x = torch.cat([self.class_embedding.unsqueeze(0), patches])
        if x.shape[0] != self.position_embedding.num_embeddings:
            raise ValueError(f"CLIP vision: the image gives {x.shape[0] - 1} patches, the model has positions for "
                             f"{self.position_embedding.num_embeddings - 1} (resize images to its image_size)")
        return x + self.position_embedding.weight


class CLIPVisionModel(nn.Module):
    """transformers' ``CLIPVisionModel`` minus the pooled output's use: returns the hidden states of each layer.

    Args:
        cfg: a ``CLIPVisionConfig``.
        num_layers: encoder layers to build and run (a model reading an earlier layer's output needs no more).
    """

    def __init__(self, cfg: Any, num_layers: int | None = None) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)  # transformers' spelling
        count = cfg.num_hidden_layers if num_layers is None else num_layers
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(count))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """``pixel_values`` ``[3, S, S]`` -> the hidden states ``[N, H]`` after the pre-norm and after each built
        layer (transformers' ``hidden_states`` tuple, as far as built)."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return states
