"""The entry-point module: the plugin API it needs, a cheap detector and the platform hook.

Only this module is imported while tokenmill chooses a platform, so it imports nothing heavy (no torch, no
Platform class: the spec names the class by path).
"""

from __future__ import annotations

import os

from tokenmill.plugin_api import PlatformSpec, hookimpl

TOKENMILL_PLUGIN_API = ">=1.0,<2"  # tokenmill refuses to load this plugin where the API does not match

ENABLE_ENV = "TOKENMILL_CPUREF"


def detect() -> tuple[bool, str]:
    """Active only when ``TOKENMILL_CPUREF=1``: the "device" is the host CPU, which tokenmill-cpu already
    serves, so claiming it by default would make two platforms active (a PlatformConflictError). A real vendor
    asks its driver here, cheaply and without creating a device context."""
    if os.environ.get(ENABLE_ENV) == "1":
        return True, f"{ENABLE_ENV}=1"
    return False, f"the cpu-reference device is off (set {ENABLE_ENV}=1, or pass --platform cpuref)"


# Written out as a vendor's package would: an example stands alone and imports only tokenmill.plugin_api.
@hookimpl
def tokenmill_platform() -> PlatformSpec:
    return PlatformSpec(
        name="cpuref",
        detect=detect,
        platform_cls="tokenmill_cpuref.platform:CpuRefPlatform",
        description="example vendor platform: the host CPU as a reference device",
    )
