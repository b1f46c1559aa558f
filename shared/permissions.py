"""Who may publish and subscribe to what: one table, next to the subjects, rendered into nats-server's
`accounts { ... }` block.

The server keeps the services apart from the people, and each team apart from the others, in
accounts:

- `GOODPUT` (SERVICE_ACCOUNT): the six services and `operator` (who sets up the storage and drives
  replays and live runs), each one NATS user, named after its role, with its own subjects. All of
  JetStream is here.
- one account per team of logins (`team_account`): `LOGINS` (LOGINS_ACCOUNT) for DEFAULT_TEAM's
  (`user`, made by `goodput up`, and the logins added without a team), `TEAM_<team>` for each other
  team's (its login named after it, made by `goodput up --teams`, and those added with `--team`).
  A login is one NATS user, with its own inboxes, and a user name no other account holds. A login
  reaches the services only through what GOODPUT exports (`EXPORTS`: the user API, the policy's
  status, the intake), imported with `share: true`, so every request
  carries the server's word of who sent it (the `Nats-Request-Info` header: the account and the
  user, set by the server over whatever the client wrote). The answer travels on the server's
  response mapping (`_R_.…` in GOODPUT, back to the requester's reply subject in its account):
  whatever reply subject a login names, nothing a service answers can land in a stream, a KV key
  or another service, since those are all in GOODPUT, where no login publishes. That holds for
  every responder, without any handler checking. The NATS service API (`$SRV.PING|INFO|STATS` of
  `nats.micro`) is not exported: every instance of every service answers each such request, at no
  limit of a login's (the user API's `RequesterLimits` do not see them), so one login's flood of
  them would stall the user API for every team.

Why an account per team, and not per-team subjects in one account: the team is then the server's
word in the same header that names the login (`account_team` of its account), on every request and
every submission, with nothing for a handler to map or to remember. A team's logins publish their
submissions on `goodput.jobs.submit.<login>` in their account, and the account's import maps that
to `goodput.jobs.submit.<team>.<login>` in GOODPUT (`subjects.intake`): the subject it lands on
names the team, which no login can choose, since no account imports another team's intake.
Per-team subjects would put the team in a subject the client writes, held to it by an allow list
per login, and every endpoint (the API's, `nats.micro`'s own) would need a subject per team to say
what the account says by itself.

Within GOODPUT the rules, beyond each role's own subjects:

- Replies come back on the role's own inboxes, `_INBOX_<role>.>` (shared/credentials.py sets the
  prefix from the user name), and on `_R_.>` for the logins' requests. nats-server's
  `allow_responses` is not used: it lets a responder publish to whatever reply subject a request
  names, past the responder's allow list.
- Only the operator creates or changes streams, consumers and KV buckets (shared/storage.py's
  plan, launcher/setup.py), and writes the team file (`TEAMS_BUCKET`), which the policy and the
  API read. One exception: the node agents make each team's logs stream as they first store its
  lines (`team_logs`: each stream named, one per team with logins, so they make no other). The
  services read a stream's info, pull from and acknowledge their own durable consumer, and read and
  write their own buckets (a KV write is a publish on `$KV.<bucket>.<key>`); a reader of a stream's
  log creates ordered consumers on that stream only (`_follow`), which cannot change it. Services answer the NATS service API (`$SRV.PING`/`INFO`/
  `STATS`, `nats.micro`) and may ping themselves (their readiness probe).
- Only the policy publishes allocations (`PLACE`, `APPLY`): a profiler, an estimator or a login cannot.

A login may publish its own submissions (`goodput.jobs.submit.<login>`, stored in the intake stream,
whose ack comes back on its inbox), use the user API (`goodput.api.*`, whose `schemas` endpoint
describes it) and read the policy's status; it subscribes to its own inboxes only, so no login reads another's answers.

Passwords never live here or in the repository: the renderers take them as mappings, and
`passwords_from` reads them from files or the environment.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from shared import storage, subjects

SERVICE_API = ("$SRV.PING", "$SRV.PING.>", "$SRV.INFO", "$SRV.INFO.>", "$SRV.STATS", "$SRV.STATS.>")
MAX_PAYLOAD_BYTES = 1024 * 1024  # nats-server's max_payload: the largest message it accepts
# nats-server's max_pending: what it holds for one connection before closing it as a slow consumer.
# A login flooding a service keeps that service's connection near 3/4 of it (the server slows the
# flooder there); the default 64 MiB leaves 16 MiB, which a service starved of CPU for 2-3 s
# overruns, and the close drops every login's requests queued for it. 256 MiB, leaving 64, was
# still overrun once on a 2-core machine running other stacks' tests beside it; 512 MiB leaves 128.
MAX_PENDING_BYTES = 512 * 1024 * 1024
SERVICES = ("api", "placer", "profiler", "estimator", "executor", "policy")
SERVICE_ACCOUNT = "GOODPUT"
LOGINS_ACCOUNT = "LOGINS"
DEFAULT_LOGIN = "user"  # the login `goodput up` makes; `goodput login add` makes more
RESPONSES = "_R_.>"  # where the server maps the reply of a request that came through an import
# What GOODPUT lets the logins ask (each a service export, imported into LOGINS with share: true).
EXPORTS = (*subjects.API_SUBJECTS, subjects.POLICY_STATUS)
# A login's own intake subject, `goodput.jobs.submit.<login>` in its account, lands in GOODPUT as
# `goodput.jobs.submit.<team>.<login>`: the import maps it, so the team is the server's word.
INTAKE_EXPORT = subjects.intake("*", "*")
PASSWORD_ENV_PREFIX = "GOODPUT_NATS_PASSWORD_"  # + role in capitals, e.g. GOODPUT_NATS_PASSWORD_PLACER
# A login's name: a NATS user and a subject token, so no dots or wildcards; never a role's name.
LOGIN_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


TEAM_ACCOUNT_PREFIX = "TEAM_"  # + a team's name: the account of that team's logins
TEAM_LOGIN_SEPARATOR = "."  # a login's password file `TEAM.LOGIN` (logins_from): a login of TEAM


def team_account(team: str) -> str:
    """The account of `team`'s logins (those of DEFAULT_TEAM: LOGINS_ACCOUNT)."""
    return LOGINS_ACCOUNT if team == subjects.DEFAULT_TEAM else TEAM_ACCOUNT_PREFIX + team


