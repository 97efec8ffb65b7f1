"""The torch dtype of each model / KV-cache dtype name (the names are :data:`tokenmill.config.DTYPE_NAMES`)."""

from __future__ import annotations

import torch

from tokenmill.config import DTYPE_NAMES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def str_to_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (``"float32"``, ``"bfloat16"`` or ``"float16"``).

    Raises:
        ValueError: unknown dtype name.
    """
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {name!r} (choose from {', '.join(TORCH_DTYPES)})") from None
