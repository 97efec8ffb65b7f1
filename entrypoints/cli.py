"""The ``tokenmill`` command: ``tokenmill serve [MODEL] [flags]``, ``tokenmill run-batch -i IN -o OUT [MODEL]``,
``tokenmill plugins [check NAME]``, ``tokenmill bench ...``, ``tokenmill --version``.

A platform or plugin problem (no platform, two active ones, a detector that raised, a plugin that fails to load)
ends any sub-command with ``tokenmill: error: <what and how to fix it>`` and exit status 1, not a traceback
(``TOKENMILL_LOGGING_LEVEL=DEBUG`` logs the traceback too).

Each sub-command is one sub-parser whose ``func`` runs it and returns the exit code; further sub-commands
(``tokenmill bench ...``) are added in :func:`build_parser` the same way.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from tokenmill import __version__
from tokenmill.process_exit import exit_without_teardown

LOG_LEVEL_ENV = "TOKENMILL_LOGGING_LEVEL"


def _add_plugin_cli_args(parser: argparse.ArgumentParser) -> None:
    """Let installed plugins add their flags (hook ``tokenmill_add_cli_args``). Leniently: a plugin that fails to
    load must not break ``tokenmill plugins`` (which reports it) or ``--help``; commands that need the plugins
    raise the load error when they use them."""
    from tokenmill.plugins.manager import get_plugin_manager, lenient_loading

    with lenient_loading():
        get_plugin_manager().hook.tokenmill_add_cli_args(parser=parser)


def _add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    from tokenmill.engine_args import EngineArgs
    from tokenmill.entrypoints.openai.cli_args import add_server_args

    parser = subparsers.add_parser(
        "serve",
        help="Serve a model over the OpenAI-compatible HTTP API.",
        description="Start the OpenAI-compatible API server. Without MODEL, the embedded default model "
                    "(SmolLM2-135M-Instruct) is served.",
    )
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="Model directory (Hugging Face layout), .gguf file or hub id.")
    parser.add_argument("--model", default=None, help="Same as MODEL.")
    add_server_args(parser)
    EngineArgs.add_cli_args(parser)
    _add_plugin_cli_args(parser)
    parser.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.openai.launcher import run_server
    from tokenmill.model_loader.default_model import DefaultModelMissingError

    from tokenmill.engine.core_client import EngineCoreStartError
    from tokenmill.plugins import load_general_plugins

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise SystemExit(f"tokenmill serve: error: MODEL {args.model_tag!r} and --model {args.model!r} differ")
    args.model = args.model_tag if args.model_tag is not None else args.model
    try:
        load_general_plugins("api_server")
        return run_server(args)
    except (OSError, ValueError, DefaultModelMissingError, EngineCoreStartError) as exc:
        # Bad input from the user (model path, port in use, flag value): a message, not a traceback.
        logging.getLogger("tokenmill.serve").debug("startup failed", exc_info=True)
        print(f"tokenmill serve: error: {exc}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill: LLM inference and serving.")
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve_parser(subparsers)
    from tokenmill.entrypoints.bench import add_bench_parser
    from tokenmill.entrypoints.plugins_cli import add_plugins_parser

    add_bench_parser(subparsers, _add_plugin_cli_args)
    from tokenmill.entrypoints.openai.run_batch import add_run_batch_parser

    add_run_batch_parser(subparsers, _add_plugin_cli_args)
    add_plugins_parser(subparsers)
    return parser


def _configure_logging() -> None:
    level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                            datefmt="%m-%d %H:%M:%S")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tokenmill`` command line; returns the exit code."""
    from tokenmill.platforms import PlatformError
    from tokenmill.plugins import PluginLoadError

    argv = list(argv) if argv is not None else sys.argv[1:]
    if argv[:1] == ["serve"] and not {"-h", "--help"} & set(argv):
        from tokenmill.engine.core_prestart import prestart_engine_core

        prestart_engine_core()  # its imports overlap ours and the config read
    try:
        parser = build_parser()  # plugins add their flags here: a broken plugin is reported below
        args = parser.parse_args(argv)
        args.command_argv = argv
        if getattr(args, "func", None) is None:
            parser.print_help()
            return 2
        _configure_logging()
        if args.command not in ("serve", "plugins"):  # serve initialises as "api_server"; plugins only reports
            from tokenmill.plugins import load_general_plugins

            load_general_plugins("cli")
        return int(args.func(args) or 0)
    except (PlatformError, PluginLoadError) as exc:
        logging.getLogger("tokenmill.cli").debug("platform or plugin error", exc_info=True)
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 1


def console_main() -> NoReturn:
    """The ``tokenmill`` console script: :func:`main`, then an exit that skips the interpreter's teardown of torch
    (a stopped server exits about a second sooner; :mod:`tokenmill.process_exit`). An exception leaves the usual
    way, with its traceback and status."""
    exit_without_teardown(main())


if __name__ == "__main__":
    console_main()
