"""Errors raised while choosing a platform."""

from __future__ import annotations


class PlatformError(RuntimeError):
    """No usable platform could be chosen (base class of the specific errors below)."""


class PlatformConflictError(PlatformError):
    """Two or more platform plugins say they are active; the user must choose one."""


class NoPlatformError(PlatformError):
    """No platform plugin is active (or none is installed)."""


class UnknownPlatformError(PlatformError):
    """``--platform`` / ``TOKENMILL_PLATFORM`` names no installed platform plugin."""


class PlatformDetectionError(PlatformError):
    """A platform plugin's ``detect()`` raised and no platform was named: tokenmill does not guess whether
    the plugin that failed was the hardware the user meant, so start-up stops (see ``docs/plugins.md``)."""
