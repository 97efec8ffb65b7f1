"""Choosing the platform: by name (``--platform`` / ``TOKENMILL_PLATFORM``), or by running every detector.

Rules (DESIGN.md section 3): a name picks that plugin and skips the other detectors. Otherwise exactly one
active plugin is the platform; two or more is a :class:`PlatformConflictError`; none is a
:class:`NoPlatformError` listing every plugin tried and why it declined. A detector that raises is
recorded and shown, never hidden.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass

from tokenmill.platforms.errors import (
    NoPlatformError,
    PlatformConflictError,
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


def resolve_platform(name: str | None = None) -> type[Platform]:
    """Choose the platform class for this process.

    Args:
        name: a platform name or platform entry-point name; ``None`` reads ``TOKENMILL_PLATFORM``;
            empty or ``"auto"`` means detect.

    Raises:
        UnknownPlatformError: the name matches no loaded platform plugin (the message lists them).
        PlatformConflictError: several plugins are active, or several plugins carry the requested name.
        NoPlatformError: no plugin is active (the message lists each plugin and why it declined).
        PlatformError: the chosen plugin's class cannot be imported or is not a ``Platform``.
        PluginLoadError: a platform plugin failed to load.
    """
    if name is None:
        name = os.environ.get(PLATFORM_ENV)
    plugins = get_platform_specs()
    if name is not None and name.strip().lower() not in _AUTO_NAMES:
        return load_platform_class(_pick_by_name(name.strip(), plugins))

    results = [_run_detector(p) for p in plugins]
    active = [r for r in results if r.active]
    if len(active) == 1:
        for r in results:
            if r.error is not None:
                logger.warning("platform detector failed (ignored, %s is active): %s", active[0].plugin.name,
                               r.describe())
        return load_platform_class(active[0].plugin)
    if len(active) > 1:
        raise PlatformConflictError(
            "more than one tokenmill platform plugin is active on this machine:\n"
            + "".join(f"  - {r.describe()}\n" for r in active)
            + f"Either {_HOW_TO_CHOOSE} (e.g. --platform {active[0].plugin.name}), "
            "or uninstall the distribution of the one you do not want."
        )
    raise NoPlatformError(_no_platform_message(results))


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
        if s.group == PLATFORM_GROUP and not s.loaded
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
