"""The torch dtype of each model / KV-cache dtype name (the names are :data:`tokenmill.config.DTYPE_NAMES`)."""

from __future__ import annotations

import torch

from tokenmill.config import DTYPE_NAMES, KV_CACHE_DTYPES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
# Quantized KV-cache element types (tokenmill.attention.kv_cache_quant); "fp8" is "fp8_e4m3", as in vLLM.
QUANTIZED_KV_TORCH_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def str_to_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (``"float32"``, ``"bfloat16"`` or ``"float16"``).

    Raises:
        ValueError: unknown dtype name.
    """
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {name!r} (choose from {', '.join(TORCH_DTYPES)})") from None


def kv_cache_dtype_to_torch(name: str) -> torch.dtype:
    """The element type of a KV cache named ``name`` (a model dtype name, ``"int8"``, ``"fp8"``, ``"fp8_e4m3"``
    or ``"fp8_e5m2"``; not ``"auto"``).

    Raises:
        ValueError: unknown name (the message lists :data:`tokenmill.config.KV_CACHE_DTYPES`).
    """
    if name in QUANTIZED_KV_TORCH_DTYPES:
        return QUANTIZED_KV_TORCH_DTYPES[name]
    if name in TORCH_DTYPES:
        return TORCH_DTYPES[name]
    raise ValueError(f"kv_cache_dtype: unknown KV cache dtype {name!r} (choose from {', '.join(KV_CACHE_DTYPES)})")
