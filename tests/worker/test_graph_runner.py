"""GraphRunner on CPU: buckets, static buffers, padding and the graph-or-eager decision.

A fake capture class stands in for CUDA graphs: it "captures" by recording the forward callable (and running
it once) and "replays" by calling it again on the static buffers, refilling the captured output in place, so
everything but the device recording itself is exercised here. The engine-level test runs the Triton
attention backend (the one that declares graph support) under the Triton interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, ClassVar

if "triton" not in sys.modules:  # the interpreter must be chosen before triton's first import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tokenmill.conformance.checks_engine import drive_staggered
from tokenmill.forward_context import get_forward_context, set_forward_context
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.graph_runner import GraphCapture, GraphRunner, graph_batch_sizes
from tokenmill.worker.input_batch import CachedRequestState, build_batch_inputs
from tokenmill_cpu.platform import CpuPlatform

TRITON_BACKEND = "tokenmill.attention.backends.triton_paged:TritonPagedAttentionBackend"
CPU = torch.device("cpu")
triton_interpreted = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton running under TRITON_INTERPRET=1",
)


class FakeGraphCapture(GraphCapture):
    """Records the callable instead of a device graph; replay calls it again."""

    log: ClassVar[list[tuple[int, Any]]] = []  # (batch rows of the captured output, pool) per capture

    @classmethod
    def create_pool(cls, device: torch.device) -> Any:
        return object()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.output = fn()
        FakeGraphCapture.log.append((self.output.shape[0], self.pool))
        return self.output

    def replay(self) -> None:
        self.output.copy_(self.fn())


class FakeGraphPlatform(CpuPlatform):
    """The CPU platform with graph capture (the fake) and the Triton attention backend."""

    name = "cpu-graphs-test"
    supports_graph_capture = True

    @classmethod
    def graph_capture_cls(cls) -> str | None:
        return f"{FakeGraphCapture.__module__}:{FakeGraphCapture.__qualname__}"

    @classmethod
    def get_attn_backend_cls(cls, config: Any) -> str:
        return TRITON_BACKEND


class EchoModel(torch.nn.Module):
    """Returns, per token row, what a graph's forward pass saw: ``[input_id, position, slot, seq_len,
    block_table[:, 0], query_start]`` (float)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        md = get_forward_context().attn_metadata
        cols = [input_ids, positions, md.slot_mapping, md.seq_lens, md.block_table[:, 0], md.query_start_loc[:-1]]
        return torch.stack([c.float() for c in cols], dim=1)


class _GraphBackend:
    name = "GRAPH_OK"
    supports_graph_capture = True


@pytest.fixture
def graph_platform(monkeypatch: pytest.MonkeyPatch):
    from tokenmill.platforms import get_current_platform, set_current_platform

    monkeypatch.delenv("TOKENMILL_PLATFORM", raising=False)
    previous = get_current_platform()
    set_current_platform(FakeGraphPlatform)
    FakeGraphCapture.log.clear()
    yield FakeGraphPlatform
    set_current_platform(previous)


def _state(req_id: str, tokens: list[int], computed: int, blocks: list[int]) -> CachedRequestState:
    return CachedRequestState(
        req_id=req_id,
        token_ids=list(tokens),
        num_prompt_tokens=2,
        sampling_params=SamplingParams(temperature=0.0),
        block_ids=list(blocks),
        num_computed_tokens=computed,
    )


def _decodes(n: int) -> list[CachedRequestState]:
    """``n`` requests with 5 + i known tokens, all but the last in the cache (one query token each)."""
    return [
        _state(f"r{i}", list(range(10 + i, 15 + 2 * i)), 4 + i, [4 * i + k + 1 for k in range(4)]) for i in range(n)
    ]


def _echo_runner(sizes: list[int] = [1, 2, 4, 8]) -> GraphRunner:  # noqa: B006 - read only
    runner = GraphRunner(EchoModel(), CPU, FakeGraphCapture, sizes, max_model_len=64, block_size=4)
    runner.capture_all()
    return runner


