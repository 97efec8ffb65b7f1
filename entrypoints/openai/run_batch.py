"""``tokenmill run-batch -i requests.jsonl -o results.jsonl [MODEL]``: an OpenAI batch file, run offline.

Input: OpenAI's batch input format, one JSON object a line::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

``url`` is ``/v1/chat/completions`` or ``/v1/completions``. Output: OpenAI's batch output format, one line per
input line (blank lines skipped), in input order::

    {"id": "batch_req_<hex>", "custom_id": "r1", "response": {"status_code": 200, "request_id": "...",
     "body": {...}}, "error": null}

A request the server would refuse (a bad body, an unknown model, a prompt too long) gets its HTTP status and
OpenAI error object in ``response``, as OpenAI reports it; a line that is no request at all (not JSON, no
``custom_id``, an unsupported ``method`` or ``url``, a ``body`` that is not an object) gets ``"response": null``
and ``"error": {"code", "message"}``. Nothing aborts the run. ``stream: true`` is refused per line (a batch
returns whole responses).

The engine runs in this process (:class:`~tokenmill.engine.async_llm.AsyncLLM`, the same engine flags as
``tokenmill serve``) and every line is handled by the server's own handlers (built by
:func:`~tokenmill.entrypoints.openai.api_server.build_app`, called without HTTP), so a batch line gets exactly
the response the HTTP server would send. All lines are submitted at once (at most ``--max-concurrency`` in
flight) and the engine batches them; a tqdm progress bar counts finished lines on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import IO, Any

from fastapi import FastAPI, Request
from pydantic import ValidationError
from tokenmill.entrypoints.openai.errors import error_from_exception, validation_error_response
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.errors import InvalidRequestError

logger = logging.getLogger(__name__)

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
DEFAULT_MAX_CONCURRENCY = 256


class _LineError(Exception):
    """A line that is not a request (reported in the line's ``error``, with ``response: null``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _parse(line: str) -> dict[str, Any]:
    try:
        line.encode("utf-8")  # the input is read with surrogateescape: a line of other bytes has lone surrogates
    except UnicodeEncodeError as exc:
        raise _LineError("invalid_json", "the line is not valid UTF-8") from exc
    try:
        entry = json.loads(line)
    except ValueError as exc:
        raise _LineError("invalid_json", f"the line is not valid JSON: {exc}") from exc
    if not isinstance(entry, dict):
        raise _LineError("invalid_request", "the line must be a JSON object")
    return entry


def _never_disconnecting_request(request_id: str) -> Request:
    """A Starlette request for the handlers' disconnect watch: its client never goes away."""
    forever = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await forever.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b"",
             "state": {"request_id": request_id}}
    return Request(scope, receive)


