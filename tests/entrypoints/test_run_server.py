"""``tokenmill serve`` as a process without a model: real uvicorn, signals, engine death, client disconnects over
TCP. Most tests replace AsyncLLM with the fake engine; the SIGKILL test runs the real AsyncLLM with a real
engine-core process (a fake EngineCore class inside it) and kills that process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import Any

import httpx
import pytest

from tests.entrypoints.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs the real CLI with tokenmill.engine.async_llm replaced by the fake engine. Knobs via environment:
# FAKE_START_S (seconds from_engine_args blocks), FAKE_DIE_ON_SIGUSR1 (the engine dies when the server gets
# SIGUSR1), FAKE_DELAY_S (seconds per token). It prints "FAKE GENERATE <id>" when a request reaches the engine
# and "FAKE ABORTED <id>" when one is aborted, so tests wait for those events instead of sleeping.
_LAUNCHER = """
import asyncio, os, signal, sys, time, types
from tests.entrypoints.fake_engine import FakeAsyncLLM

class AsyncLLM(FakeAsyncLLM):
    @classmethod
    def from_engine_args(cls, engine_args):
        if os.environ.get("FAKE_STARTING_FILE"):  # the server's signal handlers are installed by now
            open(os.environ["FAKE_STARTING_FILE"], "w").close()
        time.sleep(float(os.environ.get("FAKE_START_S", "0")))
        engine = cls(max_model_len=engine_args.max_model_len or 128,
                     delay_s=float(os.environ.get("FAKE_DELAY_S", "0")))
        engine.on_abort = lambda rid: print("FAKE ABORTED", rid, flush=True)
        if os.environ.get("FAKE_DIE_ON_SIGUSR1"):
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, setattr, engine, "dead", True)
        print("FAKE ENGINE STARTED", flush=True)
        return engine

    async def generate(self, *args, **kwargs):
        inner = super().generate(*args, **kwargs)
        print("FAKE GENERATE", args[2] if len(args) > 2 else kwargs["request_id"], flush=True)
        try:
            async for out in inner:
                yield out
        finally:
            await inner.aclose()

    def shutdown(self):
        print("FAKE ENGINE SHUTDOWN", flush=True)

module = types.ModuleType("tokenmill.engine.async_llm")
module.AsyncLLM = AsyncLLM
sys.modules["tokenmill.engine.async_llm"] = module
from tokenmill.entrypoints.cli import main
from tokenmill.process_exit import exit_without_teardown
exit_without_teardown(main(sys.argv[1:]))
"""


class Proc:
    """A server process whose output a thread collects, line by line, as it comes."""

    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process = process
        self.url = url
        self._lines: list[str] = []
        self._new_line = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._new_line:
                self._lines.append(line)
                self._new_line.notify_all()
        with self._new_line:
            self._lines.append("")  # end of output
            self._new_line.notify_all()

    @property
    def output(self) -> str:
        with self._new_line:
            return "".join(self._lines)

    def wait_for(self, text: str, timeout: float = 30) -> str:
        """The first output line holding ``text``, once it is printed.

        Raises:
            AssertionError: the output ended, or ``timeout`` seconds passed, without it.
        """
        deadline = time.monotonic() + timeout
        seen = 0
        with self._new_line:
            while True:
                for line in self._lines[seen:]:
                    if text in line:
                        return line
                    if not line:
                        raise AssertionError(f"output ended without {text!r}:\n" + "".join(self._lines))
                seen = len(self._lines)
                left = deadline - time.monotonic()
                assert left > 0, f"no {text!r} within {timeout} s:\n" + "".join(self._lines)
                self._new_line.wait(left)

    def finish(self, timeout: float = 20) -> int:
        self.process.wait(timeout)
        self._reader.join(timeout)
        return self.process.returncode


# The real AsyncLLM over a real engine-core process running tests.engine.engine_fakes.SlowEchoEngineCore
# (20 ms per step, echoes the prompt); prints the engine-core process id.
_REAL_CORE_LAUNCHER = """
import sys
import tokenmill.engine.async_llm as async_llm
from tests.engine.engine_fakes import SlowEchoEngineCore, byte_level_tokenizer, cls_path, make_config

