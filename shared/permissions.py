"""Who may publish and subscribe to what: one table, next to the subjects, rendered into nats-server's
`authorization { users = [...] }` block.

Each role is one NATS user: the five services, `operator` (who drives replays and live runs) and
`user` (whoever runs `goodput submit` and `goodput status`). The rules, beyond each role's own subjects:

- Every client receives replies on `_INBOX.>` (requests, JetStream acks, KV and consumer replies);
  services answer requests through `allow_responses` (they may publish once to the reply subject of
  a request they received, and nowhere else by that right).
- Services use JetStream and KV through `$JS.API.>` (streams, consumers, `$JS.API.DIRECT.GET` for KV
  reads) and `$JS.ACK.>` (acknowledging pulled messages); a KV write is a publish on
  `$KV.<bucket>.<key>`, so each service may write only its own buckets. They answer the NATS service
  API (`$SRV.PING`/`INFO`/`STATS`, `nats.micro`).
- Only the policy publishes allocations (`PLACE`, `APPLY`): a profiler, an estimator or a user
  cannot.
- A user may publish a submission (`SUBMIT`, stored by JetStream: the JetStream publish is a plain
  publish whose ack comes back on an inbox; `goodput submit` also creates the submissions stream if it
  is not there yet, hence `$JS.API.STREAM.CREATE.GOODPUT_JOBS` — creating an existing stream with
  its own configuration is a no-op, and a different configuration is refused) and read status
  (request the status subjects, ping services).

Passwords never live here or in the repository: `render_authorization` takes them as a mapping, and
`passwords_from` reads them from files or the environment.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from shared import subjects

__all__ = ["ROLES", "Permissions", "passwords_from", "render_authorization", "render_server_config"]

INBOX = "_INBOX.>"
JS_API = "$JS.API.>"
JS_ACK = "$JS.ACK.>"
SERVICE_API = ("$SRV.PING", "$SRV.PING.>", "$SRV.INFO", "$SRV.INFO.>", "$SRV.STATS", "$SRV.STATS.>")
MAX_PAYLOAD_BYTES = 1024 * 1024          # nats-server's max_payload: the largest message it accepts
PASSWORD_ENV_PREFIX = "GOODPUT_NATS_PASSWORD_"   # + role in capitals, e.g. GOODPUT_NATS_PASSWORD_PLACER


def kv_subjects(bucket: str) -> str:
    """What a KV write publishes on."""
    return f"$KV.{bucket}.>"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False        # may reply to requests it received


def _service(publish: Iterable[str], subscribe: Iterable[str]) -> Permissions:
    return Permissions(publish=(JS_API, JS_ACK, *publish), subscribe=(INBOX, *SERVICE_API, *subscribe),
                       allow_responses=True)


STATUS_SUBJECTS = (subjects.RECORDS, subjects.EXECUTOR_STATUS, subjects.ESTIMATOR_STATUS, subjects.POLICY_STATUS)

ROLES: dict[str, Permissions] = {
    "placer": _service(publish=(), subscribe=(subjects.PLACE,)),
    "profiler": _service(
        publish=(subjects.REJECTED, subjects.PROFILES),
        subscribe=(),
    ),
    "estimator": _service(
        publish=(kv_subjects(subjects.ESTIMATES_BUCKET),),
        subscribe=(subjects.PROFILES, subjects.OBSERVE, subjects.MODELS, subjects.ESTIMATOR_STATUS),
    ),
    "executor": _service(
        publish=(subjects.OBSERVE, kv_subjects(subjects.EXECUTOR_BUCKET)),
        subscribe=(subjects.FACTS, subjects.APPLY, subjects.ADVANCE, subjects.LIVE_JOBS, subjects.RECORDS,
                   subjects.EXECUTOR_STATUS),
    ),
    "policy": _service(
        publish=(subjects.FACTS, subjects.MODELS, subjects.PLACE, subjects.APPLY, subjects.ADVANCE,
                 subjects.LIVE_JOBS, *subjects.RUN_LOG_SUBJECTS, kv_subjects(subjects.RUNS_BUCKET),
                 kv_subjects(subjects.LEASE_BUCKET)),
        subscribe=(subjects.POLICY_STATUS,),
    ),
    # Whoever drives replays and live runs (`goodput up`, deploy/live_run.py): submits, creates runs
    # in KV, follows their logs, asks the services how they are.
    "operator": Permissions(
        publish=(JS_API, subjects.SUBMIT, kv_subjects(subjects.RUNS_BUCKET), *STATUS_SUBJECTS, *SERVICE_API),
        subscribe=(INBOX,),
    ),
    "user": Permissions(
        publish=(subjects.SUBMIT, "$JS.API.INFO", f"$JS.API.STREAM.INFO.{subjects.JOBS_STREAM}",
                 f"$JS.API.STREAM.CREATE.{subjects.JOBS_STREAM}", *STATUS_SUBJECTS, "$SRV.PING", "$SRV.PING.>"),
        subscribe=(INBOX,),
    ),
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
        if permissions.allow_responses:
            lines.append("      allow_responses: true")
        lines.append("    }}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def render_server_config(passwords: Mapping[str, str], max_payload: int = MAX_PAYLOAD_BYTES) -> str:
    """The security part of a nats-server config: the message size limit and the users."""
    return f"max_payload: {max_payload}\n" + render_authorization(passwords)


def main(argv: list[str] | None = None) -> int:
    """`python -m shared.permissions [--passwords DIR]`: print the config block (passwords from
    $GOODPUT_NATS_PASSWORD_<ROLE> or DIR/<role>), to include from nats-server's configuration."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m shared.permissions", description=main.__doc__)
    parser.add_argument("--passwords", help="folder with one file per role, named after it, holding its password")
    parser.add_argument("--roles", default=",".join(ROLES), help="comma-separated roles to render (default: all)")
    parser.add_argument("--max-payload", type=int, default=MAX_PAYLOAD_BYTES, help="largest message in bytes")
    args = parser.parse_args(argv)
    try:
        passwords = passwords_from([role for role in args.roles.split(",") if role], args.passwords)
        sys.stdout.write(render_server_config(passwords, args.max_payload))
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