# -- buckets ---------------------------------------------------------------------------------------------------


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert graph_batch_sizes(1000) == graph_batch_sizes(256)
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)


def test_capture_order_pool_and_bucket_choice() -> None:
    FakeGraphCapture.log.clear()
    runner = _echo_runner()
    assert [rows for rows, _ in FakeGraphCapture.log] == [8, 4, 2, 1]  # largest first
    assert len({id(pool) for _, pool in FakeGraphCapture.log}) == 1  # one shared pool
    assert [runner.bucket_for(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]


# -- one step ------------------------------------------------------------------------------------------------


def test_padded_replay_equals_eager_and_padding_is_harmless() -> None:
    runner = _echo_runner()
    states = _decodes(3)
    batch = build_batch_inputs(states, [1, 1, 1], 4, CPU)
    assert runner.can_run(batch)
    with set_forward_context(batch.attn_metadata):
        eager = EchoModel()(batch.input_ids, batch.positions)
    out = runner.run(batch)
    assert torch.equal(out, eager)
    assert out.shape[0] == 3  # padded rows are not returned
    assert runner.replays == Counter({4: 1})
    # the padding row of bucket 4: token 0 at position 0, no cache slot, one key of block 0
    assert runner.outputs[4][3].tolist() == [0.0, 0.0, -1.0, 1.0, 0.0, 3.0]
    # after a batch of 5 (bucket 8), a batch of 3 (bucket 4): row 3 held a real request and is padding again
    runner.run(build_batch_inputs(_decodes(5), [1] * 5, 4, CPU))
    again = runner.run(batch)
    assert torch.equal(again, eager)
    assert runner.replays == Counter({4: 2, 8: 1})
    assert runner.input_ids[3].item() == 0 and runner.slot_mapping[3].item() == -1
    assert runner.seq_lens[3].item() == 1 and runner.block_table[3].eq(0).all()
    assert runner.outputs[4][3].tolist() == [0.0, 0.0, -1.0, 1.0, 0.0, 3.0]


def test_eager_for_prefill_mixed_and_too_large_batches() -> None:
    runner = _echo_runner()
    decodes = _decodes(9)
    assert runner.can_run(build_batch_inputs(decodes[:8], [1] * 8, 4, CPU))
    assert not runner.can_run(build_batch_inputs(decodes, [1] * 9, 4, CPU))  # larger than the largest bucket
    prefill = _state("p", [1, 2, 3, 4, 5], 0, [7, 8])
    assert not runner.can_run(build_batch_inputs([prefill], [5], 4, CPU))
    assert not runner.can_run(build_batch_inputs([*decodes[:2], prefill], [1, 1, 5], 4, CPU))  # mixed
    chunk = _state("c", [1, 2, 3, 4, 5, 6], 3, [7, 8])  # two query tokens on a cached prefix
    assert not runner.can_run(build_batch_inputs([chunk], [2], 4, CPU))


# -- when graphs are on --------------------------------------------------------------------------------------


def _runner_stub(enforce_eager: bool = False, backend: Any = _GraphBackend, max_num_seqs: int = 3) -> Any:
    config = SimpleNamespace(
        enforce_eager=enforce_eager,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
        model_config=SimpleNamespace(max_model_len=32),
    )
    return SimpleNamespace(config=config, model=EchoModel(), attn_backend=backend, device=CPU, block_size=4)


def test_create_if_enabled(graph_platform, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.attention.backends.torch_paged import TorchPagedAttentionBackend
    from tokenmill.attention.backends.triton_paged import TritonPagedAttentionBackend

    assert TritonPagedAttentionBackend.supports_graph_capture
    assert not TorchPagedAttentionBackend.supports_graph_capture
    runner = GraphRunner.create_if_enabled(_runner_stub())
    assert runner is not None and runner.batch_sizes == [1, 2, 3] and set(runner.graphs) == {1, 2, 3}
    assert runner.block_table.shape == (3, 8)
    assert GraphRunner.create_if_enabled(_runner_stub(enforce_eager=True)) is None
    assert GraphRunner.create_if_enabled(_runner_stub(backend=TorchPagedAttentionBackend)) is None
    monkeypatch.setattr(FakeGraphPlatform, "supports_graph_capture", False)
    assert GraphRunner.create_if_enabled(_runner_stub()) is None


def test_platforms_without_graphs() -> None:
    from tokenmill.platforms import Platform

    assert Platform.graph_capture_cls() is None
    assert CpuPlatform.graph_capture_cls() is None
    from tokenmill_cuda.platform import CudaPlatform

    assert CudaPlatform.graph_capture_cls() == "tokenmill_cuda.graphs:CudaGraphCapture"


# -- the whole engine ----------------------------------------------------------------------------------------


@triton_interpreted
def test_engine_decode_graphs_match_eager_and_transformers(graph_platform, tiny_llama_dir: str) -> None:
    from tests.conftest import hf_greedy
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine_args import EngineArgs

    prompts = [[1, 5, 9, 33, 44, 100], [7] * 9, [3, 4, 5], [11, 300, 301, 302, 17], [40, 41]]
    args = EngineArgs(
        model=tiny_llama_dir, dtype="float32", block_size=4, max_num_seqs=8, num_gpu_blocks_override=64
    )
    core = EngineCore(args.create_engine_config())
    graphs = core.executor.worker.model_runner.graph_runner
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8]
    seen: list[tuple[bool, int]] = []
    execute = core.executor.execute_model

    def recording(so: Any) -> Any:
        seen.append((all(n == 1 for n in so.num_scheduled_tokens.values()), len(so.num_scheduled_tokens)))
        return execute(so)

    core.executor.execute_model = recording
    ours = drive_staggered(core, prompts, max_tokens=5)

    eager_core = EngineCore(args.replace(enforce_eager=True).create_engine_config())
    assert eager_core.executor.worker.model_runner.graph_runner is None
    assert drive_staggered(eager_core, prompts, max_tokens=5) == ours
    assert ours == hf_greedy(tiny_llama_dir, prompts, 5)

    decode_sizes = [n for decode_only, n in seen if decode_only]
    assert 3 in decode_sizes and 5 in decode_sizes
    assert graphs.replays == Counter(graphs.bucket_for(n) for n in decode_sizes)
    assert {4, 8} <= set(graphs.replays)  # 3 decodes ran on bucket 4, 5 decodes on bucket 8
    assert any(not decode_only for decode_only, _ in seen)  # prefill and mixed steps ran eagerly


def _graph_replays(worker: Any) -> dict[int, int]:
    graphs = worker.model_runner.graph_runner
    return {} if graphs is None else dict(graphs.replays)


@triton_interpreted
@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_replay_the_same_graphs(graph_platform, tiny_llama_dir: str) -> None:
    """TP=2 worker processes (gloo): all-reduces inside the captured forward, same bucket on every rank."""
    from tests.conftest import hf_greedy
    from tests.models.test_llama_correctness import run_engine
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine_args import EngineArgs

    prompts = [[1, 5, 9, 33], [7] * 6]
    args = EngineArgs(
        model=tiny_llama_dir,
        dtype="float32",
        block_size=4,
        max_num_seqs=2,
        num_gpu_blocks_override=32,
        tensor_parallel_size=2,
    )
    core = EngineCore(args.create_engine_config())
    try:
        assert run_engine(core, prompts, max_tokens=4) == hf_greedy(tiny_llama_dir, prompts, 4)
        per_rank = core.executor.collective_rpc(_graph_replays)
    finally:
        core.shutdown()
    assert per_rank[0] == per_rank[1] and per_rank[0].get(2, 0) >= 2
