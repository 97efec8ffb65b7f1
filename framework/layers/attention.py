"""The paged attention layer models use; the platform's backend does the work."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from tokenmill.attention.selector import get_attn_backend
from tokenmill.forward_context import get_forward_context


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache.

    Reads the step's metadata from the forward context; its ``kv_cache`` tensor is bound by the model runner.

    Args:
        num_heads: query heads on this rank.
        head_size: D.
        scale: softmax scale.
        num_kv_heads: key/value heads on this rank.
        prefix: the layer's unique name (e.g. ``model.layers.3.self_attn.attn``).
        sliding_window: attend to the last ``sliding_window`` positions only (``None``: all).
        logits_soft_cap: ``c * tanh(score / c)`` on the scaled scores (``None``: off).
        attn_type: ``"decoder"`` (causal, through the paged KV cache) or ``"encoder_only"`` (bidirectional:
            every token of a sequence sees every other; the whole sequence runs in one step and nothing is read
            from the cache), for encoder models such as BERT. Backends declare ``supports_encoder_only``.

    Raises:
        ValueError: the platform's attention backend does not support a requested option.
    """

    # AttentionImpl's constructor arguments plus ``prefix``: the layer hands them on to its backend's impl.
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        prefix: str = "",
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        attn_type: str = "decoder",
    ) -> None:
        super().__init__()
        self.layer_name = prefix
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        backend = get_attn_backend()
        options: dict[str, object] = {}
        for name, value, flag in (("sliding_window", sliding_window, "supports_sliding_window"),
                                  ("logits_soft_cap", logits_soft_cap, "supports_logits_soft_cap")):
            if value is None:
                continue
            if not getattr(backend, flag, False):
                raise ValueError(f"attention backend {backend.name or backend.__qualname__} does not support "
                                 f"{name} (layer {prefix!r}); choose a backend with {flag} = True")
            options[name] = value
        if attn_type not in ("decoder", "encoder_only"):
            raise ValueError(f"attn_type: must be 'decoder' or 'encoder_only', got {attn_type!r}")
        if attn_type == "encoder_only" and not getattr(backend, "supports_encoder_only", False):
            raise ValueError(f"attention backend {backend.name or backend.__qualname__} does not support "
                             f"encoder-only (bidirectional) attention (layer {prefix!r}); choose a backend with "
                             "supports_encoder_only = True (e.g. TORCH_PAGED)")
        self.attn_type = attn_type
        self.impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads, **options)
        self.kv_cache = torch.empty(0)
        # Unique in the model and the same in every process and run: compiled graphs hold it as a constant and
        # are saved and loaded by other processes (tokenmill.worker.compiled_runner), which look the layer up in
        # the forward context's attn_layers (the running model's), never in a process-wide table.
        self.op_key = prefix or f"attention#{next(_INSTANCE_IDS)}"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``query`` ``[T, Hq*D]``, ``key``/``value`` ``[T, Hkv*D]`` -> ``[T, Hq*D]``."""
        ctx = get_forward_context()
        if ctx.opaque_attention:
            return torch.ops.tokenmill.attention(query, key, value, self.op_key)
        return self.run_impl(query, key, value, ctx.attn_metadata)

    def run_impl(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        """The backend's attention for this layer's type (``[T, Hq*D]``)."""
        if self.attn_type == "encoder_only":
            return self.impl.forward_encoder(query, key, value, attn_metadata)  # type: ignore[attr-defined]
        return self.impl.forward(query, key, value, self.kv_cache, attn_metadata)


_INSTANCE_IDS = itertools.count()


def attention_layers(model: nn.Module) -> dict[str, Attention]:
    """``model``'s attention layers by ``op_key``: the forward context's ``attn_layers`` for opaque attention."""
    return {m.op_key: m for m in model.modules() if isinstance(m, Attention)}


@torch.library.custom_op("tokenmill::attention", mutates_args=())
def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_key: str) -> torch.Tensor:
    """One attention layer's whole step (cache write included) as a custom op: ``[T, Hq*D]``.

    torch.compile treats it as an opaque call, so a compiled forward pass can contain attention of any kind of
    step (prefill chunks, mixed batches) while the backend runs its own Python (per-request loops, host
    metadata) eagerly inside it. The layer, its backend and its cache are found by ``layer_key``, the step's
    metadata in the forward context (``attn_layers``, ``attn_metadata``); only the output is declared, so the compiler sees no mutation of the
    cache (it is never an argument) and keeps the calls in layer order through their data dependencies.
    """
    ctx = get_forward_context()
    if ctx.attn_layers is None:
        raise RuntimeError("tokenmill::attention needs the forward context's attn_layers (the running model's)")
    layer = ctx.attn_layers[layer_key]
    out = layer.run_impl(query, key, value, ctx.attn_metadata)
    return out.contiguous()


@attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_key: str) -> torch.Tensor:
    return query.new_empty(query.shape[0], query.shape[1])
