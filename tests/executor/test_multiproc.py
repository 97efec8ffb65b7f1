"""MultiprocExecutor: tensor parallelism across worker processes on CPU (gloo), and failure handling.

Each engine here spawns two worker processes (about 10-15 s on a small machine), so the module shares one
TP=2 engine: the tests that only read it borrow it, and the test that breaks it takes it over (a later
borrower then gets a new one), whatever order the tests run in.
"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import hf_greedy
from tests.models.test_llama_correctness import PROMPTS, run_engine
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.engine_args import EngineArgs
from tokenmill.executor.multiproc import (
    MultiprocExecutor,
    WorkerDiedError,
    WorkerError,
    available_cpu_cores,
    threads_per_worker,
)
from tokenmill.executor.selector import get_executor_class
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

ENGINE_KWARGS = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, kv_cache_memory="256KiB")


# -- functions run inside the workers through collective_rpc (module level, so they pickle by name) ----------


def _rank_facts(worker) -> dict:
    from tokenmill.distributed import get_tp_rank, get_tp_size

    layer = worker.model_runner.attn_layers[0]
    return dict(
        rank=worker.rank,
        tp_rank=get_tp_rank(),
        tp_size=get_tp_size(),
        threads=torch.get_num_threads(),
        num_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads,
        dist_backend=torch.distributed.get_backend(),
        num_blocks=int(worker.model_runner.num_blocks),
        pid=os.getpid(),
    )


def _set_block_budget(worker, budgets: list[int]) -> None:
    worker.determine_num_available_blocks = lambda: budgets[worker.rank]


def _clear_block_budget(worker) -> None:
    del worker.determine_num_available_blocks


def _raise_on_rank(worker, rank: int) -> int:
    if worker.rank == rank:
        raise ValueError(f"boom from rank {rank}")
    return worker.rank


# -- fixtures ------------------------------------------------------------------------------------------------


class _SharedEngine:
    """One TP=2 engine core, built on first use: ``borrow()`` lends it, ``take()`` hands it over for good (the
    taker shuts it down; the next ``borrow()`` builds a fresh one)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.core: EngineCore | None = None

    def borrow(self) -> EngineCore:
        if self.core is None:
            self.core = EngineCore(
                EngineArgs(model=self.model, tensor_parallel_size=2, **ENGINE_KWARGS).create_engine_config())
        return self.core

    def take(self) -> EngineCore:
        core = self.borrow()
        self.core = None
        return core

    def close(self) -> None:
        if self.core is not None:
            self.take().shutdown()


@pytest.fixture(scope="module")
def tp2_engine(tiny_llama_dir):
    shared = _SharedEngine(tiny_llama_dir)
    yield shared
    shared.close()


@pytest.fixture
def tp2_core(tp2_engine) -> EngineCore:
    return tp2_engine.borrow()


# -- tests ---------------------------------------------------------------------------------------------------


def _parallel(tp: int, backend: str | None) -> SimpleNamespace:
    parallel = SimpleNamespace(tensor_parallel_size=tp, distributed_executor_backend=backend)
    return SimpleNamespace(parallel_config=parallel)


def test_get_executor_class_chooses_backend(monkeypatch):
    from tokenmill.executor.uniproc import UniProcExecutor

    assert get_executor_class(_parallel(1, None)) is UniProcExecutor
    assert get_executor_class(_parallel(1, "uni")) is UniProcExecutor
    assert get_executor_class(_parallel(2, None)) is MultiprocExecutor
    assert get_executor_class(_parallel(1, "mp")) is MultiprocExecutor
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        get_executor_class(_parallel(2, "uni"))
    with pytest.raises(ValueError, match="unknown backend 'dask'"):
        get_executor_class(_parallel(2, "dask"))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install .tokenmill\[ray\]"):
        get_executor_class(_parallel(2, "ray"))


def test_threads_per_worker(monkeypatch):
    monkeypatch.delenv("TOKENMILL_WORKER_THREADS", raising=False)
    cores = available_cpu_cores()
    assert threads_per_worker(2) == max(1, cores // 2)
    assert threads_per_worker(10_000) == 1
    monkeypatch.setenv("TOKENMILL_WORKER_THREADS", "3")
    assert threads_per_worker(2) == 3


def test_tp2_greedy_matches_tp1_and_transformers(tp2_core, tiny_llama_dir):
    assert isinstance(tp2_core.executor, MultiprocExecutor)
    ours = run_engine(tp2_core, PROMPTS, max_tokens=8)
    tp1 = EngineCore(EngineArgs(model=tiny_llama_dir, **ENGINE_KWARGS).create_engine_config())
    assert run_engine(tp1, PROMPTS, max_tokens=8) == ours
    assert ours == hf_greedy(tiny_llama_dir, PROMPTS, 8)
    # each rank holds half the heads, so half of each block: twice the blocks of one rank in the same memory
    assert tp2_core.config.cache_config.num_gpu_blocks == 2 * tp1.config.cache_config.num_gpu_blocks


def test_ranks_are_separate_processes_with_sharded_heads(tp2_core):
    facts = tp2_core.executor.collective_rpc(_rank_facts)
    assert [f["rank"] for f in facts] == [0, 1] == [f["tp_rank"] for f in facts]
    assert {f["tp_size"] for f in facts} == {2}
    assert {f["dist_backend"] for f in facts} == {"gloo"}
    assert [f["pid"] for f in facts] == tp2_core.executor.worker_pids
    assert os.getpid() not in tp2_core.executor.worker_pids
    # tiny Llama: 4 query heads, 2 KV heads -> 2 and 1 per rank
    assert {(f["num_heads"], f["num_kv_heads"]) for f in facts} == {(2, 1)}
    assert {f["num_blocks"] for f in facts} == {tp2_core.config.cache_config.num_gpu_blocks}
    assert {f["threads"] for f in facts} == {threads_per_worker(2)}
    # only rank 0 sends its result when asked to
    assert tp2_core.executor.collective_rpc(_rank_facts, reply_rank=0)[1] is None


def test_kv_cache_blocks_are_the_minimum_over_ranks(tp2_core):
    executor = tp2_core.executor
    executor.collective_rpc(_set_block_budget, ([90, 70],))
    try:
        assert executor.determine_num_available_blocks() == 70
        executor.collective_rpc(_set_block_budget, ([50, 80],))
        assert executor.determine_num_available_blocks() == 50
    finally:
        executor.collective_rpc(_clear_block_budget)


def test_worker_error_then_killed_worker(tp2_engine):
    core = tp2_engine.take()  # it breaks the engine: no other test may borrow it afterwards
    executor = core.executor
    try:
        # an exception on one rank fails the call with its traceback; the ranks stay in step
        with pytest.raises(WorkerError, match="(?s)rank 1 failed in '_raise_on_rank'.*boom from rank 1"):
            executor.collective_rpc(_raise_on_rank, (1,))
        assert executor.collective_rpc(_raise_on_rank, (5,)) == [0, 1]

        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        core.add_request(EngineCoreRequest("r", [1, 2, 3, 4, 5], params))
        core.step()
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1 .*killed by SIGKILL"):
            core.step()
        assert time.monotonic() - start < 5.0
        with pytest.raises(WorkerError, match="unusable after an earlier failure"):
            core.step()
        deadline = time.monotonic() + 5.0
        while any(p.is_alive() for p in executor.processes) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(p.is_alive() for p in executor.processes), "the surviving rank was not stopped"
    finally:
        core.shutdown()
        core.shutdown()  # idempotent
