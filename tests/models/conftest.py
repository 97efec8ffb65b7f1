"""Fixtures of the model tests: the session's folder of tiny family models (see tests/models/families.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def family_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("families"))
