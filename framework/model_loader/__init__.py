"""Loading models: architecture registry and weight loaders."""

from __future__ import annotations

from tokenmill.model_loader.registry import ModelRegistry

__all__ = ["ModelRegistry"]
