"""Start the engine-core process before its configuration exists, so its imports overlap the front end's.

A spawned engine core spends seconds importing torch, transformers' config classes and tokenmill's engine
before it can read its configuration (on a Zen 4 core its first log line came 4.5 s after it was spawned, most
of it imports in a py-spy profile; docs/benchmarks-history.md, "2026-12-02 Zen 4 (46f8ad6)"), and the front
end spends about as long importing its own modules and reading the model's config first. ``tokenmill
serve`` therefore calls :func:`prestart_engine_core` as its first step: a ``spawn`` process imports those
modules, then waits on a pipe. :class:`~tokenmill.engine.core_client.AsyncMPClient` takes it with
:func:`take_prestarted_engine_core` and sends the arguments of
:func:`~tokenmill.engine.core_proc.run_engine_core`, together with what a ``spawn`` start would have handed
over at that time: the front end's environment (``TOKENMILL_PLATFORM`` is set after the process started;
variables read at import by native libraries, such as ``OMP_NUM_THREADS``, must not change in between),
``sys.path`` and the working directory.

A prestarted process that is never used (data parallelism, a start-up error) is terminated by
:func:`discard_prestarted_engine_core` (also run when the front end exits); it exits by itself when its pipe
closes (the front end died), and ignores SIGINT while it waits, so Ctrl-C reaches it only through the front end.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

logger = logging.getLogger(__name__)

# Imported while the front end works; each is needed before the engine core is ready.
PRELOAD_MODULES = (
    "torch",
    "transformers.configuration_utils",
    "tokenmill.engine.core_proc",
    "tokenmill.engine.core",
    "tokenmill.worker.model_runner",
)
# Imported next, one at a time and only while no configuration has arrived: what loading a saved compiled graph
# imports first (about 3.5 s on a Zen 4 core), which otherwise runs beside the first requests.
IDLE_PRELOAD_MODULES = (
    "torch._dynamo",
    "torch._functorch._aot_autograd.aot_autograd_result",
    "torch._inductor.codecache",
    "torch._inductor.lowering",
    "torch._inductor.codegen.wrapper",
    "torch._inductor.select_algorithm",
    "torch._inductor.codegen.cpp_wrapper_cpu",
)

_lock = threading.Lock()
_prestarted: PrestartedEngineCore | None = None


class PrestartedEngineCore:
    """A spawned process waiting for :meth:`start` (see the module docstring).

    Attributes:
        proc: the ``multiprocessing`` process (what ``AsyncMPClient`` supervises once started).
    """

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        child_conn, self._conn = ctx.Pipe(duplex=False)  # (receiving end, sending end)
        self.proc = ctx.Process(target=_wait_then_run, args=(child_conn,), name="TokenmillEngineCore")
        self.proc.start()
        child_conn.close()

    def start(self, kwargs: dict[str, Any]) -> bool:
        """Send ``run_engine_core``'s keyword arguments; ``False`` (nothing sent) if the process is gone.

        What a ``spawn`` start would hand over goes with them: the front end's environment, ``sys.path`` (a
        ``--trust-remote-code`` config's class lives in a module transformers put on it after the prestart) and
        working directory. The arguments travel pickled, so that the child unpickles them after applying those.
        """
        try:
            if not self.proc.is_alive():
                return False
            payload = bytes(ForkingPickler.dumps(kwargs))
            self._conn.send((dict(os.environ), list(sys.path), os.getcwd(), payload))
        except (OSError, ValueError):
            return False
        finally:
            self._conn.close()
        return True

    def discard(self) -> None:
        """Stop the process (it holds nothing yet: it is importing or waiting) and reap it."""
        self._conn.close()
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(5)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join(5)


def prestart_engine_core() -> None:
    """Spawn the engine-core process now (once per front-end process); errors only lose the head start."""
    global _prestarted
    with _lock:
        if _prestarted is not None:
            return
        try:
            _prestarted = PrestartedEngineCore()
        except (OSError, RuntimeError) as exc:
            logger.debug("could not prestart the engine core (%s); it starts when the engine does", exc)
            return
    atexit.register(discard_prestarted_engine_core)  # before multiprocessing joins its children at exit


def take_prestarted_engine_core() -> PrestartedEngineCore | None:
    """The waiting process, at most once; ``None`` if none was started or it was taken."""
    global _prestarted
    with _lock:
        taken, _prestarted = _prestarted, None
        return taken


def discard_prestarted_engine_core() -> None:
    """Stop a prestarted process nobody took (no-op otherwise)."""
    taken = take_prestarted_engine_core()
    if taken is not None:
        taken.discard()


def _wait_then_run(conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as the engine core itself does: the front end stops it
    spawned_with = dict(os.environ)
    for name in PRELOAD_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the engine core's own import reports the problem
            break
    for name in IDLE_PRELOAD_MODULES:
        try:
            if conn.poll():
                break
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - only a head start; EOF is seen by recv below
            break
    try:
        environ, path, cwd, payload = conn.recv()
    except (EOFError, OSError):
        sys.exit(0)
    finally:
        conn.close()
    for key in set(spawned_with) - set(environ):
        os.environ.pop(key, None)
    os.environ.update(environ)  # variables the imports above set for themselves stay
    sys.path[:] = path
    os.chdir(cwd)
    from tokenmill.engine.core_proc import run_engine_core

    run_engine_core(**pickle.loads(payload))
