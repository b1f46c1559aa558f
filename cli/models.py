"""`goodput models ...` — throughput-model reports and the built-in model zoo."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("models", help="fit, validate and package the throughput models")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    report = actions.add_parser("report", help="fit every (model, GPU type) of a reference folder")
    report.add_argument("--reference", help="reference folder (default: $GOODPUT_REFERENCE/sia)")
    report.add_argument("--out", default="models-report.json")
    report.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    raise NotImplementedError