def account_team(account: str) -> str | None:
    """The team whose logins an account holds (the server names the account of every request that
    came through an import); None for any other account (the services' own: the operator)."""
    if account == LOGINS_ACCOUNT:
        return subjects.DEFAULT_TEAM
    return account.removeprefix(TEAM_ACCOUNT_PREFIX) if account.startswith(TEAM_ACCOUNT_PREFIX) else None


def inbox_prefix(role: str) -> str:
    """The inbox prefix a role's clients connect with (nats-py's `inbox_prefix`)."""
    return f"_INBOX_{role}"


def kv_subjects(bucket: str) -> str:
    """What a KV write publishes on."""
    return f"$KV.{bucket}.>"


def _info(stream: str) -> str:
    """Read a stream's configuration and state (shared.storage checks it against the plan)."""
    return f"$JS.API.STREAM.INFO.{stream}"


def _kv(bucket: str) -> tuple[str, ...]:
    """Use a KV bucket: read keys (message get, or direct get), write and delete them, purge the parts
    of a large value (shared.bus.TypedKV)."""
    stream = f"KV_{bucket}"
    return (
        _info(stream),
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.STREAM.PURGE.{stream}",
        kv_subjects(bucket),
    )


def _kv_read(bucket: str) -> tuple[str, ...]:
    """Read a KV bucket's keys, never write them (TypedKV.values: the stream's subjects, then each key)."""
    stream = f"KV_{bucket}"
    return (
        _info(stream),
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
    )


def _stream_read(stream: str) -> tuple[str, ...]:
    """Read a stream's messages one by one, by sequence and subject (the API's `logs`), never write them."""
    return (_info(stream), f"$JS.API.STREAM.MSG.GET.{stream}")


def _durable(stream: str, consumer: str) -> tuple[str, ...]:
    """Pull from and acknowledge one durable consumer the operator made (Bus.bind_consumer)."""
    return (
        f"$JS.API.CONSUMER.INFO.{stream}.{consumer}",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}",
        f"$JS.ACK.{stream}.{consumer}.>",
    )


