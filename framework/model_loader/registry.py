"""ModelRegistry: architecture name (as in config.json ``architectures``) -> model class.

Built-in and third-party architectures register the same way: an entry point in group ``tokenmill.plugins``
whose module implements ``tokenmill_register_models(registry)``. ``ModelRegistry.register_model`` also
works from a script, but only in that process: an engine core or worker started as a separate process sees
entry-point registrations only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from tokenmill.plugins.fed_registry import HookFedRegistry, Target

_HOW_TO_REGISTER = (
    "To add an architecture, ship a package with an entry point in group 'tokenmill.plugins' whose module "
    "implements `@tokenmill.plugin_api.hookimpl def tokenmill_register_models(registry): "
    "registry.register_model('MyForCausalLM', 'my_pkg.model:MyForCausalLM')` (docs/plugins.md, \"A model "
    "plugin\"); or call tokenmill.ModelRegistry.register_model(...) in your script (that only works when the "
    "engine runs in the same process). `tokenmill plugins` lists what is registered."
)


class UnknownArchitectureError(ValueError):
    """None of a model's architectures is registered."""


class ModelRegistry(HookFedRegistry):
    """Class-level map architecture -> ``"module:Class"`` (imported lazily) or class."""

    hook_name: ClassVar[str] = "tokenmill_register_models"
    kind: ClassVar[str] = "architecture"

    @classmethod
    def register_model(cls, arch: str, model_cls: Target) -> None:
        """Register ``arch`` (e.g. ``"LlamaForCausalLM"``) as ``model_cls``.

        Registrations from a script take precedence over plugins' and last in this process only.

        Raises:
            TypeError: ``arch`` is not a non-empty string or ``model_cls`` is neither a class nor a string.
            ValueError: ``model_cls`` is a string that is not ``"module:Class"``.
        """
        cls._register(arch, model_cls)

    @classmethod
    def get_supported_archs(cls) -> list[str]:
        """Every registered architecture name, sorted."""
        return cls._names()

    @classmethod
    def is_registered(cls, arch: str) -> bool:
        return cls._lookup(arch) is not None

    @classmethod
    def resolve_model_cls(cls, architectures: Sequence[str]) -> type:
        """The class of the first registered architecture in ``architectures``, imported now.

        Raises:
            UnknownArchitectureError: none is registered (the message lists the known ones and how to
                register one).
            ImportError: the registered module cannot be imported.
            TypeError: the registered path is not a class.
        """
        for arch in architectures:
            target = cls._lookup(arch)
            if target is not None:
                return cls._load(arch, target)
        known = ", ".join(cls.get_supported_archs()) or "none"
        if not architectures:
            head = "the model's config lists no architectures (config.json 'architectures' is empty)"
        else:
            head = f"model architecture(s) {list(architectures)} are not supported by tokenmill"
        from tokenmill.plugins.manager import get_plugin_warnings

        hints = "".join(f" Plugin warning: {w}." for w in get_plugin_warnings() if "implements no tokenmill hook" in w)
        raise UnknownArchitectureError(f"{head}. Known architectures: {known}. {_HOW_TO_REGISTER}{hints}")
