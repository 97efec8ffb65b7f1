"""The executor tests' Ray cluster: started by the first test that needs it and stopped when the last test of
this package is done, so that its processes (GCS, raylets, agents) do not run beside the rest of
the suite."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.ray_cluster import RAY_ENV, LocalRayCluster


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[LocalRayCluster]:
    """One real Ray cluster for tests/executor: a head (``node_a``) and a second node (``node_b``) on
    127.0.0.1, this process connected to it (see tests/ray_cluster.py)."""
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)
    cluster = LocalRayCluster()
    try:
        cluster.start()
        cluster.add_node("node_b")
        yield cluster
    finally:
        cluster.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
