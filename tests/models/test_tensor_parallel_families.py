"""Tensor parallelism 2 (multiproc workers, gloo on CPU) gives the greedy tokens of TP 1 for a dense family whose
q/k norm spans the ranks (OLMo 2) and for an MoE family whose experts are split across them (Qwen3-MoE)."""

from __future__ import annotations

import pytest

from tests.models.families import family_dir
from tests.models.test_families import PROMPTS, run_wave, tokens
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs
from tokenmill.executor.multiproc import MultiprocExecutor
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

KWARGS = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, kv_cache_memory="512KiB")


def _facts(worker) -> dict:
    from tokenmill.layers import FusedMoE

    model = worker.model_runner.model
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    attn = worker.model_runner.attn_layers[0]
    return dict(heads=attn.num_heads, kv_heads=attn.num_kv_heads,
                expert_shape=tuple(moe[0].w2_weight.shape) if moe else None)


@pytest.mark.parametrize("name", ["olmo2", "qwen3_moe"])
def test_tp2_greedy_equals_tp1(name, family_root):
    model_dir = family_dir(name, family_root)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tp1 = EngineCore(EngineArgs(model=model_dir, **KWARGS).create_engine_config())
    expected = run_wave(tp1, "a", params)
    core = EngineCore(EngineArgs(model=model_dir, tensor_parallel_size=2, **KWARGS).create_engine_config())
    try:
        assert isinstance(core.executor, MultiprocExecutor)
        facts = core.executor.collective_rpc(_facts)
        assert [f["heads"] for f in facts] == [2, 2] and [f["kv_heads"] for f in facts] == [1, 1]
        if name == "qwen3_moe":  # every rank holds all 6 experts, half of each one's 32 intermediate columns
            assert [f["expert_shape"] for f in facts] == [(6, 64, 16)] * 2
        got = run_wave(core, "b", params)
        for i in range(len(PROMPTS)):
            assert tokens(got[i]) == tokens(expected[i]), f"prompt {i}"
    finally:
        core.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "qwen3_moe"])
def test_pp2_greedy_equals_pp1(name, family_root):
    """Pipeline parallelism on the shared DecoderModel: Gemma 2 (sandwich norms, scaled embedding, tied head on
    the other stage, soft caps) and an MoE family split into two stages give one stage's tokens."""
    model_dir = family_dir(name, family_root)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = run_wave(EngineCore(EngineArgs(model=model_dir, **KWARGS).create_engine_config()), "a", params)
    core = EngineCore(EngineArgs(model=model_dir, pipeline_parallel_size=2, **KWARGS).create_engine_config())
    try:
        got = run_wave(core, "b", params)
        for i in range(len(PROMPTS)):
            assert tokens(got[i]) == tokens(expected[i]), f"prompt {i}"
    finally:
        core.shutdown()
