"""Rotary position embedding (RoPE, Su et al. 2021), "neox" layout (rotate halves), as Llama uses.

Supports the rope types ``default``, ``linear`` and ``llama3`` (frequency scaling as in Meta's Llama 3.1
reference code, parameters ``factor``, ``low_freq_factor``, ``high_freq_factor``,
``original_max_position_embeddings``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv
    assert scaling is not None
    if rope_type == "linear":
        return inv / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key tensors of a flattened batch.

    Args:
        head_size: D.
        rotary_dim: leading dims of each head that rotate (``== head_size`` for Llama).
        max_position: positions precomputed.
        base: theta.
        scaling: HF ``rope_scaling`` / ``rope_parameters`` dict, or ``None``.
    """

    def __init__(
        self, head_size: int, rotary_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        inv = _inv_freq(rotary_dim, base, scaling)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv)
        self.register_buffer("cos_cache", freqs.cos().float(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().float(), persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[T]`` int; ``query`` ``[T, Hq*D]``, ``key`` ``[T, Hkv*D]``; returns rotated copies."""
        if torch.compiler.is_compiling():  # traced: the compiler fuses the lookup into the rotation
            cos_sin = (self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1))
            return self._rotate(query, *cos_sin), self._rotate(key, *cos_sin)
        if positions is not self._positions or self._cos_sin is None:
            # Every layer shares this module (see get_rope) and the step's positions tensor: look up once.
            self._cos_sin = (self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1))
            self._positions = positions
        cos, sin = self._cos_sin  # [T, 1, rot/2]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.view(t, -1, self.head_size)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        x1, x2 = rot[..., :half].float(), rot[..., half:].float()
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if rest.shape[-1]:
            out = torch.cat((out, rest), dim=-1)
        return out.reshape(t, -1)


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(head_size: int, max_position: int, hf_config: Any, rotary_dim: int | None = None) -> RotaryEmbedding:
    """RotaryEmbedding from a transformers config (``rope_theta`` / ``rope_scaling`` or ``rope_parameters``).

    Layers with the same settings share one module (one cos/sin table, looked up once per step).
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or params or None
    base = getattr(hf_config, "rope_theta", None) or params.get("rope_theta") or 10000.0
    key = (head_size, rotary_dim or head_size, max_position, float(base), repr(sorted((scaling or {}).items())),
           torch.get_default_device())
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = RotaryEmbedding(head_size, rotary_dim or head_size, max_position, float(base), scaling)
        _ROPE_CACHE[key] = rope
    return rope
