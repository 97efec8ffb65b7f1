"""A family built from the shared blocks runs torch.compile'd (tokenmill.worker.compiled_runner): Mixtral, whose
layers have a sliding window (traced in decode steps) and a fused-experts op (opaque in the graph)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from tests.models.families import BY_NAME, build_family
from tests.models.test_families import PROMPTS, hf_reference, run_wave, tokens
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)


@pytest.mark.slow
def test_compiled_mixtral_matches_transformers(monkeypatch, family_root):
    monkeypatch.setenv("TOKENMILL_COMPILE", "1")
    # One layer (the family's other tests use two): the window and the experts op (weights as its arguments) are
    # the same in every layer, and the graphs compile in about half the time.
    spec = BY_NAME["mixtral"]
    model_dir = build_family(dataclasses.replace(spec, kwargs={**spec.kwargs, "num_hidden_layers": 1}),
                             os.path.join(family_root, "mixtral-1-layer"))
    core = EngineCore(EngineArgs(model=model_dir, dtype="float32", block_size=4, num_gpu_blocks_override=256)
                      .create_engine_config())
    runner = core.executor.worker.model_runner.compiled_runner
    assert runner is not None  # warm-up compiled every kind
    outs = run_wave(core, "c", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    greedy, _ = hf_reference(model_dir, PROMPTS, 16)
    assert [tokens(outs[i]) for i in range(len(PROMPTS))] == greedy
    assert runner.kind_steps["many"] >= 10 and runner.kind_steps["mixed"] >= 1
