"""AsyncLLM / AsyncMPClient <-> EngineCoreProc over ZMQ, with fake engine cores in a spawned process."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.engine.engine_fakes import (
    CRASH_TOKEN,
    REJECT_TOKEN,
    EchoEngineCore,
    FailingEngineCore,
    SlowEchoEngineCore,
    byte_level_tokenizer,
    cls_path,
    make_config,
)
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.errors import EngineDeadError, EngineGenerateError, InvalidRequestError, ServerShuttingDownError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

pytest.importorskip("zmq")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return byte_level_tokenizer()


def run_with_llm(
    tokenizer: Any, core: type, body: Callable[[AsyncLLM], Awaitable[None]], exitcode: int | None = 0
) -> None:
    """Run ``body`` against an AsyncLLM whose engine core is ``core``; then check the process ended."""

    async def main() -> None:
        llm = AsyncLLM(make_config(), tokenizer=tokenizer, engine_core_cls=cls_path(core), startup_timeout_s=30)
        try:
            await asyncio.wait_for(body(llm), timeout=20)
        finally:
            llm.shutdown()
        assert not llm.engine_core.proc.is_alive()
        if exitcode is not None:
            assert llm.engine_core.proc.exitcode == exitcode  # 0: SIGTERM handled cleanly

    asyncio.run(main())


async def collect(
    llm: AsyncLLM, prompt: str | list[int], params: SamplingParams, request_id: str
) -> list[RequestOutput]:
    return [out async for out in llm.generate(prompt, params, request_id)]


def test_round_trip_and_handshake(tokenizer: Any) -> None:
    async def body(llm: AsyncLLM) -> None:
        assert llm.engine_config.cache_config.num_gpu_blocks == 64  # from the READY handshake
        text = "Hello world, naïve 🎉 café"
        n_tokens = len(tokenizer.encode(text))
        delta = SamplingParams(max_tokens=n_tokens, output_kind=RequestOutputKind.DELTA)
        cumulative = SamplingParams(max_tokens=n_tokens)
        outs_delta, outs_cum = await asyncio.gather(
            collect(llm, text, delta, "d"), collect(llm, text, cumulative, "c")
        )
        assert "".join(o.outputs[0].text for o in outs_delta) == text
        assert outs_cum[-1].outputs[0].text == text
        assert outs_cum[-1].outputs[0].finish_reason == "length"
        assert outs_cum[-1].finished and not any(o.finished for o in outs_cum[:-1])
        assert outs_cum[-1].num_cached_tokens == n_tokens // 2
        assert (await llm.get_stats()) is not None
        assert await llm.reset_prefix_cache() is True
        await llm.check_health()
        assert not llm.errored

    run_with_llm(tokenizer, EchoEngineCore, body)


def test_stop_string_aborts_in_engine_core_and_n_merge(tokenizer: Any) -> None:
    async def body(llm: AsyncLLM) -> None:
        params = SamplingParams(max_tokens=200, stop=["STOP"], n=2, seed=3)
        outs = await collect(llm, "The end. STOP here.", params, "s")
        final = outs[-1]
        assert [c.index for c in final.outputs] == [0, 1]
        for c in final.outputs:
            assert c.text == "The end. " and c.finish_reason == "stop" and c.stop_reason == "STOP"
        for _ in range(50):
            if sorted(await llm.engine_core.call_utility_async("get_aborted")) == ["0_s", "1_s"]:
                break
            await asyncio.sleep(0.02)
        assert sorted(await llm.engine_core.call_utility_async("get_aborted")) == ["0_s", "1_s"]

    run_with_llm(tokenizer, SlowEchoEngineCore, body)


def test_invalid_requests(tokenizer: Any) -> None:
    async def body(llm: AsyncLLM) -> None:
        with pytest.raises(InvalidRequestError) as info:
            await collect(llm, "", SamplingParams(), "empty")
        assert info.value.param == "prompt"
        with pytest.raises(InvalidRequestError) as info:
            await collect(llm, [5, 6], SamplingParams(max_tokens=1000), "long")
        assert info.value.param == "max_tokens"
        # Rejected inside the engine core: that request fails, the engine keeps serving.
        with pytest.raises(EngineGenerateError, match="rejected by the fake engine core"):
            await collect(llm, [REJECT_TOKEN, 5], SamplingParams(), "rejected")
        outs = await collect(llm, [5, 6, 7], SamplingParams(max_tokens=3), "ok")
        assert outs[-1].outputs[0].token_ids == [5, 6, 7]
        assert not llm.errored

    run_with_llm(tokenizer, EchoEngineCore, body)


def test_consumer_that_stops_iterating_aborts_the_request(tokenizer: Any) -> None:
    async def body(llm: AsyncLLM) -> None:
        gen = llm.generate([5, 6], SamplingParams(max_tokens=200), "gone")
        await gen.__anext__()
        await gen.__anext__()
        await gen.aclose()
        assert llm.get_num_unfinished_requests() == 0
        task = asyncio.ensure_future(collect(llm, [7, 8], SamplingParams(max_tokens=200), "cancelled"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            aborted = await llm.engine_core.call_utility_async("get_aborted")
            if sorted(aborted) == ["cancelled", "gone"]:
                break
            await asyncio.sleep(0.02)
        assert sorted(aborted) == ["cancelled", "gone"]
        assert await llm.engine_core.call_utility_async("has_unfinished_requests") is False

    run_with_llm(tokenizer, SlowEchoEngineCore, body)


def test_abort_ends_the_stream(tokenizer: Any) -> None:
    async def body(llm: AsyncLLM) -> None:
        outs: list[RequestOutput] = []

        async def consume() -> None:
            async for out in llm.generate([5, 6], SamplingParams(max_tokens=200), "a"):
                outs.append(out)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.1)
        await llm.abort("a")
        await task
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"

    run_with_llm(tokenizer, SlowEchoEngineCore, body)


def test_fail_all_requests_ends_streams_and_aborts_them_in_the_engine_core(tokenizer: Any) -> None:
    async def body(llm: AsyncLLM) -> None:
        gens = [llm.generate([5, 6, 7], SamplingParams(max_tokens=240), f"s{i}") for i in range(3)]
        for gen in gens:
            await gen.__anext__()
        assert (await llm.refresh_stats()).num_running_reqs == 3
        llm.fail_all_requests(ServerShuttingDownError("stopping"))
        for gen in gens:
            with pytest.raises(ServerShuttingDownError):
                async for _ in gen:
                    pass
        with pytest.raises(ServerShuttingDownError):
            await collect(llm, [5], SamplingParams(), "after")
        assert not llm.errored  # stopping is not a dead engine: /health stays 200 until the server is gone
        for _ in range(50):  # the aborts reach the engine core, which frees the requests' KV blocks
            stats = await llm.refresh_stats()
            if stats.num_running_reqs == 0 and stats.kv_cache_usage == 0:
                break
            await asyncio.sleep(0.05)
        assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0

    run_with_llm(tokenizer, SlowEchoEngineCore, body)


def test_sigkill_fails_pending_requests_quickly(tokenizer: Any) -> None:
    async def body(llm: AsyncLLM) -> None:
        gens = [llm.generate([5, 6, 7], SamplingParams(max_tokens=240), f"k{i}") for i in range(3)]
        for gen in gens:
            await gen.__anext__()
        os.kill(llm.engine_core.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        for gen in gens:
            with pytest.raises(EngineDeadError):
                async for _ in gen:
                    pass
        assert time.monotonic() - start < 5
        assert llm.errored
        with pytest.raises(EngineDeadError):
            await llm.check_health()
        with pytest.raises(EngineDeadError):
            await collect(llm, [5], SamplingParams(), "after")

    run_with_llm(tokenizer, SlowEchoEngineCore, body, exitcode=-signal.SIGKILL)


def test_crash_in_step_is_reported_as_engine_dead(tokenizer: Any) -> None:
    async def body(llm: AsyncLLM) -> None:
        healthy = llm.generate([5, 6], SamplingParams(max_tokens=240), "healthy")
        await healthy.__anext__()
        with pytest.raises(EngineDeadError, match="crashed in step"):
            await collect(llm, [CRASH_TOKEN, 5], SamplingParams(), "crash")
        with pytest.raises(EngineDeadError):
            async for _ in healthy:
                pass
        llm.engine_core.proc.join(5)
        assert llm.engine_core.proc.exitcode == 1

    run_with_llm(tokenizer, SlowEchoEngineCore, body, exitcode=1)


def test_startup_error_is_surfaced(tokenizer: Any) -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="fake startup failure: not enough memory"):
        AsyncLLM(make_config(), tokenizer=tokenizer, engine_core_cls=cls_path(FailingEngineCore), startup_timeout_s=30)
    assert time.monotonic() - start < 15


def test_unimportable_engine_core_is_surfaced(tokenizer: Any) -> None:
    with pytest.raises(RuntimeError, match="no_such_module"):
        AsyncLLM(make_config(), tokenizer=tokenizer, engine_core_cls="no_such_module:Core", startup_timeout_s=30)


def test_engine_core_exits_when_its_parent_is_gone() -> None:
    """parent_pid that is not the real parent: the busy loop sees a dead parent and exits with 0."""
    import zmq

    from tokenmill.engine.core_proc import run_engine_core
    from tokenmill.engine.core_wire import READY_FRAME

    with tempfile.TemporaryDirectory(prefix="tm-") as tmp:
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"ipc://{tmp}/in")
        pull = ctx.socket(zmq.PULL)
        pull.bind(f"ipc://{tmp}/out")
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            kwargs={
                "config": make_config(),
                "input_address": f"ipc://{tmp}/in",
                "output_address": f"ipc://{tmp}/out",
                "engine_core_cls": cls_path(EchoEngineCore),
                "parent_pid": 1 if os.getppid() != 1 else 2,
            },
        )
        proc.start()
        try:
            assert router.poll(20_000), "no READY from the engine core"
            assert router.recv_multipart()[1] == READY_FRAME
            proc.join(10)
            assert proc.exitcode == 0
        finally:
            if proc.is_alive():
                proc.kill()
            router.close(0)
            pull.close(0)
            ctx.term()


def test_a_prestarted_engine_core_runs_with_the_front_ends_environment_and_path_of_the_engine_start(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from tokenmill.engine import core_prestart

    core_prestart.prestart_engine_core()
    waiting = core_prestart._prestarted
    assert waiting is not None and waiting.proc.is_alive()
    monkeypatch.setenv("TOKENMILL_PRESTART_TEST", "set after the prestart")
    # A module that only exists on sys.path from now on, as transformers' remote-code modules do.
    (tmp_path / "tm_prestart_core.py").write_text(
        "from tests.engine.engine_fakes import EchoEngineCore\n\nclass Core(EchoEngineCore):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    async def main() -> None:
        llm = AsyncLLM(make_config(), tokenizer=tokenizer, engine_core_cls="tm_prestart_core:Core",
                       startup_timeout_s=30)
        try:
            assert llm.engine_core.proc is waiting.proc
            got = await llm.engine_core.call_utility_async("getenv", "TOKENMILL_PRESTART_TEST")
            assert got == "set after the prestart"
            outs = await collect(llm, "hi", SamplingParams(max_tokens=2), "p")
            assert outs[-1].outputs[0].text == "hi"
        finally:
            llm.shutdown()
        assert not llm.engine_core.proc.is_alive()

    asyncio.run(main())
    assert core_prestart.take_prestarted_engine_core() is None  # taken once


def test_an_unused_prestarted_engine_core_exits_when_discarded() -> None:
    from tokenmill.engine import core_prestart

    core_prestart.prestart_engine_core()
    waiting = core_prestart._prestarted
    assert waiting is not None
    start = time.monotonic()
    core_prestart.discard_prestarted_engine_core()
    assert waiting.proc.exitcode is not None and time.monotonic() - start < 3  # stopped, not awaited
    assert core_prestart.take_prestarted_engine_core() is None
    core_prestart.discard_prestarted_engine_core()  # no-op
