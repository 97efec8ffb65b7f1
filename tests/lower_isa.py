"""Run kernel checks against tokenmill-cpu's lower instruction-set builds, in one subprocess per build.

``ATEN_CPU_CAPABILITY`` is read when torch is imported, so a lower build runs in a process of its own. Every
lower-ISA check of one capability goes to the same process (:class:`LowerIsaWorker`): it imports torch and builds
or loads the kernels once, then runs each check's tests with ``pytest.main`` on request. One process per check
paid interpreter, torch and pytest start-up ten times a run. ``kernel_prebuild`` runs the checks last, ordered by
capability, so one worker is alive at a time.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys

import pytest

from tests import kernel_prebuild
from tokenmill_cpu import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The checks compare each instruction set's code paths with the reference, which the optimisation level does not
# select: -O1 halves the builds' compile time (the -O3 build of this machine's own level runs every other test).
BUILD_FLAGS = "-O1"
DONE = "\x00lower-isa-done"  # the worker's reply line after a request's output: DONE <json>

# The worker: load the kernels, report, then run requests (one JSON line each) until stdin closes. A pytest run
# prints to stdout; the reply line that follows it is what the parent reads.
_WORKER = """
import json, sys
from tokenmill_cpu import kernels
loaded = kernels.load()
print(%(done)r, json.dumps({"loaded": bool(loaded), "isa": kernels.isa() if loaded else {}}), flush=True)
import pytest
for line in sys.stdin:
    request = json.loads(line)
    if "script" in request:
        sys.argv = ["-c", *request["argv"]]
        try:
            exec(compile(request["script"], "<lower-isa check>", "exec"), {"__name__": "__lower_isa__"})
            rc = 0
        except BaseException as exc:
            import traceback; traceback.print_exc(file=sys.stdout)
            rc = 1
    else:
        rc = int(pytest.main(["-q", "-p", "no:cacheprovider", request["file"], "-k", request["select"]]))
    print(%(done)r, json.dumps({"rc": rc}), flush=True)
""" % {"done": DONE}


def lower_isa_env(capability: str) -> dict[str, str]:
    """The environment of a process that builds and runs the kernels for ATen capability ``capability``: with
    :data:`BUILD_FLAGS`, except where ``capability`` is this machine's own (``avx2`` on an AVX2 CPU), whose -O3
    build the rest of the suite has built already."""
    import torch

    if capability.upper() == torch.backends.cpu.get_cpu_capability():
        return dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    return dict(os.environ, ATEN_CPU_CAPABILITY=capability, TOKENMILL_CPU_CFLAGS=BUILD_FLAGS)


class LowerIsaWorker:
    """A Python process with the kernels of ATen capability ``capability`` built (with :data:`BUILD_FLAGS`) and
    loaded, running checks on request.

    Raises (construction): ``AssertionError`` when the build fails (with the process's output)."""

    def __init__(self, capability: str) -> None:
        self.capability = capability
        self.process = subprocess.Popen([sys.executable, "-c", _WORKER], env=lower_isa_env(capability), cwd=ROOT,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1)
        output, hello = self._reply()
        assert hello.get("loaded"), f"the {capability} build failed:\n{output[-6000:]}"
        self.isa: dict[str, str] = hello["isa"]

    def _reply(self) -> tuple[str, dict]:
        """The output up to the next reply line, and the reply; ``AssertionError`` if the process ends first."""
        assert self.process.stdout is not None
        lines: list[str] = []
        for line in self.process.stdout:
            if line.startswith(DONE):
                return "".join(lines), json.loads(line[len(DONE):])
            lines.append(line)
        self.process.wait(timeout=30)
        raise AssertionError(f"the {self.capability} worker exited with {self.process.returncode}:\n"
                             + "".join(lines)[-6000:])

    def run(self, request: dict) -> tuple[int, str]:
        """Send ``request`` (``{"file", "select"}`` for a pytest run, ``{"script", "argv"}`` for a script);
        returns its status (0: passed) and output."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        output, reply = self._reply()
        return int(reply["rc"]), output

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_worker: LowerIsaWorker | None = None


def worker(capability: str) -> LowerIsaWorker:
    """The worker of ``capability``, started (and any other worker closed) when needed."""
    global _worker
    if _worker is not None and (_worker.capability != capability or _worker.process.poll() is not None):
        close_worker()
    if _worker is None:
        # A background build still running (tests/kernel_prebuild.py) is stopped: its finished objects are kept,
        # and this build, at normal priority and with every core, compiles the rest.
        kernel_prebuild.stop()
        _worker = LowerIsaWorker(capability)
    return _worker


@atexit.register
def close_worker() -> None:
    global _worker
    if _worker is not None:
        _worker.close()
        _worker = None


def skip_without_avx2(isa: str) -> None:
    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= kernels.cpu_flags():
        pytest.skip("this CPU has no AVX2/FMA/F16C")


def check_lower_isa_build(test_file: str, capability: str, isa_key: str, isa: str, select: str) -> None:
    """With the kernels built for ATen capability ``capability`` (``default``: plain C++; ``avx2``: AVX2/FMA/F16C
    flags only, also on an AVX-512 machine; with :data:`BUILD_FLAGS`), check that ``kernels.isa()[isa_key] ==
    isa``, then run the tests of ``test_file`` that ``pytest -k select`` picks. Skips where the CPU lacks
    AVX2/FMA/F16C for ``isa == "avx2"``; fails (``AssertionError``) on a build error, a wrong path or a failing
    test."""
    skip_without_avx2(isa)
    w = worker(capability)
    assert w.isa.get(isa_key) == isa, w.isa
    rc, output = w.run({"file": os.path.abspath(test_file), "select": select})
    assert rc == 0 and " passed" in output, output[-6000:]


def run_lower_isa_script(capability: str, isa: str, script: str, *argv: str) -> str:
    """Run ``script`` (Python source; ``sys.argv[1:]`` is ``argv``) in the worker of ``capability``; returns its
    output. ``AssertionError`` (with the output) when it raises."""
    skip_without_avx2(isa)
    rc, output = worker(capability).run({"script": script, "argv": list(argv)})
    assert rc == 0, output[-6000:]
    return output
