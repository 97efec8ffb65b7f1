"""A real multi-"node" Ray cluster on this machine for the tests: ``ray start --head`` plus ``ray start
--address`` nodes, each a ``--block`` process in its own session, each with a custom resource naming it
(``node_a`` for the head, then ``node_b``, ...), so tests can pin ranks to nodes and make one leave.

Startup is slow (about 10-15 s per node on a quiet 2-core machine, more under load), so tests share one
cluster (the package-scoped ``ray_cluster`` fixture in tests/executor/conftest.py), and its nodes run only what the
tests use: no dashboard (the tests read actors and placement groups from the GCS, :func:`alive_actors` and
:func:`live_placement_groups`), no autoscaler monitor, no log monitors (worker logs stay in the node's files), no
idle workers started ahead for the first driver (every actor of tokenmill has a ``runtime_env`` of its own and could
not use them). That halves a cluster's start: 8 CPU-s instead of 15 for the head and one node, 13 processes
instead of 29 (docs/benchmarks.md, "Test suite time"). Only processes this helper started are stopped: SIGTERM to
each ``ray start --block`` (which stops its node), then SIGKILL to its process group for anything left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parents[1])
# Token authentication is for clusters reachable from a network; this one listens on 127.0.0.1 only.
RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    # notice a node that left within ~2 s instead of Ray's default ~30 s
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
    "RAY_prestart_worker_first_driver": "0",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


@dataclass
class RayNode:
    name: str
    proc: subprocess.Popen
    log: Path

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop this node (SIGTERM to its ``ray start``, then SIGKILL to its process group)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own session: raylet, agents, workers
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """The node leaves abruptly (every process of it SIGKILLed)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@dataclass
class LocalRayCluster:
    """A head node and worker nodes on 127.0.0.1.

    Attributes:
        address: the GCS address (``127.0.0.1:PORT``) for ``ray.init`` / ``--ray-address``.
        env: environment for processes that join it (``tokenmill serve`` subprocesses).
    """

    cpus_per_node: int = 4
    temp_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="tm-ray-", dir="/tmp"))
    address: str = ""
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, **RAY_ENV, "PYTHONPATH": pythonpath}

    def start(self, timeout_s: float = 180.0) -> LocalRayCluster:
        port = _free_port()
        self.address = f"127.0.0.1:{port}"
        self._spawn(
            "node_a",
            ["--head", f"--port={port}", f"--temp-dir={self.temp_dir}", "--include-dashboard=false", "--no-monitor",
             f"--ray-client-server-port={_free_port()}"],
        )
        self._wait_nodes(1, timeout_s)
        return self

    def add_node(self, name: str, timeout_s: float = 180.0) -> RayNode:
        """Start one more node, with custom resource ``name``, and wait until the cluster sees it."""
        node = self._spawn(name, [f"--address={self.address}"])
        self._wait_nodes(len(self.nodes), timeout_s)
        return node

    def _spawn(self, name: str, extra: list[str]) -> RayNode:
        log = Path(self.temp_dir) / f"{name}.log"
        cmd = [_ray_bin(), "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus_per_node}",
               f"--resources={json.dumps({name: 1})}", "--object-store-memory=200000000",
               "--disable-usage-stats", "--include-log-monitor=false", *extra]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        node = RayNode(name, proc, log)
        self.nodes.append(node)
        return node

    def _wait_nodes(self, count: int, timeout_s: float) -> None:
        """Connect this process to the cluster (once) and wait until ``count`` nodes are alive."""
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.proc.poll() is not None:
                    raise RuntimeError(f"ray node {node.name} exited:\n{node.log.read_text()[-3000:]}")
            if not ray.is_initialized():
                try:
                    ray.init(address=self.address, log_to_driver=False)
                except Exception:  # noqa: BLE001 - the head is not listening yet
                    time.sleep(1.0)
                    continue
            if sum(1 for n in ray.nodes() if n["Alive"]) >= count:
                return
            time.sleep(0.5)
        raise TimeoutError(f"the Ray cluster did not reach {count} nodes within {timeout_s} s")

    def node_ids_by_resource(self) -> dict[str, str]:
        """``{"node_a": <node id>, ...}`` for the alive nodes (needs ``ray.init`` in this process)."""
        import ray

        found = {}
        for n in ray.nodes():
            if n["Alive"]:
                for key in n["Resources"]:
                    if key.startswith("node_") and not key.startswith("node:"):
                        found[key] = n["NodeID"]
        return found

    def stop(self) -> None:
        import ray

        ray.shutdown()
        for node in reversed(self.nodes):  # workers first, the head last
            node.stop()
        self.nodes.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@dataclass(frozen=True)
class ActorInfo:
    """An alive actor: its name, Ray namespace, class name and the (hex) id of the node it runs on."""

    name: str
    namespace: str
    class_name: str
    node_id: str


def alive_actors(class_name: str) -> list[ActorInfo]:
    """The alive actors of class ``class_name`` in the cluster this process is connected to (``ray.init``), read
    from the GCS: Ray's state API (``ray.util.state``) would need the dashboard, which this cluster does not run."""
    import ray
    from ray._private import state

    namespaces = {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)}
    return [ActorInfo(a["Name"], namespaces.get(a["Name"], ""), a["ActorClassName"], a["Address"]["NodeID"])
            for a in state.actors(actor_state_name="ALIVE").values() if a["ActorClassName"] == class_name]


def live_placement_groups() -> list[dict]:
    """The placement groups of the connected cluster that are not removed (``ray.util.placement_group_table``)."""
    import ray

    return [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
