"""What the step runners that a model runner owns read back from it.

:class:`~tokenmill.worker.compiled_runner.CompiledRunner` and :class:`~tokenmill.worker.graph_runner.GraphRunner`
are built by :class:`~tokenmill.worker.model_runner.ModelRunner` and read a few of its attributes; they name
this protocol instead of the class, so neither imports the module that imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from tokenmill.attention.backend import AttentionBackend
    from tokenmill.config import EngineConfig


class ModelRunnerView(Protocol):
    """Attributes:
    config: the engine configuration.
    model: the loaded model (``None`` before ``load_model``).
    device: the device the model and its KV caches live on.
    attn_backend: the attention backend class in use.
    block_size: tokens per KV cache block.
    kv_cache_dtype: dtype of the KV caches.
    kv_caches: one tensor per attention layer, in the backend's layout (empty before the cache is allocated).
    """

    config: EngineConfig
    model: torch.nn.Module | None
    device: torch.device
    attn_backend: type[AttentionBackend]
    block_size: int
    kv_cache_dtype: torch.dtype
    kv_caches: list[torch.Tensor]
