"""RayExecutor on a real Ray cluster (tests/ray_cluster.py: a head ``node_a`` and a node ``node_b`` on
127.0.0.1, shared by tests/executor): tensor and pipeline parallelism across actors with gloo, placement across
nodes, a killed actor and a node that leaves, and no actor or placement group left behind.

Every engine here starts Ray actors (each a fresh Python process that imports torch), so these tests are
slow on 2 cores and marked so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.models.test_llama_correctness import PROMPTS, run_engine
from tests.ray_cluster import ActorInfo, alive_actors, live_placement_groups
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.engine_args import EngineArgs
from tokenmill.executor.multiproc import WorkerDiedError, WorkerError
from tokenmill.executor.ray import RayExecutor
from tokenmill.executor.ray_utils import BUNDLE_RESOURCES_ENV, RAY_NAMESPACE
from tokenmill.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENGINE_KWARGS = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, kv_cache_memory="256KiB")


def _rank_facts(worker) -> dict:
    import os

    import torch

    from tokenmill.distributed import get_pp_group, get_tp_group

    return dict(
        rank=worker.rank,
        tp=(get_tp_group().rank_in_group, get_tp_group().world_size),
        pp=(get_pp_group().rank_in_group, get_pp_group().world_size),
        backend=torch.distributed.get_backend(),
        layers=(worker.model_runner.model.model.start_layer, worker.model_runner.model.model.end_layer),
        pid=os.getpid(),
    )


def _alive_tokenmill_actors() -> list[ActorInfo]:
    return alive_actors("RayWorkerWrapper")


def _all_gone() -> bool:
    return not _alive_tokenmill_actors() and not live_placement_groups()


def _wait_until(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return predicate()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Greedy tokens of the single-process engine."""
    return run_engine(EngineCore(EngineArgs(model=tiny_llama_dir, **ENGINE_KWARGS).create_engine_config()), PROMPTS,
                      max_tokens=8)


def _ray_core(ray_cluster, model: str, **kwargs) -> EngineCore:
    args = EngineArgs(model=model, distributed_executor_backend="ray", ray_address=ray_cluster.address,
                      **ENGINE_KWARGS, **kwargs)
    return EngineCore(args.create_engine_config())


