"""``tokenmill plugins``: what plugins are installed, what was chosen and why; ``tokenmill plugins check NAME``:
the conformance kit.

``tokenmill plugins [--json] [--model PATH]`` never fails because of a broken plugin: it reports it (with the
end of its traceback) and the rest. ``tokenmill plugins check NAME`` exits 0 only when every contract item
passes (skipped items, for features the platform does not claim, are not failures), 1 when one fails, 2 on a
usage error (unknown platform or item).
"""

from __future__ import annotations

import argparse
import json
import sys


def add_plugins_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plugins",
        help="List plugins, platforms, backends and architectures; `plugins check NAME` runs the conformance kit.",
        description="Every distribution with a tokenmill entry point and the hooks it implements, every platform "
                    "tried and why it is active or declined, what is selected and why, and the registered "
                    "architectures, attention backends, custom ops, quantization methods and tool parsers.",
    )
    parser.add_argument("--json", action="store_true", help="Print JSON instead of text.")
    parser.add_argument("--model", default=None, help="Also show which class serves this model's architecture.")
    parser.set_defaults(func=_run_list)
    sub = parser.add_subparsers(dest="plugins_command", metavar="COMMAND")
    check = sub.add_parser(
        "check",
        help="Run the conformance kit on a platform plugin.",
        description="Take a platform plugin through tokenmill's contract (detection, memory and KV sizing, "
                    "dtypes, the attention backend against a float64 reference, KV-cache slot mapping, device "
                    "graphs, custom ops, quantization, an end-to-end greedy run). Exit status 0 only when every "
                    "item passes.",
    )
    check.add_argument("platform", metavar="NAME", help="Platform name (or platform entry-point name).")
    check.add_argument("--device", choices=["auto", "real", "emulate"], default="auto",
                       help="auto: the real device when the plugin's detect() is active here, else an emulated one "
                            "on the host CPU (Triton interpreted, device graphs emulated).")
    check.add_argument("--attention-backend", default=None,
                       help="Check this registered attention backend instead of the platform's choice.")
    check.add_argument("--only", nargs="+", default=None, metavar="ITEM", help="Run only these contract items.")
    check.add_argument("--json", action="store_true", help="Print the report as JSON.")
    check.add_argument("-v", "--verbose", action="store_true", help="Show what every item checked.")
    check.set_defaults(func=_run_check)


def _run_list(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.plugins_diagnosis import collect_diagnosis, format_diagnosis

    report = collect_diagnosis(model=args.model)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_diagnosis(report))
    return 0


def _run_check(args: argparse.Namespace) -> int:
    from tokenmill.conformance import CONTRACT_ITEMS, run_conformance
    from tokenmill.platforms import UnknownPlatformError

    if args.only:
        unknown = [i for i in args.only if i not in CONTRACT_ITEMS]
        if unknown:
            print(f"tokenmill plugins check: error: unknown contract item(s) {', '.join(unknown)}; items: "
                  f"{', '.join(CONTRACT_ITEMS)}", file=sys.stderr)
            return 2

    def progress(result: object) -> None:
        if not args.json:
            print(f"  {result.status.upper():<5}{result.item}", file=sys.stderr, flush=True)  # type: ignore[attr-defined]

    try:
        report = run_conformance(args.platform, device=args.device, attention_backend=args.attention_backend,
                                 items=args.only, on_result=progress)
    except UnknownPlatformError as exc:
        print(f"tokenmill plugins check: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print(report.format(verbose=args.verbose))
    return 0 if report.ok else 1
