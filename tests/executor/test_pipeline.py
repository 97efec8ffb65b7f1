"""Pipeline parallelism with local worker processes: the layer split, the model contract helpers, and greedy
tokens of PP=2 (with a tied LM head on a different stage than the embedding) equal to PP=1, with two
micro-batches in flight."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import build_tiny_llama
from tests.models.test_llama_correctness import PROMPTS, run_engine
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs
from tokenmill.layers.pipeline import (
    PP_LAYER_PARTITION_ENV,
    IntermediateTensors,
    PPMissingLayer,
    get_pp_indices,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
)

ENGINE_KWARGS = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, kv_cache_memory="256KiB")


def test_pp_indices_split_layers_with_the_remainder_before_the_last_stage(monkeypatch):
    monkeypatch.delenv(PP_LAYER_PARTITION_ENV, raising=False)
    assert [get_pp_indices(8, r, 2) for r in range(2)] == [(0, 4), (4, 8)]
    assert [get_pp_indices(7, r, 3) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [get_pp_indices(3, r, 2) for r in range(2)] == [(0, 2), (2, 3)]
    assert get_pp_indices(5, 0, 1) == (0, 5)
    with pytest.raises(ValueError, match="only 2 layers"):
        get_pp_indices(2, 0, 3)
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "1,4")
    assert [get_pp_indices(5, r, 2) for r in range(2)] == [(0, 1), (1, 5)]
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "2,2")
    with pytest.raises(ValueError, match="summing to 5"):
        get_pp_indices(5, 0, 2)


def test_missing_layers_and_intermediate_tensors():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), PPMissingLayer()])
    assert is_pp_missing_parameter("layers.1.weight", model)
    assert not is_pp_missing_parameter("layers.0.weight", model)
    assert not is_pp_missing_parameter("layers.10.weight", model)
    assert list(PPMissingLayer().parameters()) == []
    x = torch.ones(3)
    assert PPMissingLayer()(x) is x
    empty = make_empty_intermediate_tensors_factory(["hidden_states", "residual"], 8)(5, torch.float32, torch.device("cpu"))
    assert isinstance(empty, IntermediateTensors)
    assert sorted(empty) == ["hidden_states", "residual"] and empty["residual"].shape == (5, 8)


def test_pp_flags_are_validated(tiny_llama_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size: 3 stages but the model has only 2 layers"):
        EngineArgs(model=tiny_llama_dir, pipeline_parallel_size=3).create_engine_config()
    with pytest.raises(ValueError, match="pipeline_parallel_size: must be at least 1"):
        EngineArgs(model=tiny_llama_dir, pipeline_parallel_size=0).create_engine_config()
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        EngineArgs(model=tiny_llama_dir, pipeline_parallel_size=2, distributed_executor_backend="uni").create_engine_config()
    config = EngineArgs(model=tiny_llama_dir, pipeline_parallel_size=2, tensor_parallel_size=2).create_engine_config()
    assert config.parallel_config.world_size == 4
    assert config.parallel_config.distributed_executor_backend == "mp"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pp2_multiproc_tied_head_matches_pp1(tmp_path, monkeypatch):
    monkeypatch.delenv(PP_LAYER_PARTITION_ENV, raising=False)
    model = build_tiny_llama(str(tmp_path / "tied3"), tie=True, num_hidden_layers=3, seed=3)
    expected = run_engine(EngineCore(EngineArgs(model=model, **ENGINE_KWARGS).create_engine_config()), PROMPTS,
                          max_tokens=8)
    core = EngineCore(EngineArgs(model=model, pipeline_parallel_size=2, **ENGINE_KWARGS).create_engine_config())
    try:
        in_flight = []
        submit = core.executor.execute_model

        def counting_submit(scheduler_output, non_block=False):
            in_flight.append(len(core.batch_queue) + 1)
            return submit(scheduler_output, non_block)

        core.executor.execute_model = counting_submit
        assert run_engine(core, PROMPTS, max_tokens=8) == expected
        assert max(in_flight) == 2
        # the first stage (2 of 3 layers) bounds the cache: each stage holds only its layers' blocks
        assert core.config.cache_config.num_gpu_blocks > 0
    finally:
        core.shutdown()
