"""EngineCoreProc: the engine core's own process (busy loop + ZMQ I/O threads).

Started by :class:`tokenmill.engine.core_client.AsyncMPClient` with the ``spawn`` start method and target
:func:`run_engine_core`. See that module for the socket layout. Threads:

* input thread: DEALER socket -> decoded ``(EngineCoreRequestType, payload)`` on a queue;
* output thread: queue -> encoded EngineCoreOutputs on the PUSH socket;
* main thread: builds the EngineCore, sends READY, then drains the input queue, steps while there is work
  and blocks on the queue when idle.

It exits with 0 on SIGTERM or when its parent process is gone (SIGINT is ignored: Ctrl-C reaches the whole
process group and the front end owns shutdown), and with 1 after a fatal error
(startup failure, or an exception in a step), which it first reports to the front end.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import traceback
from typing import Any

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.engine.core_wire import (
    DEAD_FRAME,
    DEFAULT_ENGINE_CORE_CLS,
    OUTPUTS_FRAME,
    READY_FRAME,
    ReadyMessage,
    resolve_engine_core_cls,
)
from tokenmill.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    SchedulerStats,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.process_exit import exit_without_teardown

logger = logging.getLogger(__name__)

# Seconds the idle loop waits for input before re-checking signals and the parent process.
_IDLE_POLL_S = 0.2
_IO_POLL_MS = 200


class _Fatal:
    """Marker on the input queue: the input thread failed."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Shutdown(Exception):
    """Raised by the signal handler while the engine core is still starting."""


# Takes EngineCoreProc's constructor arguments: it is the process target that builds one.
def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    engine_core_cls: str = DEFAULT_ENGINE_CORE_CLS,
    parent_pid: int | None = None,
    identity: bytes = b"engine-core-0",
) -> None:
    """Process target: run the engine core until told to stop; exits the process with its status."""
    if not logging.getLogger().handlers:
        rank = config.parallel_config.data_parallel_rank
        label = f"engine core {rank}" if config.parallel_config.data_parallel_size > 1 else "engine core"
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [{label}] %(message)s")
    proc = EngineCoreProc(config, input_address, output_address, engine_core_cls, parent_pid, identity)
    exit_without_teardown(proc.run())


