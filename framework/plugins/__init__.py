"""tokenmill's plugin system: pluggy hooks discovered through Python entry points.

Public API for plugin authors: :data:`hookimpl` (decorate hook functions with it) and the hook names in
:mod:`tokenmill.plugins.hookspecs`. The engine uses :func:`get_plugin_manager`,
:func:`load_general_plugins` and :func:`get_platform_specs`.
"""

from __future__ import annotations

from tokenmill.plugins.hookspecs import hookimpl, hookspec
from tokenmill.plugins.manager import (
    GENERAL_GROUP,
    PLATFORM_GROUP,
    LoadedPlatformSpec,
    PluginLoadError,
    PluginStatus,
    get_platform_specs,
    get_plugin_manager,
    get_plugin_status,
    load_general_plugins,
    load_generation,
    reset_for_tests,
)
from tokenmill.plugins.qualname import resolve_qualname

__all__ = [
    "GENERAL_GROUP",
    "PLATFORM_GROUP",
    "LoadedPlatformSpec",
    "PluginLoadError",
    "PluginStatus",
    "get_platform_specs",
    "get_plugin_manager",
    "get_plugin_status",
    "hookimpl",
    "hookspec",
    "load_general_plugins",
    "load_generation",
    "reset_for_tests",
    "resolve_qualname",
]
