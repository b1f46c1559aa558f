"""`goodput teams apply FILE`, `goodput teams show` — the operator's: the teams of a `goodput up`.

A team file (shared/teams.py) names each team's guaranteed GPUs per type, what more it may borrow
and its weight. `goodput up --teams FILE` starts with one; `apply` changes it while the stack serves:
the file is checked against the stack's cluster (the one `goodput up` recorded in DATA/cluster.yaml)
and, when the live run's policy honours teams, stored in the teams' KV bucket, where the policy reads
it at its next round; then copied to DATA/teams.yaml (the file in force: a file removed or edited
after changes nothing until it is applied again), and each new team is given its own login,
DATA/teams/TEAM.env, which the server takes in at once. An invalid file is refused with the reason,
and nothing changes. A team taken out of the file keeps its login (`goodput login remove TEAM`
forgets it) and its jobs, which go on as DEFAULT_TEAM's would.

Without a stack serving DATA, `apply` checks the file, makes the logins and leaves the file for the
next `goodput up` on DATA to store.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from shared import credentials

CLUSTER_FILE = "cluster.yaml"  # under the data folder: the cluster `goodput up` serves, for `teams apply`


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("teams", help="the operator's: the teams of a goodput up, their quotas and logins")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    apply = actions.add_parser(
        "apply", help="check a team file against the stack's cluster and put it in force from the next round"
    )
    apply.add_argument("file", type=Path, help="the team file (YAML: teams: NAME: {quota, borrow, weight})")
    show = actions.add_parser("show", help="the team file in force, against the stack's cluster")
    for action in (apply, show):
        action.add_argument(
            "--data",
            type=Path,
            default=credentials.DEFAULT_DATA,
            help="goodput up's data folder (default: %(default)s)",
        )
    parser.set_defaults(func=_teams)


def record_cluster(data: Path, cluster: str) -> None:
    """Keep the cluster `goodput up` serves in DATA (a preset's nodes, or a cluster file's), so that
    `teams apply` checks a team file against it."""
    import yaml

    from shared.cluster import PRESETS, load_cluster
    from shared.permissions import write_private

    if cluster in PRESETS:
        name, nodes = cluster, PRESETS[cluster]
    else:
        path = Path(cluster)
        spec = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
        name, nodes = load_cluster(cluster).name, spec["nodes"]
    write_private(data / CLUSTER_FILE, yaml.safe_dump({"name": name, "nodes": nodes}, sort_keys=False))


def recorded_cluster(data: Path):
    """The cluster the `goodput up` on DATA serves (ValueError when it has not recorded one)."""
    from shared.cluster import load_cluster

    path = data / CLUSTER_FILE
    if not path.is_file():
        raise ValueError(
            f"{data} is no goodput up's data folder (no {path}): start one with `goodput up --data {data}`"
        )
    return load_cluster(str(path))


def _teams(args: argparse.Namespace) -> int:
    return _apply(args) if args.action == "apply" else _show(args)


def _apply(args: argparse.Namespace) -> int:
    from launcher.nats import SECRETS, TEAM_FILE, Access, reload, serving_pid
    from shared.bus.connection import DEFAULT_SERVER, SERVER_ENV
    from shared.permissions import write_private
    from shared.teams import load_team_file, resolve

    data: Path = args.data
    cluster = recorded_cluster(data)  # ValueError: no `goodput up` has served DATA
    teams = load_team_file(args.file)
    resolve(teams, cluster)  # ValueError with the reason: nothing has changed
    text = args.file.read_text()
    user_env = data / credentials.USER_ENV
    connection = credentials.read_env(user_env) if user_env.is_file() else {}
    url = connection.get(SERVER_ENV, DEFAULT_SERVER)
    access = Access(data / SECRETS) if (data / SECRETS).is_dir() else None
    if access is not None:
        problems = access.team_login_problems(teams.teams)
        if problems:
            raise ValueError("; ".join(problems))
    before = load_team_file(data / TEAM_FILE).teams if (data / TEAM_FILE).is_file() else {}
    left_out = [team for team in before if team not in teams.teams]
    serving = serving_pid(data) is not None
    if serving:
        secured = access is not None and "GOODPUT_NATS_USER" in connection
        options = credentials.connect_options(environ=access.env("operator")) if secured else {}
        asyncio.run(_store(url, options, teams, str(data / CLUSTER_FILE)))
    write_private(data / TEAM_FILE, text)
    made = access.add_team_logins(teams.teams, url) if access is not None else []
    if made and serving:
        reload(data, access)
        asyncio.run(_taken(access, made))
    print(
        f"teams {', '.join(teams.teams)} on cluster {cluster.name}: "
        + ("in force from the next round" if serving else f"taken in at the next `goodput up --data {data}`")
    )
    for team in made:
        path = access.teams_folder / f"{team}.env"
        print(f"  new team {team}: its login {path} (readable by you only; export {credentials.LOGIN_ENV}={path})")
    for team in left_out:
        print(
            f"  team {team} is left out: its login and its jobs go on as the default team's (no guarantee; "
            f"they borrow what is idle); `goodput login remove {team}` forgets the login"
        )
    return 0


async def _store(url: str, options: dict, teams, cluster: str) -> None:
    """Store the team file for the policy's next round, unless the live run's policy cannot honour teams."""
    from launcher.setup import refuse_policy_without_teams, store_teams
    from shared import storage, subjects
    from shared.bus import Bus
    from shared.schema.runs import RunCheckpoint

    try:
        bus = await Bus.connect_once(url, "goodput-teams", **options)
    except Exception as error:  # noqa: BLE001 - any failure to reach the stack is the same answer
        raise ValueError(credentials.unreachable(url, error, options)) from None
    try:
        live = await (await storage.open_kv(bus, subjects.RUNS_BUCKET, RunCheckpoint)).get(subjects.LIVE_RUN)
        if live is not None:
            request = live.value.request
            refuse_policy_without_teams(request.policy, teams, cluster, dict(request.policy_options))
        await refuse_held_names(bus, teams)
        await store_teams(bus, teams)
    finally:
        await bus.close()


async def refuse_held_names(bus, teams) -> None:
    """ValueError when jobs of the default team hold ids that begin with a team's name and a dot:
    within the cluster those are that team's ids (`shared.teams.scoped_id`), so the team could
    neither use them nor be told why without learning of the default team's jobs."""
    from shared import subjects
    from shared.lifecycle import JobState
    from shared.schema.records import JobRecords, JobsQuery

    for team in teams.teams:
        query = JobsQuery(f"{team}.", team=subjects.DEFAULT_TEAM)
        records = (await bus.request(subjects.RECORDS, query, JobRecords, timeout=10)).jobs
        held = [r for r in records if r.state != JobState.REJECTED]  # a refused submission holds no id
        if held:
            names = ", ".join(record.name for record in held[:3])
            raise ValueError(
                f"team {team}: jobs of the default team hold ids beginning with {team}. ({names}); within "
                "the cluster those are the team's own ids: choose another name for the team, or let those "
                "jobs end and age out first"
            )


