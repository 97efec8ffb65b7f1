"""Optionally compile tokenmill-cpu's lower instruction-set kernel builds in the background while the suite runs.

The checks in tests/lower_isa.py each need a build of every C++ source for one ATen capability (about 50 s of
both cores per build on a cold cache). The checks always run last (``pytest_collection_modifyitems`` moves
them). With ``TOKENMILL_TEST_PREBUILD=1`` the builds also start when the session starts, in one process at the
lowest priority with one compiler at a time, and the first check stops a build still running and finishes it
in the foreground (ninja keeps the objects already compiled). Off by default: on a 2-core machine the
background compiler slowed the CPU-bound tests by more than it saved (docs/benchmarks.md, "Test suite time");
on a machine with idle cores it saves the builds' time.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "lower_isa"

_process: subprocess.Popen[bytes] | None = None


def capabilities_to_build() -> list[str]:
    """The ATen capabilities the lower-ISA checks use that are not this machine's own build."""
    import torch

    from tokenmill_cpu import kernels

    native = torch.backends.cpu.get_cpu_capability()
    wanted = ["default"]
    if {"avx2", "fma", "f16c"} <= kernels.cpu_flags():
        wanted.insert(0, "avx2")
    return [c for c in wanted if c.upper() != native]


def start(items: list[pytest.Item]) -> None:
    """Move the lower-ISA checks to the end of ``items`` and start their builds (once per session)."""
    global _process
    checks = [item for item in items if item.get_closest_marker(MARKER)]
    if not checks or _process is not None:
        return
    # By capability: the checks of one build share one worker process (tests/lower_isa.py).
    checks.sort(key=lambda item: str(getattr(getattr(item, "callspec", None), "params", {}).get("capability", "")))
    items[:] = [item for item in items if not item.get_closest_marker(MARKER)] + checks
    if os.environ.get("TOKENMILL_TEST_PREBUILD") != "1" or os.environ.get("TOKENMILL_CPU_KERNELS") == "0":
        return
    build = "from tokenmill_cpu import kernels; kernels.load()"
    # ATEN_CPU_CAPABILITY is read when torch is imported: one interpreter per capability, one after the other.
    script = "; ".join(f"ATEN_CPU_CAPABILITY={c} {shlex.quote(sys.executable)} -c {shlex.quote(build)}"
                       for c in capabilities_to_build())
    if not script:
        return
    from tests.lower_isa import BUILD_FLAGS

    _process = subprocess.Popen(["nice", "-n", "19", "sh", "-c", script], cwd=ROOT,
                                env=dict(os.environ, MAX_JOBS="1", TOKENMILL_CPU_CFLAGS=BUILD_FLAGS),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def stop() -> None:
    """End the background builds (a check that still needs one builds it itself)."""
    global _process
    if _process is not None and _process.poll() is None:
        os.killpg(_process.pid, signal.SIGTERM)  # the shell, the interpreter, ninja and the compilers
        try:
            _process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(_process.pid, signal.SIGKILL)
    _process = None
