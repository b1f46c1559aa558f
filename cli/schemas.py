"""`goodput schemas [--out FILE]` — the JSON Schema document of every goodput.api message (each
request's and answer's, and which endpoint takes which), as the API serves it live on
goodput.api.schemas: printed, or written to FILE. No stack is needed: it is made from the code."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "schemas", help="the JSON Schema of every goodput.api request and answer, as goodput.api.schemas serves it"
    )
    parser.add_argument("--out", metavar="FILE", help="write the document to FILE instead of printing it")
    parser.set_defaults(func=_schemas)


def _schemas(args: argparse.Namespace) -> int:
    from services.api.endpoints import schemas

    document = json.dumps(schemas(), indent=2, sort_keys=True)
    if args.out is None:
        print(document)
    else:
        Path(args.out).write_text(document + "\n")
    return 0
