"""Multimodal (image) inputs: loading images, the Hugging Face processor, and the per-image features that travel
with a request to the workers (docs/multimodal.md)."""

from __future__ import annotations

from tokenmill.multimodal.inputs import MultiModalFeature, PlaceholderRange, TensorData

__all__ = ["MultiModalFeature", "PlaceholderRange", "TensorData"]
