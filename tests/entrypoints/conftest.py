"""Fixtures for the server tests: an app over a fake engine (fast) and a real ``tokenmill serve`` process."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from tokenmill.entrypoints.openai.api_server import build_app

from tests.entrypoints.fake_engine import FakeAsyncLLM, server_args

SERVER_START_TIMEOUT_S = 180.0
REAL_SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> FakeAsyncLLM:
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    return FakeAsyncLLM()


@pytest.fixture
def fake_app(fake_engine: FakeAsyncLLM) -> FastAPI:
    return build_app(fake_engine, server_args())


@pytest.fixture
def client(fake_app: FastAPI) -> Iterator[TestClient]:
    with TestClient(fake_app, raise_server_exceptions=False) as c:
        yield c


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RealServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: str

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]


def _children(pid: int) -> list[int]:
    """Child process ids of ``pid`` (from /proc; empty where that is not available)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _stop(process: subprocess.Popen[bytes]) -> tuple[int, list[int]]:
    """SIGTERM the server (SIGKILL its group after 30 s); returns its exit code and its children still alive."""
    if process.poll() is not None:
        return process.returncode, []
    children = _children(process.pid)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the server and its engine-core child
        process.wait(timeout=10)
    deadline = time.monotonic() + 5
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    return process.returncode, [c for c in children if _alive(c)]


# Package scope: the server (and its engine core) stops once tests/entrypoints is done instead of idling beside
# the rest of the suite.
@pytest.fixture(scope="package")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    """``tokenmill serve`` with the embedded default model on a free port of 127.0.0.1."""
    yield from serve_default_model(tmp_path_factory)


def serve_default_model(tmp_path_factory: pytest.TempPathFactory, extra_args: tuple[str, ...] = ()
                        ) -> Iterator[RealServer]:
    """Run ``tokenmill serve`` (the embedded default model, ``extra_args`` added) for a fixture to yield;
    checks its clean SIGTERM shutdown afterwards."""
    from tokenmill.model_loader.default_model import (
        DefaultModelMissingError,
        default_model_path,
    )

    try:
        default_model_path()
    except DefaultModelMissingError as exc:
        pytest.skip(str(exc))
    if importlib.util.find_spec("tokenmill.engine.async_llm") is None:
        pytest.skip("tokenmill.engine.async_llm is not implemented yet")
    yield from run_server(str(tmp_path_factory.mktemp("server")),
                          ["--max-model-len", "2048", "--kv-cache-memory", "512MiB", *extra_args])


TOOL_TEMPLATE = Path(__file__).with_name("tool_template.jinja")
TOOL_SERVER_KEY = "test-key"


@pytest.fixture(scope="package")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    """One ``tokenmill serve`` of the default model with tool calling (hermes parser, ``tool_template.jinja``) and
    an API key (``TOOL_SERVER_KEY``), shared by the structured-output and Anthropic Messages tests."""
    yield from serve_default_model(tmp_path_factory, ("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                                      "--chat-template", str(TOOL_TEMPLATE),
                                                      "--api-key", TOOL_SERVER_KEY))


def wait_healthy(url: str, process: subprocess.Popen[bytes], log_tail: Callable[[], str],
                 timeout_s: float = SERVER_START_TIMEOUT_S) -> None:
    """Poll ``url/health`` every 0.1 s until it answers 200; fails the test (with ``log_tail()``) when
    ``process`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            pytest.fail(f"tokenmill serve exited with {process.returncode}:\n{log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            pytest.fail(f"tokenmill serve not healthy after {timeout_s:.0f} s:\n{log_tail()}")
        time.sleep(0.1)


def run_server(log_dir: str, args: list[str], timeout_s: float = SERVER_START_TIMEOUT_S) -> Iterator[RealServer]:
    """Run ``tokenmill serve ARGS --port <free port>`` (log in ``log_dir/server.log``) until it is healthy, yield
    it, then SIGTERM it and check the clean shutdown: exit status 0 and no engine-core process left behind."""
    port = free_port()
    log_path = os.path.join(log_dir, "server.log")
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", *args, "--port", str(port)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TOKENMILL_API_KEY", None)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = RealServer(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(server.url, process, server.log_tail, timeout_s)
        yield server
    finally:
        code, left = _stop(process)
    assert code == 0, f"tokenmill serve exited with {code} after SIGTERM:\n{server.log_tail()}"
    assert not left, f"processes {left} outlived the server"
