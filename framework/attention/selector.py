"""The attention backend in use in this process (chosen by the platform, set by the model runner)."""

from __future__ import annotations

from tokenmill.attention.backend import AttentionBackend
from tokenmill.plugins.qualname import resolve_qualname

_BACKEND: type[AttentionBackend] | None = None


def load_backend_cls(path: str) -> type[AttentionBackend]:
    """Import ``"module:Class"`` (the platform's choice).

    Raises:
        ValueError: ``path`` is not of the form ``module:Class``.
        ImportError: the module or class does not exist.
    """
    return resolve_qualname(path)


def set_attn_backend(cls: type[AttentionBackend]) -> None:
    global _BACKEND
    _BACKEND = cls


def get_attn_backend() -> type[AttentionBackend]:
    """The backend set by the model runner, or the core's torch backend when none was set (tests)."""
    if _BACKEND is None:
        from tokenmill.attention.backends.torch_paged import TorchPagedAttentionBackend

        return TorchPagedAttentionBackend
    return _BACKEND
