"""How front ends talk to the EngineCore: directly in-process, or over ZMQ to its own process(es).

``InprocClient`` (used by the sync ``LLMEngine``) needs no ZMQ; ``AsyncMPClient`` (used by ``AsyncLLM``)
imports ``zmq`` only when constructed, so the offline path works without pyzmq installed. ``SyncMPClient`` drives
an ``AsyncMPClient`` for the sync ``LLMEngine`` when it runs several data-parallel engine cores.

ZMQ layout (ipc:// sockets in a private temp directory, both bound by the front end):

* requests: front-end ROUTER <- engine-core DEALER. The engine core's first message is the READY handshake
  (which also tells the ROUTER its identity); then the front end sends ``[identity, type, payload]`` with
  ``type`` an :class:`EngineCoreRequestType` and ``payload`` msgpack (EngineCoreRequest, a list of request
  ids to abort, or ``(call_id, method, args)`` for a utility call).
* outputs: front-end PULL <- engine-core PUSH: ``[OUTPUTS_FRAME, msgpack EngineCoreOutputs]`` or
  ``[DEAD_FRAME, utf-8 error text]`` when the engine core hit a fatal error.

With data parallelism every engine core connects to the same two sockets (identity ``engine-core-<i>``);
with Ray-placed engine cores the sockets are TCP on this node's address instead of ipc.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.engine.core_wire import (
    DEAD_FRAME,
    DEFAULT_ENGINE_CORE_CLS,
    READY_FRAME,
    ReadyMessage,
    resolve_engine_core_cls,
)
from tokenmill.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    SchedulerStats,
    merge_scheduler_stats,
)
from tokenmill.errors import EngineDeadError

logger = logging.getLogger(__name__)

# Seconds between checks that the engine-core process is still alive while no output arrives.
_LIVENESS_POLL_S = 0.2


class EngineCoreStartError(RuntimeError):
    """The engine core reported an error while starting (a bad model, plugin or setting); the message carries it."""

class EngineCoreClient:
    """Interface of the front end's link to the engine core.

    Sync methods serve ``LLMEngine`` (in-process, or data-parallel engine-core processes through
    :class:`SyncMPClient`); the ``*_async`` ones serve ``AsyncLLM``. A client raises ``NotImplementedError`` for
    the half it does not support.
    """

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def has_unfinished_requests(self) -> bool:
        raise NotImplementedError

    def get_stats(self) -> SchedulerStats:
        raise NotImplementedError

    def reset_prefix_cache(self) -> bool:
        raise NotImplementedError

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class InprocClient(EngineCoreClient):
    """The EngineCore in this process; ``get_output`` runs one engine step.

    Args:
        config: the engine configuration (the EngineCore fills ``cache_config.num_gpu_blocks``).
        engine_core_cls: EngineCore class or ``"module:Class"`` path (default: the real one).
    """

    def __init__(self, config: EngineConfig, engine_core_cls: str | type | None = None) -> None:
        self.engine_core = resolve_engine_core_cls(engine_core_cls)(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """``[EngineCore.<method>(*args)]``: the one engine core's result, as :class:`SyncMPClient` gives all."""
        return [getattr(self.engine_core, method)(*args)]

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class LocalEngineProc:
    """A data-parallel engine core as a local process (``spawn``).

    Attributes:
        proc: the ``multiprocessing`` process.
    """

    def __init__(self, proc: multiprocessing.process.BaseProcess) -> None:
        self.proc = proc

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def describe_exit(self) -> str:
        return f"process {self.proc.pid} exited with code {self.proc.exitcode}"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        proc = self.proc
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
            if proc.is_alive():
                logger.warning("engine core process did not stop within 5 s of SIGTERM; killing it")
                proc.kill()
                proc.join(5)


