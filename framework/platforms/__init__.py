"""Platforms: the hardware tokenmill runs on, provided by plugins (entry-point group ``tokenmill.platforms``).

``current_platform`` resolves lazily on first attribute access; the CLI's ``--platform`` calls
:func:`set_current_platform` before anything touches it.
"""

from __future__ import annotations

from tokenmill.platforms.current import (
    current_platform,
    get_current_platform,
    get_platform_selection,
    reset_current_platform,
    set_current_platform,
)
from tokenmill.platforms.errors import (
    NoPlatformError,
    PlatformConflictError,
    PlatformDetectionError,
    PlatformError,
    UnknownPlatformError,
)
from tokenmill.platforms.interface import Platform, PlatformSpec, UnspecifiedPlatform
from tokenmill.platforms.selection import (
    PLATFORM_ENV,
    DetectionResult,
    PlatformSelection,
    detect_platforms,
    load_platform_class,
    resolve_platform,
    select_platform,
)

__all__ = [
    "PLATFORM_ENV",
    "DetectionResult",
    "NoPlatformError",
    "Platform",
    "PlatformConflictError",
    "PlatformDetectionError",
    "PlatformError",
    "PlatformSelection",
    "PlatformSpec",
    "UnknownPlatformError",
    "UnspecifiedPlatform",
    "current_platform",
    "detect_platforms",
    "get_current_platform",
    "get_platform_selection",
    "load_platform_class",
    "reset_current_platform",
    "resolve_platform",
    "select_platform",
    "set_current_platform",
]