@pytest.fixture(scope="module")
def tp2_core(ray_cluster, tiny_llama_dir) -> Iterator[EngineCore]:
    """A TP=2 engine with rank 0 on the head and rank 1 on the second node (their custom resources). The
    killed-actor test takes it over after the placement test (one engine start less: two actor processes that
    import torch, about 10 CPU-s); it is shut down here if that test did not run."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(BUNDLE_RESOURCES_ENV, json.dumps([{"node_a": 0.01}, {"node_b": 0.01}]))
        core = _ray_core(ray_cluster, tiny_llama_dir, tensor_parallel_size=2)
    yield core
    if core.executor.actors:
        core.shutdown()


def test_tp2_across_two_nodes_matches_tp1(ray_cluster, tp2_core, reference):
    import ray

    core = tp2_core
    executor = core.executor
    assert isinstance(executor, RayExecutor)
    nodes = ray_cluster.node_ids_by_resource()
    placed = ray.get([a.node_id.remote() for a in executor.actors])
    assert placed == [nodes["node_a"], nodes["node_b"]]
    facts = executor.collective_rpc(_rank_facts)
    assert [f["tp"] for f in facts] == [(0, 2), (1, 2)]
    assert {f["backend"] for f in facts} == {"gloo"}
    assert run_engine(core, PROMPTS, max_tokens=8) == reference
    assert len(_alive_tokenmill_actors()) == 2
    assert len(live_placement_groups()) == 1
    names = {a.name for a in _alive_tokenmill_actors()}
    assert all(n.startswith("tokenmill-") and n.endswith(("-rank0", "-rank1")) for n in names)
    assert ray.get_actor(sorted(names)[0], namespace=RAY_NAMESPACE) is not None


def test_killed_actor_fails_the_step_quickly_and_shutdown_cleans_up(tp2_core):
    import ray

    core = tp2_core
    try:
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        core.add_request(EngineCoreRequest("r", [1, 2, 3, 4, 5], params))
        core.step()
        ray.kill(core.executor.actors[1])
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="died"):
            for _ in range(100):
                core.step()
        assert time.monotonic() - start < 10.0
        with pytest.raises(WorkerError, match="unusable"):
            core.step()
    finally:
        core.shutdown()
    assert _wait_until(lambda: _all_gone())


def test_pipeline_parallel_pp2_and_tp2_pp2_match_pp1(ray_cluster, tiny_llama_dir, reference):
    for sizes in (dict(pipeline_parallel_size=2), dict(pipeline_parallel_size=2, tensor_parallel_size=2)):
        core = _ray_core(ray_cluster, tiny_llama_dir, **sizes)
        try:
            facts = core.executor.collective_rpc(_rank_facts)
            tp = sizes.get("tensor_parallel_size", 1)
            assert [f["pp"] for f in facts] == [(r // tp, 2) for r in range(2 * tp)]
            assert [f["layers"] for f in facts] == [((0, 1) if r < tp else (1, 2)) for r in range(2 * tp)]
            in_flight = []
            submit = core.executor.execute_model

            def counting_submit(scheduler_output, non_block=False):
                in_flight.append(len(core.batch_queue) + 1)  # batches in the pipeline once this one is in
                return submit(scheduler_output, non_block)

            core.executor.execute_model = counting_submit
            assert run_engine(core, PROMPTS, max_tokens=8) == reference, sizes
            assert max(in_flight) == 2  # two micro-batches in the pipeline at once
        finally:
            core.shutdown()
    assert _wait_until(lambda: _all_gone())


def test_node_leaving_fails_the_step(ray_cluster, tiny_llama_dir, monkeypatch):
    node = ray_cluster.add_node("node_c")
    monkeypatch.setenv(BUNDLE_RESOURCES_ENV, json.dumps([{"node_a": 0.01}, {"node_c": 0.01}]))
    core = _ray_core(ray_cluster, tiny_llama_dir, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        core.add_request(EngineCoreRequest("r", [1, 2, 3, 4, 5], params))
        core.step()
        node.kill()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError):
            for _ in range(100):
                core.step()
        assert time.monotonic() - start < 15.0
    finally:
        core.shutdown()
        ray_cluster.nodes.remove(node)
    assert _wait_until(lambda: _all_gone(), 30.0)


def test_unplaceable_group_is_a_clear_error(ray_cluster, tiny_llama_dir, monkeypatch):
    from tokenmill.executor.ray_utils import PLACEMENT_TIMEOUT_ENV, RayPlacementError

    monkeypatch.setenv(BUNDLE_RESOURCES_ENV, json.dumps({"no_such_node": 1}))
    monkeypatch.setenv(PLACEMENT_TIMEOUT_ENV, "2")
    with pytest.raises(RayPlacementError, match="could not place 2 bundles"):
        _ray_core(ray_cluster, tiny_llama_dir, tensor_parallel_size=2)
    assert _wait_until(lambda: not live_placement_groups())


_LOCAL_SCRIPT = """
import json, sys
from tests.models.test_llama_correctness import PROMPTS, run_engine
from tests.ray_cluster import ActorInfo, alive_actors, live_placement_groups
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs
import ray

args = EngineArgs(model=sys.argv[1], distributed_executor_backend="ray", tensor_parallel_size=2, **json.loads(sys.argv[2]))
core = EngineCore(args.create_engine_config())
started_here = ray.is_initialized() and core.executor._owns_connection
out = run_engine(core, PROMPTS, max_tokens=8)
core.shutdown()
print("RESULT", json.dumps({"tokens": out, "started_here": started_here, "still_connected": ray.is_initialized()}))
"""


def test_without_an_address_a_local_ray_instance_is_started_and_stopped(tiny_llama_dir, reference):
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from tests.ray_cluster import RAY_ENV, REPO_ROOT

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    ray_tmp = tempfile.mkdtemp(prefix="tm-ray-", dir="/tmp")  # unix socket paths must stay short
    env.update(RAY_ENV, PYTHONPATH=REPO_ROOT, RAY_TMPDIR=ray_tmp)
    try:
        proc = subprocess.run([sys.executable, "-c", _LOCAL_SCRIPT, tiny_llama_dir, json.dumps(ENGINE_KWARGS)],
                              env=env, capture_output=True, text=True, timeout=400, cwd=REPO_ROOT)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result == {"tokens": reference, "started_here": True, "still_connected": False}
