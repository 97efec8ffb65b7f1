"""Import an object from a ``"module:attr"`` path (how plugins name classes without importing them)."""

from __future__ import annotations

import importlib
from typing import Any


def resolve_qualname(path: str) -> Any:
    """Import ``"package.module:Attr"`` (``Attr`` may be dotted, e.g. ``"mod:Outer.Inner"``).

    Raises:
        ValueError: ``path`` has no ``":"`` separating module and attribute.
        ImportError: the module cannot be imported, or it has no such attribute (the message names ``path``).
    """
    module_name, sep, attr_path = path.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"expected a 'module:Attr' path, got {path!r}")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ImportError(f"{path!r}: module {module_name!r} has no attribute {attr_path!r}") from exc
    return obj
