"""The rotary self-attention block of decoder layers, with the switches the common families need.

``DecoderAttention`` = fused ``qkv_proj`` -> optional q/k RMSNorm -> RoPE -> paged :class:`Attention` ->
``o_proj``. Switches: QKV bias with or without an ``o_proj`` bias (Qwen2: QKV only), per-head q/k norm (Qwen3,
Gemma 3) or whole-projection q/k norm (OLMo 2), a softmax scale other than ``head_dim ** -0.5`` (Gemma's
``query_pre_attn_scalar ** -0.5``, Granite's ``attention_multiplier``), an attention logit soft cap (Gemma 2),
a sliding window per layer (``sliding_window`` + ``layer_types``), partial rotary and per-layer rope
parameters (through the :class:`RotaryEmbedding` passed in).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from tokenmill.distributed import get_tp_rank, get_tp_size
from tokenmill.layers.attention import Attention
from tokenmill.layers.layernorm import RMSNorm, ShardedRMSNorm
from tokenmill.layers.linear import QKVParallelLinear, RowParallelLinear
from tokenmill.layers.rotary import RotaryEmbedding, get_rope

QKNorm = Literal["per_head", "full"]


class DecoderAttention(nn.Module):
    """Multi-head / grouped-query self-attention with rotary positions.

    Args:
        hidden_size: H.
        num_heads: query heads (all ranks).
        num_kv_heads: key/value heads (all ranks).
        head_dim: D.
        rotary_emb: the layer's RoPE (``None``: no positional rotation).
        qkv_bias: biases on the query/key/value projections.
        o_bias: bias on the output projection.
        qk_norm: ``"per_head"`` (RMSNorm over each head's D, Qwen3 / Gemma 3), ``"full"`` (over the whole
            projection, OLMo 2) or ``None``.
        norm_eps, norm_offset, norm_in_float32: the q/k norms' settings (see :class:`RMSNorm`).
        scale: softmax scale (default ``head_dim ** -0.5``).
        logits_soft_cap: ``c * tanh(s / c)`` on the scores.
        sliding_window: attend to the last ``sliding_window`` positions only.
        prefix: the module's name in the model (``model.layers.3.self_attn``).

    Checkpoint names: ``q_proj`` / ``k_proj`` / ``v_proj`` (stacked into ``qkv_proj``) or a fused ``qkv_proj``,
    ``o_proj``, ``q_norm``, ``k_norm``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary_emb: RotaryEmbedding | None,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: QKNorm | None = None,
        norm_eps: float = 1e-6,
        norm_offset: float = 0.0,
        norm_in_float32: bool = False,
        scale: float | None = None,
        logits_soft_cap: float | None = None,
        sliding_window: int | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.num_heads = num_heads // get_tp_size()
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qk_norm = qk_norm
        norm_kw = dict(offset=norm_offset, multiply_in_float32=norm_in_float32)
        if qk_norm == "per_head":
            self.q_norm = RMSNorm(head_dim, norm_eps, **norm_kw)
            self.k_norm = RMSNorm(head_dim, norm_eps, **norm_kw)
        elif qk_norm == "full":
            rank = get_tp_rank()
            self.q_norm = ShardedRMSNorm(self.q_size, rank, norm_eps, **norm_kw)
            self.k_norm = ShardedRMSNorm(self.kv_size, rank // self.qkv_proj.kv_replicas, norm_eps, **norm_kw)
        elif qk_norm is not None:
            raise ValueError(f"qk_norm must be 'per_head', 'full' or None, got {qk_norm!r}")
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            head_dim,
            head_dim**-0.5 if scale is None else scale,
            self.num_kv_heads,
            prefix=f"{prefix}.attn",
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """``positions`` ``[T]``, ``hidden_states`` ``[T, H]`` -> ``[T, H]``."""
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "per_head":
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)
            k = self.k_norm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
        elif self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


def layer_type_of(hf_config: Any, layer_idx: int) -> str:
    """``"sliding_attention"`` or ``"full_attention"`` for layer ``layer_idx`` (from ``layer_types`` when the
    config has them; otherwise every layer is sliding when ``sliding_window`` is set, as Mistral, Mixtral and
    Phi-3 do in transformers)."""
    types = getattr(hf_config, "layer_types", None)
    if types:
        return types[layer_idx]
    return "sliding_attention" if getattr(hf_config, "sliding_window", None) else "full_attention"


def layer_sliding_window(hf_config: Any, layer_idx: int, max_model_len: int) -> int | None:
    """The sliding window of layer ``layer_idx`` in tokens, or ``None`` (full attention, or a window no
    shorter than ``max_model_len``, which changes nothing)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or layer_type_of(hf_config, layer_idx) != "sliding_attention":
        return None
    return int(window) if int(window) < max_model_len else None


def attention_args(config: Any, layer_idx: int, prefix: str, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of :class:`DecoderAttention` read from an engine ``ModelConfig`` the usual way
    (``hidden_size``, heads, ``head_dim``, ``attention_bias`` on q/k/v and o, the layer's rope and sliding
    window); ``overrides`` replace any of them."""
    cfg = config.hf_config
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    max_position = max(config.max_model_len, int(getattr(cfg, "max_position_embeddings", 0) or 0))
    bias = bool(getattr(cfg, "attention_bias", False))
    args: dict[str, Any] = dict(
        hidden_size=cfg.hidden_size,
        num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rotary_emb=None,
        qkv_bias=bias,
        o_bias=bias,
        norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        sliding_window=layer_sliding_window(cfg, layer_idx, config.max_model_len),
        prefix=prefix,
    )
    if "rotary_emb" not in overrides:
        args["rotary_emb"] = get_rope(head_dim, max_position, cfg, layer_type=layer_type_of(cfg, layer_idx))
    args.update(overrides)
    return args
