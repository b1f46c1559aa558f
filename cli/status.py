"""`goodput status` — the jobs known to a running goodput (a login's own; every job for the
operator), and its live run: its state, rounds so far and policy leader."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from cli.output import tally
from cli.submit import add_connection_arguments
from shared import credentials
from shared.schema.records import JOB_STATES


def register(sub: argparse._SubParsersAction) -> None:
    status = sub.add_parser("status", help="jobs known to a running goodput, and its live run")
    status.add_argument("ids", nargs="*", metavar="ID", help="show these jobs only, each in full")
    status.add_argument(
        "--json",
        action="store_true",
        help='one JSON document: {"jobs": [...], "run": {...}} (with one ID: that job\'s)',
    )
    status.add_argument(
        "--teams",
        action="store_true",
        help="each team's guarantee, use and lending per GPU type (your team's; every team for the operator)",
    )
    add_connection_arguments(status)
    status.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    import json

    import msgspec

    from cli.job_view import job_lines, job_table
    from shared.text import printable

    if args.teams:
        from cli.submit import teams_status

        return teams_status(args)
    server = args.server
    options = credentials.connect_options(credentials.from_args(args))  # ValueError: a missing file
    try:
        statuses, policy = asyncio.run(_query(server, args.ids, **options))
    except Exception as exc:  # noqa: BLE001 - any failure to reach the stack is the same answer
        raise ValueError(credentials.unreachable(server, exc, options)) from None
    jobs = [msgspec.to_builtins(status) for status in statuses]
    if args.ids:
        known: dict = {}
        for j in jobs:  # the first listed under an id: the job, before refusals of other bodies under it
            known.setdefault(j["id"], j)
        if missing := [i for i in args.ids if i not in known]:
            raise ValueError(f"no job of yours is known to the executors as {', '.join(map(repr, missing))}")
        jobs = [known[i] for i in dict.fromkeys(args.ids)]
    run = run_document(policy)
    if args.json:
        print(json.dumps(jobs[0] if len(args.ids) == 1 else {"jobs": jobs, "run": run}, indent=2))
        return 0
    print(tally("job", JOB_STATES, [j["state"] for j in jobs]))
    idle = run["state"] == "running" and not run["jobs"] and not run["reason"]
    print(
        printable(
            f"live run: {run['state']}"
            + (f", {run['round']} round{'s' * (run['round'] != 1)} so far" if run.get("round") is not None else "")
            + (f" ({run['reason']})" if run["reason"] else "")
            + (" (idle: no active job; the rounds go on with the next submission)" if idle else "")
            + f"; policy leader: {run['leader'] or 'none'}"
        )
    )
    # A job's reason holds its own stderr: each line is printed as `printable` makes it (shared/text.py).
    for row in job_table(jobs):
        print(printable(row))
    for job in jobs if args.ids else ():
        lines = job_lines(job)
        if lines and len(jobs) > 1:
            print(printable(f"    {job['id']}:"))
        for line in lines:
            print(f"      {printable(line)}")
    return 0


RUN_KEYS = ("id", "state", "reason", "round", "now_s", "jobs", "leader")  # `goodput status --json`'s run


def run_document(policy) -> dict:
    """The live run (and the policy leader) as `goodput status --json` shows it."""
    if policy is None:
        return dict.fromkeys(RUN_KEYS) | {"state": "unknown", "reason": "no policy replica answers", "jobs": 0}
    if policy.run is None:
        return dict.fromkeys(RUN_KEYS) | {
            "state": "none",
            "reason": "no live run yet",
            "jobs": 0,
            "leader": policy.leader,
        }
    return {key: getattr(policy.run, key) for key in RUN_KEYS[:-1]} | {"leader": policy.leader}


async def _query(server: str, ids: list[str], **options):
    """The login's jobs (every job, for the operator), page by page through the user API, each of
    `ids` as `goodput.api.job` tells it (with the refusals of other bodies under its id) first; and
    the policy's status."""
    import nats.errors
    from nats.micro.request import ServiceError

    from shared import subjects
    from shared.bus import Bus
    from shared.schema.api import MAX_PAGE, JobRequest, JobsPage, JobsRequest, JobStatus
    from shared.schema.base import Ack
    from shared.schema.runs import PolicyStatus

    bus = await Bus.connect_once(server, "goodput-status", **options)
    try:
        statuses, offset = [], 0
        for job_id in dict.fromkeys(ids):
            with contextlib.suppress(ServiceError):  # none of the login's: the listing says so
                statuses.append(await bus.request(subjects.API_JOB, JobRequest(job_id), JobStatus, timeout=10))
        while offset is not None:
            page = await bus.request(
                subjects.API_JOBS, JobsRequest(offset=offset, limit=MAX_PAGE), JobsPage, timeout=10
            )
            statuses += page.jobs
            offset = page.next_offset
        try:
            policy = await bus.request(subjects.POLICY_STATUS, Ack(), PolicyStatus, timeout=5)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            policy = None  # the jobs are still worth showing
        return statuses, policy
    finally:
        await bus.close()