def _nodes() -> tuple[str, ...]:
    """Read (and, an agent, renew) the node agents' membership: keys listed through an ordered consumer."""
    return (*_kv(subjects.NODES_BUCKET), *_follow(f"KV_{subjects.NODES_BUCKET}"))


def _objects(store: str) -> tuple[str, ...]:
    """Copy objects in and out of an object store (nats-py: chunks and meta on `$O.<store>.>`, the
    meta read by direct get, a read through an ordered consumer, old chunks purged)."""
    return (*_objects_read(store), f"$JS.API.STREAM.PURGE.OBJ_{store}", f"$O.{store}.>")


def _objects_read(store: str) -> tuple[str, ...]:
    """Copy objects out of an object store, never into it: the meta by direct get, the chunks through
    an ordered consumer."""
    stream = f"OBJ_{store}"
    return (
        _info(stream),
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        *_follow(stream),
    )


def _provision() -> tuple[str, ...]:
    """Create every stream, bucket and durable consumer of the plan, or bring it to the plan."""
    streams = [
        *storage.STREAMS,
        *(bucket.stream for bucket in storage.BUCKETS.values()),
        *(f"OBJ_{store}" for store in storage.OBJECT_STORES),
    ]
    made = tuple(f"$JS.API.STREAM.{op}.{name}" for name in streams for op in ("CREATE", "UPDATE", "INFO"))
    api = "$JS.API.CONSUMER"
    return made + tuple(
        subject
        for c in storage.CONSUMERS.values()
        for subject in (
            f"{api}.CREATE.{c.stream}.{c.name}",
            f"{api}.CREATE.{c.stream}.{c.name}.>",
            f"{api}.DURABLE.CREATE.{c.stream}.{c.name}",
            f"{api}.INFO.{c.stream}.{c.name}",
        )
    )


def _follow(stream: str) -> tuple[str, ...]:
    """Read a stream through ordered consumers (Bus.follow): nats-py looks the stream up by subject,
    creates unnamed consumers, and answers the server's flow control on `$JS.FC`."""
    return (
        "$JS.API.STREAM.NAMES",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>",
        f"$JS.FC.{stream}.>",
    )


def team_logs(role: str, teams: Iterable[str]) -> tuple[str, ...]:
    """What `role` may do with the logs stream of each of `teams` (shared/storage.py's `logs_plan`):
    the node agents (`executor`) store in it, and make it and bring it to the plan (but DEFAULT_TEAM's,
    the operator's); the API reads it (to a login, its own team's only). A stream's name is one token
    of these subjects, so no wildcard can say "the logs streams" alone: `render_accounts` names each
    team's, the teams of the accounts."""
    if role == "executor":
        return tuple(
            f"$JS.API.STREAM.{op}.{subjects.logs_stream(team)}"
            for team in teams
            for op in ("INFO", *(("CREATE", "UPDATE") if team != subjects.DEFAULT_TEAM else ()))
        )
    if role == "api":
        return tuple(subject for team in teams for subject in _stream_read(subjects.logs_stream(team)))
    return ()


@dataclass(frozen=True)
class LoginLimits:
    """What the server lets each team's account of logins hold, so that no login takes what the
    server has for everyone (its 65,536 connections, its memory for subscriptions): beyond them the
    server refuses a connection, or closes the connection that subscribed once too often."""

    connections: int = 1024  # at once, all the team's logins together
    subscriptions: int = 1000  # on one connection (a client of ours holds two or three)


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def _dead_letters(consumer: str) -> tuple[str, ...]:
    """Store what a consumer could not process in the dead letters' stream (streams.ensure_dead_letters)."""
    return (subjects.dead_letters(consumer), _info(subjects.DEAD_LETTER_STREAM))


def _service(name: str, publish: Iterable[str], subscribe: Iterable[str]) -> Permissions:
    """A service: answers on the roles' inboxes and the logins' response mapping only."""
    replies = tuple(f"{inbox_prefix(role)}.>" for role in (*SERVICES, subjects.OPERATOR))
    return Permissions(
        publish=(f"$SRV.PING.{name}", *replies, RESPONSES, *publish),
        subscribe=(f"{inbox_prefix(name)}.>", *SERVICE_API, *subscribe),
    )


