"""MultiprocExecutor: one worker process per rank (tensor x pipeline) on this machine.

Processes are started with the ``spawn`` method (no inherited device state, no fork after threads or a CUDA
context). Each rank builds the platform's Worker, joins ``torch.distributed`` with the platform's backend
(``gloo`` on CPU, ``nccl`` on CUDA/ROCm) through a TCP rendezvous on ``127.0.0.1`` and a free port, loads its
shard of the model, and then serves calls from the executor.

Channel: one duplex ``multiprocessing`` pipe per rank. A call is pickled once
(``(method, args, kwargs, reply_rank)``) and the same bytes are written to every rank's pipe, so all ranks
run the same step on the same scheduler output; every rank answers on its pipe, but only ``reply_rank``
(rank 0 for ``execute_model``) sends its result, the others a bare acknowledgement. Pipes were chosen over a
shared-memory ring because a step's message is small (new requests in full once, then only deltas), the
per-step cost of a pipe write is a few microseconds next to a forward pass, and pipes come with clean
end-of-file semantics when a process dies. Waiting for answers uses ``multiprocessing.connection.wait`` over
the pipes *and* the worker processes' sentinels, so a worker that dies (killed, crashed, out of memory) is
noticed at once; a deadline (``TOKENMILL_RPC_TIMEOUT_S``) guards against a rank that hangs.

Pipeline parallelism: ``execute_model(..., non_block=True)`` writes the step to every pipe and returns at
once, so the engine core can submit the next micro-batch while the first stage already works on it and the
later stages still run the previous one. Every rank answers calls in the order it received them, so answers
are collected strictly oldest call first (a later call's future waits for the earlier ones).

Any failure (a worker error, a dead worker, a timeout) leaves the ranks out of step, possibly inside a
collective, so the executor is then marked broken: the remaining workers are stopped and every later call
raises at once. The engine core reports that as its own death.

Workers also stop when their parent disappears: the pipe reaches end-of-file, and a watchdog thread exits
the process if the parent's pid changes while the rank is busy (e.g. stuck in a collective).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import connection
from multiprocessing.context import SpawnProcess
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor, FutureOutput
from tokenmill.process_exit import exit_without_teardown

logger = logging.getLogger(__name__)

RPC_TIMEOUT_ENV = "TOKENMILL_RPC_TIMEOUT_S"
START_TIMEOUT_ENV = "TOKENMILL_WORKER_START_TIMEOUT_S"
THREADS_ENV = "TOKENMILL_WORKER_THREADS"
DEFAULT_RPC_TIMEOUT_S = 600.0
DEFAULT_START_TIMEOUT_S = 1800.0
ERROR_GRACE_S = 5.0  # after one rank's error, how long the others may take to answer
_SHUTDOWN = "__shutdown__"
_PARENT_POLL_S = 1.0

Method = str | Callable[..., Any]


class WorkerError(RuntimeError):
    """A worker failed; the executor can no longer be used."""


class WorkerDiedError(WorkerError):
    """A worker process exited (killed, crashed, out of memory) while the engine needed it."""


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def available_cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def threads_per_worker(world_size: int) -> int:
    """Intra-op threads for each of ``world_size`` workers sharing this machine's cores.

    ``TOKENMILL_WORKER_THREADS`` overrides; otherwise ``max(1, cores // world_size)`` so the ranks do not
    oversubscribe the cores (the engine-core process itself mostly waits).
    """
    override = os.environ.get(THREADS_ENV)
    if override:
        return max(1, int(override))
    return max(1, available_cpu_cores() // max(1, world_size))


def _env_seconds(name: str, default: float) -> float | None:
    """Seconds from environment variable ``name``; ``0`` or a negative value means no limit."""
    value = os.environ.get(name)
    seconds = float(value) if value else default
    return seconds if seconds > 0 else None


def _platform_path() -> str:
    from tokenmill.platforms import get_current_platform

    cls = get_current_platform()
    return f"{cls.__module__}:{cls.__qualname__}"


def _format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker when the process that started it is gone (it may be stuck in a collective)."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(
    config: EngineConfig,
    rank: int,
    distributed_init_method: str,
    conn: connection.Connection,
    platform_path: str,
    parent_pid: int,
    num_threads: int,
) -> None:
    """Process target of one rank: build the worker, answer ``("ready", None)`` or ``("error", text)``,
    then serve pickled calls until told to stop or the pipe closes."""
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    torch.set_num_threads(num_threads)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="tokenmill-parent-watch", daemon=True).start()
    worker: Any = None
    try:
        from tokenmill.platforms import set_current_platform
        from tokenmill.plugins import resolve_qualname

        platform = set_current_platform(resolve_qualname(platform_path))
        worker_cls = resolve_qualname(platform.worker_cls)
        worker = worker_cls(config, local_rank=rank, rank=rank, distributed_init_method=distributed_init_method)
        worker.init_device()
        worker.load_model()
    except BaseException as exc:  # noqa: BLE001 - reported to the executor, which raises it
        conn.send_bytes(pickle.dumps(("error", f"rank {rank} failed to start:\n{_format_exception(exc)}")))
        conn.close()
        return
    conn.send_bytes(pickle.dumps(("ready", None)))
    try:
        while True:
            try:
                payload = conn.recv_bytes()
            except (EOFError, OSError):
                break  # the executor is gone
            try:
                method, args, kwargs, reply_rank = pickle.loads(payload)
                if method == _SHUTDOWN:
                    break
                if isinstance(method, str):
                    result = getattr(worker, method)(*args, **kwargs)
                else:
                    result = method(worker, *args, **kwargs)
                answer = ("ok", result if reply_rank is None or reply_rank == rank else None)
                data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 - reported to the executor (also unpicklable calls/results)
                data = pickle.dumps(("error", _format_exception(exc)), protocol=pickle.HIGHEST_PROTOCOL)
            try:
                conn.send_bytes(data)
            except (EOFError, OSError):
                break
    finally:
        try:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
        conn.close()
    exit_without_teardown(0)


def _stop_workers(procs: list[SpawnProcess], conns: list[connection.Connection], grace_s: float = 5.0) -> None:
    """Ask every worker to stop, then terminate and kill whatever is left. Safe to call twice."""
    message = pickle.dumps((_SHUTDOWN, (), {}, None))
    for conn in conns:
        try:
            conn.send_bytes(message)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        if proc.pid is not None:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.terminate()
    for proc in procs:
        if proc.pid is not None:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
    for conn in conns:
        try:
            conn.close()
        except OSError:
            pass


@dataclass
class _Call:
    """A call written to every rank's pipe whose answers are not all read yet."""

    seq: int
    name: str
    reply_rank: int | None
    timeout_s: float | None
    done: bool = False
    results: list[Any] = field(default_factory=list)
    error: BaseException | None = None


class _MultiprocFuture:
    """``result()`` of a step submitted with ``non_block=True`` (see :class:`FutureOutput`)."""

    def __init__(self, executor: MultiprocExecutor, call: _Call, rank: int) -> None:
        self._executor, self._call, self._rank = executor, call, rank

    def result(self) -> ModelRunnerOutput:
        return self._executor._wait_for(self._call)[self._rank]


class MultiprocExecutor(Executor):
    """Ranks (tensor x pipeline) as local processes (see the module docstring for the protocol).

    Raises (from the constructor):
        WorkerError: a rank failed to start (its traceback is in the message).
        WorkerDiedError: a rank died while starting.
    """

    def _init_executor(self) -> None:
        import multiprocessing

        self.world_size = self.config.parallel_config.world_size
        self.rpc_timeout_s = _env_seconds(RPC_TIMEOUT_ENV, DEFAULT_RPC_TIMEOUT_S)
        self._broken: str | None = None
        self._unanswered: deque[_Call] = deque()
        self._seq = 0
        self.distributed_init_method = f"tcp://127.0.0.1:{get_open_port()}"
        ctx = multiprocessing.get_context("spawn")
        pc = self.config.parallel_config
        local_engines = pc.data_parallel_size if pc.data_parallel_backend == "mp" else 1
        num_threads = threads_per_worker(self.world_size * local_engines)
        platform_path = _platform_path()
        self.processes: list[SpawnProcess] = []
        self._conns: list[connection.Connection] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self._conns)
        try:
            for rank in range(self.world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker_main,
                    name=f"TokenmillWorker-{rank}",
                    args=(
                        self.config,
                        rank,
                        self.distributed_init_method,
                        child_conn,
                        platform_path,
                        os.getpid(),
                        num_threads,
                    ),
                    daemon=True,
                )
                self.processes.append(proc)
                self._conns.append(parent_conn)
                proc.start()
                child_conn.close()
            self._collect("start", reply_rank=None, timeout_s=_env_seconds(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S))
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "%d worker processes ready (%s, %s, %d threads each)",
            self.world_size,
            self.distributed_init_method,
            platform_path,
            num_threads,
        )

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the ranks, in rank order."""
        return [int(p.pid or 0) for p in self.processes]

    def collective_rpc(
        self,
        method: Method,
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        reply_rank: int | None = None,
        timeout_s: float | None = -1.0,
    ) -> list[Any]:
        """Call ``method`` on every rank and wait for all of them.

        Args:
            method: a Worker method name, or a picklable function called as ``method(worker, *args, **kwargs)``.
            args, kwargs: its arguments (pickled once, sent to every rank).
            reply_rank: only this rank sends its result back (the others' entries are ``None``); ``None``:
                every rank does.
            timeout_s: seconds to wait; ``-1`` (default): ``TOKENMILL_RPC_TIMEOUT_S`` (600 s); ``None``: no limit.

        Returns:
            Each rank's result, in rank order.

        Raises:
            WorkerError: a rank raised (its traceback is in the message), or the deadline passed.
            WorkerDiedError: a rank's process is gone.
        """
        call = self._submit(method, args, kwargs, reply_rank, self.rpc_timeout_s if timeout_s == -1.0 else timeout_s)
        return self._wait_for(call)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | FutureOutput:
        """Run the step on every rank; the output rank's result is the answer (the others only acknowledge).

        ``non_block=True`` returns a future at once (see the module docstring).
        """
        rank = self.output_rank
        call = self._submit("execute_model", (scheduler_output,), None, rank, self.rpc_timeout_s)
        future = _MultiprocFuture(self, call, rank)
        return future if non_block else future.result()

    def _submit(
        self, method: Method, args: tuple, kwargs: dict | None, reply_rank: int | None, timeout_s: float | None
    ) -> _Call:
        """Write one call to every rank's pipe (without waiting for answers)."""
        if self._broken is not None:
            raise WorkerError(f"the executor's workers are unusable after an earlier failure: {self._broken}")
        payload = pickle.dumps((method, args, kwargs or {}, reply_rank), protocol=pickle.HIGHEST_PROTOCOL)
        name = method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
        try:
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(payload)
                except (OSError, ValueError) as exc:
                    self._raise_if_dead(f"sending {name!r}")
                    raise WorkerError(f"cannot reach worker rank {rank}: {exc}") from exc
        except WorkerError as exc:
            self._fail(str(exc))
            raise
        self._seq += 1
        call = _Call(self._seq, name, reply_rank, timeout_s)
        self._unanswered.append(call)
        return call

    def _wait_for(self, call: _Call) -> list[Any]:
        """Read answers, oldest call first, until ``call``'s are in; returns them or raises its error."""
        while not call.done:
            if not self._unanswered:  # the executor failed and dropped the queue
                raise WorkerError(f"the executor's workers are unusable after an earlier failure: {self._broken}")
            oldest = self._unanswered[0]
            try:
                oldest.results = self._collect(oldest.name, oldest.reply_rank, oldest.timeout_s)
            except BaseException as exc:
                oldest.error = exc
                if self._broken is not None:
                    for pending in self._unanswered:
                        pending.done = True
                        pending.error = pending.error or exc
                    self._unanswered.clear()
            oldest.done = True
            if self._unanswered and self._unanswered[0] is oldest:
                self._unanswered.popleft()
        if call.error is not None:
            raise call.error
        return call.results

    def check_health(self) -> None:
        """Raises:
        WorkerDiedError: a worker process is gone.
        WorkerError: the executor failed earlier.
        """
        if self._broken is not None:
            raise WorkerError(self._broken)
        self._raise_if_dead("health check")

    def shutdown(self) -> None:
        """Stop every worker process (asks first, then terminates); idempotent."""
        self._finalizer()

    # -- internals ---------------------------------------------------------------------------------------

    def _collect(self, what: str, reply_rank: int | None, timeout_s: float | None) -> list[Any]:
        """Wait for one answer per rank while watching the processes; see :meth:`collective_rpc`.

        When a rank answers with an error, the others get ``ERROR_GRACE_S`` more to answer: if they all do, the
        ranks are still in step and only this call fails; if not (a peer is stuck in a collective the failed
        rank never joined), the executor is marked broken. A dead process always breaks it.
        """
        results: list[Any] = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        errors: list[tuple[int, str]] = []
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            failed = {r for r, _ in errors}  # ranks that reported an error may exit (e.g. failed start)
            sentinels = [p.sentinel for r, p in enumerate(self.processes) if r not in failed]
            ready = connection.wait([*pending, *sentinels], timeout=remaining)
            for conn in [obj for obj in ready if obj in pending]:
                rank = pending.pop(conn)  # type: ignore[index]
                try:
                    status, value = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError):
                    # The pipe closes as the process dies; reap it so the error can say how it ended.
                    self.processes[rank].join(timeout=2.0)
                    self._raise_if_dead(what, grace_s=1.0)
                    self._fail(f"rank {rank} closed its pipe during {what!r}")
                    raise WorkerDiedError(f"worker rank {rank} closed its connection during {what!r}") from None
                if status == "error":
                    if not errors:
                        grace_end = time.monotonic() + ERROR_GRACE_S
                        deadline = grace_end if deadline is None else min(deadline, grace_end)
                    errors.append((rank, value))
                results[rank] = value
            if any(obj in sentinels for obj in ready):
                self._raise_if_dead(what, ignore={r for r, _ in errors})
            if not ready:  # deadline passed
                waiting = sorted(pending.values())
                if errors:
                    rank, text = errors[0]
                    self._fail(f"rank {rank} raised in {what!r} and rank(s) {waiting} never answered")
                    raise WorkerError(
                        f"worker rank {rank} failed in {what!r} (rank(s) {waiting} then hung; workers stopped):\n{text}"
                    )
                self._fail(f"{what!r} timed out after {timeout_s:.0f} s waiting for rank(s) {waiting}")
                raise WorkerError(
                    f"worker rank(s) {waiting} did not answer {what!r} within {timeout_s:.0f} s "
                    f"(raise {RPC_TIMEOUT_ENV} / {START_TIMEOUT_ENV} if this is expected)"
                )
        if errors:
            # A peer's death often surfaces first as a collective error on a live rank: prefer reporting it.
            self._raise_if_dead(what, grace_s=0.2, ignore={r for r, _ in errors})
            rank, text = errors[0]
            if what == "start":
                self._fail(f"rank {rank} failed to start")
            raise WorkerError(f"worker rank {rank} failed in {what!r}:\n{text}")
        return results

    def _raise_if_dead(self, what: str, grace_s: float = 0.0, ignore: set[int] | frozenset[int] = frozenset()) -> None:
        """Raise WorkerDiedError if a worker process (other than the ``ignore`` ranks) has exited, waiting up
        to ``grace_s`` for one to."""
        watched = [(rank, p) for rank, p in enumerate(self.processes) if rank not in ignore]
        if grace_s > 0:
            connection.wait([p.sentinel for _, p in watched], timeout=grace_s)
        dead = [(rank, p.exitcode) for rank, p in watched if p.exitcode is not None]
        if not dead:
            return
        detail = ", ".join(f"rank {r} (pid {self.processes[r].pid}, {_describe_exit(code)})" for r, code in dead)
        self._fail(f"worker process died: {detail}")
        raise WorkerDiedError(f"tensor-parallel worker process died during {what!r}: {detail}")

    def _fail(self, reason: str) -> None:
        """Mark the executor unusable and stop the remaining workers (they may be stuck in a collective)."""
        if self._broken is None:
            self._broken = reason
            logger.error("multiproc executor failed: %s; stopping the workers", reason)
        _stop_workers(self.processes, [], grace_s=0.0)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"

