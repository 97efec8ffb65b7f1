"""The HTTP-server flags of ``tokenmill serve`` (engine flags come from ``EngineArgs.add_cli_args``)."""

from __future__ import annotations

import argparse

from tokenmill.entrypoints.openai.api_server import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT
from tokenmill.entrypoints.openai.middleware import DEFAULT_MAX_BODY_BYTES

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``server`` flag group to ``parser`` and return it."""
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST,
                        help=f"Address to listen on (default {DEFAULT_HOST}: local connections only; "
                             "use 0.0.0.0 to accept connections from the network).")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"Port (default {DEFAULT_PORT}).")
    server.add_argument("--api-key", default=None,
                        help="Require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize "
                             f"(also ${API_KEY_ENV}).")
    server.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template file (or inline template) replacing the tokenizer's.")
    server.add_argument("--return-tokens-as-token-ids", action="store_true", default=False,
                        help="Name tokens 'token_id:<id>' in logprobs unless a request says otherwise with "
                             "return_tokens_as_token_ids (vLLM's flag).")
    server.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                        help="Enable CORS for these origins: comma-separated or a JSON list, '*' for any "
                             "(default: CORS off).")
    server.add_argument("--allowed-methods", default=None, metavar="METHODS",
                        help="CORS: allowed methods (default '*'; only with --allowed-origins).")
    server.add_argument("--allowed-headers", default=None, metavar="HEADERS",
                        help="CORS: allowed request headers (default '*'; only with --allowed-origins).")
    server.add_argument("--allow-credentials", action="store_true", default=False,
                        help="CORS: allow credentials (cookies, Authorization) in cross-origin requests.")
    server.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                        help=f"Refuse larger request bodies with 413 (default {DEFAULT_MAX_BODY_BYTES}, 32 MiB).")
    server.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                        help='Allow tool_choice "auto": the model\'s text is read for tool calls with '
                             "--tool-call-parser.")
    server.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="How the model writes tool calls (built in: hermes, llama3_json, mistral, pythonic; "
                             "plugins add more through the tokenmill_register_tool_parsers hook).")
    server.add_argument("--reasoning-parser", default=None, metavar="NAME",
                        help="Split a reasoning model's thinking from its answer into message.reasoning (built in: "
                             "deepseek_r1, granite, mistral, qwen3; plugins add more through the "
                             "tokenmill_register_reasoning_parsers hook). See docs/reasoning.md.")
    server.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                        help="uvicorn's log level (default info).")
    server.add_argument("--disable-uvicorn-access-log", action="store_true", default=False,
                        help="Do not log one line per HTTP request.")
    server.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) to load at start-up, each served as model NAME; "
                             "also as JSON '{\"name\": ..., \"path\": ...}'. Needs --enable-lora.")
    return parser
