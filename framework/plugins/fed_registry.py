"""Base of the class-level registries that plugin hooks fill (models, attention backends).

Entries come from three places, looked up in this order:

1. direct calls from the user's script (``Registry.register_x(...)``), in this process only;
2. the registry's hook (e.g. ``tokenmill_register_models``) of every loaded plugin, re-run whenever the
   plugin set is reloaded (new process, or :func:`tokenmill.plugins.reset_for_tests`);
3. built-in defaults of the subclass.

Values are ``"module:Class"`` paths (imported on first use) or classes. Every entry remembers who registered it
(:meth:`HookFedRegistry.source_of`), which ``tokenmill plugins`` shows.
"""

from __future__ import annotations

import logging
import threading
from typing import ClassVar

from tokenmill.plugins.manager import PluginLoadError, get_plugin_manager, load_generation
from tokenmill.plugins.qualname import resolve_qualname

logger = logging.getLogger(__name__)

Target = str | type


class HookFedRegistry:
    """Subclasses set :attr:`hook_name` and :attr:`kind`, and expose public wrappers of the ``_`` methods."""

    hook_name: ClassVar[str] = ""
    kind: ClassVar[str] = "entry"  # what an entry is called in messages, e.g. "architecture"
    _builtin: ClassVar[dict[str, Target]] = {}
    _script: ClassVar[dict[str, Target]]
    _plugin: ClassVar[dict[str, Target]]
    _sources: ClassVar[dict[str, str]]  # name -> "script" / "plugin <pluggy plugin name>" (plugin entries)
    _conflicts: ClassVar[list[str]]  # one line per plugin entry that replaced another plugin's
    _plugin_generation: ClassVar[int | None]
    _loading: ClassVar[str | None]  # the plugin whose hook is running, while one is
    _lock: ClassVar[threading.RLock]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls._script = {}
        cls._plugin = {}
        cls._sources = {}
        cls._conflicts = []
        cls._plugin_generation = None
        cls._loading = None
        cls._lock = threading.RLock()

    @classmethod
    def _normalize(cls, name: str) -> str:
        """How names compare (subclasses may fold case)."""
        return name

    @classmethod
    def _register(cls, name: str, target: Target) -> None:
        """Raises:
        TypeError: ``name`` is not a non-empty string or ``target`` is neither a class nor a string.
        ValueError: ``target`` is a string without ``":"`` (expected ``"module:Class"``).
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.kind} name must be a non-empty string, got {name!r}")
        if isinstance(target, str):
            if ":" not in target:
                raise ValueError(f"{cls.kind} {name!r}: expected a 'module:Class' path, got {target!r}")
        elif not isinstance(target, type):
            raise TypeError(f"{cls.kind} {name!r}: expected a class or 'module:Class' path, got {target!r}")
        name = cls._normalize(name)
        with cls._lock:
            table = cls._plugin if cls._loading is not None else cls._script
            previous = table.get(name)
            if previous is not None and previous != target:
                message = (f"{cls.kind} {name!r} registered twice: {target!r} (by "
                           f"{f'plugin {cls._loading}' if cls._loading else 'the script'}) "
                           f"replaces {previous!r} (by {cls._sources.get(name, 'the script')})")
                logger.warning("%s", message)
                if cls._loading is not None:
                    cls._conflicts.append(message)
            table[name] = target
            if cls._loading is not None:
                cls._sources[name] = f"plugin {cls._loading}"

    @classmethod
    def _ensure_plugins(cls) -> None:
        with cls._lock:
            if cls._loading:
                return  # a hook is registering right now (re-entrant lookup)
            generation = load_generation()
            if cls._plugin_generation == generation:
                return
            cls._plugin.clear()
            cls._sources.clear()
            cls._conflicts.clear()
            # Each plugin's hook separately, so that every entry knows its plugin and a hook that raises is named;
            # in load order (platform plugins, then general plugins, each by distribution name), so a plugin
            # loaded later replaces an earlier one's entry of the same name (with a warning): a general plugin can
            # override what a platform plugin registers.
            for impl in getattr(get_plugin_manager().hook, cls.hook_name).get_hookimpls():
                cls._loading = impl.plugin_name
                try:
                    impl.function(registry=cls)
                except Exception as exc:
                    cls._plugin.clear()  # retried (and raised again) on next use
                    cls._sources.clear()
                    raise PluginLoadError(
                        f"{cls.hook_name}() of plugin {impl.plugin_name} raised {type(exc).__name__}: {exc}"
                    ) from exc
                finally:
                    cls._loading = None
            cls._plugin_generation = generation

    @classmethod
    def _lookup(cls, name: str) -> Target | None:
        name = cls._normalize(name)
        cls._ensure_plugins()
        with cls._lock:
            for table in (cls._script, cls._plugin, cls._builtin):
                if name in table:
                    return table[name]
        return None

    @classmethod
    def source_of(cls, name: str) -> str:
        """Who provides the entry ``name`` now: ``"script"``, ``"plugin <plugin>"`` (the pluggy name
        ``group:entry point``), ``"builtin"``, or ``""`` when it is not registered."""
        name = cls._normalize(name)
        cls._ensure_plugins()
        with cls._lock:
            if name in cls._script:
                return "script"
            if name in cls._plugin:
                return cls._sources.get(name, "plugin")
            return "builtin" if name in cls._builtin else ""

    @classmethod
    def get_conflicts(cls) -> list[str]:
        """One line per name that two plugins registered (the one loaded later won); ``tokenmill plugins``
        shows them as warnings."""
        cls._ensure_plugins()
        with cls._lock:
            return list(cls._conflicts)

    @classmethod
    def _names(cls) -> list[str]:
        cls._ensure_plugins()
        with cls._lock:
            return sorted({*cls._script, *cls._plugin, *cls._builtin})

    @classmethod
    def _load(cls, name: str, target: Target) -> type:
        """Raises:
        ImportError: the path cannot be imported (the message names the entry).
        TypeError: the path names something that is not a class.
        """
        if isinstance(target, type):
            return target
        try:
            obj = resolve_qualname(target)
        except ImportError as exc:
            raise ImportError(f"cannot import {cls.kind} {name!r} from {target!r}: {exc}") from exc
        if not isinstance(obj, type):
            raise TypeError(f"{cls.kind} {name!r}: {target!r} is {type(obj).__name__}, not a class")
        return obj

    @classmethod
    def reset_for_tests(cls) -> None:
        """Drop script registrations and re-run the plugin hook on next use."""
        with cls._lock:
            cls._script.clear()
            cls._plugin.clear()
            cls._sources.clear()
            cls._conflicts.clear()
            cls._plugin_generation = None