class EngineCoreProc:
    """One engine core serving one front end over ZMQ (see :func:`run_engine_core` for the arguments)."""

    def __init__(
        self,
        config: EngineConfig,
        input_address: str,
        output_address: str,
        engine_core_cls: str = DEFAULT_ENGINE_CORE_CLS,
        parent_pid: int | None = None,
        identity: bytes = b"engine-core-0",
        install_signal_handlers: bool = True,
    ) -> None:
        self.config = config
        self.engine_index = config.parallel_config.data_parallel_rank
        self.install_signal_handlers = install_signal_handlers
        self.input_address = input_address
        self.output_address = output_address
        self.engine_core_cls = engine_core_cls
        self.parent_pid = parent_pid
        self.identity = identity
        self.engine_core: Any = None
        self._stop = threading.Event()
        self._input_queue: queue.Queue[tuple[EngineCoreRequestType, Any] | _Fatal] = queue.Queue()
        self._output_queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._encoder = msgspec.msgpack.Encoder()

    def run(self) -> int:
        """Start, serve, clean up; returns the exit status."""
        import zmq

        if self.install_signal_handlers:
            self._install_signal_handlers()
        _share_cores_between_engines(self.config)
        ctx = zmq.Context()
        input_socket = ctx.socket(zmq.DEALER)
        input_socket.setsockopt(zmq.IDENTITY, self.identity)
        input_socket.setsockopt(zmq.LINGER, 0)
        input_socket.connect(self.input_address)
        try:
            self.engine_core = resolve_engine_core_cls(self.engine_core_cls)(self.config)
        except _Shutdown:
            input_socket.close()
            ctx.term()
            return 0
        except Exception as exc:
            from tokenmill.platforms import PlatformError
            from tokenmill.plugins import PluginLoadError

            if isinstance(exc, (ValueError, OSError, PlatformError, PluginLoadError)):  # the user's input: the
                logger.debug("engine core failed to start:\n%s", traceback.format_exc())  # front end says why
            else:
                logger.error("engine core failed to start:\n%s", traceback.format_exc())
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            input_socket.setsockopt(zmq.LINGER, 2000)
            input_socket.send_multipart([READY_FRAME, msgspec.msgpack.encode(ReadyMessage(error=error))])
            input_socket.close()
            ctx.term()
            return 1
        ready = ReadyMessage(
            num_gpu_blocks=self.config.cache_config.num_gpu_blocks,
            max_model_len=self.config.model_config.max_model_len,
        )
        input_socket.send_multipart([READY_FRAME, msgspec.msgpack.encode(ready)])
        threads = [
            threading.Thread(target=self._input_loop, args=(input_socket,), name="engine-core-input", daemon=True),
            threading.Thread(target=self._output_loop, args=(ctx,), name="engine-core-output", daemon=True),
        ]
        for thread in threads:
            thread.start()
        status = 0
        try:
            self._busy_loop()
        except _Shutdown:
            pass
        except Exception as exc:
            logger.error("engine core failed:\n%s", traceback.format_exc())
            message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            self._output_queue.put((DEAD_FRAME, message.encode()))
            status = 1
        finally:
            self._stop.set()
            self._output_queue.put(None)
            for thread in threads:
                thread.join(timeout=3)
            try:
                self.engine_core.shutdown()
            except Exception:
                logger.exception("engine core shutdown failed")
                status = status or 1
        if not any(t.is_alive() for t in threads):
            ctx.term()
        return status

    # -- main thread -----------------------------------------------------------------------------------

    def _busy_loop(self) -> None:
        engine = self.engine_core
        while not self._stop.is_set():
            if not self._parent_alive():
                logger.info("front-end process %s is gone; engine core exits", self.parent_pid)
                return
            if not engine.has_unfinished_requests():
                try:
                    item = self._input_queue.get(timeout=_IDLE_POLL_S)
                except queue.Empty:
                    continue
                self._handle(item)
            while True:
                try:
                    item = self._input_queue.get_nowait()
                except queue.Empty:
                    break
                self._handle(item)
            if engine.has_unfinished_requests():
                outputs = engine.step()
                if outputs.outputs or _has_counters(outputs.scheduler_stats):
                    self._send_outputs(outputs)

    def _handle(self, item: tuple[EngineCoreRequestType, Any] | _Fatal) -> None:
        if isinstance(item, _Fatal):
            raise RuntimeError(f"engine core input thread failed: {item.error!r}") from item.error
        kind, payload = item
        if kind == EngineCoreRequestType.ADD:
            try:
                self.engine_core.add_request(payload)
            except InvalidRequestError as exc:
                error = EngineCoreOutput(
                    request_id=payload.request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=str(exc)
                )
                self._send_outputs(EngineCoreOutputs(outputs=[error]))
        elif kind == EngineCoreRequestType.ABORT:
            self.engine_core.abort_requests(payload)
        else:
            self._send_outputs(EngineCoreOutputs(utility_output=self._call_utility(*payload)))

    def _call_utility(self, call_id: int, method: str, args: list[Any]) -> tuple[int, object, str | None]:
        if method.startswith("_") or not callable(getattr(self.engine_core, method, None)):
            return (call_id, None, f"EngineCore has no method {method!r}")
        try:
            result = getattr(self.engine_core, method)(*args)
            msgspec.msgpack.encode(result)
        except Exception as exc:
            logger.exception("utility call %s failed", method)
            return (call_id, None, f"{type(exc).__name__}: {exc}")
        return (call_id, result, None)

    def stop(self) -> None:
        """Ask the busy loop to return (from another thread; what SIGTERM does for a process)."""
        self._stop.set()

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        outputs.engine_index = self.engine_index
        self._output_queue.put((OUTPUTS_FRAME, self._encoder.encode(outputs)))

    def _parent_alive(self) -> bool:
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def _install_signal_handlers(self) -> None:
        def handle(signum: int, frame: Any) -> None:
            self._stop.set()
            if self.engine_core is None:
                raise _Shutdown()

        signal.signal(signal.SIGTERM, handle)
        # Ctrl-C reaches the whole process group; the front end owns shutdown and stops this process with
        # SIGTERM once its in-flight requests are dealt with, so the engine core ignores SIGINT itself.
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    # -- I/O threads -----------------------------------------------------------------------------------

    def _input_loop(self, sock: Any) -> None:
        import zmq

        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        abort_decoder = msgspec.msgpack.Decoder(list[str])
        utility_decoder = msgspec.msgpack.Decoder(tuple[int, str, list[Any]])
        try:
            while not self._stop.is_set():
                if not sock.poll(_IO_POLL_MS):
                    continue
                kind_frame, payload = sock.recv_multipart()
                kind = EngineCoreRequestType(kind_frame)
                if kind == EngineCoreRequestType.ADD:
                    self._input_queue.put((kind, add_decoder.decode(payload)))
                elif kind == EngineCoreRequestType.ABORT:
                    self._input_queue.put((kind, abort_decoder.decode(payload)))
                else:
                    self._input_queue.put((kind, utility_decoder.decode(payload)))
        except zmq.ContextTerminated:
            return
        except Exception as exc:
            logger.exception("engine core input thread failed")
            self._input_queue.put(_Fatal(exc))
        finally:
            sock.close(linger=0)

    def _output_loop(self, ctx: Any) -> None:
        import zmq

        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(self.output_address)
        try:
            while True:
                item = self._output_queue.get()
                if item is None:
                    return
                sock.send_multipart(item, copy=False)
        except Exception as exc:
            logger.exception("engine core output thread failed")
            self._input_queue.put(_Fatal(exc))
        finally:
            sock.close()


def _share_cores_between_engines(config: EngineConfig) -> None:
    """With several local engine cores, each one that runs its model in-process takes its share of the
    cores for torch (the multiprocess executor divides its workers' threads the same way)."""
    pc = config.parallel_config
    if pc.data_parallel_size > 1 and pc.data_parallel_backend == "mp" and pc.world_size == 1:
        import torch

        from tokenmill.executor.multiproc import threads_per_worker

        torch.set_num_threads(threads_per_worker(pc.data_parallel_size))


def _has_counters(stats: SchedulerStats | None) -> bool:
    """Whether a step's stats carry counts the front end would otherwise lose (prefix-cache lookups,
    preemptions); gauges alone are not worth a message."""
    if stats is None:
        return False
    spec = stats.spec_decoding_stats
    return bool(stats.prefix_cache_queries or stats.num_preemptions or (spec is not None and spec.num_drafts))