def login_permissions(login: str) -> Permissions:
    """A login, in LOGINS: what GOODPUT exports, its own intake subject, its own inboxes."""
    return Permissions(
        publish=(*subjects.API_SUBJECTS, subjects.POLICY_STATUS, subjects.submit(login)),
        subscribe=(f"{inbox_prefix(login)}.>",),
    )


STATUS_SUBJECTS = (
    subjects.RECORDS,
    subjects.EXECUTOR_STATUS,
    subjects.ESTIMATOR_STATUS,
    subjects.POLICY_STATUS,
    subjects.EXECUTOR_NODES,
)
JOBS = subjects.JOBS_STREAM
INTAKE = subjects.INTAKE_STREAM

ROLES: dict[str, Permissions] = {
    "placer": _service("placer", publish=(), subscribe=(subjects.PLACE,)),
    # The user API: it answers the logins, judges their own submissions from the intake stream as
    # it judges a request, stores the valid ones, the refusals and cancel orders, marks the ids it
    # stores (the owners' KV), asks the executors for the records and, with real executors, reads
    # which applications the live node agents run; it reads jobs' output to their submitters, and
    # stores the code archives logins upload (checked first: a login never writes JetStream itself).
    "api": _service(
        "api",
        publish=(
            f"{subjects.STORED}.*.*",
            f"{subjects.REFUSED}.*.*",
            subjects.CANCEL,
            subjects.RECORDS,
            _info(JOBS),
            _info(INTAKE),
            *_durable(INTAKE, subjects.INTAKE_CONSUMER),
            *_dead_letters(subjects.INTAKE_CONSUMER),
            *_kv(subjects.JOB_OWNERS_BUCKET),
            *_kv_read(subjects.NODES_BUCKET),
            *_kv_read(subjects.TEAMS_BUCKET),  # each team's guarantee, for `goodput.api.teams`
            *team_logs("api", (subjects.DEFAULT_TEAM,)),  # jobs' output (each other team's: rendered)
            *_objects(subjects.CODE_STORE),
            _info(subjects.DECISIONS_STREAM),  # the rounds' decisions, for `explain` and `rounds`
            *_follow(subjects.DECISIONS_STREAM),
        ),
        subscribe=subjects.API_SUBJECTS,
    ),
    # The verdicts on stored submissions: it claims each id (the owners' KV), hands the profiles to
    # the estimator and, with real executors, runs the profiling on a live node agent.
    "profiler": _service(
        "profiler",
        publish=(
            subjects.REJECTED,
            subjects.PROFILED,
            subjects.PROFILES,
            _info(JOBS),
            *_durable(JOBS, subjects.PROFILER_CONSUMER),
            *_dead_letters(subjects.PROFILER_CONSUMER),
            *_kv(subjects.JOB_OWNERS_BUCKET),
            *_kv_read(subjects.NODES_BUCKET),
            subjects.node_subject("*", "profile"),
            subjects.EXECUTOR_NODES,  # which nodes train jobs: a run goes to one that trains none
        ),
        subscribe=(subjects.CANCEL,),  # cancel orders: a cancelled job is not profiled
    ),
    "estimator": _service(
        "estimator",
        publish=_kv(subjects.ESTIMATES_BUCKET),
        subscribe=(subjects.PROFILES, subjects.OBSERVE, subjects.MODELS, subjects.ESTIMATOR_STATUS),
    ),
    # The executors, and the node agents of real ones (they share this role): the executor service
    # drives the agents' workers, each agent renews its node in KV, answers for it and stores what its
    # workers print.
    "executor": _service(
        "executor",
        publish=(
            subjects.OBSERVE,
            *_kv(subjects.EXECUTOR_BUCKET),
            *_kv(subjects.NODE_JOBS_BUCKET),
            subjects.NODE_SUBJECTS,
            *_nodes(),
            *_kv(subjects.DRAINED_BUCKET),
            *_objects(subjects.CHECKPOINTS_STORE),
            *_objects_read(subjects.CODE_STORE),  # jobs' own code, which the agents unpack and run
            *subjects.LOGS_SUBJECTS,
            *team_logs("executor", (subjects.DEFAULT_TEAM,)),  # each other team's: rendered with its account
            *_follow(f"KV_{subjects.DRAINED_BUCKET}"),
            _info(JOBS),
            *_durable(JOBS, subjects.EXECUTOR_CONSUMER),
            *_durable(JOBS, subjects.NODE_AGENT_CONSUMER),
            *_dead_letters(subjects.EXECUTOR_CONSUMER),
            *_dead_letters(subjects.NODE_AGENT_CONSUMER),
        ),
        subscribe=(
            subjects.FACTS,
            subjects.APPLY,
            subjects.ADVANCE,
            subjects.LIVE_JOBS,
            subjects.RECORDS,
            subjects.EXECUTOR_STATUS,
            subjects.EXECUTOR_DRAIN,
            subjects.EXECUTOR_NODES,
            subjects.NODE_SUBJECTS,
        ),
    ),
    "policy": _service(
        "policy",
        publish=(
            subjects.FACTS,
            subjects.MODELS,
            subjects.PLACE,
            subjects.APPLY,
            subjects.ADVANCE,
            subjects.LIVE_JOBS,
            *subjects.RUN_LOG_SUBJECTS,
            _info(subjects.RUN_LOG_STREAM),
            *subjects.DECISIONS_SUBJECTS,  # the live run's decisions (services/policy/recorder.py)
            _info(subjects.DECISIONS_STREAM),
            *_kv(subjects.RUNS_BUCKET),
            *_follow(f"KV_{subjects.RUNS_BUCKET}"),
            *_kv(subjects.LEASE_BUCKET),
            *_kv_read(subjects.TEAMS_BUCKET),  # the operator's team file, read at every round
            subjects.POLICY_STATUS,
        ),  # its readiness probe asks how the live run is
        subscribe=(subjects.POLICY_STATUS,),
    ),
    # Whoever sets up the storage and drives replays and live runs (`goodput up`, launcher/setup.py,
    # launcher/live_run.py, `goodput teams apply`): makes the streams, buckets and consumers, stores
    # the team file, submits, creates runs in KV, follows their logs and the submissions, asks the
    # services how they are.
    subjects.OPERATOR: Permissions(
        publish=(
            *_provision(),
            subjects.stored(subjects.DEFAULT_TEAM, subjects.OPERATOR),
            subjects.intake(subjects.DEFAULT_TEAM, subjects.OPERATOR),
            subjects.REPLAY_SUBMIT,
            *_follow(JOBS),
            *_follow(subjects.RUN_LOG_STREAM),
            *_kv(subjects.RUNS_BUCKET),
            *_kv(subjects.TEAMS_BUCKET),  # the team file (`goodput up --teams`, `goodput teams apply`)
            *STATUS_SUBJECTS,
            *SERVICE_API,
            *subjects.API_SUBJECTS,
            subjects.EXECUTOR_DRAIN,
        ),
        subscribe=(f"{inbox_prefix(subjects.OPERATOR)}.>",),
    ),
}