class BatchRunner:
    """Runs batch lines with the handlers of an app made by ``build_app``.

    Args:
        app: the server's app (its ``state`` holds the chat and completion handlers).
    """

    def __init__(self, app: FastAPI) -> None:
        self.handlers: dict[str, tuple[type[Any], Callable[[Any, Request], Awaitable[Any]]]] = {
            CHAT_URL: (ChatCompletionRequest, app.state.serving_chat.create_chat_completion),
            COMPLETIONS_URL: (CompletionRequest, app.state.serving_completion.create_completion),
        }

    async def run_line(self, line: str) -> dict[str, Any]:
        """The output object of one input line (never raises for a bad line)."""
        custom_id: str | None = None
        request_id = f"batch_req_{uuid.uuid4().hex}"
        try:
            entry = _parse(line)
            custom_id = entry.get("custom_id") if isinstance(entry.get("custom_id"), str) else None
            self._check(entry)
            status, body = await self._run(entry, request_id)
        except _LineError as exc:
            return {"id": request_id, "custom_id": custom_id, "response": None,
                    "error": {"code": exc.code, "message": str(exc)}}
        return {"id": request_id, "custom_id": custom_id,
                "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}

    def _check(self, entry: dict[str, Any]) -> None:
        custom_id = entry.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise _LineError("missing_custom_id", "custom_id: required (a non-empty string)")
        method = entry.get("method", "POST")
        if not isinstance(method, str) or method.upper() != "POST":
            raise _LineError("invalid_method", f"method: only POST is supported, got {method!r}")
        if entry.get("url") not in self.handlers:
            raise _LineError("invalid_url", f"url: {entry.get('url')!r} is not supported (supported: "
                                            f"{', '.join(self.handlers)})")
        if not isinstance(entry.get("body"), dict):
            raise _LineError("invalid_body", "body: must be a JSON object (the request)")

    async def _run(self, entry: dict[str, Any], request_id: str) -> tuple[int, dict[str, Any]]:
        model, handler = self.handlers[entry["url"]]
        try:
            body = entry["body"]
            if body.get("stream"):
                raise InvalidRequestError("stream: not supported in a batch (each line gets a whole response)",
                                          param="stream")
            request = model.model_validate(model.check_request_fields(body))
            response = await handler(request, _never_disconnecting_request(request_id))
        except ValidationError as exc:
            invalid = validation_error_response(exc.errors(include_url=False))
            return invalid.status_code, json.loads(bytes(invalid.body))
        except Exception as exc:  # noqa: BLE001 - every failure is reported in the line's response
            status, error = error_from_exception(exc)
            if status >= 500:
                logger.error("batch request %s (%s) failed", request_id, entry["custom_id"], exc_info=exc)
            return status, error
        return response.status_code, json.loads(bytes(response.body))

    async def run(self, lines: Iterable[str], write: Callable[[str], None], max_concurrency: int = 256,
                  progress: bool = True) -> int:
        """Run every non-blank line and ``write`` each output line (with its newline) in input order; returns
        the number of lines run."""
        from tqdm import tqdm

        texts = [line for line in lines if line.strip()]
        limit = asyncio.Semaphore(max(1, max_concurrency))

        async def one(line: str) -> dict[str, Any]:
            async with limit:
                return await self.run_line(line)

        tasks = [asyncio.ensure_future(one(line)) for line in texts]
        with tqdm(total=len(tasks), desc="run-batch", unit="req", disable=not progress, file=sys.stderr) as bar:
            for task in tasks:
                task.add_done_callback(lambda _: bar.update(1))
            try:
                for task in tasks:
                    write(json.dumps(await task, ensure_ascii=False) + "\n")
            finally:
                for task in tasks:
                    task.cancel()
        return len(texts)


# ------------------------------------------------------------------------------------------------- CLI


def add_run_batch_parser(subparsers: argparse._SubParsersAction,
                         add_plugin_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """The ``run-batch`` sub-command: engine flags as ``serve``, plus the handlers' flags."""
    from tokenmill.engine_args import EngineArgs

    parser = subparsers.add_parser(
        "run-batch", help="Run an OpenAI batch file (JSONL) offline.",
        description="Run the requests of an OpenAI batch input file with an in-process engine and write OpenAI "
                    "batch output lines, in input order. Without MODEL, the embedded default model is used.")
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="Model directory (Hugging Face layout), .gguf file or hub id.")
    parser.add_argument("--model", default=None, help="Same as MODEL.")
    parser.add_argument("-i", "--input-file", required=True, metavar="FILE",
                        help="Batch input (JSONL; '-' for stdin).")
    parser.add_argument("-o", "--output-file", required=True, metavar="FILE",
                        help="Batch output (JSONL; '-' for stdout).")
    parser.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY, metavar="N",
                        help=f"Requests in flight at once (default {DEFAULT_MAX_CONCURRENCY}).")
    parser.add_argument("--disable-progress-bar", action="store_true", default=False)
    handlers = parser.add_argument_group("request handling (as tokenmill serve)")
    handlers.add_argument("--chat-template", default=None, metavar="FILE",
                          help="Jinja chat template file (or inline template) replacing the tokenizer's.")
    handlers.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                          help='Allow tool_choice "auto" (with --tool-call-parser).')
    handlers.add_argument("--tool-call-parser", default=None, metavar="NAME", help="How the model writes tool calls.")
    handlers.add_argument("--reasoning-parser", default=None, metavar="NAME",
                          help="Split a reasoning model's thinking into message.reasoning (see docs/reasoning.md).")
    handlers.add_argument("--return-tokens-as-token-ids", action="store_true", default=False,
                          help="Name tokens 'token_id:<id>' in logprobs by default.")
    EngineArgs.add_cli_args(parser)
    add_plugin_args(parser)
    parser.set_defaults(func=run_batch_command)


@contextlib.contextmanager
def _open(path: str, mode: str) -> Iterator[IO[str]]:
    # Input is decoded with surrogateescape, so one line that is not UTF-8 is that line's error, not the run's.
    errors = "surrogateescape" if "r" in mode else "strict"
    if path == "-":
        if "r" in mode:
            yield io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors=errors)
        else:
            yield sys.stdout
        return
    with open(path, mode, encoding="utf-8", errors=errors) as f:
        yield f


def run_batch_command(args: argparse.Namespace) -> int:
    """Run ``tokenmill run-batch``; returns the exit code (1 for a startup error: bad flags, files, model)."""
    from tokenmill.engine_args import EngineArgs

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        print(f"tokenmill run-batch: error: MODEL {args.model_tag!r} and --model {args.model!r} differ",
              file=sys.stderr)
        return 1
    args.model = args.model_tag if args.model_tag is not None else args.model
    args.api_key = None
    try:
        with _open(args.input_file, "r") as f:
            lines = f.read().splitlines()
        engine_args = EngineArgs.from_cli_args(args)
        with _open(args.output_file, "w") as out:
            count = asyncio.run(_run(args, engine_args, lines, out))
    except (OSError, ValueError) as exc:
        logger.debug("run-batch failed", exc_info=True)
        print(f"tokenmill run-batch: error: {exc}", file=sys.stderr)
        return 1
    logger.info("run-batch: %d requests written to %s", count, args.output_file)
    return 0


async def _run(args: argparse.Namespace, engine_args: Any, lines: list[str], out: IO[str]) -> int:
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.entrypoints.openai.api_server import build_app

    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        app = build_app(engine, args)
        try:
            count = await BatchRunner(app).run(lines, out.write, args.max_concurrency,
                                               progress=not args.disable_progress_bar)
        finally:
            app.state.tokenization.shutdown()
        out.flush()
        return count
    finally:
        engine.shutdown()