async def _taken(access, teams: list[str]) -> None:
    """Wait until the server takes each new team's login."""
    from launcher.nats import taken

    for team in teams:
        environ = credentials.read_env(access.teams_folder / f"{team}.env")
        try:
            connection = await taken(environ["GOODPUT_NATS_URL"], credentials.connect_options(environ=environ))
        except RuntimeError as error:
            raise ValueError(str(error)) from None
        await connection.close()


def _show(args: argparse.Namespace) -> int:
    from launcher.nats import SECRETS, TEAM_FILE, Access
    from shared.hardware import hardware_name
    from shared.teams import load_team_file, resolve

    path = args.data / TEAM_FILE
    if not path.is_file():
        print(f"no teams: every job is the default team's ({path} is not there; `goodput teams apply FILE`)")
        return 0
    cluster = recorded_cluster(args.data)
    teams = resolve(load_team_file(path), cluster)
    logins = Access(args.data / SECRETS).teams() if (args.data / SECRETS).is_dir() else {}
    print(f"{len(teams.teams)} teams on cluster {cluster.name} ({path}):")
    for name, team in teams.teams.items():
        quota = ", ".join(f"{gpus} {hardware_name(t)}" for t, gpus in team.quota.items() if gpus) or "none"
        limits = [f"{gpus} {hardware_name(t)}" for t, gpus in team.borrow.items() if gpus is not None]
        unlimited = len(limits) < len(cluster.gpu_types)  # a type not named: any idle GPU of it
        borrows = (
            f"at most {', '.join(limits)}{', any idle GPU of the other types' if unlimited else ''}"
            if limits
            else "any idle GPU"
        )
        members = sorted(login for login, of in logins.items() if of == name)
        print(
            f"  {name:<16} quota {quota}; borrows {borrows}; weight {team.weight:g}; "
            f"logins {', '.join(members) or 'none'}"
        )
    return 0
