"""Running the server: bind, start the engine, serve with uvicorn, stop cleanly.

* SIGINT / SIGTERM: during the engine start they interrupt it; while serving, the server stops accepting
  connections, every request in flight ends at once with a 503 ``server_shutting_down`` error (a streaming
  one with an SSE error event; the engine core aborts them and frees their KV blocks), uvicorn closes the
  connections (waiting at most 5 s) and the engine core is shut down. Exit status 0.
* Engine-core death: in-flight requests fail (500, or an SSE error event), ``/health`` answers 503 for
  :data:`ENGINE_DEAD_EXIT_DELAY_S` seconds (so probes and load balancers see it), then the server stops and
  the process exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
from types import FrameType
from typing import Any

from tokenmill.entrypoints.openai.api_server import DEFAULT_HOST, DEFAULT_PORT, ServerState, build_app
from tokenmill.entrypoints.openai.reasoning import resolve_reasoning_parser
from tokenmill.entrypoints.openai.serving_models import parse_lora_modules
from tokenmill.entrypoints.openai.chat_template import load_chat_template
from tokenmill.entrypoints.openai.tool_choice import resolve_tool_parser
from tokenmill.entrypoints.openai.serving_engine import EngineClient
from tokenmill.errors import ServerShuttingDownError

logger = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_DELAY_S = 2.0
_ENGINE_WATCH_INTERVAL_S = 0.5
_GRACEFUL_SHUTDOWN_S = 5


class _SignalState:
    """SIGINT/SIGTERM during startup interrupt it. Once a uvicorn server is set, uvicorn handles them while it
    serves (draining connections) and re-raises them when it stops; they must then only stop the server,
    never kill the process before the engine core is shut down."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.server: Any = None

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        if self.server is None:
            raise KeyboardInterrupt(f"signal {signum}")
        self.server.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket before the (slow) engine start, so a busy port fails fast.

    Raises:
        OSError: the address is in use or not available.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(address)
    sock.set_inheritable(False)
    return sock


def run_server(args: argparse.Namespace) -> int:
    """Start the engine and serve the API until SIGINT/SIGTERM or engine death.

    The server listens on ``args.host:args.port``, by default ``127.0.0.1:8000``: unlike vLLM (which binds
    ``0.0.0.0``) tokenmill only accepts local connections unless ``--host 0.0.0.0`` is given, so a model is
    never exposed to the network by accident.

    Returns:
        The process exit code: 0 after a requested shutdown, 1 when the engine core died.

    Raises:
        OSError: the address cannot be bound.
        FileNotFoundError: the model or ``--chat-template`` does not exist.
        ValueError: ``--enable-auto-tool-choice`` without a known ``--tool-call-parser``.
    """
    import uvicorn
    from tokenmill.engine_args import EngineArgs

    signals = _SignalState()
    previous = {sig: signal.signal(sig, signals.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        load_chat_template(getattr(args, "chat_template", None))
        resolve_tool_parser(args)
        resolve_reasoning_parser(args)
        host = getattr(args, "host", None) or DEFAULT_HOST
        port = DEFAULT_PORT if getattr(args, "port", None) is None else int(args.port)
        sock = _bind(host, port)
        try:
            engine_args = EngineArgs.from_cli_args(args)
            if engine_args.compile_mode is None:  # a server answers first and compiles meanwhile
                engine_args = engine_args.replace(compile_mode="background")
            return asyncio.run(_serve(args, engine_args, sock, signals, uvicorn))
        except KeyboardInterrupt:
            logger.info("interrupted (signal %s); stopped", signals.received)
            return 0
        finally:
            sock.close()
    finally:
        from tokenmill.engine.core_prestart import discard_prestarted_engine_core

        discard_prestarted_engine_core()  # not taken: the engine never started (an error, or data parallelism)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _serve(args: argparse.Namespace, engine_args: Any, sock: socket.socket, signals: _SignalState,
                 uvicorn: Any) -> int:
    from tokenmill.engine.async_llm import AsyncLLM

    host, port = sock.getsockname()[:2]
    lora_modules = parse_lora_modules(getattr(args, "lora_modules", None))  # malformed: fail before the engine
    if lora_modules and not getattr(engine_args, "enable_lora", False):
        raise ValueError("lora_modules: needs --enable-lora")
    logger.info("starting the engine (model: %s)", engine_args.model or "embedded default")
    engine = AsyncLLM.from_engine_args(engine_args)
    watcher: asyncio.Task[None] | None = None
    try:
        app = build_app(engine, args)
        state: ServerState = app.state.server_state
        await app.state.models.load_static_loras(engine, lora_modules)
        config = uvicorn.Config(
            app,
            log_level=getattr(args, "uvicorn_log_level", None) or "info",
            access_log=not getattr(args, "disable_uvicorn_access_log", False),
            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
            timeout_keep_alive=5,
        )
        loop = asyncio.get_running_loop()

        class Server(uvicorn.Server):  # type: ignore[misc, valid-type]
            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                first = not self.should_exit
                super().handle_exit(sig, frame)
                if first:  # signal handler: hand the work to the event loop
                    loop.call_soon_threadsafe(_stop_requests, engine)

        server = Server(config)

        def stop_serving_soon() -> None:
            loop.call_later(ENGINE_DEAD_EXIT_DELAY_S, setattr, server, "should_exit", True)

        state.add_engine_dead_listener(stop_serving_soon)
        watcher = asyncio.ensure_future(_watch(engine, server, state, f"http://{_url_host(host)}:{port}"))
        signals.server = server
        await server.serve(sockets=[sock])
        return 1 if state.engine_dead else 0
    finally:
        if watcher is not None:
            watcher.cancel()
        logger.info("shutting down the engine")
        engine.shutdown()


def _stop_requests(engine: EngineClient) -> None:
    logger.info("stopping: %d request(s) in flight end with 503 server_shutting_down",
                engine.get_num_unfinished_requests())
    engine.fail_all_requests(ServerShuttingDownError("the server is shutting down"))


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def _watch(engine: EngineClient, server: Any, state: ServerState, url: str) -> None:
    """Log readiness once uvicorn serves; notice engine death even when no request is in flight."""
    announced = False
    while True:
        await asyncio.sleep(0.1 if not announced else _ENGINE_WATCH_INTERVAL_S)
        if not announced and server.started:
            announced = True
            logger.info("Uvicorn running on %s (Press CTRL+C to quit)", url)
            logger.info("tokenmill API server ready")
        if engine.errored:
            state.mark_engine_dead()
            return
