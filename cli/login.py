"""`goodput login add NAME [--team T]`, `remove NAME`, `list` — the operator's: one login per person or team.

A login is a NATS user of its own in its team's account (shared/permissions.py): its replies are
its own, its jobs are its own and its team's, and what it may keep and ask is bounded. `add`
writes DATA/logins/NAME.env (0600: the URL, the login, its password, its team), the file to hand
to that person (`export GOODPUT_LOGIN=FILE` for goodput's commands); with `--team T` the login is
of team T, which must be a team of the team file in force (DATA/teams.yaml), else of the default
team. Each team has its own login besides, named after it (DATA/teams/TEAM.env, made by `goodput
up --teams` and `goodput teams apply`). A `goodput up` serving DATA takes a new login in at once
(the server reads its accounts again), and one removed is disconnected there and then.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from shared import credentials
from shared.bus.connection import DEFAULT_SERVER, SERVER_ENV


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("login", help="the operator's: add, remove and list the logins of a goodput up")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, help_text in (
        ("add", "make a login and its file, DATA/logins/NAME.env"),
        ("remove", "forget a login; its connections are closed"),
    ):
        action = actions.add_parser(name, help=help_text)
        action.add_argument("name", help="the login: lower-case letters, digits, '_' and '-'")
        action.add_argument(
            "--data",
            type=Path,
            default=credentials.DEFAULT_DATA,
            help="goodput up's data folder (default: %(default)s)",
        )
        if name == "add":
            action.add_argument(
                "--team", help="the login's team, one of the team file in force (default: the default team)"
            )
    listing = actions.add_parser("list", help="the logins and their teams")
    listing.add_argument(
        "--data", type=Path, default=credentials.DEFAULT_DATA, help="goodput up's data folder (default: %(default)s)"
    )
    parser.set_defaults(func=_login)


def _login(args: argparse.Namespace) -> int:
    from launcher.nats import SECRETS, Access, reload

    secrets = args.data / SECRETS
    if not secrets.is_dir():
        raise ValueError(
            f"{args.data} is no secured goodput up's data folder (no {secrets}): start one with "
            f"`goodput up --data {args.data}` first"
        )
    access = Access(secrets)
    if args.action == "list":
        for name, team in access.teams().items():
            print(f"{name:<32} team {team}")
        return 0
    if args.action == "add":
        if args.team is not None:
            _check_team(args.data, args.team)
        user_env = args.data / credentials.USER_ENV  # where `goodput up` serves
        url = (credentials.read_env(user_env) if user_env.is_file() else {}).get(SERVER_ENV, DEFAULT_SERVER)
        path = access.add_login(args.name, url, args.team)
        serving = reload(args.data, access)
        if serving:
            asyncio.run(_logged_in(path))
        print(
            f"login {args.name}{f' of team {args.team}' if args.team else ''}: {path} (readable by you only; "
            f"hand it to its person: export {credentials.LOGIN_ENV}={path})"
            + ("" if serving else "; taken in at the next goodput up")
        )
    else:
        if access.teams().get(args.name) == args.name and args.name in _teams_in_force(args.data):
            raise ValueError(
                f"login {args.name!r} is team {args.name}'s own, and the team is in the team file in force: "
                "it stays while the team does"
            )
        access.remove_login(args.name)
        serving = reload(args.data, access)
        print(f"login {args.name} removed" + ("; its connections are closed" if serving else ""))
    return 0


def _teams_in_force(data: Path) -> dict:
    """The teams of the team file in force on DATA ({} without one)."""
    from launcher.nats import TEAM_FILE
    from shared.teams import load_team_file

    return dict(load_team_file(data / TEAM_FILE).teams) if (data / TEAM_FILE).is_file() else {}


def _check_team(data: Path, team: str) -> None:
    """ValueError unless `team` is a team of the team file in force on DATA (or the default team)."""
    from launcher.nats import TEAM_FILE
    from shared.subjects import DEFAULT_TEAM

    if team == DEFAULT_TEAM:
        return
    teams = _teams_in_force(data)
    if not teams:
        raise ValueError(
            f"no team {team!r}: {data} has no team file ({data / TEAM_FILE}); give one with "
            f"`goodput up --teams FILE` or `goodput teams apply FILE --data {data}`"
        )
    if team not in teams:
        raise ValueError(
            f"no team {team!r} in the team file in force ({data / TEAM_FILE}); its teams: {', '.join(teams)}"
        )


async def _logged_in(path: Path) -> None:
    """Wait until the server takes the new login (it reads its accounts again on the signal)."""
    from launcher.nats import taken

    environ = credentials.read_env(path)
    try:
        connection = await taken(environ["GOODPUT_NATS_URL"], credentials.connect_options(environ=environ))
    except RuntimeError as error:
        raise ValueError(str(error)) from None
    await connection.close()
