"""AttentionBackendRegistry: backend name -> attention backend class; what the engine consults.

Plugins add backends, or replace one under an existing name, through the hook
``tokenmill_register_attention_backends(registry)`` (a module of entry-point group ``tokenmill.plugins`` or
``tokenmill.platforms``); a platform names the one to use with ``Platform.get_attn_backend_cls(config)``, and
``--attention-backend NAME`` overrides the platform's choice (:func:`tokenmill.attention.selector.
select_attn_backend`). Names compare case-insensitively and are stored upper-case, as vLLM's are.
"""

from __future__ import annotations

from typing import ClassVar

from tokenmill.plugins.fed_registry import HookFedRegistry, Target


class UnknownAttentionBackendError(ValueError):
    """No attention backend is registered under the requested name."""


class AttentionBackendRegistry(HookFedRegistry):
    """Class-level map backend name -> ``"module:Class"`` (imported lazily) or class."""

    hook_name: ClassVar[str] = "tokenmill_register_attention_backends"
    kind: ClassVar[str] = "attention backend"
    _builtin: ClassVar[dict[str, Target]] = {
        "TORCH_PAGED": "tokenmill.attention.backends.torch_paged:TorchPagedAttentionBackend",
        "TRITON_PAGED": "tokenmill.attention.backends.triton_paged:TritonPagedAttentionBackend",
    }

    @classmethod
    def _normalize(cls, name: str) -> str:
        return name.strip().upper() if isinstance(name, str) else name

    @classmethod
    def register_backend(cls, name: str, backend_cls: Target) -> None:
        """Register ``backend_cls`` under ``name`` (script registrations win over plugins' and built-ins).

        Raises:
            TypeError: ``name`` is not a non-empty string or ``backend_cls`` is neither a class nor a string.
            ValueError: ``backend_cls`` is a string that is not ``"module:Class"``.
        """
        cls._register(name, backend_cls)

    @classmethod
    def get_backend_names(cls) -> list[str]:
        """Every registered backend name, sorted."""
        return cls._names()

    @classmethod
    def is_registered(cls, name: str) -> bool:
        return cls._lookup(name) is not None

    @classmethod
    def get_backend_path(cls, name: str) -> str:
        """``"module:Class"`` of backend ``name`` (a registered class is turned into its path).

        Raises:
            UnknownAttentionBackendError: ``name`` is not registered (the message lists the known ones).
        """
        target = cls._require(name)
        return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"

    @classmethod
    def resolve_backend_cls(cls, name: str) -> type:
        """The backend class registered as ``name``, imported now.

        Raises:
            UnknownAttentionBackendError: ``name`` is not registered.
            ImportError: the registered module cannot be imported.
            TypeError: the registered path is not a class.
        """
        return cls._load(name, cls._require(name))

    @classmethod
    def _require(cls, name: str) -> Target:
        target = cls._lookup(name)
        if target is None:
            known = ", ".join(cls.get_backend_names()) or "none"
            raise UnknownAttentionBackendError(
                f"unknown attention backend {name!r}; known: {known}. Plugins add backends with the hook "
                "tokenmill_register_attention_backends(registry) in entry-point group 'tokenmill.plugins'."
            )
        return target
