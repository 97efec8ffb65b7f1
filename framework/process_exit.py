"""End a process without the interpreter's module teardown.

A process that imported torch spends 1-2 s of CPU in interpreter finalization after its work is done (freeing
every module's objects one by one; docs/benchmarks.md, "Test suite time"). A stopped server waits for that
twice: once in its engine-core process and once in its own. The processes that end through
:func:`exit_without_teardown` still do everything a normal exit does that anyone can observe: the non-daemon
threads finish, the ``atexit`` callbacks run (logging's flush, ``weakref.finalize`` clean-ups, temporary
directories), and stdio is flushed.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_without_teardown(status: int) -> NoReturn:
    """Exit the process with ``status`` (0-255) after joining the non-daemon threads, running the ``atexit``
    callbacks and flushing stdout/stderr, skipping the interpreter's teardown of modules.

    Only for a process's own top level (a console script, a process target): it never returns, so a caller that
    runs inside another program (a test calling ``main()``) must not use it.
    """
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        # What the interpreter's exit calls first: threading's own exit hooks (a concurrent.futures executor left
        # open tells its idle workers to stop), then the join of every non-daemon thread. Joining them without
        # those hooks waits forever on such a worker.
        shutdown()
    else:
        current = threading.current_thread()
        for thread in threading.enumerate():
            if thread is not current and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to deliver to
            pass
    os._exit(status)
