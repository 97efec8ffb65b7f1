"""Entry-point discovery and the per-process pluggy plugin manager.

Two entry-point groups are loaded, once per process (the guard is keyed by ``os.getpid()``, so forked or
spawned workers load them again):

* ``tokenmill.platforms``: modules implementing ``tokenmill_platform()``;
* ``tokenmill.plugins``: modules implementing any other hook.

When the environment variable ``TOKENMILL_PLUGINS`` holds a comma-separated list of entry-point names, only
those entry points (of either group) are loaded. An entry point that fails to import stops loading with a
:class:`PluginLoadError` naming the entry point and its distribution.
"""

from __future__ import annotations

import importlib
import importlib.metadata as importlib_metadata
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

from tokenmill.plugins import hookspecs

if TYPE_CHECKING:
    from tokenmill.platforms.interface import PlatformSpec

logger = logging.getLogger(__name__)

PLATFORM_GROUP = "tokenmill.platforms"
GENERAL_GROUP = "tokenmill.plugins"
PLUGINS_ENV = "TOKENMILL_PLUGINS"
_UNKNOWN_DIST = "<unknown distribution>"


class PluginLoadError(RuntimeError):
    """A plugin entry point could not be imported, registered or queried."""


@dataclass(frozen=True)
class PluginStatus:
    """One discovered entry point and whether it was loaded in this process.

    Attributes:
        group: the entry-point group (``tokenmill.platforms`` or ``tokenmill.plugins``).
        entry_point: the entry point's name.
        value: what it points at (``"module"`` or ``"module:attr"``).
        distribution: the distribution that declares it.
        loaded: False when ``TOKENMILL_PLUGINS`` excluded it.
    """

    group: str
    entry_point: str
    value: str
    distribution: str
    loaded: bool


@dataclass(frozen=True)
class LoadedPlatformSpec:
    """A platform plugin's :class:`~tokenmill.platforms.PlatformSpec` and where it came from."""

    spec: PlatformSpec
    entry_point: str
    distribution: str

    @property
    def name(self) -> str:
        return self.spec.name

    def describe(self) -> str:
        """``"cpu (entry point 'cpu' of distribution tokenmill-cpu)"``: for error messages."""
        return f"{self.spec.name} (entry point {self.entry_point!r} of distribution {self.distribution})"


@dataclass
class _LoadedState:
    pid: int
    generation: int
    pm: pluggy.PluginManager
    platform_specs: list[LoadedPlatformSpec]
    statuses: list[PluginStatus]


@dataclass(frozen=True)
class _Discovered:
    entry_point: importlib_metadata.EntryPoint
    distribution: str


_lock = threading.RLock()
_state: _LoadedState | None = None
_generation = 0
_search_path: tuple[str, ...] | None = None


def get_plugin_manager() -> pluggy.PluginManager:
    """The process's plugin manager with every allowed plugin of both groups registered.

    Raises:
        PluginLoadError: an entry point failed to import or register.
    """
    return _ensure_loaded().pm


def load_general_plugins() -> None:
    """Load the plugins of both entry-point groups into this process (no-op when already loaded).

    Raises:
        PluginLoadError: an entry point failed to import or register.
    """
    _ensure_loaded()


def get_platform_specs() -> list[LoadedPlatformSpec]:
    """Every allowed platform plugin's spec, sorted by distribution then entry-point name.

    Raises:
        PluginLoadError: a platform entry point failed to import, lacks ``tokenmill_platform``, or it
            raised / returned something other than a ``PlatformSpec``.
    """
    return list(_ensure_loaded().platform_specs)


def get_plugin_status() -> list[PluginStatus]:
    """Every discovered entry point of both groups, with whether ``TOKENMILL_PLUGINS`` let it load."""
    return list(_ensure_loaded().statuses)


def load_generation() -> int:
    """A number that changes whenever the plugin set is (re)loaded: in a new process or after a reset.

    Registries fed by hooks compare it with the value they saw last to know when to re-run the hooks.
    """
    return _ensure_loaded().generation


def reset_for_tests(search_path: Sequence[str | os.PathLike[str]] | None = None) -> None:
    """Forget the loaded plugins; the next call reloads them.

    Args:
        search_path: when given, entry points are discovered only in distributions (``*.dist-info``)
            found in these directories, instead of all of ``sys.path``; ``None`` restores normal discovery.
            Plugin modules are still imported through ``sys.path``.
    """
    global _state, _search_path
    with _lock:
        _state = None
        _search_path = None if search_path is None else tuple(os.fspath(p) for p in search_path)
        importlib.invalidate_caches()


def _ensure_loaded() -> _LoadedState:
    global _state, _generation
    with _lock:
        if _state is not None and _state.pid == os.getpid():
            return _state
        _generation += 1
        _state = _load(_generation)
        return _state


def _allowed_names() -> set[str] | None:
    raw = os.environ.get(PLUGINS_ENV, "")
    names = {n.strip() for n in raw.split(",") if n.strip()}
    return names or None


def _dist_name(dist: importlib_metadata.Distribution | None) -> str:
    if dist is None:
        return _UNKNOWN_DIST
    name = dist.metadata["Name"] if dist.metadata is not None else None
    return str(name) if name else _UNKNOWN_DIST


