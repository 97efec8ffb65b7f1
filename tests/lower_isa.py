"""Run a test file's kernel checks against tokenmill-cpu's lower instruction-set builds, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import kernel_prebuild
from tokenmill_cpu import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The checks compare each instruction set's code paths with the reference, which the optimisation level does not
# select: -O1 halves the builds' compile time (the -O3 build of this machine's own level runs every other test).
BUILD_FLAGS = "-O1"


def lower_isa_env(capability: str) -> dict[str, str]:
    """The environment of a process that builds and runs the kernels for ATen capability ``capability``."""
    return dict(os.environ, ATEN_CPU_CAPABILITY=capability, TOKENMILL_CPU_CFLAGS=BUILD_FLAGS)


def check_lower_isa_build(test_file: str, capability: str, isa_key: str, isa: str, select: str) -> None:
    """Build the kernels for ATen capability ``capability`` (``default``: plain C++; ``avx2``: AVX2/FMA/F16C
    flags only, also on an AVX-512 machine; with :data:`BUILD_FLAGS`), check that
    ``kernels.isa()[isa_key] == isa``, then run the tests of ``test_file`` that ``pytest -k select`` picks under
    that capability. Skips where the CPU lacks AVX2/FMA/F16C for ``isa == "avx2"``; fails (``AssertionError``) on a build error, a wrong path or a failing test."""
    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= kernels.cpu_flags():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    # A background build still running (tests/kernel_prebuild.py) is stopped: its finished objects are kept, and
    # this build, at normal priority and with every core, compiles the rest.
    kernel_prebuild.stop()
    env = lower_isa_env(capability)
    # One interpreter builds, checks the path and runs the tests (a second one would import torch again).
    code = (f"import sys; from tokenmill_cpu import kernels; assert kernels.load(); "
            f"assert kernels.isa()[{isa_key!r}] == {isa!r}, kernels.isa(); import pytest; "
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {os.path.abspath(test_file)!r}, "
            f"'-k', {select!r}]))")
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0 and " passed" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
