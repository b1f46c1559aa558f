"""`goodput` — the one command-line entry point. Each subcommand lives in its own module with a
`register(subparsers)` function that adds its parser and sets `func`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Subcommand modules under cli/, in help order.
COMMANDS = [
    "models",
    "timeslice",
    "autoscale",
    "simulate",
    "bound",
    "interference",
    "workload",
    "submit",
    "logs",
    "explain",
    "schemas",
    "up",
    "status",
    "nodes",
    "dashboard",
    "login",
    "teams",
    "chaos",
]


class _Version(argparse.Action):
    """`goodput --version`: the version the services report (shared.runner.VERSION, pyproject's),
    looked up only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from shared.runner import VERSION

        print(f"{parser.prog} {VERSION}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="goodput",
        description="Goodput-optimised, heterogeneity-aware scheduler for deep-learning training clusters.",
    )
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:  # a reason may quote a job's own text: printable
        from shared.text import printable

        print(f"goodput {args.command}: error: {printable(str(exc), lines=True)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `goodput status | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except KeyboardInterrupt:
        print(f"goodput {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