def _discover(group: str) -> list[_Discovered]:
    found: list[_Discovered] = []
    if _search_path is None:
        for ep in importlib_metadata.entry_points(group=group):
            found.append(_Discovered(ep, _dist_name(getattr(ep, "dist", None))))
    else:
        seen: set[str] = set()
        for dist in importlib_metadata.distributions(path=list(_search_path)):
            name = _dist_name(dist)
            key = name.lower().replace("-", "_").replace(".", "_")
            if key in seen:  # the first one on the path wins, as importlib.metadata does
                continue
            seen.add(key)
            found.extend(_Discovered(ep, name) for ep in dist.entry_points if ep.group == group)
    found.sort(key=lambda d: (d.distribution, d.entry_point.name))
    return found


def _where(d: _Discovered) -> str:
    ep = d.entry_point
    return f"entry point {ep.name!r} = {ep.value!r} (group {ep.group}, distribution {d.distribution})"


def _load(generation: int) -> _LoadedState:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    allowed = _allowed_names()
    statuses: list[PluginStatus] = []
    platform_plugins: list[tuple[_Discovered, str]] = []
    seen_names: set[str] = set()

    for group in (PLATFORM_GROUP, GENERAL_GROUP):
        for d in _discover(group):
            ep = d.entry_point
            seen_names.add(ep.name)
            loaded = allowed is None or ep.name in allowed
            statuses.append(PluginStatus(group, ep.name, ep.value, d.distribution, loaded))
            if not loaded:
                logger.debug("%s not loaded: not listed in %s", _where(d), PLUGINS_ENV)
                continue
            plugin_name = _register(pm, d)
            if group == PLATFORM_GROUP:
                platform_plugins.append((d, plugin_name))

    if allowed is not None:
        unknown = sorted(allowed - seen_names)
        if unknown:
            logger.warning(
                "%s names %s, which no installed entry point is called (known: %s)",
                PLUGINS_ENV, ", ".join(unknown), ", ".join(sorted(seen_names)) or "none",
            )
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginLoadError(
            f"plugin {exc.plugin!r} implements a hook tokenmill does not define: {exc}. "
            "Check the hook name, or mark it @hookimpl(optionalhook=True)."
        ) from exc

    specs = [_platform_spec(pm, d, plugin_name) for d, plugin_name in platform_plugins]
    _warn_misplaced_platform_hooks(pm, {name for _, name in platform_plugins})
    logger.debug("loaded plugins (generation %d): %s", generation, [s for s in statuses if s.loaded])
    return _LoadedState(os.getpid(), generation, pm, specs, statuses)


def _register(pm: pluggy.PluginManager, d: _Discovered) -> str:
    ep = d.entry_point
    try:
        obj = ep.load()
    except Exception as exc:
        raise PluginLoadError(
            f"failed to import plugin {_where(d)}: {type(exc).__name__}: {exc}. "
            f"Fix or uninstall {d.distribution}, or leave {ep.name!r} out of {PLUGINS_ENV}."
        ) from exc
    plugin_name = f"{ep.group}:{ep.name}"
    existing = pm.get_plugin(plugin_name)
    if existing is not None:
        raise PluginLoadError(
            f"two installed distributions declare the entry point {ep.name!r} in group {ep.group}; "
            f"the second is {_where(d)}. Uninstall one of them."
        )
    if pm.is_registered(obj):
        # The same module listed in both groups (or twice): its hooks are registered once.
        return pm.get_name(obj) or plugin_name
    try:
        pm.register(obj, name=plugin_name)
    except Exception as exc:
        raise PluginLoadError(f"failed to register plugin {_where(d)}: {exc}") from exc
    return plugin_name


def _platform_spec(pm: pluggy.PluginManager, d: _Discovered, plugin_name: str) -> LoadedPlatformSpec:
    from tokenmill.platforms.interface import PlatformSpec

    impls = [i for i in pm.hook.tokenmill_platform.get_hookimpls() if i.plugin_name == plugin_name]
    if not impls:
        raise PluginLoadError(
            f"platform plugin {_where(d)} has no tokenmill_platform() hook "
            "(a module-level function decorated with tokenmill.plugins.hookimpl)"
        )
    try:
        spec: Any = impls[0].function()
    except Exception as exc:
        raise PluginLoadError(
            f"tokenmill_platform() of {_where(d)} raised {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(spec, PlatformSpec):
        raise PluginLoadError(
            f"tokenmill_platform() of {_where(d)} returned {type(spec).__name__}, expected PlatformSpec"
        )
    return LoadedPlatformSpec(spec=spec, entry_point=d.entry_point.name, distribution=d.distribution)


def _warn_misplaced_platform_hooks(pm: pluggy.PluginManager, platform_plugin_names: set[str]) -> None:
    for impl in pm.hook.tokenmill_platform.get_hookimpls():
        if impl.plugin_name not in platform_plugin_names:
            logger.warning(
                "plugin %s implements tokenmill_platform() but is not declared in group %s; "
                "it is not considered a platform",
                impl.plugin_name, PLATFORM_GROUP,
            )
