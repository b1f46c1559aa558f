"""`goodput login add NAME`, `remove NAME`, `list` — the operator's: one login per person or team.

A login is a NATS user of its own in the logins' account (shared/permissions.py): its replies are
its own, its jobs are its own, and what it may keep and ask is bounded. `add` writes
DATA/logins/NAME.env (0600: the URL, the login, its password), the file to hand to that person
(`export GOODPUT_LOGIN=FILE` for goodput's commands); a `goodput up` serving DATA takes it in at
once (the server reads its accounts again), and one removed is disconnected there and then.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from shared import credentials
from shared.bus import DEFAULT_SERVER, SERVER_ENV


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
    listing = actions.add_parser("list", help="the logins")
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
        for name in access.logins():
            print(name)
        return 0
    if args.action == "add":
        user_env = args.data / credentials.USER_ENV  # where `goodput up` serves
        url = (credentials.read_env(user_env) if user_env.is_file() else {}).get(SERVER_ENV, DEFAULT_SERVER)
        path = access.add_login(args.name, url)
        serving = reload(args.data, access)
        if serving:
            asyncio.run(_logged_in(path))
        print(
            f"login {args.name}: {path} (readable by you only; hand it to its person: "
            f"export {credentials.LOGIN_ENV}={path})" + ("" if serving else "; taken in at the next goodput up")
        )
    else:
        access.remove_login(args.name)
        serving = reload(args.data, access)
        print(f"login {args.name} removed" + ("; its connections are closed" if serving else ""))
    return 0


async def _logged_in(path: Path) -> None:
    """Wait until the server takes the new login (it reads its accounts again on the signal)."""
    from launcher.nats import taken

    environ = credentials.read_env(path)
    try:
        connection = await taken(environ["GOODPUT_NATS_URL"], credentials.connect_options(environ=environ))
    except RuntimeError as error:
        raise ValueError(str(error)) from None
    await connection.close()
