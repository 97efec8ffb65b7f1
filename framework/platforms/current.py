"""The process's current platform: chosen once, lazily, unless the CLI picked one first."""

from __future__ import annotations

import os
import threading
from typing import Any

from tokenmill.platforms.interface import Platform
from tokenmill.platforms.selection import PLATFORM_ENV, PlatformSelection, select_platform

_lock = threading.RLock()
_current: type[Platform] | None = None
_selection: PlatformSelection | None = None


def get_current_platform() -> type[Platform]:
    """The platform of this process, resolved on first call (see :func:`select_platform` for errors)."""
    global _current, _selection
    with _lock:
        if _current is None:
            _selection = select_platform()
            _current = _selection.platform_cls
        return _current


def get_platform_selection() -> PlatformSelection:
    """The current platform and why it was chosen (resolving it now if needed)."""
    with _lock:
        cls = get_current_platform()
        if _selection is None or _selection.platform_cls is not cls:
            return PlatformSelection(cls, None, "set directly in this process (set_current_platform)")
        return _selection


def set_current_platform(platform: str | type[Platform]) -> type[Platform]:
    """Choose the platform now, before anything reads ``current_platform``.

    A name is resolved immediately (errors as :func:`resolve_platform`) and also written to
    ``TOKENMILL_PLATFORM`` so that engine-core and worker processes started later choose the same one.
    A class is used as is in this process only.
    """
    global _current, _selection
    with _lock:
        if isinstance(platform, str):
            _selection = select_platform(platform)
            cls = _selection.platform_cls
            os.environ[PLATFORM_ENV] = platform
        elif isinstance(platform, type) and issubclass(platform, Platform):
            cls = platform
            _selection = None
        else:
            raise TypeError(f"expected a platform name or Platform subclass, got {platform!r}")
        _current = cls
        return cls


def reset_current_platform() -> None:
    """Forget the chosen platform (tests); the next access resolves it again."""
    global _current, _selection
    with _lock:
        _current = None
        _selection = None


class _CurrentPlatformProxy:
    """Forwards attribute access to :func:`get_current_platform`, resolving it on first use."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # introspection (copy, pickle, inspect) must not pick a platform
        return getattr(get_current_platform(), name)

    def __repr__(self) -> str:
        chosen = _current
        return f"<current_platform: {chosen.name if chosen is not None else 'not resolved yet'}>"


current_platform: Any = _CurrentPlatformProxy()
