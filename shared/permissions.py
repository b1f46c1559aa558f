"""Who may publish and subscribe to what: one table, next to the subjects, rendered into nats-server's
`authorization { users = [...] }` block.

Each role is one NATS user: the five services, `operator` (who drives replays and live runs) and
`user` (whoever runs `goodput submit` and `goodput status`). The rules, beyond each role's own subjects:

- Replies (requests, JetStream acks, KV and consumer replies) come back on the role's own inboxes,
  `_INBOX_<role>.>`: a client connects with that inbox prefix (shared/credentials.py sets it from
  the user name), so no role can subscribe to another's replies. A service answers by publishing
  to the roles' inboxes, and nowhere else: nats-server's `allow_responses` is not used, since it
  lets a responder publish to whatever reply subject a request names (`$JS.API.STREAM.DELETE.…`,
  a KV key), past the responder's own allow list; and a service drops a request whose
  reply is not an inbox before handling it (shared/bus.py).
- Only the operator creates or changes streams, consumers and KV buckets (shared/storage.py's
  plan, deploy/setup.py). The services read a stream's info, pull from and acknowledge their own
  durable consumer, and read and write their own buckets (a KV write is a publish on
  `$KV.<bucket>.<key>`); a reader of a stream's log creates ordered consumers on that stream only
  (`_follow`), which cannot change it. Services answer the NATS service API (`$SRV.PING`/`INFO`/
  `STATS`, `nats.micro`) and may ping themselves (their readiness probe).
- Only the policy publishes allocations (`PLACE`, `APPLY`): a profiler, an estimator or a user
  cannot.
- A user may publish a submission (`SUBMIT`, stored by JetStream: the JetStream publish is a plain
  publish whose ack comes back on an inbox), use the user API (`goodput.api.*`: submit, look up,
  list, cancel; the profiler serves it and stores what it takes), read the submissions stream's
  info, and read status (request the status subjects, ping and discover services). A user cannot
  create, change or delete anything in JetStream.

What stays coarse: replicas of one role share its inboxes, and every `user` shares the user role's;
a service may publish to any role's inbox (a reply no one waits for is dropped by its receiver).

Passwords never live here or in the repository: `render_authorization` takes them as a mapping, and
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

__all__ = ["ROLES", "Permissions", "inbox_prefix", "passwords_from", "render_authorization", "render_server_config"]

SERVICE_API = ("$SRV.PING", "$SRV.PING.>", "$SRV.INFO", "$SRV.INFO.>", "$SRV.STATS", "$SRV.STATS.>")
MAX_PAYLOAD_BYTES = 1024 * 1024          # nats-server's max_payload: the largest message it accepts
SERVICES = ("placer", "profiler", "estimator", "executor", "policy")
CLIENTS = ("operator", "user")
PASSWORD_ENV_PREFIX = "GOODPUT_NATS_PASSWORD_"   # + role in capitals, e.g. GOODPUT_NATS_PASSWORD_PLACER


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
    return (_info(stream), f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>", f"$JS.API.STREAM.PURGE.{stream}", kv_subjects(bucket))


def _durable(stream: str, consumer: str) -> tuple[str, ...]:
    """Pull from and acknowledge one durable consumer the operator made (Bus.bind_consumer)."""
    return (f"$JS.API.CONSUMER.INFO.{stream}.{consumer}", f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}",
            f"$JS.ACK.{stream}.{consumer}.>")


def _nodes() -> tuple[str, ...]:
    """Read (and, an agent, renew) the node agents' membership: keys listed through an ordered consumer."""
    return (*_kv(subjects.NODES_BUCKET), *_follow(f"KV_{subjects.NODES_BUCKET}"))