class AsyncLLM(async_llm.AsyncLLM):
    @classmethod
    def from_engine_args(cls, engine_args, **kwargs):
        engine = cls(make_config(max_model_len=256), tokenizer=byte_level_tokenizer(),
                     engine_core_cls=cls_path(SlowEchoEngineCore), startup_timeout_s=60)
        print("ENGINE CORE PID", engine.engine_core.proc.pid, flush=True)
        return engine

async_llm.AsyncLLM = AsyncLLM
from tokenmill.entrypoints.cli import main
from tokenmill.process_exit import exit_without_teardown
exit_without_teardown(main(sys.argv[1:]))
"""


@contextmanager
def launch(*extra: str, env: dict[str, str] | None = None, port: int | None = None,
           launcher: str = _LAUNCHER) -> Iterator[Proc]:
    port = port or free_port()
    cmd = [sys.executable, "-c", launcher, "serve", "--port", str(port), "--max-model-len", "128", *extra]
    full_env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    full_env.pop("TOKENMILL_API_KEY", None)
    full_env.update(env or {})
    process = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    proc = Proc(process, f"http://127.0.0.1:{port}")
    try:
        yield proc
    finally:
        if process.poll() is None:
            process.kill()
            proc.finish(timeout=10)


def wait_healthy(proc: Proc, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.process.poll() is None, proc.finish()
        try:
            if httpx.get(proc.url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("server did not become healthy")


def test_serve_streams_and_stops_cleanly_on_sigterm() -> None:
    with launch(env={"FAKE_DELAY_S": "0.02"}) as proc:
        wait_healthy(proc)
        # Events arrive one by one over real TCP, not all at the end.
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "stream": True}
        arrivals = []
        with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body, timeout=10) as r:
            assert r.headers["x-request-id"]
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
        assert len(arrivals) >= 20 and arrivals[-1] - arrivals[1] > 0.2
        # A client that goes away mid-stream aborts its request.
        body["max_tokens"] = 100
        with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body, timeout=10) as r:
            next(r.iter_lines())
        proc.wait_for("FAKE ABORTED chatcmpl-")
        proc.process.send_signal(signal.SIGTERM)
        assert proc.finish() == 0, proc.output
    assert "Uvicorn running on " + proc.url in proc.output
    assert "FAKE ABORTED chatcmpl-" in proc.output
    assert "FAKE ENGINE SHUTDOWN" in proc.output


def test_serve_non_stream_disconnect_aborts() -> None:
    with launch(env={"FAKE_DELAY_S": "0.2"}) as proc:
        wait_healthy(proc)
        body = json.dumps({"prompt": "x", "max_tokens": 100}).encode()
        host, port = proc.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
            # The answer takes 6 s (31 tokens, 0.2 s each): the client goes while the engine runs the request.
            proc.wait_for("FAKE GENERATE cmpl-")
        proc.wait_for("FAKE ABORTED cmpl-")
        proc.process.send_signal(signal.SIGINT)
        assert proc.finish() == 0
    assert "FAKE ABORTED cmpl-" in proc.output


def test_engine_death_makes_health_503_and_exits_nonzero() -> None:
    with launch(env={"FAKE_DIE_ON_SIGUSR1": "1"}) as proc:
        wait_healthy(proc)
        proc.process.send_signal(signal.SIGUSR1)  # the engine dies now
        saw_503 = False
        deadline = time.monotonic() + 20
        while proc.process.poll() is None and time.monotonic() < deadline:
            try:
                saw_503 |= httpx.get(proc.url + "/health", timeout=1).status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert proc.finish() == 1, proc.output
    assert saw_503  # the server keeps answering 503 for a moment before it exits
    assert "FAKE ENGINE SHUTDOWN" in proc.output
    assert "engine core is dead" in proc.output


def test_engine_core_sigkill_fails_requests_and_health() -> None:
    """SIGKILL the real engine-core process while a stream and a non-stream request run."""
    with launch(launcher=_REAL_CORE_LAUNCHER) as proc:
        wait_healthy(proc, timeout=60)
        pid = int(proc.wait_for("ENGINE CORE PID").split()[-1])  # printed before uvicorn started
        body = {"prompt": "Hello world, this is a tiny corpus", "max_tokens": 240, "ignore_eos": True}
        results: dict[str, Any] = {}

        def non_stream() -> None:
            r = httpx.post(proc.url + "/v1/completions", json=body, timeout=30)
            results["non_stream"] = (r.status_code, r.json(), time.monotonic())

        worker = threading.Thread(target=non_stream)
        with httpx.stream("POST", proc.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            worker.start()
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith('data: {"id"')
            time.sleep(0.2)  # both requests in flight
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            events = [line[6:] for line in lines if line.startswith("data: ")]
            streamed_error_at = time.monotonic()
        health = httpx.get(proc.url + "/health", timeout=5)
        worker.join(timeout=10)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and error["code"] == "engine_dead"
        assert streamed_error_at - killed < 5
        status, payload, at = results["non_stream"]
        assert status == 500 and payload["error"]["code"] == "engine_dead" and at - killed < 5
        assert health.status_code == 503
        assert proc.finish(timeout=30) == 1, proc.output
    assert "engine core process died unexpectedly" in proc.output or "engine core is dead" in proc.output


def test_api_key_from_environment_variable() -> None:
    with launch(env={"TOKENMILL_API_KEY": "envkey"}) as proc:
        wait_healthy(proc)
        assert httpx.get(proc.url + "/v1/models").status_code == 401
        assert httpx.post(proc.url + "/tokenize", json={"prompt": "x"}).status_code == 401
        ok = httpx.get(proc.url + "/v1/models", headers={"Authorization": "Bearer envkey"})
        assert ok.status_code == 200
        assert httpx.get(proc.url + "/metrics").status_code == 200
        proc.process.send_signal(signal.SIGTERM)
        assert proc.finish() == 0


def test_sigterm_during_engine_start(tmp_path) -> None:
    marker = tmp_path / "starting"
    with launch(env={"FAKE_START_S": "30", "FAKE_STARTING_FILE": str(marker)}) as proc:
        deadline = time.monotonic() + 60  # imports take seconds, more on a loaded machine
        while not marker.exists():
            assert proc.process.poll() is None and time.monotonic() < deadline, proc.finish()
            time.sleep(0.1)
        start = time.monotonic()
        proc.process.send_signal(signal.SIGTERM)
        assert proc.finish() == 0, proc.output
        assert time.monotonic() - start < 10


def test_port_in_use_fails_fast() -> None:
    with closing(socket.socket()) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with launch(env={"FAKE_START_S": "30"}, port=port) as proc:
            assert proc.finish() == 1
    assert "tokenmill serve: error:" in proc.output
    assert "FAKE ENGINE STARTED" not in proc.output


def test_api_key_flag() -> None:
    with launch("--api-key", "k1") as proc:
        wait_healthy(proc)
        assert httpx.get(proc.url + "/v1/models").status_code == 401
        r = httpx.get(proc.url + "/v1/models", headers={"Authorization": "Bearer k1"})
        assert json.loads(r.text)["data"][0]["id"]
        proc.process.send_signal(signal.SIGTERM)
        assert proc.finish() == 0


def test_stop_signal_ends_requests_in_flight_with_503_not_a_cut_connection() -> None:
    with launch(env={"FAKE_DELAY_S": "0.5"}) as proc:
        wait_healthy(proc)
        results: dict[str, Any] = {}

        def plain() -> None:
            r = httpx.post(proc.url + "/v1/completions", json={"prompt": "x", "max_tokens": 50}, timeout=30)
            results["plain"] = (r.status_code, r.json())

        streaming = threading.Event()

        def streamed() -> None:
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50, "stream": True}
            events = results["stream"] = []
            with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        streaming.set()

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        # both are in the engine, and the stream has sent its first event (31 tokens take 15 s)
        proc.wait_for("FAKE GENERATE cmpl-")
        assert streaming.wait(30), proc.output
        start = time.monotonic()
        proc.process.send_signal(signal.SIGINT)
        for t in threads:
            t.join(timeout=20)
        assert proc.finish() == 0, proc.output
        assert time.monotonic() - start < 4.5, "requests were not stopped before uvicorn's 5 s drain"
    status, body = results["plain"]
    assert status == 503 and body["error"]["code"] == "server_shutting_down", body
    assert body["error"]["type"] == "server_error" and body["error"]["param"] is None
    events = results["stream"]
    assert events[0]["choices"] and events[-1]["error"]["code"] == "server_shutting_down", events
    assert "Traceback" not in proc.output and "graceful shutdown exceeded" not in proc.output, proc.output
    assert "FAKE ENGINE SHUTDOWN" in proc.output
