"""`goodput submit JOB.yaml` — store a job submission in JetStream and print its id."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
import yaml

from shared import credentials
from shared.bus import DEFAULT_SERVER, SERVER_ENV


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("submit", help="submit a job (YAML or JSON JobSpec) to a running goodput")
    parser.add_argument("job", help="job file: id, application, and optionally requested_gpus, requested_batch, "
                                    "min_gpus, rigid, strong_scaling, gpu_types")
    add_connection_arguments(parser)
    parser.set_defaults(func=_submit)


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """--server and the credentials of a user's command: from the environment, else from the default
    data folder's user.env (a `goodput up` on this machine)."""
    environ = credentials.user_environment()
    parser.add_argument("--server", default=environ.get(SERVER_ENV, DEFAULT_SERVER),
                        help=f"NATS URL (default: ${SERVER_ENV}, else {credentials.DEFAULT_DATA / credentials.USER_ENV}'s, "
                             f"else {DEFAULT_SERVER})")
    credentials.add_arguments(parser, environ)


def load_job(path: str | Path):
    """A JobSpec from a YAML or JSON file; ValueError with the field that is wrong."""
    from shared.schema import JobSpec

    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from None
    try:
        return msgspec.convert(document, JobSpec, strict=False)     # as the bus decodes: 2.0 is 2
    except msgspec.ValidationError as exc:
        raise ValueError(f"{path}: {exc}") from None


async def submit(spec, server: str, **options) -> bool:
    """Publish the spec to the submissions stream; True if stored, False if that id was already stored.
    `options`: nats-py connect options, e.g. `shared.credentials.connect_options()`."""
    from shared import subjects
    from shared.bus import Bus
    from shared.storage import MAX_SUBMISSION_BYTES

    # A one-shot client: fail when the server is not there, rather than retry forever (nats-py reads
    # max_reconnect_attempts=0 as "no limit" while choosing a server; 1 gives up after one try).
    bus = await Bus.connect(server, "goodput-submit", allow_reconnect=False, max_reconnect_attempts=1, **options)
    try:
        if len(bus.encode(spec)) > MAX_SUBMISSION_BYTES:
            raise ValueError(f"job {spec.id}: a submission is at most {MAX_SUBMISSION_BYTES // 1024} KiB")
        try:
            ack = await bus.js_publish(subjects.SUBMIT, spec, msg_id=spec.id, timeout=10)
        except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
            raise ValueError(f"no submissions stream at {credentials.redact(server)}: the operator sets it up "
                             "(`goodput up` does at start)") from None
        except nats.js.errors.APIError as error:       # e.g. the stream is full: it refuses, drops nothing
            raise ValueError(f"the submissions stream refused job {spec.id}: {error.description}") from None
        return not ack.duplicate
    finally:
        await bus.close()


def _submit(args: argparse.Namespace) -> int:
    spec = load_job(args.job)
    options = credentials.connect_options(credentials.from_args(args))   # ValueError: a missing file
    try:
        stored = asyncio.run(submit(spec, args.server, **options))
    except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
        raise ValueError(f"cannot reach NATS at {credentials.redact(args.server)} ({exc or type(exc).__name__}); is `goodput up` running?") from None
    print(spec.id if stored else f"{spec.id} (already submitted: not stored again)")
    return 0