class AsyncMPClient(EngineCoreClient):
    """The EngineCore(s) in their own processes, reached over asyncio ZMQ sockets.

    With ``data_parallel_size`` N there are N engine cores (identities ``engine-core-<i>``), each with its
    own scheduler, KV cache and workers: local processes (``spawn``), or Ray actors placed on the cluster
    with ``data_parallel_backend="ray"`` (the sockets are then TCP on this node's address instead of ipc).
    Every request goes to the engine a :class:`~tokenmill.engine.dp_lb.DPLoadBalancer` picks (queue length
    and KV-cache usage, optionally prefix-aware); aborts follow it there. All engine cores push outputs to
    one socket, tagged with ``engine_index``.

    Construction starts the engine cores; :meth:`wait_for_ready` waits for their handshakes. Outputs are read
    by a background task (started by the first async call) into a queue; the same task notices when an
    engine core dies (within ~0.2 s) and from then on every call raises :class:`EngineDeadError` (one dead
    engine core fails the whole client, as in vLLM: its requests cannot be recovered elsewhere).

    Args:
        config: the engine configuration; the handshake writes the resolved ``num_gpu_blocks`` (the smallest
            of the engine cores') and ``max_model_len`` into it.
        engine_core_cls: EngineCore ``"module:Class"`` path the children import (default: the real one).
    """

    def __init__(self, config: EngineConfig, engine_core_cls: str | None = None) -> None:
        import zmq
        import zmq.asyncio

        from tokenmill.engine.dp_lb import DPLoadBalancer

        pc = config.parallel_config
        self.engine_config = config
        self.num_engines = pc.data_parallel_size
        self._dead_error: EngineDeadError | None = None
        self._closed = False
        self._identities: list[bytes | None] = [None] * self.num_engines
        self._encoder = msgspec.msgpack.Encoder()
        self._call_ids = itertools.count()
        self._utility_futures: dict[int, asyncio.Future[Any]] = {}
        self._outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._reader: asyncio.Task[None] | None = None
        self.balancer = DPLoadBalancer(self.num_engines, pc.data_parallel_routing, config.cache_config.block_size)
        self._request_engine: dict[str, int] = {}
        self.engines: list[Any] = []
        ray_dp = pc.data_parallel_backend == "ray"

        self._tmpdir = tempfile.mkdtemp(prefix="tokenmill-")
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.ROUTER)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._output = zmq.asyncio.Context.shadow(self._ctx.underlying).socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.setsockopt(zmq.RCVHWM, 0)
        if ray_dp:
            from tokenmill.engine import dp_ray

            host = dp_ray.front_end_address(pc)
            input_address = f"tcp://{host}:{self._input.bind_to_random_port(f'tcp://{host}')}"
            output_address = f"tcp://{host}:{self._output.bind_to_random_port(f'tcp://{host}')}"
        else:
            input_address = f"ipc://{self._tmpdir}/input"
            output_address = f"ipc://{self._tmpdir}/output"
            self._input.bind(input_address)
            self._output.bind(output_address)
        self._finalizer = weakref.finalize(
            self, _release, self.engines, [self._input, self._output], self._ctx, self._tmpdir
        )
        try:
            for rank in range(self.num_engines):
                engine_config = _for_dp_rank(config, rank)
                identity = f"engine-core-{rank}".encode()
                if ray_dp:
                    from tokenmill.engine import dp_ray

                    self.engines.append(dp_ray.RayEngineActor.start(
                        engine_config, input_address, output_address, engine_core_cls or DEFAULT_ENGINE_CORE_CLS,
                        identity,
                    ))
                else:
                    self.engines.append(LocalEngineProc(self._spawn(
                        engine_config, input_address, output_address, engine_core_cls, identity
                    )))
        except BaseException:
            self._closed = True
            self._finalizer()
            raise
        finally:
            from tokenmill.engine.core_prestart import discard_prestarted_engine_core

            discard_prestarted_engine_core()  # left over when data parallelism started its own processes

    @staticmethod
    def _spawn(config: EngineConfig, input_address: str, output_address: str, engine_core_cls: str | None,
               identity: bytes) -> multiprocessing.process.BaseProcess:
        from tokenmill.engine.core_prestart import take_prestarted_engine_core
        from tokenmill.engine.core_proc import run_engine_core

        rank = config.parallel_config.data_parallel_rank
        single = config.parallel_config.data_parallel_size == 1
        kwargs = {
            "config": config,
            "input_address": input_address,
            "output_address": output_address,
            "engine_core_cls": engine_core_cls or DEFAULT_ENGINE_CORE_CLS,
            "parent_pid": os.getpid(),
            "identity": identity,
        }
        prestarted = take_prestarted_engine_core() if single else None
        if prestarted is not None:
            try:
                started = prestarted.start(kwargs)
            except BaseException:
                prestarted.discard()
                raise
            if started:
                return prestarted.proc
            prestarted.discard()
        mp = multiprocessing.get_context("spawn")
        proc = mp.Process(
            target=run_engine_core,
            name="TokenmillEngineCore" if single else f"TokenmillEngineCore-{rank}",
            kwargs=kwargs,
        )
        proc.start()
        return proc

    @property
    def proc(self) -> multiprocessing.process.BaseProcess:
        """The first engine core's process (local engine cores only)."""
        return self.engines[0].proc

    # -- startup ---------------------------------------------------------------------------------------

    def wait_for_ready(self, timeout_s: float | None = None) -> None:
        """Block until every engine core's READY handshake.

        Raises:
            RuntimeError: an engine core failed to start (the message carries its error), exited without
                a word, or did not answer within ``timeout_s``. Every engine core is stopped first.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        index = {f"engine-core-{i}".encode(): i for i in range(self.num_engines)}
        blocks: list[int] = []
        try:
            while any(identity is None for identity in self._identities):
                if self._input.poll(100):
                    frames = self._input.recv_multipart()
                    if len(frames) != 3 or frames[1] != READY_FRAME or frames[0] not in index:
                        raise RuntimeError(f"engine core sent an unexpected startup message ({len(frames)} frames)")
                    ready = msgspec.msgpack.decode(frames[2], type=ReadyMessage)
                    rank = index[frames[0]]
                    if ready.error is not None:
                        proc = getattr(self.engines[rank], "proc", None)
                        if proc is not None:
                            proc.join(5)
                        which = f" (engine core {rank})" if self.num_engines > 1 else ""
                        raise EngineCoreStartError(f"Engine core failed to start{which}: {ready.error}")
                    self._identities[rank] = frames[0]
                    if ready.num_gpu_blocks is not None:
                        blocks.append(ready.num_gpu_blocks)
                    self.engine_config.model_config.max_model_len = ready.max_model_len
                    continue
                for rank, engine in enumerate(self.engines):
                    if self._identities[rank] is None and engine.exitcode is not None:
                        which = f" {rank}" if self.num_engines > 1 else ""
                        raise RuntimeError(
                            f"Engine core{which} exited before it was ready ({engine.describe_exit()}; see its log "
                            "output above)"
                        )
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"Engine core did not become ready within {timeout_s} s")
            if blocks:
                self.engine_config.cache_config.num_gpu_blocks = min(blocks)
        except BaseException:
            self.shutdown()
            raise

    # -- state -----------------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine core(s) are unusable, or ``None`` while they run."""
        if self._dead_error is None and not self._closed:
            for rank, engine in enumerate(self.engines):
                if engine.exitcode is not None:
                    which = f" {rank}" if self.num_engines > 1 else ""
                    self._dead_error = EngineDeadError(
                        f"engine core{which} died unexpectedly ({engine.describe_exit()})"
                    )
                    break
        return self._dead_error

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("engine core client was shut down")
        error = self.dead_error
        if error is not None:
            raise error

    # -- requests --------------------------------------------------------------------------------------

    def _send(self, engine: int, kind: EngineCoreRequestType, payload: bytes) -> None:
        identity = self._identities[engine]
        assert identity is not None, "wait_for_ready() was not called"
        self._input.send_multipart([identity, kind.value, payload], copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to the engine core the balancer picks (non-blocking).

        Raises:
            EngineDeadError: an engine core is dead.
        """
        self._check_alive()
        engine = self.balancer.choose(request)
        self._request_engine[request.request_id] = engine
        self.balancer.on_sent(engine)
        self._send(engine, EngineCoreRequestType.ADD, self._encoder.encode(request))

    def has_unfinished_requests(self) -> bool:
        """Whether a request sent to an engine core has not yet been seen finished (or aborted)."""
        return bool(self._request_engine)

    def has_outputs_waiting(self) -> bool:
        """Whether outputs read from the engine cores wait for :meth:`get_output_async`."""
        return self._outputs is not None and not self._outputs.empty()

    def engine_of(self, request_id: str) -> int | None:
        """The engine core an unfinished request was sent to."""
        return self._request_engine.get(request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Send aborts (non-blocking) to the engine cores holding the requests; nothing to do when they are gone."""
        if not request_ids or self._closed or self.dead_error is not None:
            return
        by_engine: dict[int, list[str]] = {}
        for req_id in request_ids:
            engine = self._request_engine.pop(req_id, None)
            if engine is None:
                if self.num_engines > 1:
                    continue  # finished already (or never sent)
                engine = 0
            else:
                self.balancer.on_finished(engine)
            by_engine.setdefault(engine, []).append(req_id)
        for engine, ids in by_engine.items():
            self._send(engine, EngineCoreRequestType.ABORT, self._encoder.encode(ids))

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_reader()
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def call_utility_async(self, method: str, *args: Any, engine_index: int = 0) -> Any:
        """Call ``EngineCore.<method>(*args)`` in engine core ``engine_index``; returns its msgpack-decoded
        result.

        Raises:
            EngineDeadError: the engine core is dead or dies meanwhile.
            RuntimeError: the call raised in the engine core (its message).
        """
        self._check_alive()
        self._ensure_reader()
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        self._send(engine_index, EngineCoreRequestType.UTILITY, self._encoder.encode((call_id, method, list(args))))
        return await future

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        """:meth:`call_utility_async` on every engine core; their results in engine order."""
        return list(await asyncio.gather(
            *(self.call_utility_async(method, *args, engine_index=i) for i in range(self.num_engines))
        ))

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step's outputs (of any engine core; ``engine_index`` says which).

        Raises:
            EngineDeadError: an engine core died (after every output sent before was delivered).
        """
        self._check_alive()
        self._ensure_reader()
        assert self._outputs is not None
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put_nowait(item)
            raise item
        return item

    # -- output reader ---------------------------------------------------------------------------------

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._outputs = asyncio.Queue()
            self._reader = asyncio.get_running_loop().create_task(self._read_outputs(), name="engine-core-outputs")

    async def _read_outputs(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        try:
            while True:
                if await self._output.poll(timeout=int(_LIVENESS_POLL_S * 1000)):
                    kind, payload = await self._output.recv_multipart()
                    if kind == DEAD_FRAME:
                        message = bytes(payload).decode(errors="replace")
                        self._mark_dead(EngineDeadError(f"engine core failed: {message}"))
                        return
                    outputs = decoder.decode(payload)
                    self._track(outputs)
                    if outputs.utility_output is not None:
                        self._resolve_utility(outputs.utility_output)
                        if not outputs.outputs:
                            continue
                    assert self._outputs is not None
                    self._outputs.put_nowait(outputs)
                elif not self._closed and self.dead_error is not None:
                    self._mark_dead(self.dead_error)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("reading engine core outputs failed")
            self._mark_dead(EngineDeadError(f"reading engine core outputs failed: {exc!r}"))

    def _track(self, outputs: EngineCoreOutputs) -> None:
        """Load-balancer bookkeeping: finished requests, the engine's latest queue and KV-cache figures."""
        if outputs.scheduler_stats is not None and outputs.engine_index < self.num_engines:
            self.balancer.update_stats(outputs.engine_index, outputs.scheduler_stats)
        for out in outputs.outputs:
            if out.finished:
                engine = self._request_engine.pop(out.request_id, None)
                if engine is not None:
                    self.balancer.on_finished(engine)

    def _resolve_utility(self, reply: tuple[int, object, str | None]) -> None:
        call_id, result, error = reply
        future = self._utility_futures.pop(call_id, None)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(RuntimeError(f"engine core utility call failed: {error}"))
        else:
            future.set_result(result)

    def _mark_dead(self, error: EngineDeadError) -> None:
        if self._dead_error is None:
            self._dead_error = error
        logger.error("%s", self._dead_error)
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(self._dead_error)
        self._utility_futures.clear()
        if self._outputs is not None:
            self._outputs.put_nowait(self._dead_error)

    # -- shutdown --------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the engine cores (processes: SIGTERM, then SIGKILL after 5 s; Ray actors: killed, their
        placement groups removed) and release the sockets."""
        if self._closed:
            return
        self._closed = True
        reader = self._reader
        if reader is not None and not reader.done() and not reader.get_loop().is_closed():
            reader.cancel()
        self._finalizer()


class SyncMPClient(EngineCoreClient):
    """Data-parallel engine cores for the synchronous ``LLMEngine`` (the offline ``LLM`` with
    ``data_parallel_size`` N > 1): N engine-core processes, each with its own scheduler, KV cache and share of the
    CPU cores, behind one front end.

    It drives an :class:`AsyncMPClient` (which starts the processes, spreads the requests over them with its load
    balancer and reads their outputs) on an event loop of its own, in a daemon thread: every call is handed to that
    thread and waited for, so the client works from any thread, including one that runs an event loop itself
    (a notebook), and a wait interrupted by ``KeyboardInterrupt`` is cancelled there instead of staying behind to
    take a later output. Construction waits for every engine core's handshake.

    Raises (construction):
        RuntimeError / EngineCoreStartError: an engine core failed to start (every one is stopped first).
    """

    def __init__(self, config: EngineConfig, engine_core_cls: str | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tokenmill-dp-client", daemon=True)
        self._thread.start()
        try:
            client = AsyncMPClient(config, engine_core_cls)
        except BaseException:
            _stop_loop(self._loop, self._thread, None)
            raise
        try:
            client.wait_for_ready()
        except BaseException:
            _stop_loop(self._loop, self._thread, client)
            raise
        self._client = client
        self.num_engines = client.num_engines
        self._finalizer = weakref.finalize(self, _stop_loop, self._loop, self._thread, client)

    def _wait(self, coro: Any) -> Any:
        """Run ``coro`` on the client's loop and wait for its result; an interrupted wait cancels it."""
        if not self._finalizer.alive:
            coro.close()
            raise EngineDeadError("engine core client was shut down")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in the loop's thread (the AsyncMPClient and its sockets are used from that thread only)."""

        async def call() -> Any:
            return fn(*args)

        return self._wait(call())

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to the engine core the balancer picks.

        Raises:
            EngineDeadError: an engine core is dead.
        """
        self._call(self._client.add_request, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._call(self._client.abort_requests, request_ids)

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs of any engine core (``engine_index`` says which), waiting for one.

        Raises:
            EngineDeadError: an engine core died.
        """
        return self._wait(self._client.get_output_async())

    def has_unfinished_requests(self) -> bool:
        """Whether a request is still running in an engine core, or outputs already read from one wait for
        :meth:`get_output` (a request's last output can be read, during any call that runs the loop, before the
        front end has taken it)."""
        return self._call(lambda: self._client.has_unfinished_requests() or self._client.has_outputs_waiting())

    def engine_of(self, request_id: str) -> int | None:
        """The engine core an unfinished request was sent to."""
        return self._call(self._client.engine_of, request_id)

    def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """``EngineCore.<method>(*args)`` in every engine core; their msgpack-decoded results in engine order.

        Raises:
            EngineDeadError: an engine core is dead or dies meanwhile.
            RuntimeError: the call raised in an engine core (its message).
        """
        return self._wait(self._client.call_utility_all_async(method, *args))

    def get_stats(self) -> SchedulerStats:
        """The engine cores' gauges now, summed (KV-cache usage: the mean)."""
        raws = self.call_utility_all("get_stats")
        return merge_scheduler_stats([msgspec.convert(raw, SchedulerStats) for raw in raws])

    def reset_prefix_cache(self) -> bool:
        """Reset every engine core's prefix cache; ``True`` when all of them did."""
        return all(bool(r) for r in self.call_utility_all("reset_prefix_cache"))

    def shutdown(self) -> None:
        """Stop the engine cores and the loop's thread (also done when the client is garbage-collected or the
        interpreter exits); later calls raise :class:`EngineDeadError`, a second shutdown does nothing."""
        self._finalizer()


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, client: AsyncMPClient | None) -> None:
    """Shut ``client`` down and cancel every task on ``loop`` (in the loop's thread), then stop and close it."""

    async def close() -> None:
        if client is not None:
            client.shutdown()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        if thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        if not thread.is_alive():
            loop.close()


def _for_dp_rank(config: EngineConfig, rank: int) -> EngineConfig:
    """A copy of ``config`` for data-parallel engine core ``rank``."""
    if config.parallel_config.data_parallel_size == 1:
        return config
    return dataclasses.replace(
        config, parallel_config=dataclasses.replace(config.parallel_config, data_parallel_rank=rank)
    )


def _release(engines: list[Any], sockets: list[Any], ctx: Any, tmpdir: str) -> None:
    for engine in engines:
        try:
            engine.stop()
        except Exception:  # noqa: BLE001 - keep stopping the others
            logger.exception("stopping an engine core failed")
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()
    shutil.rmtree(tmpdir, ignore_errors=True)
