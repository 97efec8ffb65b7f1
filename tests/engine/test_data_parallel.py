"""Data parallelism: the load balancer's choices, and N real engine cores (local processes) behind one
AsyncLLM, or behind the offline LLMEngine, giving the single engine's greedy tokens, spread by load, prefix-aware
on request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest

from tests.engine.engine_fakes import byte_level_tokenizer
from tests.models.test_llama_correctness import PROMPTS, run_engine
from tokenmill.engine.core import EngineCore
from tokenmill.engine.dp_lb import DPLoadBalancer
from tokenmill.engine.messages import EngineCoreRequest, SchedulerStats
from tokenmill.engine_args import EngineArgs
from tokenmill.errors import EngineDeadError
from tokenmill.sampling_params import SamplingParams

ENGINE_KWARGS = dict(dtype="float32", block_size=4, max_num_batched_tokens=64, kv_cache_memory="256KiB")


def _req(req_id: str, tokens: list[int], salt: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(req_id, tokens, SamplingParams(max_tokens=1), cache_salt=salt)


def test_least_loaded_spreads_a_burst_and_breaks_ties_by_kv_usage():
    lb = DPLoadBalancer(3, "least-loaded", block_size=4)
    chosen = []
    for i in range(6):
        engine = lb.choose(_req(str(i), [1, 2, 3]))
        lb.on_sent(engine)
        chosen.append(engine)
    assert sorted(chosen) == [0, 0, 1, 1, 2, 2]  # in-flight counts are known at once
    lb.on_finished(1)
    assert lb.choose(_req("x", [1])) == 1
    lb.on_sent(1)
    # equal counts: the emptier KV cache wins; waiting requests count on top of in-flight ones
    lb.update_stats(0, SchedulerStats(num_running_reqs=2, kv_cache_usage=0.9))
    lb.update_stats(1, SchedulerStats(num_running_reqs=2, kv_cache_usage=0.1))
    lb.update_stats(2, SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5))
    assert lb.choose(_req("y", [1])) == 1
    lb.update_stats(1, SchedulerStats(num_running_reqs=1, num_waiting_reqs=1, kv_cache_usage=0.1))
    assert lb.choose(_req("z", [1])) == 2
    with pytest.raises(ValueError, match="data_parallel_routing"):
        DPLoadBalancer(2, "random")


def test_prefix_aware_keeps_a_prefix_on_its_engine_unless_it_is_much_busier():
    lb = DPLoadBalancer(2, "prefix-aware", block_size=4, max_imbalance=2)
    system_a, system_b = list(range(100, 112)), list(range(200, 212))
    first_a = lb.choose(_req("a0", system_a + [1, 2]))
    lb.on_sent(first_a)
    first_b = lb.choose(_req("b0", system_b + [3]))
    lb.on_sent(first_b)
    assert first_a != first_b
    for i in range(1, 3):
        for prefix, owner, tail in ((system_a, first_a, [9, i]), (system_b, first_b, [8, i])):
            engine = lb.choose(_req(f"{owner}-{i}", prefix + tail))
            assert engine == owner
            lb.on_sent(engine)
    # a different salt is a different prefix; a short prompt (no full block) is routed by load alone
    assert lb.block_hashes(system_a, "t1") != lb.block_hashes(system_a, "t2")
    assert lb.block_hashes([1, 2, 3]) == []
    # the owner of prefix a gets 3 more requests than the other engine: the next a-request goes elsewhere
    for _ in range(3):
        lb.on_sent(first_a)
    other = 1 - first_a
    assert lb.choose(_req("a-over", system_a + [7])) == other
    assert lb.choose(_req("a-after", system_a + [6])) == other  # the prefix moved with it


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return run_engine(EngineCore(EngineArgs(model=tiny_llama_dir, **ENGINE_KWARGS).create_engine_config()), PROMPTS,
                      max_tokens=8)


async def _generate(llm, prompt: list[int], request_id: str, max_tokens: int = 8) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    final = None
    async for out in llm.generate(prompt, params, request_id):
        final = out
    return list(final.outputs[0].token_ids)


def _engine_of(llm, request_id: str, seen: dict[str, int]):
    """Record which engine core a request went to (while it is in flight)."""
    original = llm.engine_core.add_request

    def add(request):
        original(request)
        seen[request.request_id] = llm.engine_core.engine_of(request.request_id)

    llm.engine_core.add_request = add


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dp2_local_processes_match_one_engine_and_spread_the_load(tiny_llama_dir, reference):
    from tokenmill.engine.async_llm import AsyncLLM

    async def main() -> None:
        args = EngineArgs(model=tiny_llama_dir, data_parallel_size=2, **ENGINE_KWARGS)
        llm = AsyncLLM(args.create_engine_config(), tokenizer=byte_level_tokenizer(), startup_timeout_s=240)
        try:
            assert llm.num_engines == 2 and len(llm.engine_core.engines) == 2
            seen: dict[str, int] = {}
            _engine_of(llm, "", seen)
            outs = await asyncio.gather(*(_generate(llm, p, f"r{i}") for i, p in enumerate(PROMPTS)))
            assert outs == reference
            assert sorted(seen.values()).count(0) in (2, 3)  # 5 concurrent requests: 3 and 2
            stats = await llm.refresh_stats()
            assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0  # every block free when idle
            assert llm.engine_core.balancer.in_flight == [0, 0]
            assert await llm.reset_prefix_cache() is True
        finally:
            llm.shutdown()
        assert not any(e.proc.is_alive() for e in llm.engine_core.engines)

    asyncio.run(main())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dp2_prefix_aware_routing_sends_a_prefix_to_one_engine(tiny_llama_dir):
    from tokenmill.engine.async_llm import AsyncLLM

    async def main() -> None:
        args = EngineArgs(model=tiny_llama_dir, data_parallel_size=2, data_parallel_routing="prefix-aware",
                          **ENGINE_KWARGS)
        llm = AsyncLLM(args.create_engine_config(), tokenizer=byte_level_tokenizer(), startup_timeout_s=240)
        hits: dict[int, int] = {0: 0, 1: 0}
        llm.add_stats_listener(
            lambda outputs, now: outputs.scheduler_stats is not None
            and hits.__setitem__(outputs.engine_index, hits[outputs.engine_index]
                                 + outputs.scheduler_stats.prefix_cache_hits)
        )
        try:
            seen: dict[str, int] = {}
            _engine_of(llm, "", seen)
            shared = [list(range(30, 54)), list(range(60, 84))]  # 6 full blocks each
            await asyncio.gather(_generate(llm, shared[0] + [5], "a0", 2), _generate(llm, shared[1] + [6], "b0", 2))
            for i in range(1, 4):
                await asyncio.gather(_generate(llm, shared[0] + [7, i], f"a{i}", 2),
                                     _generate(llm, shared[1] + [8, i], f"b{i}", 2))
            assert seen["a0"] != seen["b0"]
            assert {seen[f"a{i}"] for i in range(4)} == {seen["a0"]}
            assert {seen[f"b{i}"] for i in range(4)} == {seen["b0"]}
            # each engine served its prefix from its cache three times (24 tokens each)
            assert hits[seen["a0"]] >= 3 * 24 and hits[seen["b0"]] >= 3 * 24
        finally:
            llm.shutdown()

    asyncio.run(main())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_offline_llm_with_dp2_engine_cores_gives_the_single_engines_tokens(tiny_llama_dir, reference):
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.entrypoints.llm import LLM

    args = EngineArgs(model=tiny_llama_dir, data_parallel_size=2, **ENGINE_KWARGS)
    engine = LLMEngine(args.create_engine_config(), tokenizer=byte_level_tokenizer())
    client = engine.engine_core
    try:
        assert client.num_engines == 2
        assert engine.engine_config.cache_config.num_gpu_blocks > 0  # from the handshakes
        # a wait interrupted by Ctrl-C is cancelled: it does not stay behind and take a later step's output
        real_result = concurrent.futures.Future.result

        def interrupted(self, timeout=None):
            concurrent.futures.Future.result = real_result
            raise KeyboardInterrupt

        concurrent.futures.Future.result = interrupted
        try:
            with pytest.raises(KeyboardInterrupt):
                client.get_output()  # nothing in flight: left behind, it would take the next generate's first step
        finally:
            concurrent.futures.Future.result = real_result

        # the engine each request is sent to, as the balancer hands it over (engine_of(), asked after the send,
        # already answers None when the output reader has seen a short request finish)
        seen: dict[str, int] = {}
        sent_to: list[int] = []
        balancer = client._client.balancer  # the synchronous client drives an asyncio client in its own thread
        original, original_on_sent = client.add_request, balancer.on_sent

        def on_sent(engine_index: int) -> None:
            sent_to.append(engine_index)
            original_on_sent(engine_index)

        def add(request):
            original(request)
            seen[request.request_id] = sent_to[-1]

        balancer.on_sent = on_sent
        client.add_request = add
        llm = LLM.from_llm_engine(engine)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == reference
        # added at once: spread by load (in-flight counts, plus the queue lengths the engines report meanwhile)
        assert sorted(list(seen.values()).count(e) for e in (0, 1)) == [2, 3]
        assert not client.has_unfinished_requests()

        # an abort mid-generation: the request ends, the other engine's request finishes, every block is free;
        # stats asked for while outputs arrive do not make the front end lose track of them
        engine.add_request("long", PROMPTS[3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        engine.add_request("short", PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert {seen["long"], seen["short"]} == {0, 1}
        time.sleep(0.5)  # "short" finishes in its engine core meanwhile
        engine.get_stats()  # runs the client's loop: the finished output is read before step() takes it
        finished: dict[str, str | None] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].finish_reason
            if steps == 2:
                engine.abort_request("long")
            steps += 1
            assert steps < 500
        assert finished == {"short": "length"}  # an aborted request produces no further outputs
        stats = engine.get_stats()
        assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
        assert engine.reset_prefix_cache() is True
        assert engine.list_loras() == []
        # tokenmill bench asks an engine core which kernels it runs (they load in its process, not this one)
        from tokenmill.entrypoints.bench.common import engine_kernel_info, kernel_info

        reported = engine_kernel_info(engine)
        assert reported and reported.keys() == kernel_info().keys()
        assert len(client.call_utility_all("kernel_info")) == 2
        assert min(client.call_utility_all("peak_rss_bytes")) > 0

        # the same engine driven from a thread that runs an event loop (a notebook), with every token
        async def from_a_loop() -> list[list[int]]:
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        assert asyncio.run(from_a_loop()) == reference
    finally:
        engine.shutdown()
    assert not any(e.proc.is_alive() for e in client._client.engines)
    engine.shutdown()  # a second shutdown is a no-op
    with pytest.raises(EngineDeadError):
        client.get_output()


def test_offline_engine_with_dp_needs_an_importable_engine_core_class(tiny_llama_dir):
    from tokenmill.engine.llm_engine import LLMEngine

    with pytest.raises(TypeError, match="module:Class"):
        LLMEngine(EngineArgs(model=tiny_llama_dir, data_parallel_size=2).create_engine_config(),
                  tokenizer=byte_level_tokenizer(), engine_core_cls=EngineCore)