def _objects(store: str) -> tuple[str, ...]:
    """Copy objects in and out of an object store (nats-py: chunks and meta on `$O.<store>.>`, the
    meta read by direct get, a read through an ordered consumer, old chunks purged)."""
    stream = f"OBJ_{store}"
    return (_info(stream), f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>", f"$JS.API.STREAM.PURGE.{stream}", f"$O.{store}.>", *_follow(stream))


def _provision() -> tuple[str, ...]:
    """Create every stream, bucket and durable consumer of the plan, or bring it to the plan."""
    streams = [*storage.STREAMS, *(bucket.stream for bucket in storage.BUCKETS.values()),
               *(f"OBJ_{store}" for store in storage.OBJECT_STORES)]
    made = tuple(f"$JS.API.STREAM.{op}.{name}" for name in streams for op in ("CREATE", "UPDATE", "INFO"))
    api = "$JS.API.CONSUMER"
    return made + tuple(subject for c in storage.CONSUMERS.values() for subject in (
        f"{api}.CREATE.{c.stream}.{c.name}", f"{api}.CREATE.{c.stream}.{c.name}.>",
        f"{api}.DURABLE.CREATE.{c.stream}.{c.name}", f"{api}.INFO.{c.stream}.{c.name}"))


def _follow(stream: str) -> tuple[str, ...]:
    """Read a stream through ordered consumers (Bus.follow): nats-py looks the stream up by subject,
    creates unnamed consumers, and answers the server's flow control on `$JS.FC`."""
    return ("$JS.API.STREAM.NAMES", f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.INFO.{stream}.>", f"$JS.FC.{stream}.>")


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def _dead_letters(consumer: str) -> tuple[str, ...]:
    """Store what a consumer could not process in the dead letters' stream (streams.ensure_dead_letters)."""
    return (subjects.dead_letters(consumer), _info(subjects.DEAD_LETTER_STREAM))


def _service(name: str, publish: Iterable[str], subscribe: Iterable[str]) -> Permissions:
    """A service: answers on the roles' inboxes only (the replies to what they asked)."""
    replies = tuple(f"{inbox_prefix(role)}.>" for role in (*SERVICES, *CLIENTS))
    return Permissions(publish=(f"$SRV.PING.{name}", *replies, *publish),
                       subscribe=(f"{inbox_prefix(name)}.>", *SERVICE_API, *subscribe))


def _client(name: str, publish: Iterable[str]) -> Permissions:
    return Permissions(publish=tuple(publish), subscribe=(f"{inbox_prefix(name)}.>",))


STATUS_SUBJECTS = (subjects.RECORDS, subjects.EXECUTOR_STATUS, subjects.ESTIMATOR_STATUS, subjects.POLICY_STATUS,
                   subjects.EXECUTOR_NODES)
JOBS = subjects.JOBS_STREAM

ROLES: dict[str, Permissions] = {
    "placer": _service("placer", publish=(), subscribe=(subjects.PLACE,)),
    "profiler": _service(
        "profiler",
        # It serves the user API too: it stores valid submissions and cancel orders, asks for the records.
        publish=(subjects.REJECTED, subjects.PROFILED, subjects.PROFILES, subjects.SUBMIT, subjects.CANCEL,
                 subjects.RECORDS, _info(JOBS),
                 *_durable(JOBS, subjects.PROFILER_CONSUMER), *_dead_letters(subjects.PROFILER_CONSUMER),
                 *_kv(subjects.JOB_OWNERS_BUCKET), *_nodes(), subjects.node_subject("*", "profile")),
        subscribe=(*subjects.API_SUBJECTS, subjects.CANCEL),     # cancel orders: a cancelled job is not profiled
    ),
    "estimator": _service(
        "estimator",
        publish=_kv(subjects.ESTIMATES_BUCKET),
        subscribe=(subjects.PROFILES, subjects.OBSERVE, subjects.MODELS, subjects.ESTIMATOR_STATUS),
    ),
    # The executors, and the node agents of real ones (they share this role): the executor service
    # drives the agents' workers, each agent renews its node in KV and answers for it.
    "executor": _service(
        "executor",
        publish=(subjects.OBSERVE, *_kv(subjects.EXECUTOR_BUCKET), *_kv(subjects.NODE_JOBS_BUCKET),
                 subjects.NODE_SUBJECTS, *_nodes(), *_kv(subjects.DRAINED_BUCKET), *_objects(subjects.CHECKPOINTS_STORE),
                 *_follow(f"KV_{subjects.DRAINED_BUCKET}"),
                 _info(JOBS),
                 *_durable(JOBS, subjects.EXECUTOR_CONSUMER), *_durable(JOBS, subjects.NODE_AGENT_CONSUMER),
                 *_dead_letters(subjects.EXECUTOR_CONSUMER), *_dead_letters(subjects.NODE_AGENT_CONSUMER)),
        subscribe=(subjects.FACTS, subjects.APPLY, subjects.ADVANCE, subjects.LIVE_JOBS, subjects.RECORDS,
                   subjects.EXECUTOR_STATUS, subjects.EXECUTOR_DRAIN, subjects.EXECUTOR_NODES, subjects.NODE_SUBJECTS),
    ),
    "policy": _service(
        "policy",
        publish=(subjects.FACTS, subjects.MODELS, subjects.PLACE, subjects.APPLY, subjects.ADVANCE,
                 subjects.LIVE_JOBS, *subjects.RUN_LOG_SUBJECTS, _info(subjects.RUN_LOG_STREAM),
                 *_kv(subjects.RUNS_BUCKET), *_follow(f"KV_{subjects.RUNS_BUCKET}"), *_kv(subjects.LEASE_BUCKET),
                 subjects.POLICY_STATUS),          # its readiness probe asks how the live run is
        subscribe=(subjects.POLICY_STATUS,),
    ),
    # Whoever sets up the storage and drives replays and live runs (`goodput up`, deploy/setup.py,
    # deploy/live_run.py): makes the streams, buckets and consumers, submits, creates runs in KV,
    # follows their logs and the submissions, asks the services how they are.
    "operator": _client("operator", publish=(
        *_provision(), subjects.SUBMIT, subjects.REPLAY_SUBMIT, *_follow(JOBS), *_follow(subjects.RUN_LOG_STREAM),
        *_kv(subjects.RUNS_BUCKET), *STATUS_SUBJECTS, *SERVICE_API, *subjects.API_SUBJECTS, subjects.EXECUTOR_DRAIN)),
    "user": _client("user", publish=(
        subjects.SUBMIT, *subjects.API_SUBJECTS, "$JS.API.INFO", _info(JOBS), *STATUS_SUBJECTS, *SERVICE_API)),
}

# Letters, digits and a few marks: safe inside a quoted nats-server config string, and no $VAR.
_PASSWORD = re.compile(r"^[A-Za-z0-9_.~+=/-]{8,}$")


def passwords_from(roles: Iterable[str] = ROLES, directory: str | Path | None = None,
                   environ: Mapping[str, str] | None = None) -> dict[str, str]:
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


def render_authorization(passwords: Mapping[str, str], roles: Mapping[str, Permissions] = ROLES) -> str:
    """nats-server's `authorization { users = [...] }` block: one user per role in `passwords`, named
    after the role, with that role's permissions."""
    lines = ["authorization {", "  users = ["]
    for role, password in passwords.items():
        if role not in roles:
            raise ValueError(f"unknown NATS role {role!r}; the roles are {', '.join(roles)}")
        if not _PASSWORD.match(password):
            raise ValueError(f"the password of NATS role {role!r} must be at least 8 characters of letters, "
                             "digits and _.~+=/-")
        permissions = roles[role]
        lines += [
            f"    {{user: {json.dumps(role)}, password: {json.dumps(password)}, permissions: {{",
            f"      publish: {{allow: {_quoted(permissions.publish)}}}",
            f"      subscribe: {{allow: {_quoted(permissions.subscribe)}}}",
        ]
        lines.append("    }}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def render_server_config(passwords: Mapping[str, str], max_payload: int = MAX_PAYLOAD_BYTES) -> str:
    """The security part of a nats-server config: the message size limit and the users."""
    return f"max_payload: {max_payload}\n" + render_authorization(passwords)


def write_private(path: str | Path, text: str) -> None:
    """Write `text` to a file only its owner can read (it holds passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)


def main(argv: list[str] | None = None) -> int:
    """`python -m shared.permissions [--passwords DIR] [--out FILE]`: the config block (passwords from
    $GOODPUT_NATS_PASSWORD_<ROLE> or DIR/<role>), to include from nats-server's configuration."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m shared.permissions", description=main.__doc__)
    parser.add_argument("--passwords", help="folder with one file per role, named after it, holding its password")
    parser.add_argument("--roles", default=",".join(ROLES), help="comma-separated roles to render (default: all)")
    parser.add_argument("--max-payload", type=int, default=MAX_PAYLOAD_BYTES, help="largest message in bytes")
    parser.add_argument("--out", help="write the block to this file, readable by its owner only (default: stdout)")
    args = parser.parse_args(argv)
    try:
        passwords = passwords_from([role for role in args.roles.split(",") if role], args.passwords)
        config = render_server_config(passwords, args.max_payload)
    except ValueError as error:
        parser.error(str(error))
    if args.out:
        write_private(args.out, config)
    else:
        sys.stdout.write(config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
