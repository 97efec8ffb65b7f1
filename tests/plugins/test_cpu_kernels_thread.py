"""tokenmill-cpu's background kernel build must not change ``sys.meta_path`` while the caller imports."""

from __future__ import annotations

import subprocess
import sys

# A fresh interpreter: the test process has imported setuptools long ago. ``load`` is replaced so that nothing
# builds; the check is what ``load_async`` imported before its thread ran.
_SCRIPT = """
import sys
from tokenmill_cpu import kernels
assert "setuptools" not in sys.modules, "imported before load_async: the check would prove nothing"
kernels.load = lambda: True
kernels.load_async()
kernels._thread.join()
print("IMPORTED_IN_CALLER" if "setuptools" in sys.modules else "NOT_IMPORTED")
"""


def test_load_async_imports_setuptools_in_the_calling_thread() -> None:
    # setuptools' distutils override inserts and removes sys.meta_path[0]; from the build thread that made a
    # concurrent import in the caller's thread skip the path finder (ModuleNotFoundError for an existing module).
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "IMPORTED_IN_CALLER"
