"""Admission through the front ends on the tiny Llama: requests that can never fit the KV cache are rejected
with a clear error (LLM, LLMEngine, EngineCore), and ``priority=`` reaches the scheduler from LLM, LLMEngine
and AsyncLLM."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from tests.engine.engine_fakes import EchoEngineCore, byte_level_tokenizer, cls_path, make_config
from tests.engine.tiny_model import ScheduleRecorder, tiny_llama_with_tokenizer
from tokenmill.core.request import Request
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.core import EngineCore
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.engine_args import EngineArgs
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

# 4 blocks of 16 tokens: the whole KV cache holds 64 tokens.
CAPACITY = 64


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_llama_with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("tiny_admission") / "model")


@pytest.fixture(scope="module")
def small_llm(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", block_size=16, num_gpu_blocks_override=CAPACITY // 16)


def core_of(llm: LLM) -> EngineCore:
    return llm.llm_engine.engine_core.engine_core


# -- requests larger than the KV cache ------------------------------------------------------------------


def test_llm_rejects_what_can_never_fit_and_keeps_serving(small_llm: LLM) -> None:
    greedy = dict(temperature=0, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="KV cache holds only 64") as info:
        small_llm.generate([list(range(3, 3 + CAPACITY + 6))], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="KV cache holds 64 tokens") as info:
        small_llm.generate([[5] * 10], SamplingParams(max_tokens=60, **greedy), use_tqdm=False)
    assert info.value.param == "max_tokens"
    # One bad request in a batch rejects the batch; nothing is left running.
    with pytest.raises(InvalidRequestError):
        small_llm.generate([[5] * 10, [6] * 10], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=55)],
                           use_tqdm=False)
    engine = small_llm.llm_engine
    assert not engine.has_unfinished_requests() and not core_of(small_llm).has_unfinished_requests()
    pool = core_of(small_llm).scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks

    # Still serving; an unset max_tokens is lowered to what the cache holds instead of failing.
    [out] = small_llm.generate([[5] * 10], SamplingParams(max_tokens=None, **greedy), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == CAPACITY - 10
    assert out.outputs[0].finish_reason == "length"


def test_llm_engine_rejects_at_add_request(small_llm: LLM) -> None:
    engine: LLMEngine = small_llm.llm_engine
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("too-long", [5] * 20, SamplingParams(max_tokens=50))
    assert info.value.param == "max_tokens"
    assert not engine.has_unfinished_requests()
    engine.add_request("too-long", [5] * 20, SamplingParams(max_tokens=5))  # the id is free again
    while engine.has_unfinished_requests():
        engine.step()


def test_engine_core_rejects_when_the_front_end_is_bypassed(small_llm: LLM) -> None:
    core = core_of(small_llm)
    for prompt, max_tokens, param in [([5] * 10, 60, "max_tokens"), ([5] * 70, 1, "prompt")]:
        with pytest.raises(InvalidRequestError) as info:
            core.add_request(EngineCoreRequest("direct", prompt, SamplingParams(max_tokens=max_tokens)))
        assert info.value.param == param
        assert "direct" not in core.scheduler.requests
    assert not core.has_unfinished_requests()


# -- priority -------------------------------------------------------------------------------------------


def record_priorities(core: EngineCore) -> dict[str, int]:
    """Wrap ``scheduler.add_request``; returns the live map request id -> Request.priority."""
    seen: dict[str, int] = {}
    original = core.scheduler.add_request

    def add_request(request: Request) -> None:
        seen[request.request_id] = request.priority
        original(request)

    core.scheduler.add_request = add_request  # type: ignore[method-assign]
    return seen


def test_llm_generate_priority_orders_admission(model_dir: str) -> None:
    llm = LLM(model_dir, dtype="float32", num_gpu_blocks_override=64, scheduling_policy="priority", max_num_seqs=1)
    seen = record_priorities(core_of(llm))
    rec = ScheduleRecorder(core_of(llm).scheduler)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([[5, 6], [7, 8], [9, 10]], params, priority=[2, 0, 1], use_tqdm=False)
    ids = [o.request_id for o in outs]  # results stay in prompt order
    assert [seen[i] for i in ids] == [2, 0, 1]
    assert rec.admission_order() == [ids[1], ids[2], ids[0]]
    with pytest.raises(ValueError, match="priority"):
        llm.generate([[5, 6], [7, 8]], params, priority=[1], use_tqdm=False)


def test_llm_engine_priority_reaches_every_child(small_llm: LLM) -> None:
    engine = small_llm.llm_engine
    seen = record_priorities(core_of(small_llm))
    engine.add_request("p", [5, 6, 7], SamplingParams(n=2, max_tokens=2), priority=-3)
    while engine.has_unfinished_requests():
        engine.step()
    assert seen == {"0_p": -3, "1_p": -3}


class PriorityEchoEngineCore(EchoEngineCore):
    """Fake engine core that generates the request's priority as its only token (runs in the child process)."""

    def add_request(self, request: EngineCoreRequest) -> None:
        super().add_request(msgspec.structs.replace(request, prompt_token_ids=[request.priority]))


def test_async_llm_priority_crosses_the_process_boundary() -> None:
    tokenizer: Any = byte_level_tokenizer()

    async def main() -> list[int]:
        llm = AsyncLLM(
            make_config(), tokenizer=tokenizer, engine_core_cls=cls_path(PriorityEchoEngineCore), startup_timeout_s=30
        )
        try:
            results = []
            for priority in (7, 42):
                params = SamplingParams(max_tokens=1)
                async for out in llm.generate("hi", params, f"req-{priority}", priority=priority):
                    if out.finished:
                        results.append(out.outputs[0].token_ids[0])
            return results
        finally:
            llm.shutdown()

    assert asyncio.run(asyncio.wait_for(main(), timeout=60)) == [7, 42]


def test_engine_args_scheduling_policy_is_validated(model_dir: str) -> None:
    cfg = EngineArgs(model=model_dir, scheduling_policy="priority").create_engine_config()
    assert cfg.scheduler_config.policy == "priority"