# Letters, digits and a few marks: safe inside a quoted nats-server config string, and no $VAR.
_PASSWORD = re.compile(r"^[A-Za-z0-9_.~+=/-]{8,}$")


def passwords_from(
    roles: Iterable[str] = ROLES, directory: str | Path | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Each role's password: `$GOODPUT_NATS_PASSWORD_<ROLE>`, else the file `<directory>/<role>`.
    ValueError naming what is missing."""
    environ = os.environ if environ is None else environ
    passwords = {}
    for role in roles:
        value = environ.get(PASSWORD_ENV_PREFIX + role.upper())
        if not value and directory is not None:
            file = Path(directory) / role
            if file.is_file():
                value = file.read_text().strip()
        if not value:
            where = f" or the file {Path(directory) / role}" if directory is not None else ""
            raise ValueError(f"no password for the NATS role {role!r}: set ${PASSWORD_ENV_PREFIX}{role.upper()}{where}")
        passwords[role] = value
    return passwords


def _quoted(items: Iterable[str]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def login_problem(name: str) -> str | None:
    """Why `name` cannot be a login, or None."""
    if not LOGIN_NAME.match(name):
        return (
            f"a login is 1 to 32 lower-case letters, digits, '_' and '-', starting with a letter or digit "
            f"(it is a NATS user and a subject token); {name!r} is not"
        )
    if name in ROLES:
        return f"{name!r} is a role of the services' own; choose another name"
    return None


def _user(name: str, password: str, permissions: Permissions) -> list[str]:
    if not _PASSWORD.match(password):
        raise ValueError(
            f"the password of NATS user {name!r} must be at least 8 characters of letters, digits and _.~+=/-"
        )
    return [
        f"      {{user: {json.dumps(name)}, password: {json.dumps(password)}, permissions: {{",
        f"        publish: {{allow: {_quoted(permissions.publish)}}}",
        f"        subscribe: {{allow: {_quoted(permissions.subscribe)}}}",
        "      }}",
    ]


def render_accounts(
    passwords: Mapping[str, str],
    logins: Mapping[str, str],
    roles: Mapping[str, Permissions] = ROLES,
    teams: Mapping[str, str] | None = None,
    limits: LoginLimits = LoginLimits(),
) -> str:
    """nats-server's `accounts { ... }` block: SERVICE_ACCOUNT with a user per role in `passwords`
    (with JetStream, exporting EXPORTS and the intake), and an account per team of
    the logins (`team_account`; LOGINS_ACCOUNT, DEFAULT_TEAM's, always), with a user per login of
    `logins` of that team (`teams`: login -> its team; DEFAULT_TEAM for a login it does not name),
    importing the exports (the requester's info shared) and the intake of its own team only, held
    to `limits`. The roles' permissions name each team's logs stream (`team_logs`)."""
    teams = teams or {}
    strangers = sorted(set(teams) - set(logins))
    if strangers:
        raise ValueError(f"teams are given for logins there are not: {', '.join(strangers)}")
    by_team: dict[str, dict[str, str]] = {subjects.DEFAULT_TEAM: {}}
    for login, password in logins.items():
        by_team.setdefault(teams.get(login, subjects.DEFAULT_TEAM), {})[login] = password
    other_teams = sorted(set(by_team) - {subjects.DEFAULT_TEAM})
    lines = ["accounts {", f"  {SERVICE_ACCOUNT} {{", "    jetstream: enabled", "    users: ["]
    for role, password in passwords.items():
        if role not in roles:
            raise ValueError(f"unknown NATS role {role!r}; the roles are {', '.join(roles)}")
        allowed = roles[role]
        # The logs streams of the teams with logins: theirs are the jobs that print (DEFAULT_TEAM's in ROLES).
        allowed = Permissions((*allowed.publish, *team_logs(role, other_teams)), allowed.subscribe)
        lines += _user(role, password, allowed)
    lines += ["    ]", "    exports: ["]
    lines += [f"      {{service: {json.dumps(subject)}}}" for subject in (*EXPORTS, INTAKE_EXPORT)]
    lines += ["    ]", "  }"]
    for team in sorted(by_team, key=lambda name: (name != subjects.DEFAULT_TEAM, name)):
        lines += _login_account(team, by_team[team], limits)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _login_account(team: str, logins: Mapping[str, str], limits: LoginLimits) -> list[str]:
    """The account of `team`'s logins: a user each, the imports of what GOODPUT exports, its limits."""
    from shared.teams import team_problem

    problem = None if team == subjects.DEFAULT_TEAM else team_problem(team)
    if problem is not None:
        raise ValueError(problem)
    lines = [
        f"  {team_account(team)} {{",
        f"    limits: {{max_connections: {limits.connections}, max_subscriptions: {limits.subscriptions}}}",
        "    users: [",
    ]
    for login, password in logins.items():
        problem = login_problem(login)
        if problem is not None:
            raise ValueError(problem)
        lines += _user(login, password, login_permissions(login))
    lines += ["    ]", "    imports: ["]
    # Every import shares the requester's info, so no request from a login reaches a service
    # without the server's word of who sent it and of its team (a header a login wrote itself is
    # replaced).
    lines += [
        f"      {{service: {{account: {SERVICE_ACCOUNT}, subject: {json.dumps(subject)}}}, share: true}}"
        for subject in EXPORTS
    ]
    # The login's `submit(login)` lands on its own team's intake subject: the team is the account's.
    lines.append(
        f"      {{service: {{account: {SERVICE_ACCOUNT}, subject: {json.dumps(subjects.intake(team, '*'))}}}, "
        f"to: {json.dumps(subjects.submit('*'))}, share: true}}"
    )
    return [*lines, "    ]", "  }"]


def render_server_config(
    passwords: Mapping[str, str],
    logins: Mapping[str, str],
    max_payload: int = MAX_PAYLOAD_BYTES,
    teams: Mapping[str, str] | None = None,
    limits: LoginLimits = LoginLimits(),
) -> str:
    """The security part of a nats-server config: the message size limit, what one connection may
    have pending, and the accounts (`teams`: each login's team; `limits`: each team's, as
    `render_accounts` takes them)."""
    sizes = f"max_payload: {max_payload}\nmax_pending: {MAX_PENDING_BYTES}\n"
    return sizes + render_accounts(passwords, logins, teams=teams, limits=limits)


def write_private(path: str | Path, text: str) -> None:
    """Write `text` to a file only its owner can read (it holds passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)


def logins_from(directory: str | Path | None, team_logins_only: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    """Each login's password, and the team of each login of a team, from the files of `directory`:
    one per login, holding its password, named after it (a login of DEFAULT_TEAM) or `TEAM.LOGIN`
    (a login of TEAM: a Secret's key may hold a dot, a login's name may not). `team_logins_only`:
    the `TEAM.LOGIN` files alone (in a folder that holds the roles' passwords too)."""
    passwords: dict[str, str] = {}
    teams: dict[str, str] = {}
    if directory is None:
        return passwords, teams
    for file in sorted(Path(directory).iterdir()):
        if not file.is_file() or file.name.startswith("."):
            continue
        team, dot, login = file.name.rpartition(TEAM_LOGIN_SEPARATOR)
        if team_logins_only and not dot:
            continue
        if login in passwords:
            raise ValueError(f"login {login!r} has two files in {directory}: a login is one user, in one team")
        passwords[login] = file.read_text().strip()
        if dot:
            teams[login] = team
    return passwords, teams


def main(argv: list[str] | None = None) -> int:
    """`python -m shared.permissions [--passwords DIR] [--logins DIR] [--out FILE]`: the config block
    (each role's password from $GOODPUT_NATS_PASSWORD_<ROLE> or DIR/<role>, the default login `user`'s
    from DIR/user when there is one, and each team's logins' from DIR/TEAM.LOGIN; each login's of the
    logins' folder from a file named after it, or TEAM.LOGIN for a login of TEAM), to include from
    nats-server's configuration."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m shared.permissions", description=main.__doc__)
    parser.add_argument(
        "--passwords",
        help="folder with one file per role, named after it, holding its password (and `user`, and TEAM.LOGIN "
        "for the logins of a team)",
    )
    parser.add_argument(
        "--logins",
        help="folder with one file per login holding its password, named after it, or TEAM.LOGIN for a login of TEAM",
    )
    parser.add_argument("--roles", default=",".join(ROLES), help="comma-separated roles to render (default: all)")
    parser.add_argument("--max-payload", type=int, default=MAX_PAYLOAD_BYTES, help="largest message in bytes")
    parser.add_argument("--out", help="write the block to this file, readable by its owner only (default: stdout)")
    args = parser.parse_args(argv)
    try:
        passwords = passwords_from([role for role in args.roles.split(",") if role], args.passwords)
        default = Path(args.passwords or ".") / DEFAULT_LOGIN
        logins = {DEFAULT_LOGIN: default.read_text().strip()} if args.passwords and default.is_file() else {}
        teams: dict[str, str] = {}
        for folder, team_logins_only in ((args.passwords, True), (args.logins, False)):
            found, their_teams = logins_from(folder, team_logins_only)
            twice = sorted(set(found) & set(logins))
            if twice:
                raise ValueError(f"logins with two files: {', '.join(twice)}; a login is one user, in one team")
            logins.update(found)
            teams.update(their_teams)
        config = render_server_config(passwords, logins, args.max_payload, teams)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    if args.out:
        write_private(args.out, config)
    else:
        sys.stdout.write(config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
