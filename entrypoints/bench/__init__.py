"""``tokenmill bench``: throughput, latency, serve and sweep benchmarks.

``tokenmill bench throughput``, ``latency``, ``structured`` (structured-output cost) and ``embed`` (embedding
throughput against sentence-transformers) run the engine in this process (every engine flag of
``tokenmill serve`` applies, from :meth:`tokenmill.engine_args.EngineArgs.add_cli_args`); ``serve`` loads any
running OpenAI-compatible server; ``sweep`` records throughput and step time against batch size for
``benchmarks/plot.py``. Each prints a table and, with ``--json FILE``, writes every figure with the machine
and the command line. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

from tokenmill.entrypoints.bench.common import AddArgs

__all__ = ["add_bench_parser"]


def add_bench_parser(subparsers: argparse._SubParsersAction, add_extra_args: AddArgs | None = None) -> None:
    """Register ``bench`` and its sub-commands on the ``tokenmill`` parser.

    Args:
        subparsers: the top-level parser's sub-parsers.
        add_extra_args: adds plugin flags to the engine benchmarks' parsers (as ``serve`` has them).
    """
    from tokenmill.entrypoints.bench import embed, latency, serve, structured, sweep, throughput

    parser = subparsers.add_parser("bench", help="Benchmark tokenmill (throughput, latency, serve, sweep, structured, embed).",
                                   description="Benchmarks; each prints a table and can write JSON (--json).")
    bench_sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    throughput.add_parser(bench_sub, add_extra_args)
    latency.add_parser(bench_sub, add_extra_args)
    serve.add_parser(bench_sub)
    sweep.add_parser(bench_sub, add_extra_args)
    structured.add_parser(bench_sub, add_extra_args)
    embed.add_parser(bench_sub, add_extra_args)
    parser.set_defaults(func=lambda _args: _print_help(parser))


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2
