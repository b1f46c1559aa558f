"""`goodput explain ID [--rounds N] [--json]` — why a job has what it has, in plain sentences, from the
decisions the policy leader recorded for it (goodput.api.explain), read as the login's: another team's
job is unknown to it, and the other jobs a sentence names are named by their team only unless they
are the login's team's (its own, for a login without a team)."""

from __future__ import annotations

import argparse
import json

import msgspec

from cli.submit import _call, add_connection_arguments
from shared.text import printable


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "explain",
        help="why a job has what it has: waiting for whom, shrunk or moved for what, predicted against measured",
    )
    parser.add_argument("id", help="the job's id")
    parser.add_argument(
        "--rounds", type=int, default=50, metavar="N", help="read its last N recorded decisions (1 to 500; default 50)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="the answer as one JSON document: sentences and the decisions they come from",
    )
    add_connection_arguments(parser)
    parser.set_defaults(func=_explain)


def _explain(args: argparse.Namespace) -> int:
    from shared import subjects
    from shared.schema.decisions import ExplainRequest, Explanation
    from shared.submissions import ID_RULES

    if not 1 <= args.rounds <= 500:
        raise ValueError(f"--rounds {args.rounds}: from 1 to 500")
    try:
        request = msgspec.convert({"id": args.id, "rounds": args.rounds}, ExplainRequest)
    except msgspec.ValidationError:
        raise ValueError(f"{args.id!r} is not a job id: {ID_RULES}") from None
    answer = _call(args, subjects.API_EXPLAIN, request, Explanation)
    if args.json:
        print(json.dumps(msgspec.to_builtins(answer), indent=2))
        return 0
    print(printable(f"{answer.id}: {answer.state}"))
    for sentence in answer.sentences:
        print(f"  {printable(sentence)}")  # a job's own error text may be in it
    return 0
