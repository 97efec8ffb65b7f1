"""exit_without_teardown: a process ends with its status after what a normal exit does that can be observed."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=60)


def test_threads_finish_and_atexit_callbacks_run_before_the_exit() -> None:
    done = _run("""
        import atexit, threading, time
        from tokenmill.process_exit import exit_without_teardown
        atexit.register(lambda: print("atexit ran", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished", flush=True))).start()
        print("main done")  # buffered: the exit flushes it
        exit_without_teardown(3)
    """)
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == ["main done", "thread finished", "atexit ran"]


def test_an_executor_left_open_does_not_block_the_exit() -> None:
    # A concurrent.futures pool's idle workers are non-daemon threads that stop only when threading's exit hooks
    # tell them to; joining them without those hooks never returned.
    done = _run("""
        from concurrent.futures import ThreadPoolExecutor
        from tokenmill.process_exit import exit_without_teardown
        pool = ThreadPoolExecutor(2)
        print(pool.submit(lambda: 41 + 1).result(), flush=True)
        exit_without_teardown(5)
    """)
    assert done.returncode == 5, done.stderr
    assert done.stdout.strip() == "42"
