"""NATS credentials and TLS for every process that connects: the services and the CLI commands.

One set of command-line options, each with an environment variable standing in for it, turned into
nats-py connect options in one place (`connect_options`). Secrets are read from files (or, for the
password, from the environment), never from the command line, where `ps` would show them:

  --nats-user USER            GOODPUT_NATS_USER            user name (the role, see shared/permissions.py)
  --nats-password-file PATH   GOODPUT_NATS_PASSWORD_FILE   the user's password, from a file
                              GOODPUT_NATS_PASSWORD        ... or from the environment (used only with a user)
  --nats-token-file PATH      GOODPUT_NATS_TOKEN_FILE      a token instead of user and password
  --nats-creds PATH           GOODPUT_NATS_CREDS           a .creds file (JWT and nkey seed, decentralised auth)
  --nats-nkey-seed PATH       GOODPUT_NATS_NKEY_SEED       an nkey seed file
  --tls-ca PATH               GOODPUT_NATS_TLS_CA          CA bundle that verifies the server (enables TLS)
  --tls-cert PATH             GOODPUT_NATS_TLS_CERT        client certificate (mutual TLS; needs --tls-key)
  --tls-key PATH              GOODPUT_NATS_TLS_KEY         the client certificate's private key
  --nats-inbox-prefix PREFIX  GOODPUT_NATS_INBOX_PREFIX    where replies come back; default _INBOX_<user>
                                                           with a user, since each role may read only
                                                           its own inboxes (shared/permissions.py)

A file that is named but missing or empty is a ValueError naming the option and the path.

`goodput up` writes DATA/user.env (`write_user_env`): the URL and the default login, `user`; `goodput
login add NAME` writes DATA/logins/NAME.env, and `goodput up --teams` DATA/teams/TEAM.env for each
team's login (`write_login_env`): a login's file to hand to its person or team, whole in itself
(it says its team too, for the reader: the server knows it by the login's account). The user's
commands (`goodput submit`, `status`, `cancel`) read the login file that $GOODPUT_LOGIN names, else
the default data folder's user.env, by themselves (`user_environment`), when no GOODPUT_NATS_*
variable is set.
Credentials in the URL (nats://USER:PASSWORD@HOST:4222) still connect, but their replies use
nats-py's default inbox: against the per-role permissions, give --nats-inbox-prefix _INBOX_<USER> too.
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import nats.errors

from shared.permissions import inbox_prefix

ENV_PREFIX = "GOODPUT_NATS_"
PASSWORD_ENV = "GOODPUT_NATS_PASSWORD"
USER_ENV = "user.env"  # in `goodput up`'s data folder
LOGIN_ENV = "GOODPUT_LOGIN"  # a login's file (DATA/user.env, DATA/logins/NAME.env, DATA/teams/TEAM.env)
TEAM_ENV = "GOODPUT_TEAM"  # in a login's file: its team, for the reader (no client sends it)
DEFAULT_DATA = Path("out/stack")  # `goodput up`'s default data folder

# field -> (option, environment variable, help)
_OPTIONS = {
    "user": ("--nats-user", "GOODPUT_NATS_USER", "NATS user name"),
    "password_file": ("--nats-password-file", "GOODPUT_NATS_PASSWORD_FILE", "file holding the user's password"),
    "token_file": ("--nats-token-file", "GOODPUT_NATS_TOKEN_FILE", "file holding a NATS token"),
    "creds": ("--nats-creds", "GOODPUT_NATS_CREDS", "NATS .creds file (JWT and nkey seed)"),
    "nkey_seed": ("--nats-nkey-seed", "GOODPUT_NATS_NKEY_SEED", "file holding an nkey seed"),
    "tls_ca": ("--tls-ca", "GOODPUT_NATS_TLS_CA", "CA bundle verifying the NATS server (turns TLS on)"),
    "tls_cert": ("--tls-cert", "GOODPUT_NATS_TLS_CERT", "client certificate for mutual TLS"),
    "tls_key": ("--tls-key", "GOODPUT_NATS_TLS_KEY", "private key of the client certificate"),
    "inbox_prefix": (
        "--nats-inbox-prefix",
        "GOODPUT_NATS_INBOX_PREFIX",
        "prefix of this client's reply subjects (default: _INBOX_<user> with a user)",
    ),
}


@dataclass(frozen=True)
class Credentials:
    """Where this process's NATS credentials are; nothing secret is held until `connect_options`."""

    user: str | None = None
    password_file: str | None = None
    token_file: str | None = None
    creds: str | None = None
    nkey_seed: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    inbox_prefix: str | None = None


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Add the credential and TLS options, defaulting to their GOODPUT_NATS_* variables."""
    environ = os.environ if environ is None else environ
    group = parser.add_argument_group("NATS credentials and TLS (secrets from files or the environment)")
    for field, (option, env, help_text) in _OPTIONS.items():
        group.add_argument(
            option, dest=f"nats_{field}", default=environ.get(env) or None, help=f"{help_text} (default: ${env})"
        )


def from_args(args: argparse.Namespace) -> Credentials:
    return Credentials(**{f.name: getattr(args, f"nats_{f.name}", None) for f in fields(Credentials)})


def from_env(environ: Mapping[str, str] | None = None) -> Credentials:
    environ = os.environ if environ is None else environ
    return Credentials(**{field: environ.get(env) or None for field, (_, env, _) in _OPTIONS.items()})


def _existing(field: str, path: str) -> Path:
    option, env, _ = _OPTIONS[field]
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{option} (${env}): no such file: {file}")
    return file


def _secret(field: str, path: str) -> str:
    option, env, _ = _OPTIONS[field]
    file = _existing(field, path)
    secret = file.read_text().strip()
    if not secret:
        raise ValueError(f"{option} (${env}): {file} is empty")
    return secret


def tls_context(credentials: Credentials) -> ssl.SSLContext | None:
    """A client SSLContext verifying the server with the CA bundle (and presenting the client
    certificate when given); None when no TLS option is set."""
    if not (credentials.tls_ca or credentials.tls_cert or credentials.tls_key):
        return None
    if bool(credentials.tls_cert) != bool(credentials.tls_key):
        raise ValueError("--tls-cert and --tls-key go together (mutual TLS needs both)")
    ca = str(_existing("tls_ca", credentials.tls_ca)) if credentials.tls_ca else None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    if credentials.tls_cert:
        cert, key = _existing("tls_cert", credentials.tls_cert), _existing("tls_key", credentials.tls_key)
        try:
            context.load_cert_chain(str(cert), str(key))
        except ssl.SSLError as error:
            raise ValueError(f"--tls-cert {cert} / --tls-key {key}: cannot load ({error})") from None
    return context


# The nats-py connect options `connect_options` logs in with, one per way to authenticate.
LOGIN_OPTIONS = ("user", "token", "user_credentials", "nkeys_seed")


def connect_options(credentials: Credentials | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """nats-py `connect` keyword arguments (pass them to `Bus.connect`) for these credentials;
    `credentials` None reads the GOODPUT_NATS_* environment. ValueError for a missing file or a
    combination that cannot work."""
    environ = os.environ if environ is None else environ
    named = environ.get(LOGIN_ENV)
    if named and not Path(named).expanduser().is_file():
        raise ValueError(
            f"${LOGIN_ENV} names {named}, which is not a file (a login's file: DATA/{USER_ENV}, "
            f"DATA/logins/NAME.env that `goodput login add NAME` wrote, or DATA/teams/TEAM.env that "
            f"`goodput up --teams` wrote)"
        )
    credentials = from_env(environ) if credentials is None else credentials
    options: dict[str, Any] = {}
    methods = [
        name
        for name, given in (
            ("user", credentials.user),
            ("token", credentials.token_file),
            ("creds", credentials.creds),
            ("nkey seed", credentials.nkey_seed),
        )
        if given
    ]
    if len(methods) > 1:
        raise ValueError(f"choose one way to authenticate to NATS, not {' and '.join(methods)}")
    if credentials.password_file and not credentials.user:
        raise ValueError("--nats-password-file needs --nats-user (or $GOODPUT_NATS_USER)")
    if credentials.user:
        options["user"] = credentials.user
        if credentials.password_file:
            options["password"] = _secret("password_file", credentials.password_file)
        elif environ.get(PASSWORD_ENV):
            options["password"] = environ[PASSWORD_ENV]
        elif named and read_env(Path(named).expanduser()).get(PASSWORD_ENV):  # a login's file holds it
            options["password"] = read_env(Path(named).expanduser())[PASSWORD_ENV]
        else:
            raise ValueError(
                f"--nats-user {credentials.user} needs a password: --nats-password-file or ${PASSWORD_ENV}"
            )
    # Replies come back where this role may subscribe (shared/permissions.py).
    prefix = credentials.inbox_prefix or (inbox_prefix(credentials.user) if credentials.user else None)
    if prefix:
        options["inbox_prefix"] = prefix
    if credentials.token_file:
        options["token"] = _secret("token_file", credentials.token_file)
    if credentials.creds:
        options["user_credentials"] = str(_existing("creds", credentials.creds))
    if credentials.nkey_seed:
        options["nkeys_seed"] = str(_existing("nkey_seed", credentials.nkey_seed))
    context = tls_context(credentials)
    if context is not None:
        options["tls"] = context
    return options


def unreachable(server: str, error: BaseException, options: Mapping[str, Any]) -> str:
    """Why a command could not use the stack at `server` (its nats-py connect `options`), and what
    to do: a refused login is told apart from a server that is not there."""
    where = redact(server)
    if isinstance(error, nats.errors.NoRespondersError):  # the server is there; the service is not
        return (
            f"NATS at {where} answers, but no goodput service answered the request: is the service's process "
            "running? (`goodput up` prints a line when one exits, and where its log is)"
        )
    in_url = any(urlsplit(url.strip()).username for url in server.split(","))
    login = in_url or any(options.get(key) for key in LOGIN_OPTIONS)
    if "authorization violation" not in str(error).lower():
        elsewhere = (
            ""
            if login
            else (
                f" (one started with --data DATA serves the URL in DATA/{USER_ENV}: set -a; . DATA/{USER_ENV}; set +a)"
            )
        )
        return f"cannot reach NATS at {where} ({error or type(error).__name__}); is `goodput up` running?{elsewhere}"
    if login:
        return (
            f"NATS at {where} refused the login (Authorization Violation): check the user and its password "
            f"file (a `goodput up`'s are in DATA/{USER_ENV})"
        )
    return (
        f"NATS at {where} refused a client without a login: no {ENV_PREFIX}* variable is set and there is no "
        f"{DEFAULT_DATA / USER_ENV}; for a `goodput up --data DATA`: set -a; . DATA/{USER_ENV}; set +a"
    )


def redact(servers: str) -> str:
    """The URL(s) with any password or token replaced by ***."""
    shown = []
    for server in servers.split(","):
        parts = urlsplit(server.strip())
        if parts.username is None:
            shown.append(server.strip())
            continue
        host = parts.netloc.rpartition("@")[2]
        user = f"{parts.username}:***" if parts.password is not None else "***"
        shown.append(urlunsplit(parts._replace(netloc=f"{user}@{host}")))
    return ",".join(shown)


def write_user_env(data: Path, url: str, password_file: Path | None) -> Path:
    """DATA/user.env: how a user's client reaches this stack (no password in it: the file's path)."""
    from shared.permissions import DEFAULT_LOGIN, inbox_prefix, write_private

    lines = [
        "# Written by `goodput up`: how a user reaches this goodput. In a shell: set -a; . THIS_FILE; set +a",
        f'# Other NATS clients: user "{DEFAULT_LOGIN}", the password in the file below, inbox prefix '
        f"{inbox_prefix(DEFAULT_LOGIN)}",
        f"GOODPUT_NATS_URL={url}",
    ]
    if password_file is not None:
        lines += [f"GOODPUT_NATS_USER={DEFAULT_LOGIN}", f"GOODPUT_NATS_PASSWORD_FILE={password_file.resolve()}"]
    path = data / USER_ENV
    write_private(path, "\n".join(lines) + "\n")
    return path


def write_login_env(path: Path, url: str, login: str, password: str, team: str | None = None) -> Path:
    """A login's file (0600), whole in itself: the URL, the login and its password, and the team
    it belongs to (`team`; DEFAULT_TEAM's without one), for the reader."""
    from shared.permissions import inbox_prefix, write_private
    from shared.subjects import DEFAULT_TEAM

    team = team or DEFAULT_TEAM
    write_private(
        path,
        "\n".join(
            [
                f"# Written by goodput: {login}'s login to this goodput, of team {team}. For goodput's commands: "
                f"export {LOGIN_ENV}=THIS_FILE; in a shell: set -a; . THIS_FILE; set +a",
                f'# Other NATS clients: user "{login}", the password below, inbox prefix {inbox_prefix(login)}',
                f"GOODPUT_NATS_URL={url}",
                f"GOODPUT_NATS_USER={login}",
                f"{PASSWORD_ENV}={password}",
                f"{TEAM_ENV}={team}",
            ]
        )
        + "\n",
    )
    return path


def read_env(file: Path, prefix: str = ENV_PREFIX) -> dict[str, str]:
    """The GOODPUT_NATS_* settings of a login's file (`prefix`: those of another prefix)."""
    settings = {}
    for line in file.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.startswith("#") and key.strip().startswith(prefix):
            settings[key.strip()] = value.strip()
    return settings


def login_team(file: Path) -> str:
    """The team a login's file says its login is of (DEFAULT_TEAM when it says none)."""
    from shared.subjects import DEFAULT_TEAM

    return read_env(file, TEAM_ENV).get(TEAM_ENV) or DEFAULT_TEAM


def user_environment(
    environ: Mapping[str, str] | None = None, data: Path = DEFAULT_DATA, role: str = "user"
) -> dict[str, str]:
    """The environment, plus a login file's settings when no GOODPUT_NATS_* variable is set: the file
    $GOODPUT_LOGIN names, else DATA/user.env, so a user's command on
    the machine of a `goodput up` with the default data folder finds it and logs in. Another `role`
    (the operator) logs in with its own password file beside the user's."""
    environ = dict(os.environ if environ is None else environ)
    if any(key.startswith(ENV_PREFIX) for key in environ):
        return environ
    named = environ.get(LOGIN_ENV)
    file = Path(named).expanduser() if named else data / USER_ENV
    if not file.is_file():  # a $GOODPUT_LOGIN that names no file: connect_options says so
        return environ
    environ.update(read_env(file))
    if role != "user" and f"{ENV_PREFIX}PASSWORD_FILE" in environ:
        environ[f"{ENV_PREFIX}USER"] = role
        environ[f"{ENV_PREFIX}PASSWORD_FILE"] = str(Path(environ[f"{ENV_PREFIX}PASSWORD_FILE"]).with_name(role))
    return environ
