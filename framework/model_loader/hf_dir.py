"""Weights of a Hugging Face-layout directory (``*.safetensors``, or ``pytorch_model*.bin`` as a fallback)."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch


def iterate_hf_weights(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in the directory's checkpoint files.

    Raises:
        FileNotFoundError: no ``.safetensors`` or ``.bin`` checkpoint in the directory.
    """
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if files:
        from safetensors import safe_open

        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    files = sorted(glob.glob(os.path.join(directory, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors or pytorch_model*.bin files in {directory!r}")
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=True)
        yield from state.items()
