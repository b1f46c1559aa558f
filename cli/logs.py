"""`goodput logs JOB [--rank N] [--follow]` — what a job printed (each rank's stdout and stderr, as
its node agents stored them), read through the user API (goodput.api.logs) as the login's: another
team's job is unknown to it."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import TextIO

import msgspec
import nats.errors

from cli.submit import API_UNANSWERED, add_connection_arguments, ask_on
from shared import credentials
from shared.text import printable

POLL_S = 1.0  # --follow: how often it asks for new lines
SETTLE_S = 2.0  # --follow: once the job has ended, its agents' last lines are stored within this
NO_LINES = (
    "no output of job {job}{rank} is stored: it has printed nothing yet, its lines aged out, or it runs "
    "on simulated executors, whose jobs run no code"
)
NO_LINES_ENDED = (
    "no output of job {job}{rank} is stored, and it has ended: it printed nothing, its lines aged out, it "
    "ran on simulated executors (whose jobs run no code), or it was refused before it ran; `goodput status "
    "{job}` says how it ended"
)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "logs", help="what a job printed: each rank's stdout and stderr (all ranks by default, each line marked)"
    )
    parser.add_argument("id", help="the job's id")
    parser.add_argument(
        "--rank",
        type=_rank,
        help="only this rank's lines (a number; 'profile': its profiling runs'; 'env': the installer of its requirements')",
    )
    parser.add_argument(
        "-f", "--follow", action="store_true", help="keep printing new lines until the job ends (or Ctrl-C)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object a line: rank, time, stream, text")
    add_connection_arguments(parser)
    parser.set_defaults(func=_logs)


def _rank(text: str) -> int | str:
    from shared.subjects import ENVIRONMENT_RANK, PROFILE_RANK

    if text in (PROFILE_RANK, ENVIRONMENT_RANK):
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a rank: a number from 0, {PROFILE_RANK!r} or {ENVIRONMENT_RANK!r}"
    )


def _logs(args: argparse.Namespace) -> int:
    from nats.micro.request import ServiceError

    from shared.schema.logs import LogsRequest
    from shared.submissions import ID_RULES

    try:
        request = msgspec.convert({"id": args.id, "rank": args.rank}, LogsRequest)
    except msgspec.ValidationError:
        raise ValueError(f"{args.id!r} is not a job id: {ID_RULES}") from None
    options = credentials.connect_options(credentials.from_args(args))  # ValueError: a missing file
    try:
        asyncio.run(show(args.server, request, args.follow, args.json, **options))
    except ServiceError as error:  # the API's reason: e.g. no job of this login's
        raise ValueError(error.description) from None
    except nats.errors.NoRespondersError:
        raise ValueError(API_UNANSWERED.format(server=credentials.redact(args.server))) from None
    except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
        raise ValueError(credentials.unreachable(args.server, exc, options)) from None
    return 0


async def show(server: str, request, follow: bool, as_json: bool, out: TextIO = sys.stdout, **options) -> None:
    """Print the job's lines from the oldest kept; with `follow`, on as they come until it has ended
    (and its last lines, stored by then, are printed)."""
    from shared import subjects
    from shared.bus import Bus
    from shared.schema.logs import LogsPage

    bus = await Bus.connect_once(server, "goodput-logs", **options)
    try:
        marked = request.rank is None  # several ranks: each line says whose
        ended_at = None
        printed = 0
        while True:
            page = await ask_on(bus, server, subjects.API_LOGS, request, LogsPage)
            for line in page.lines:
                print(_shown(line, marked, as_json), file=out)
            printed += len(page.lines)
            out.flush()
            request = msgspec.structs.replace(request, after=page.next)
            if page.more:
                continue
            if not follow or (ended_at is not None and asyncio.get_running_loop().time() - ended_at >= SETTLE_S):
                if not printed:  # an empty answer is not an error, but it should not look like a hang
                    rank = "" if request.rank is None else f" (rank {request.rank})"
                    print((NO_LINES_ENDED if page.end else NO_LINES).format(job=request.id, rank=rank), file=sys.stderr)
                return
            if page.end and ended_at is None:
                ended_at = asyncio.get_running_loop().time()
            await asyncio.sleep(POLL_S)
    finally:
        await bus.close()


def _shown(line, marked: bool, as_json: bool) -> str:
    """A line as printed: as stored with --json (escaped there), else `printable` (no escape sequence
    or control of the job's drives the terminal)."""
    if as_json:
        return json.dumps(msgspec.to_builtins(line))
    return printable(f"[{line.rank}] {line.text}" if marked else line.text)
