"""The attention backend in use in this process (chosen by the platform, set by the model runner)."""

from __future__ import annotations

import importlib

from tokenmill.attention.backend import AttentionBackend

_BACKEND: type[AttentionBackend] | None = None


def load_backend_cls(path: str) -> type[AttentionBackend]:
    """Import ``"module:Class"``.

    Raises:
        ImportError: the module or class does not exist.
    """
    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name, None)
    if cls is None:
        raise ImportError(f"attention backend {path!r}: {module} has no attribute {name!r}")
    return cls


def set_attn_backend(cls: type[AttentionBackend]) -> None:
    global _BACKEND
    _BACKEND = cls


def get_attn_backend() -> type[AttentionBackend]:
    """The backend set by the model runner, or the core's torch backend when none was set (tests)."""
    if _BACKEND is None:
        from tokenmill.attention.backends.torch_paged import TorchPagedAttentionBackend

        return TorchPagedAttentionBackend
    return _BACKEND
