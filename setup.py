"""The package list of the ``tokenmill`` distribution, computed from the source tree.

The import package ``tokenmill`` is laid out over three top-level folders (``[tool.setuptools] package-dir`` in
pyproject.toml: ``tokenmill`` = framework/, ``tokenmill.models`` = models/, ``tokenmill.entrypoints`` =
entrypoints/). setuptools' own discovery (``[tool.setuptools.packages.find]``) names a package after its path
below one ``where`` folder, so it cannot call ``framework/lora`` ``tokenmill.lora``, and a hand-written list
misses each new sub-package. Here every folder with an ``__init__.py`` below a root is a package, named after
that root. Everything else about the distribution is in pyproject.toml.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import find_packages, setup

if sys.version_info >= (3, 11):
    import tomllib
else:  # pyproject.toml's build-system requires it there
    import tomli as tomllib

HERE = Path(__file__).resolve().parent


def package_roots() -> dict[str, str]:
    """pyproject.toml's ``package-dir``: import package name -> folder (relative to this file)."""
    with open(HERE / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def discovered_packages() -> list[str]:
    """Every package under :func:`package_roots`: each root, and each folder below it with an ``__init__.py``."""
    packages = set()
    for name, folder in package_roots().items():
        packages.add(name)
        packages.update(f"{name}.{sub}" for sub in find_packages(str(HERE / folder)))
    return sorted(packages)


setup(packages=discovered_packages())
