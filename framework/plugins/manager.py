"""Entry-point discovery and the per-process pluggy plugin manager.

Two entry-point groups are loaded, once per process (the guard is keyed by ``os.getpid()``, so forked or
spawned workers load them again):

* ``tokenmill.platforms``: modules implementing ``tokenmill_platform()``;
* ``tokenmill.plugins``: modules implementing any other hook.

When the environment variable ``TOKENMILL_PLUGINS`` holds a comma-separated list of entry-point names, only
those entry points (of either group) are loaded. An entry point that fails to import, or whose
``TOKENMILL_PLUGIN_API`` requirement this tokenmill does not meet (:mod:`tokenmill.plugins.api_version`), stops
start-up with a :class:`PluginLoadError` naming the entry point and its distribution. ``tokenmill plugins``
loads the same way but leniently (:func:`lenient_loading`), so it can report every failure at once.

:func:`load_general_plugins` is called at the start of every tokenmill process (API server, engine core,
workers, offline scripts); it loads the plugins and runs their ``tokenmill_init_process`` hooks once.
"""

from __future__ import annotations

import importlib
import importlib.metadata as importlib_metadata
import logging
import os
import threading
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from dataclasses import replace as dataclasses_replace
from typing import TYPE_CHECKING, Any

import pluggy

