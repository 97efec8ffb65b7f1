"""How front ends talk to the EngineCore: directly in-process, or over ZMQ to its own process.

``InprocClient`` (used by the sync ``LLMEngine``) needs no ZMQ; ``AsyncMPClient`` (used by ``AsyncLLM``)
imports ``zmq`` only when constructed, so the offline path works without pyzmq installed.

ZMQ layout (ipc:// sockets in a private temp directory, both bound by the front end):

* requests: front-end ROUTER <- engine-core DEALER. The engine core's first message is the READY handshake
  (which also tells the ROUTER its identity); then the front end sends ``[identity, type, payload]`` with
  ``type`` an :class:`EngineCoreRequestType` and ``payload`` msgpack (EngineCoreRequest, a list of request
  ids to abort, or ``(call_id, method, args)`` for a utility call).
* outputs: front-end PULL <- engine-core PUSH: ``[OUTPUTS_FRAME, msgpack EngineCoreOutputs]`` or
  ``[DEAD_FRAME, utf-8 error text]`` when the engine core hit a fatal error.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import weakref
from typing import Any

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    SchedulerStats,
)
from tokenmill.errors import EngineDeadError

logger = logging.getLogger(__name__)

DEFAULT_ENGINE_CORE_CLS = "tokenmill.engine.core:EngineCore"

# Seconds between checks that the engine-core process is still alive while no output arrives.
_LIVENESS_POLL_S = 0.2


def resolve_engine_core_cls(spec: str | type | None) -> type:
    """The EngineCore class: ``None`` is the default, a string is a ``"module:Class"`` path.

    Raises:
        ImportError / ValueError: the path cannot be imported.
    """
    if spec is None:
        spec = DEFAULT_ENGINE_CORE_CLS
    if isinstance(spec, str):
        from tokenmill.plugins.qualname import resolve_qualname

        return resolve_qualname(spec)
    return spec



class EngineCoreStartError(RuntimeError):
    """The engine core reported an error while starting (a bad model, plugin or setting); the message carries it."""

class EngineCoreClient:
    """Interface of the front end's link to the engine core.

    Sync methods serve ``LLMEngine`` (in-process); the ``*_async`` ones serve ``AsyncLLM``. A client
    raises ``NotImplementedError`` for the half it does not support.
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

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class AsyncMPClient(EngineCoreClient):
    """The EngineCore in its own process (spawned), reached over asyncio ZMQ sockets.

    Construction starts the process; :meth:`wait_for_ready` waits for its handshake. Outputs are read by a
    background task (started by the first async call) into a queue; the same task notices when the process
    dies (within ~0.2 s) and from then on every call raises :class:`EngineDeadError`.

    Args:
        config: the engine configuration; the handshake writes the resolved ``num_gpu_blocks`` and
            ``max_model_len`` into it.
        engine_core_cls: EngineCore ``"module:Class"`` path the child imports (default: the real one).
    """

    def __init__(self, config: EngineConfig, engine_core_cls: str | None = None) -> None:
        import zmq
        import zmq.asyncio

        from tokenmill.engine.core_proc import run_engine_core

        self.engine_config = config
        self._dead_error: EngineDeadError | None = None
        self._closed = False
        self._identity: bytes | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._call_ids = itertools.count()
        self._utility_futures: dict[int, asyncio.Future[Any]] = {}
        self._outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._reader: asyncio.Task[None] | None = None

        self._tmpdir = tempfile.mkdtemp(prefix="tokenmill-")
        input_address = f"ipc://{self._tmpdir}/input"
        output_address = f"ipc://{self._tmpdir}/output"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.ROUTER)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(input_address)
        self._output = zmq.asyncio.Context.shadow(self._ctx.underlying).socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(output_address)

        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(
            target=run_engine_core,
            name="TokenmillEngineCore",
            kwargs={
                "config": config,
                "input_address": input_address,
                "output_address": output_address,
                "engine_core_cls": engine_core_cls or DEFAULT_ENGINE_CORE_CLS,
                "parent_pid": os.getpid(),
            },
        )
        self._finalizer = weakref.finalize(
            self, _release, self.proc, [self._input, self._output], self._ctx, self._tmpdir
        )
        try:
            self.proc.start()
        except BaseException:
            self._closed = True
            self._finalizer()
            raise

    # -- startup ---------------------------------------------------------------------------------------

    def wait_for_ready(self, timeout_s: float | None = None) -> None:
        """Block until the engine core's READY handshake.

        Raises:
            RuntimeError: the engine core failed to start (the message carries its error), exited without
                a word, or did not answer within ``timeout_s``. The process is stopped first.
        """
        from tokenmill.engine.core_proc import READY_FRAME, ReadyMessage

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                if self._input.poll(100):
                    frames = self._input.recv_multipart()
                    if len(frames) != 3 or frames[1] != READY_FRAME:
                        raise RuntimeError(f"engine core sent an unexpected startup message ({len(frames)} frames)")
                    ready = msgspec.msgpack.decode(frames[2], type=ReadyMessage)
                    if ready.error is not None:
                        self.proc.join(5)
                        raise EngineCoreStartError(f"Engine core failed to start: {ready.error}")
                    self._identity = frames[0]
                    if ready.num_gpu_blocks is not None:
                        self.engine_config.cache_config.num_gpu_blocks = ready.num_gpu_blocks
                    self.engine_config.model_config.max_model_len = ready.max_model_len
                    return
                if self.proc.exitcode is not None:
                    raise RuntimeError(
                        f"Engine core process exited with code {self.proc.exitcode} before it was ready "
                        "(see its log output above)"
                    )
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"Engine core did not become ready within {timeout_s} s")
        except BaseException:
            self.shutdown()
            raise

    # -- state -----------------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine core is unusable, or ``None`` while it runs."""
        if self._dead_error is None and not self._closed and self.proc.exitcode is not None:
            self._dead_error = EngineDeadError(
                f"engine core process died unexpectedly (exit code {self.proc.exitcode})"
            )
        return self._dead_error

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("engine core client was shut down")
        error = self.dead_error
        if error is not None:
            raise error

    # -- requests --------------------------------------------------------------------------------------

    def _send(self, kind: EngineCoreRequestType, payload: bytes) -> None:
        assert self._identity is not None, "wait_for_ready() was not called"
        self._input.send_multipart([self._identity, kind.value, payload], copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request (non-blocking).

        Raises:
            EngineDeadError: the engine core is dead.
        """
        self._check_alive()
        self._send(EngineCoreRequestType.ADD, self._encoder.encode(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Send an abort (non-blocking); nothing to do when the engine core is gone."""
        if request_ids and not self._closed and self.dead_error is None:
            self._send(EngineCoreRequestType.ABORT, self._encoder.encode(request_ids))

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_reader()
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Call ``EngineCore.<method>(*args)`` in the engine process; returns its msgpack-decoded result.

        Raises:
            EngineDeadError: the engine core is dead or dies meanwhile.
            RuntimeError: the call raised in the engine core (its message).
        """
        self._check_alive()
        self._ensure_reader()
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        self._send(EngineCoreRequestType.UTILITY, self._encoder.encode((call_id, method, list(args))))
        return await future

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step's outputs.

        Raises:
            EngineDeadError: the engine core died (after every output it sent was delivered).
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
        from tokenmill.engine.core_proc import DEAD_FRAME

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
                    if outputs.utility_output is not None:
                        self._resolve_utility(outputs.utility_output)
                        if not outputs.outputs:
                            continue
                    assert self._outputs is not None
                    self._outputs.put_nowait(outputs)
                elif self.proc.exitcode is not None:
                    if not self._closed:
                        self._mark_dead(
                            EngineDeadError(f"engine core process died unexpectedly (exit code {self.proc.exitcode})")
                        )
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("reading engine core outputs failed")
            self._mark_dead(EngineDeadError(f"reading engine core outputs failed: {exc!r}"))

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
        """Stop the engine-core process (SIGTERM, then SIGKILL after 5 s) and release the sockets."""
        if self._closed:
            return
        self._closed = True
        reader = self._reader
        if reader is not None and not reader.done() and not reader.get_loop().is_closed():
            reader.cancel()
        self._finalizer()


def _release(proc: multiprocessing.process.BaseProcess, sockets: list[Any], ctx: Any, tmpdir: str) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
        if proc.is_alive():
            logger.warning("engine core process did not stop within 5 s of SIGTERM; killing it")
            proc.kill()
            proc.join(5)
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()
    shutil.rmtree(tmpdir, ignore_errors=True)
