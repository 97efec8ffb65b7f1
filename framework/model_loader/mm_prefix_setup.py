"""Engine settings of a multimodal prefix-LM (vLLM's ``is_mm_prefix_lm``: an image's tokens attend to each other
in both directions, Gemma 3's vision model), decided from its model class when the engine configuration is built
(docs/multimodal.md)."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.model_loader.hybrid_setup import registered_model_cls


def configure_mm_prefix_lm(config: EngineConfig) -> None:
    """Set ``model_config.is_mm_prefix_lm`` from the registered model class's ``is_mm_prefix_lm``."""
    config.model_config.is_mm_prefix_lm = bool(getattr(registered_model_cls(config), "is_mm_prefix_lm", False))