from tokenmill.plugins import hookspecs
from tokenmill.plugins.api_version import PLUGIN_API_VERSION, REQUIREMENT_ATTR, unmet_requirement

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
        loaded: False when ``TOKENMILL_PLUGINS`` excluded it or it failed to load.
        excluded: ``TOKENMILL_PLUGINS`` left it out.
        requires_api: the module's ``TOKENMILL_PLUGIN_API`` requirement, if it declares one.
        error: why it failed to load (one line), or ``None``.
        traceback_tail: the last lines of the traceback of that failure.
        plugin_name: its name in the plugin manager (``group:entry point``; the first one when a module is
            listed twice).
        version: the distribution's version.
    """

    group: str
    entry_point: str
    value: str
    distribution: str
    loaded: bool
    excluded: bool = False
    requires_api: str | None = None
    error: str | None = None
    traceback_tail: str = ""
    plugin_name: str = ""
    version: str = ""


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
    errors: list[PluginLoadError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    init_process: str | None = None  # the process kind tokenmill_init_process ran with


@dataclass(frozen=True)
class _Discovered:
    entry_point: importlib_metadata.EntryPoint
    distribution: str
    version: str = ""


_lock = threading.RLock()
_state: _LoadedState | None = None
_generation = 0
_search_path: tuple[str, ...] | None = None
_lenient = threading.local()


@contextmanager
def lenient_loading() -> Iterator[None]:
    """Within this block (this thread), plugin load failures are recorded instead of raised: the manager and
    the registries hold every plugin that did load (``tokenmill plugins`` uses it to report them all)."""
    previous = getattr(_lenient, "on", False)
    _lenient.on = True
    try:
        yield
    finally:
        _lenient.on = previous


def get_plugin_manager() -> pluggy.PluginManager:
    """The process's plugin manager with every allowed plugin of both groups registered.

    Raises:
        PluginLoadError: an entry point failed to import or register, or requires another plugin API.
    """
    return _checked().pm


def load_general_plugins(process: str | None = None) -> None:
    """Load the plugins of both entry-point groups into this process and, the first time with ``process``,
    run every plugin's ``tokenmill_init_process(process=...)`` hook (once per process).

    Args:
        process: the kind of process (see ``hookspecs.tokenmill_init_process``); ``None`` only loads.

    Raises:
        PluginLoadError: an entry point failed to import or register, or a ``tokenmill_init_process`` hook
            raised (the message names the plugin).
    """
    state = _checked()
    if process is None:
        return
    with _lock:
        if state.init_process is not None:
            return
        state.init_process = process
        for impl in state.pm.hook.tokenmill_init_process.get_hookimpls()[::-1]:
            try:
                impl.function(process=process)
            except Exception as exc:
                raise PluginLoadError(
                    f"tokenmill_init_process(process={process!r}) of plugin {impl.plugin_name} raised "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        logger.debug("plugins initialised for process kind %r (pid %d)", process, os.getpid())


def get_platform_specs() -> list[LoadedPlatformSpec]:
    """Every allowed platform plugin's spec, sorted by distribution then entry-point name.

    Raises:
        PluginLoadError: a platform entry point failed to import, lacks ``tokenmill_platform``, or it
            raised / returned something other than a ``PlatformSpec``.
    """
    return list(_checked().platform_specs)


def get_plugin_status() -> list[PluginStatus]:
    """Every discovered entry point of both groups: whether it loaded, and why not (never raises for a plugin
    that failed to load: the status says so)."""
    return list(_ensure_loaded().statuses)


def get_plugin_warnings() -> list[str]:
    """Problems found while loading that did not stop it (e.g. ``TOKENMILL_PLUGINS`` naming nothing)."""
    return list(_ensure_loaded().warnings)


def get_plugin_errors() -> list[PluginLoadError]:
    """The load failures of this process (empty when every allowed plugin loaded)."""
    return list(_ensure_loaded().errors)


def _checked() -> _LoadedState:
    state = _ensure_loaded()
    if state.errors and not getattr(_lenient, "on", False):
        raise state.errors[0]
    return state


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


def _dist_version(dist: importlib_metadata.Distribution | None) -> str:
    try:
        return str(dist.version) if dist is not None else ""
    except Exception:  # noqa: BLE001 - broken metadata: the version is only shown
        return ""


def _discover(group: str) -> list[_Discovered]:
    found: list[_Discovered] = []
    if _search_path is None:
        for ep in importlib_metadata.entry_points(group=group):
            dist = getattr(ep, "dist", None)
            found.append(_Discovered(ep, _dist_name(dist), _dist_version(dist)))
    else:
        seen: set[str] = set()
        for dist in importlib_metadata.distributions(path=list(_search_path)):
            name = _dist_name(dist)
            key = name.lower().replace("-", "_").replace(".", "_")
            if key in seen:  # the first one on the path wins, as importlib.metadata does
                continue
            seen.add(key)
            found.extend(_Discovered(ep, name, _dist_version(dist)) for ep in dist.entry_points if ep.group == group)
    found.sort(key=lambda d: (d.distribution, d.entry_point.name))
    return found


def _where(d: _Discovered) -> str:
    ep = d.entry_point
    return f"entry point {ep.name!r} = {ep.value!r} (group {ep.group}, distribution {d.distribution})"


def _traceback_tail(exc: BaseException, lines: int = 6) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip().splitlines()
    return "\n".join(text[-lines:])


def _load(generation: int) -> _LoadedState:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    allowed = _allowed_names()
    statuses: list[PluginStatus] = []
    errors: list[PluginLoadError] = []
    warnings: list[str] = []
    platform_plugins: list[tuple[_Discovered, str]] = []
    discovered: dict[str, _Discovered] = {}  # plugin name -> where it came from
    seen_names: set[str] = set()

    for group in (PLATFORM_GROUP, GENERAL_GROUP):
        for d in _discover(group):
            ep = d.entry_point
            seen_names.add(ep.name)
            status = PluginStatus(group, ep.name, ep.value, d.distribution, loaded=False, version=d.version)
            if allowed is not None and ep.name not in allowed:
                logger.debug("%s not loaded: not listed in %s", _where(d), PLUGINS_ENV)
                statuses.append(dataclasses_replace(status, excluded=True))
                continue
            try:
                plugin_name, requires = _register(pm, d)
            except PluginLoadError as exc:
                errors.append(exc)
                cause = exc.__cause__ or exc
                statuses.append(dataclasses_replace(status, error=str(exc), traceback_tail=_traceback_tail(cause)))
                continue
            statuses.append(dataclasses_replace(status, loaded=True, requires_api=requires, plugin_name=plugin_name))
            discovered.setdefault(plugin_name, d)
            if group == PLATFORM_GROUP:
                platform_plugins.append((d, plugin_name))

    if allowed is not None:
        unknown = sorted(allowed - seen_names)
        if unknown:
            message = (f"{PLUGINS_ENV} names {', '.join(unknown)}, which no installed entry point is called "
                       f"(known: {', '.join(sorted(seen_names)) or 'none'})")
            logger.warning("%s", message)
            warnings.append(message)
    def fail(plugin_name: str, exc: PluginLoadError, group: str | None = None) -> None:
        nonlocal statuses
        errors.append(exc)
        statuses = [dataclasses_replace(s, loaded=False, error=str(exc)) if s.plugin_name == plugin_name
                    and (group is None or s.group == group) else s for s in statuses]

    for plugin_name, d, unknown_hooks in _unknown_hooks(pm, discovered):
        fail(plugin_name, PluginLoadError(
            f"plugin {_where(d)} implements {', '.join(unknown_hooks)}, which tokenmill does not define (plugin "
            f"API {PLUGIN_API_VERSION}). Check the hook name, or mark it @hookimpl(optionalhook=True)."
        ))
        pm.unregister(name=plugin_name)
        platform_plugins = [(pd, name) for pd, name in platform_plugins if name != plugin_name]

    specs: list[LoadedPlatformSpec] = []
    for d, plugin_name in platform_plugins:
        try:
            spec = _platform_spec(pm, d, plugin_name)
        except PluginLoadError as exc:
            fail(plugin_name, exc, PLATFORM_GROUP)
            continue
        same = next((other for other in specs if other.name == spec.name), None)
        if same is not None:
            fail(plugin_name, PluginLoadError(
                f"two platform plugins are both named {spec.name!r}: entry point {same.entry_point!r} of "
                f"{same.distribution} and {_where(d)}. Uninstall one of them, or leave one out of {PLUGINS_ENV}."
            ), PLATFORM_GROUP)
            pm.unregister(name=plugin_name)
            continue
        specs.append(spec)
    warnings.extend(_warn_misplaced_platform_hooks(pm, {name for _, name in platform_plugins}))
    warnings.extend(_warn_hookless(pm, discovered))
    logger.debug("loaded plugins (generation %d): %s", generation, [s for s in statuses if s.loaded])
    return _LoadedState(os.getpid(), generation, pm, specs, statuses, errors, warnings)


def _unknown_hooks(pm: pluggy.PluginManager, discovered: dict[str, _Discovered]
                   ) -> list[tuple[str, _Discovered, list[str]]]:
    """Plugins implementing hooks without a spec (a typo, or a hook of another tokenmill version) that are not
    marked ``optionalhook``: (plugin name, where it came from, the hook names)."""
    found = []
    for plugin_name, d in discovered.items():
        plugin = pm.get_plugin(plugin_name)
        if plugin is None:
            continue
        names = sorted(
            caller.name for caller in pm.get_hookcallers(plugin) or []
            if caller.spec is None
            and any(i.plugin is plugin and not i.optionalhook for i in caller.get_hookimpls())
        )
        if names:
            found.append((plugin_name, d, names))
    return found


def _register(pm: pluggy.PluginManager, d: _Discovered) -> tuple[str, str | None]:
    """Import and register one entry point; returns its plugin name and its plugin API requirement."""
    ep = d.entry_point
    try:
        obj = ep.load()
    except Exception as exc:
        raise PluginLoadError(
            f"failed to import plugin {_where(d)}: {type(exc).__name__}: {exc}. "
            f"Fix or uninstall {d.distribution}, or leave {ep.name!r} out of {PLUGINS_ENV}."
        ) from exc
    requires = getattr(obj, REQUIREMENT_ATTR, None)
    if requires is not None:
        reason = unmet_requirement(requires)
        if reason is not None:
            raise PluginLoadError(
                f"plugin {_where(d)} cannot be loaded: {reason}. Install a version of {d.distribution} made "
                f"for plugin API {PLUGIN_API_VERSION} (or a tokenmill that provides what it needs), or leave "
                f"{ep.name!r} out of {PLUGINS_ENV}."
            )
    plugin_name = f"{ep.group}:{ep.name}"
    existing = pm.get_plugin(plugin_name)
    if existing is not None:
        raise PluginLoadError(
            f"two installed distributions declare the entry point {ep.name!r} in group {ep.group}; "
            f"the second is {_where(d)}. Uninstall one of them."
        )
    if pm.is_registered(obj):
        # The same module listed in both groups (or twice): its hooks are registered once.
        return pm.get_name(obj) or plugin_name, requires
    try:
        pm.register(obj, name=plugin_name)
    except Exception as exc:
        raise PluginLoadError(f"failed to register plugin {_where(d)}: {exc}") from exc
    return plugin_name, requires


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


def _warn_hookless(pm: pluggy.PluginManager, discovered: dict[str, _Discovered]) -> list[str]:
    """Entry points whose module implements no tokenmill hook: a missing ``@hookimpl``, or another module of
    the same name (a directory in the working directory, say) shadowing the plugin's."""
    found = []
    for plugin_name, d in discovered.items():
        plugin = pm.get_plugin(plugin_name)
        if plugin is None or pm.get_hookcallers(plugin):
            continue
        paths = sorted(set(getattr(plugin, "__path__", []) or []))
        where = getattr(plugin, "__file__", None) or ", ".join(paths) or "?"
        message = (f"plugin {_where(d)} implements no tokenmill hook (its module was imported from {where}): "
                   "decorate its hook functions with tokenmill.plugin_api.hookimpl, and check that no other "
                   "module of that name shadows it")
        logger.warning("%s", message)
        found.append(message)
    return found


def _warn_misplaced_platform_hooks(pm: pluggy.PluginManager, platform_plugin_names: set[str]) -> list[str]:
    found = []
    for impl in pm.hook.tokenmill_platform.get_hookimpls():
        if impl.plugin_name not in platform_plugin_names:
            message = (f"plugin {impl.plugin_name} implements tokenmill_platform() but is not declared in group "
                       f"{PLATFORM_GROUP}; it is not considered a platform")
            logger.warning("%s", message)
            found.append(message)
    return found
