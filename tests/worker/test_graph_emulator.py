"""The CPU graph-capture emulator: replay runs only what was recorded at capture, on the captured tensors.

Unit tests of its semantics (fresh tensors refilled, views and in-place ops on the same memory, host values
frozen, host reads refused), then the model-level check the old graph-runner tests could not make: the rotary
embedding's cos/sin lookup must happen inside the captured forward pass (a lookup cached on a Python object at
warm-up is frozen in the graph, and the emulator shows it).
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:  # the interpreter must be chosen before triton's first import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util

import pytest
import torch

from tokenmill.worker.graph_emulator import EmulatedGraphCapture, GraphCaptureError

CPU = torch.device("cpu")


def _capture(fn):  # noqa: ANN001, ANN202
    graph = EmulatedGraphCapture(CPU, None)
    return graph, graph.capture(fn)


def test_replay_recomputes_recorded_ops_on_new_contents() -> None:
    x = torch.randn(4, 8)
    w = torch.randn(8, 3)
    buf = torch.zeros(4, 3)

    def fn() -> torch.Tensor:
        h = torch.relu(x @ w)  # fresh tensors: refilled on replay
        buf[:2].copy_(h[:2])  # in-place write into a view of a static buffer
        return (h + buf).t().contiguous()  # a view, then a fresh copy

    graph, out = _capture(fn)
    assert torch.allclose(out, fn())
    x.copy_(torch.randn(4, 8))
    w.mul_(-1)
    graph.replay()
    buf_before = buf.clone()
    expected = fn()  # eager on the same inputs (rewrites buf the same way)
    assert torch.allclose(out, expected) and torch.equal(buf, buf_before)


def test_host_values_are_frozen_at_capture() -> None:
    x = torch.arange(6.0)
    lengths = [2]  # a host list, like AttentionMetadata.seq_lens_cpu

    def fn() -> torch.Tensor:
        return x[: lengths[0]] * 10

    graph, out = _capture(fn)
    lengths[0] = 5
    x.add_(1)
    graph.replay()
    assert out.tolist() == [10.0, 20.0]  # the slice length of capture time, new contents
    assert fn().shape == (5,)  # what a re-run of the Python would have done instead


@pytest.mark.parametrize("op", ["item", "tolist", "bool", "nonzero", "mask"])
def test_host_reads_and_data_dependent_shapes_are_refused(op: str) -> None:
    x = torch.tensor([0.0, 1.0, 2.0])

    def fn() -> torch.Tensor:
        if op == "item":
            return x * x.sum().item()
        if op == "tolist":
            return x * len([v for v in x.tolist() if v])
        if op == "bool":
            return x * 2 if bool(x.sum() > 0) else x
        if op == "nonzero":
            return x.nonzero()
        return x[x > 0]

    with pytest.raises(GraphCaptureError, match="device graph cannot contain it"):
        _capture(fn)


def test_python_state_changed_per_call_is_frozen() -> None:
    """A re-running fake replays Python; a graph (and the emulator) does not."""
    counter = {"n": 0}
    x = torch.ones(3)

    def fn() -> torch.Tensor:
        counter["n"] += 1
        return x * counter["n"]

    graph, out = _capture(fn)
    graph.replay()
    graph.replay()
    assert out.tolist() == [1.0, 1.0, 1.0] and counter["n"] == 1


# -- the rotary embedding inside a captured decode step ---------------------------------------------------------

triton_interpreted = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton running under TRITON_INTERPRET=1",
)


def _stale_rope_cls():  # noqa: ANN202
    from tokenmill.layers import RotaryEmbedding

    class StaleRope(RotaryEmbedding):
        """The behaviour the issue suspected: cos/sin cached per ``positions`` tensor object across forward
        passes. The graph runner's warm-up and capture use the same positions object, so the capture records
        no lookup."""

        def begin_step(self, positions: torch.Tensor) -> None:
            memo = getattr(self, "_memo", None)
            if memo is None or memo[0] is not positions:
                self._memo = (positions, *self.lookup(positions))
            self._step = self._memo

    return StaleRope


def _graph_vs_eager(model_dir: str, rope_cls: type | None) -> float:
    """Largest difference between replayed and eager hidden states over decode steps whose positions change."""
    from tokenmill.attention.selector import set_attn_backend
    from tokenmill.attention.backends.triton_paged import TritonPagedAttentionBackend
    from tokenmill.config import ModelConfig
    from tokenmill.forward_context import set_forward_context
    from tokenmill.layers.attention import Attention
    from tokenmill.layers.custom_op import CustomOpRegistry
    from tokenmill.model_loader.hf_config import load_hf_config
    from tokenmill.model_loader.loader import get_model
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.worker.graph_runner import GraphRunner
    from tokenmill.worker.input_batch import CachedRequestState, build_batch_inputs

    CustomOpRegistry.reset_for_tests()
    if rope_cls is not None:
        CustomOpRegistry.register_op("rotary_embedding", rope_cls)
    set_attn_backend(TritonPagedAttentionBackend)
    try:
        config = ModelConfig(model=model_dir, tokenizer=model_dir, hf_config=load_hf_config(model_dir, None),
                             dtype="float32", max_model_len=64)
        model = get_model(config, CPU)
        if rope_cls is not None:
            assert type(model.model.layers[0].self_attn.rotary_emb) is rope_cls
        for layer in (m for m in model.modules() if isinstance(m, Attention)):
            layer.kv_cache = torch.randn(TritonPagedAttentionBackend.get_kv_cache_shape(24, 4, layer.num_kv_heads,
                                                                                       layer.head_size))
        runner = GraphRunner(model, CPU, EmulatedGraphCapture, [1, 2, 4], max_model_len=64, block_size=4)
        runner.capture_all()
        worst = 0.0
        for step in range(3):
            states = [
                CachedRequestState(f"r{i}", list(range(3, 14 + 5 * i + step)), 2, SamplingParams(temperature=0),
                                   [1 + 6 * i + b for b in range(6)], 10 + 5 * i + step)
                for i in range(3)
            ]
            batch = build_batch_inputs(states, [1, 1, 1], 4, CPU)
            with torch.inference_mode():
                replayed = runner.run(batch).clone()
                with set_forward_context(batch.attn_metadata):
                    eager = model(batch.input_ids, batch.positions)
            worst = max(worst, float((replayed - eager).abs().max()))
        assert runner.replays[4] == 3
        return worst
    finally:
        CustomOpRegistry.reset_for_tests()
        set_attn_backend(None)  # type: ignore[arg-type]
        from tokenmill.layers.rotary import _ROPE_CACHE

        _ROPE_CACHE.clear()


@triton_interpreted
def test_rotary_lookup_is_captured_in_the_graph(tiny_llama_dir: str) -> None:
    assert _graph_vs_eager(tiny_llama_dir, None) < 1e-5  # current code: cos/sin looked up inside the graph
    assert _graph_vs_eager(tiny_llama_dir, _stale_rope_cls()) > 1e-2  # a per-object cache is caught
