"""RayExecutor against a small in-process stand-in for Ray (Ray itself is not installed in CI).

The stand-in runs each "actor" as a plain object in this process, resolves top-level object refs the way
Ray does, and can mark an actor dead, so the executor's protocol (rendezvous, one ``put`` per step, rank 0's
answer, errors) is checked end to end with one rank.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import pytest
import torch

from tests.models.test_llama_correctness import run_engine
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs
from tokenmill.executor.multiproc import WorkerDiedError, WorkerError


class _RayError(Exception):
    pass


class _Ref:
    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error


class _Handle:
    def __init__(self, fake: FakeRay, obj: Any) -> None:
        self._fake, self._obj, self.dead = fake, obj, False

    def __getattr__(self, name: str) -> Any:
        handle = self

        class _Method:
            @staticmethod
            def remote(*args: Any) -> _Ref:
                if handle.dead:
                    return _Ref(error=handle._fake.exceptions.RayActorError("actor died"))
                args = tuple(a.value if isinstance(a, _Ref) else a for a in args)  # top-level refs resolve
                try:
                    return _Ref(getattr(handle._obj, name)(*args))
                except Exception as exc:  # noqa: BLE001
                    return _Ref(error=handle._fake.exceptions.RayTaskError(repr(exc)))

        return _Method


class FakeRay(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("ray")
        self.__spec__ = importlib.machinery.ModuleSpec("ray", None)
        self.initialized = False
        self.actors: list[_Handle] = []
        self.actor_options: list[dict] = []
        self.puts = 0
        self.exceptions = types.SimpleNamespace(
            GetTimeoutError=type("GetTimeoutError", (_RayError,), {}),
            RayActorError=type("RayActorError", (_RayError,), {}),
            RayTaskError=type("RayTaskError", (_RayError,), {}),
        )
        self.util = types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1")

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, **kwargs: Any) -> None:
        self.initialized = True

    def remote(self, cls: type) -> Any:
        fake = self

        class _ActorClass:
            def options(self, **options: Any) -> _ActorClass:
                fake.actor_options.append(options)
                return self

            def remote(self, *args: Any) -> _Handle:
                handle = _Handle(fake, cls(*args))
                fake.actors.append(handle)
                return handle

        return _ActorClass()

    def put(self, value: Any) -> _Ref:
        self.puts += 1
        return _Ref(value)

    def get(self, refs: list[_Ref], timeout: float | None = None) -> list[Any]:
        for ref in refs:
            if ref.error is not None:
                raise ref.error
        return [ref.value for ref in refs]

    def kill(self, handle: _Handle) -> None:
        handle.dead = True


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> FakeRay:
    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    threads = torch.get_num_threads()
    yield fake
    torch.set_num_threads(threads)


def test_ray_executor_runs_the_engine_and_reports_a_dead_actor(fake_ray: FakeRay, tiny_llama_dir: str) -> None:
    from tokenmill.executor.ray import RayExecutor

    args = EngineArgs(model=tiny_llama_dir, dtype="float32", block_size=4, num_gpu_blocks_override=64)
    core = EngineCore(args.replace(distributed_executor_backend="ray").create_engine_config())
    assert isinstance(core.executor, RayExecutor)
    assert fake_ray.initialized and len(fake_ray.actors) == 1
    assert fake_ray.actor_options == [{"num_cpus": fake_ray.actor_options[0]["num_cpus"]}]  # CPU: no GPU asked
    assert core.executor.distributed_init_method.startswith("tcp://127.0.0.1:")
    prompts = [[1, 5, 9, 33], [7] * 9]
    puts_before = fake_ray.puts
    ours = run_engine(core, prompts, max_tokens=5)
    steps = fake_ray.puts - puts_before
    assert steps >= 5  # one put per step (the scheduler output, shared by every actor)
    assert ours == run_engine(EngineCore(args.create_engine_config()), prompts, max_tokens=5)

    with pytest.raises(WorkerError, match="no_such_method"):
        core.executor.collective_rpc("no_such_method")
    with pytest.raises(WorkerError, match="unusable"):
        core.executor.collective_rpc("determine_num_available_blocks")


def test_ray_dead_actor_raises_worker_died(fake_ray: FakeRay, tiny_llama_dir: str) -> None:
    args = EngineArgs(
        model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=16, distributed_executor_backend="ray"
    )
    core = EngineCore(args.create_engine_config())
    fake_ray.actors[0].dead = True
    with pytest.raises(WorkerDiedError, match="died"):
        core.executor.determine_num_available_blocks()
    core.shutdown()
