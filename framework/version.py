"""The version of tokenmill: the one place it is written.

The distribution's version (pyproject.toml's dynamic ``version``), ``tokenmill.__version__``, ``tokenmill
--version`` and the server's ``GET /version`` all read :data:`__version__`. A PEP 440 string; kept a plain
literal because setuptools reads it without importing the package.
"""

from __future__ import annotations

__version__ = "0.1.0"
