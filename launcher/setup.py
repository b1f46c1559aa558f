"""The operator's one-shot setup: every stream, KV bucket and durable consumer of the storage plan
(shared/storage.py), created or brought to the plan, and the team file stored in its KV bucket. No
service may create them.

`goodput up` and the embedded stacks run it before they start the services (`provision_now`); the
manifests' and compose's `live-run` one-shot runs it first (launcher/live_run.py), the manifests'
with the team file of their ConfigMap (`--teams FILE --cluster CLUSTER`); `python -m launcher.setup`
runs it alone, with the operator's credentials (shared/credentials.py).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
from types import EllipsisType
from typing import Any

from shared import credentials, storage, subjects
from shared.bus import Bus
from shared.bus.connection import DEFAULT_SERVER, SERVER_ENV
from shared.schema.teams import TeamFile


async def store_teams(bus: Bus, teams: TeamFile | None) -> None:
    """The operator's team file into its KV bucket, which the policy reads at every round and the
    API to answer; None: no teams (the key deleted). Check it against the cluster first
    (shared.teams.resolve): this stores what it is given."""
    bucket = await storage.open_kv(bus, subjects.TEAMS_BUCKET, TeamFile)
    if teams is not None:
        await bucket.put(subjects.TEAMS_KEY, teams)
    elif await bucket.get(subjects.TEAMS_KEY) is not None:
        await bucket.delete(subjects.TEAMS_KEY)


async def provision(
    server: str,
    lease_ttl_s: float = storage.LEASE_TTL_S,
    teams: TeamFile | None | EllipsisType = ...,
    **options: Any,
) -> None:
    """Set up the storage; then store `teams` (None: no teams; left out: the stored one as it is)."""
    bus = await Bus.connect_once(server, "goodput-setup", **options)
    try:
        await storage.provision(bus, lease_ttl_s)
        if teams is not ...:
            await store_teams(bus, teams)
    finally:
        await bus.close()


def provision_now(
    server: str,
    lease_ttl_s: float = storage.LEASE_TTL_S,
    teams: TeamFile | None | EllipsisType = ...,
    **options: Any,
) -> None:
    """`provision`, finished before this returns, from synchronous code (even inside an event loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, provision(server, lease_ttl_s, teams, **options)).result()


def checked_teams(path: str, cluster: str) -> TeamFile:
    """The team file at `path`, checked against `cluster` (a preset or a cluster file): ValueError
    with the reason for a missing or invalid one."""
    from shared.cluster import load_cluster
    from shared.teams import load_team_file, resolve

    teams = load_team_file(path)
    resolve(teams, load_cluster(cluster))
    return teams


def refuse_policy_without_teams(spec: str, teams: TeamFile, cluster: str, options: dict | None = None) -> None:
    """ValueError when the policy `spec` (NAME or NAME:KEY=VALUE,...; `options` on top) cannot
    honour the teams' guarantees and borrowing limits (its `honours_teams`), as the policy service
    would refuse them at its first round."""
    from policies.base import check_honours_teams, make_policy, policy_spec
    from shared.cluster import load_cluster
    from shared.teams import resolve

    name, given = policy_spec(spec)
    check_honours_teams(make_policy(name, **{**given, **(options or {})}), resolve(teams, load_cluster(cluster)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.setup", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server",
        default=os.environ.get(SERVER_ENV, DEFAULT_SERVER),
        help=f"NATS URL (default: ${SERVER_ENV}, else {DEFAULT_SERVER})",
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=storage.LEASE_TTL_S,
        help="seconds the policy leader's lease lasts unrenewed: a standby takes over within it (default: %(default)s)",
    )
    parser.add_argument(
        "--teams",
        help="the team file (YAML) to store, checked against --cluster first (default: the stored one stays)",
    )
    parser.add_argument("--cluster", help="the cluster the services run (preset or YAML file): needed with --teams")
    parser.add_argument(
        "--policy",
        help="with --teams: the live run's policy (NAME or NAME:KEY=VALUE,...), refused unless it honours teams",
    )
    credentials.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.lease_ttl <= 0:
        parser.error("--lease-ttl must be positive")
    if args.teams and not args.cluster:
        parser.error("--teams needs --cluster: the team file is checked against the cluster's GPUs")
    try:
        teams = checked_teams(args.teams, args.cluster) if args.teams else ...
        if args.teams and args.policy:
            refuse_policy_without_teams(args.policy, teams, args.cluster)
        options = credentials.connect_options(credentials.from_args(args))
    except ValueError as error:
        parser.error(str(error))
    asyncio.run(provision(args.server, args.lease_ttl, teams, **options))
    print(
        f"storage ready on {credentials.redact(args.server)}: {len(storage.STREAMS)} streams, "
        f"{len(storage.BUCKETS)} KV buckets, {len(storage.CONSUMERS)} consumers, "
        f"at most {storage.total_bytes() / storage.GIB:.1f} GiB"
        + (f"; teams stored: {', '.join(teams.teams)}" if isinstance(teams, TeamFile) else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
