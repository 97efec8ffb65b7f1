"""Run by tests/packaging/test_wheels.py with the Python of a venv holding tokenmill's wheels: prints, as JSON,
where each top-level package was imported from, the versions, and every module of the packages that failed to
import. Standalone (no ``tests`` imports): it must see only what that venv sees.

Usage: ``python installed_checks.py PACKAGE...``
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import pkgutil
import sys
import traceback

# Modules that need a toolkit a CPU-only machine lacks, each with the reason; none today.
SKIPPED: dict[str, str] = {}


def import_all(package_name: str) -> tuple[list[str], dict[str, str]]:
    """Import ``package_name`` and every module below it; ``(imported names, {name: error})``."""
    package = importlib.import_module(package_name)
    imported, failed = [package_name], {}
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{package_name}.", onerror=lambda name: None):
        if info.name in SKIPPED:
            continue
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - every failure is reported, with its traceback's last line
            failed[info.name] = traceback.format_exc().strip().splitlines()[-1]
        else:
            imported.append(info.name)
    return imported, failed


def main(packages: list[str]) -> None:
    report: dict[str, object] = {"modules": {}, "failed": {}, "files": {}}
    for name in packages:
        imported, failed = import_all(name)
        report["modules"][name] = imported  # type: ignore[index]
        report["failed"].update(failed)  # type: ignore[attr-defined]
        report["files"][name] = sys.modules[name].__file__  # type: ignore[index]
    import tokenmill

    report["version"] = tokenmill.__version__
    report["dist_version"] = importlib.metadata.version("tokenmill")
    report["dist_location"] = str(importlib.metadata.distribution("tokenmill").locate_file(""))
    from tokenmill_cpu import kernels

    report["cpu_kernel_sources_missing"] = [s for s in kernels.SOURCES if not (kernels.CSRC / s).is_file()]
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
