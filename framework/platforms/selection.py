"""Choosing the platform: by name (``--platform`` / ``TOKENMILL_PLATFORM``), or by running every detector.

Rules:

1. A name picks that plugin and skips every detector.
2. Otherwise every platform plugin's ``detect()`` runs. A detector that raises stops start-up with a
   :class:`PlatformDetectionError` naming it (and whichever plugins are active): the failing plugin may well be
   the hardware the user wants, and silently running on another platform (say, the CPU instead of a GPU whose
   driver is broken) is the worst outcome. ``--platform NAME`` is the way past it.
3. Exactly one active plugin is the platform; two or more is a :class:`PlatformConflictError`; none is a
   :class:`NoPlatformError` listing every plugin tried and why it declined.

:func:`select_platform` returns the decision with its reason, which start-up logs and ``tokenmill plugins``
show.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass

from tokenmill.platforms.errors import (
    NoPlatformError,
    PlatformConflictError,
    PlatformDetectionError,
    PlatformError,
    UnknownPlatformError,
)
from tokenmill.platforms.interface import Platform
from tokenmill.plugins.manager import (
    PLATFORM_GROUP,
    PLUGINS_ENV,
    LoadedPlatformSpec,
    get_platform_specs,
    get_plugin_status,
)
from tokenmill.plugins.qualname import resolve_qualname

logger = logging.getLogger(__name__)

PLATFORM_ENV = "TOKENMILL_PLATFORM"
_AUTO_NAMES = ("", "auto")
_HOW_TO_CHOOSE = f"choose one with --platform NAME or {PLATFORM_ENV}=NAME"
_INSTALL_HINT = (
    "Install the plugin for your hardware: `pip install tokenmill-cpu` (CPU), `pip install tokenmill-cuda` "
    "(NVIDIA GPUs) or `pip install tokenmill-rocm` (AMD GPUs); or force one with --platform NAME or "
    f"{PLATFORM_ENV}=NAME."
)


@dataclass(frozen=True)
class DetectionResult:
    """The outcome of one platform plugin's ``detect()``.

    Attributes:
        plugin: the plugin whose detector ran.
        active: whether it claims this machine.
        reason: why it declined (or accepted), as the detector said; may be empty.
        error: the detector's exception text (with its type) if it raised; ``active`` is then False.
    """

    plugin: LoadedPlatformSpec
    active: bool
    reason: str = ""
    error: str | None = None

    def describe(self) -> str:
        """One line for error messages: the plugin, its distribution, and what its detector said."""
        if self.error is not None:
            outcome = f"detect() raised {self.error}"
        elif self.active:
            outcome = "active" + (f": {self.reason}" if self.reason else "")
        else:
            outcome = "declined" + (f": {self.reason}" if self.reason else " (no reason given)")
        return f"{self.plugin.describe()}: {outcome}"


def detect_platforms() -> list[DetectionResult]:
    """Run every allowed platform plugin's detector and report what each said.

    Raises:
        PluginLoadError: a platform plugin failed to load (detector errors are recorded, not raised).
    """
    return [_run_detector(p) for p in get_platform_specs()]


@dataclass(frozen=True)
class PlatformSelection:
    """The platform chosen for this process and why.

    Attributes:
        platform_cls: the :class:`Platform` subclass.
        plugin: the plugin it came from (``None`` when a class was set directly, e.g. by a test or the kit).
        reason: one line, e.g. ``"the only active platform plugin (cpu: torch was built without accelerator
            support)"`` or ``"named by TOKENMILL_PLATFORM=cpu (detection skipped)"``.
        detections: what each detector said (empty when a name skipped detection).
    """

    platform_cls: type[Platform]
    plugin: LoadedPlatformSpec | None
    reason: str
    detections: tuple[DetectionResult, ...] = ()

    def describe(self) -> str:
        """``"cpu (tokenmill-cpu 0.1.0): <reason>"``: for start-up logs."""
        where = f" ({self.plugin.distribution})" if self.plugin is not None else ""
        return f"{self.platform_cls.name}{where}: {self.reason}"


def resolve_platform(name: str | None = None) -> type[Platform]:
    """Choose the platform class for this process (see :func:`select_platform`)."""
    return select_platform(name).platform_cls


def select_platform(name: str | None = None) -> PlatformSelection:
    """Choose the platform for this process, following the module's rules.

    Args:
        name: a platform name or platform entry-point name; ``None`` reads ``TOKENMILL_PLATFORM``;
            empty or ``"auto"`` means detect.

    Raises:
        UnknownPlatformError: the name matches no loaded platform plugin (the message lists them).
        PlatformConflictError: several plugins are active, or several plugins carry the requested name.
        PlatformDetectionError: a detector raised (the message names it and says how to choose).
        NoPlatformError: no plugin is active (the message lists each plugin and why it declined).
        PlatformError: the chosen plugin's class cannot be imported or is not a ``Platform``.
        PluginLoadError: a platform plugin failed to load.
    """
    source = "--platform"
    if name is None:
        name = os.environ.get(PLATFORM_ENV)
        source = PLATFORM_ENV
    plugins = get_platform_specs()
    if name is not None and name.strip().lower() not in _AUTO_NAMES:
        plugin = _pick_by_name(name.strip(), plugins)
        reason = f"named by {source}={name.strip()} (detection skipped)"
        return PlatformSelection(load_platform_class(plugin), plugin, reason)

    results = tuple(_run_detector(p) for p in plugins)
    active = [r for r in results if r.active]
    failed = [r for r in results if r.error is not None]
    if failed:
        raise PlatformDetectionError(_detection_error_message(failed, active))
    if len(active) == 1:
        plugin = active[0].plugin
        said = f": {active[0].reason}" if active[0].reason else ""
        others = len(results) - 1
        reason = f"the only active platform plugin ({plugin.name}{said}; {others} other(s) declined)"
        return PlatformSelection(load_platform_class(plugin), plugin, reason, results)
    if len(active) > 1:
        raise PlatformConflictError(
            "more than one tokenmill platform plugin is active on this machine:\n"
            + "".join(f"  - {r.describe()}\n" for r in active)
            + f"Either {_HOW_TO_CHOOSE} (e.g. --platform {active[0].plugin.name}), "
            "or uninstall the distribution of the one you do not want."
        )
    raise NoPlatformError(_no_platform_message(list(results)))


def _detection_error_message(failed: list[DetectionResult], active: list[DetectionResult]) -> str:
    lines = "".join(f"  - {r.describe()}\n" for r in failed)
    message = f"a tokenmill platform plugin's detector raised, so tokenmill cannot tell which hardware to use:\n{lines}"
    if active:
        message += "Active: " + ", ".join(r.plugin.describe() for r in active) + ".\n"
        example = active[0].plugin.name
    else:
        example = failed[0].plugin.name
    return message + (
        f"Fix or uninstall the failing plugin, or {_HOW_TO_CHOOSE} (e.g. --platform {example}); "
        "`tokenmill plugins` shows every plugin and what its detector said."
    )


def load_platform_class(plugin: LoadedPlatformSpec) -> type[Platform]:
    """Import the :class:`Platform` subclass that ``plugin``'s spec names.

    Raises:
        PlatformError: the import fails or the object is not a ``Platform`` subclass.
    """
    path = plugin.spec.platform_cls
    try:
        cls = resolve_qualname(path)
    except (ImportError, ValueError) as exc:
        raise PlatformError(
            f"cannot import platform class {path!r} of {plugin.describe()}: {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise PlatformError(
            f"platform class {path!r} of {plugin.describe()} is not a subclass of tokenmill.platforms.Platform"
        )
    return cls


def _pick_by_name(name: str, plugins: list[LoadedPlatformSpec]) -> LoadedPlatformSpec:
    matches = [p for p in plugins if p.name == name] or [p for p in plugins if p.entry_point == name]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise PlatformConflictError(
            f"platform {name!r} is provided by more than one plugin:\n"
            + "".join(f"  - {p.describe()}\n" for p in matches)
            + "Uninstall all but one of these distributions."
        )
    available = ", ".join(f"{p.name} ({p.distribution})" for p in plugins) or "none"
    message = f"unknown platform {name!r} (from --platform or {PLATFORM_ENV}); available: {available}."
    excluded = _excluded_platform_entry_points()
    if excluded:
        message += f" Not loaded because {PLUGINS_ENV} leaves them out: {', '.join(excluded)}."
    raise UnknownPlatformError(message + " " + _INSTALL_HINT)


def _run_detector(plugin: LoadedPlatformSpec) -> DetectionResult:
    try:
        outcome = plugin.spec.detect()
    except Exception as exc:
        logger.debug("platform detector of %s raised", plugin.describe(), exc_info=True)
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return DetectionResult(plugin, active=False, error=error)
    if isinstance(outcome, bool):
        return DetectionResult(plugin, active=outcome)
    if (
        isinstance(outcome, tuple)
        and len(outcome) == 2
        and isinstance(outcome[0], bool)
        and isinstance(outcome[1], str)
    ):
        return DetectionResult(plugin, active=outcome[0], reason=outcome[1])
    return DetectionResult(
        plugin,
        active=False,
        error=f"TypeError: detect() returned {outcome!r}; expected a bool or a (bool, str) tuple",
    )


def _excluded_platform_entry_points() -> list[str]:
    return [
        f"{s.entry_point} ({s.distribution})"
        for s in get_plugin_status()
        if s.group == PLATFORM_GROUP and s.excluded
    ]


def _no_platform_message(results: list[DetectionResult]) -> str:
    if results:
        lines = "".join(f"  - {r.describe()}\n" for r in results)
        message = f"no tokenmill platform is active. Platform plugins tried:\n{lines}"
    else:
        message = f"no tokenmill platform plugin is installed (entry-point group {PLATFORM_GROUP} is empty).\n"
    excluded = _excluded_platform_entry_points()
    if excluded:
        message += f"Not loaded because {PLUGINS_ENV} leaves them out: {', '.join(excluded)}.\n"
    return message + _INSTALL_HINT
