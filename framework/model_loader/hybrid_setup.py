"""Engine settings a hybrid (attention + state layers) or attention-free model needs, decided from its model
class when the engine configuration is built.

A model class declares ``is_hybrid = True`` (state layers and possibly attention layers) and, when it has no
attention layer at all, ``is_attention_free = True`` (vLLM's ``IsHybrid`` / ``IsAttentionFree``).
"""

from __future__ import annotations

import logging

from tokenmill.config import EngineConfig
from tokenmill.model_loader.registry import ModelRegistry

logger = logging.getLogger(__name__)


def registered_model_cls(config: EngineConfig) -> type | None:
    """The configured model's registered class, or ``None`` for an unregistered architecture (it fails with its
    own error when loaded)."""
    archs = config.model_config.architectures
    if not any(ModelRegistry.is_registered(a) for a in archs):
        return None
    return ModelRegistry.resolve_model_cls(archs)


def model_has_state_layers(config: EngineConfig) -> tuple[bool, bool]:
    """(has state layers, has no attention layer) for the configured model's registered class; an
    unregistered architecture reports ``(False, False)``."""
    model_cls = registered_model_cls(config)
    return bool(getattr(model_cls, "is_hybrid", False)), bool(getattr(model_cls, "is_attention_free", False))


def configure_hybrid_cache(config: EngineConfig) -> None:
    """For a model with state layers: one state slot per schedulable request (``max_num_seqs``; the worker
    takes their memory out of the KV-cache budget) and prefix caching off (logged).

    Raises:
        ValueError: tensor or pipeline parallelism, or the pooling runner, which state layers do not support.
    """
    hybrid, attention_free = model_has_state_layers(config)
    if not hybrid:
        return
    arch = config.model_config.architectures[0]
    pc = config.parallel_config
    if pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size / pipeline_parallel_size: {arch} has state layers, which run on "
                         "one rank only; use 1")
    if config.model_config.runner_type != "generate":
        raise ValueError(f"runner: {arch} has state layers and is served for generation only")
    cc = config.cache_config
    cc.num_state_slots = config.scheduler_config.max_num_seqs
    cc.attention_free = attention_free
    if cc.enable_prefix_caching:
        logger.info("prefix caching is off for %s: its state layers would need a saved state per cached prefix, "
                    "which tokenmill does not keep", arch)
        cc.enable_prefix_caching = False
