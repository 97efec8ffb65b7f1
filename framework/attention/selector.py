"""Which attention backend this process uses: chosen by name through the registry, set by the model runner.

:func:`select_attn_backend` is the one place the choice is made: ``--attention-backend NAME`` (or
``TOKENMILL_ATTENTION_BACKEND``) when given, else the platform's ``get_attn_backend_cls(config)``; the name is
resolved by :class:`tokenmill.attention.registry.AttentionBackendRegistry`, so a plugin that registers a
backend under the same name replaces it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.attention.backend import AttentionBackend
from tokenmill.plugins.qualname import resolve_qualname

if TYPE_CHECKING:
    from tokenmill.platforms.interface import Platform

ATTENTION_BACKEND_ENV = "TOKENMILL_ATTENTION_BACKEND"

_BACKEND: type[AttentionBackend] | None = None


@dataclass(frozen=True)
class AttentionBackendChoice:
    """Attributes:
    name: the name asked for (registry name, or a ``"module:Class"`` path).
    backend_cls: the resolved class.
    path: ``"module:Class"`` of that class.
    reason: who asked for it (``"--attention-backend"``, ``"TOKENMILL_ATTENTION_BACKEND"``, ``"platform cpu"``).
    source: who registered it (``"builtin"``, ``"plugin <name>"``, ``"script"``; ``"path"`` for a path).
    """

    name: str
    backend_cls: type[AttentionBackend]
    path: str
    reason: str
    source: str

    def describe(self) -> str:
        """``"CPU_PAGED (tokenmill_cpu.attention:CpuPagedAttentionBackend, registered by plugin ...), chosen
        by platform cpu"``: for start-up logs."""
        return f"{self.name} ({self.path}, registered by {self.source}), chosen by {self.reason}"


def select_attn_backend(platform: type[Platform], config: Any) -> AttentionBackendChoice:
    """The attention backend for ``config`` on ``platform``.

    Args:
        platform: the current platform class.
        config: the engine config (``config.attention_backend`` is the user's choice, or ``None``).

    Raises:
        tokenmill.attention.registry.UnknownAttentionBackendError: the name is not registered (the message
            lists the registered ones).
        ImportError: the backend's module cannot be imported.
        TypeError: the name resolves to something that is not an ``AttentionBackend`` subclass.
        ValueError: the model is a multimodal prefix-LM (``model_config.is_mm_prefix_lm``) and the backend the
            user named lacks ``supports_mm_prefix`` (the platform's own choice falls back to ``TORCH_PAGED``).
    """
    requested = getattr(config, "attention_backend", None)
    if requested:
        name, reason = requested, "--attention-backend"
    elif os.environ.get(ATTENTION_BACKEND_ENV):
        name, reason = os.environ[ATTENTION_BACKEND_ENV], ATTENTION_BACKEND_ENV
    else:
        name, reason = platform.get_attn_backend_cls(config), f"platform {platform.name}"
    choice = _resolve(name, reason)
    if getattr(getattr(config, "model_config", None), "is_mm_prefix_lm", False) \
            and not getattr(choice.backend_cls, "supports_mm_prefix", False):
        # bidirectional attention within an image's tokens (Gemma 3): the platform's pick yields to the torch
        # backend, which runs everywhere; a backend the user named is refused
        if reason != f"platform {platform.name}":
            raise ValueError(f"attention backend {choice.name} ({reason}) does not support bidirectional attention "
                             "within an image's tokens (supports_mm_prefix), which this model needs; use TORCH_PAGED")
        choice = _resolve("TORCH_PAGED", f"{reason} (its {choice.name} lacks supports_mm_prefix, which the model "
                                         "needs)")
    return choice


def _resolve(name: str, reason: str) -> AttentionBackendChoice:
    """``name`` (a registry name or ``"module:Class"``) resolved, with who asked for it."""
    from tokenmill.attention.registry import AttentionBackendRegistry

    if ":" in name:
        cls, source = resolve_qualname(name), "path"
    else:
        from tokenmill.attention.registry import UnknownAttentionBackendError

        try:
            cls = AttentionBackendRegistry.resolve_backend_cls(name)
        except UnknownAttentionBackendError as exc:
            raise UnknownAttentionBackendError(f"{exc} (the name came from {reason})") from None
        source = AttentionBackendRegistry.source_of(name)
        name = AttentionBackendRegistry._normalize(name)
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"attention backend {name!r} ({reason}) is {cls!r}, not an AttentionBackend subclass")
    return AttentionBackendChoice(name, cls, f"{cls.__module__}:{cls.__qualname__}", reason, source)


def load_backend_cls(path: str) -> type[AttentionBackend]:
    """Import a backend by registry name or ``"module:Class"`` path.

    Raises:
        tokenmill.attention.registry.UnknownAttentionBackendError: an unknown name.
        ValueError / ImportError: a malformed or missing path.
    """
    if ":" not in path:
        from tokenmill.attention.registry import AttentionBackendRegistry

        return AttentionBackendRegistry.resolve_backend_cls(path)
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
