"""`goodput submit JOB.yaml` — store a job submission in JetStream and print its id."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import msgspec
import nats.errors
import yaml

from shared import credentials
from shared.bus import DEFAULT_SERVER, SERVER_ENV


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("submit", help="submit a job (YAML or JSON JobSpec) to a running goodput")
    parser.add_argument("job", help="job file: id, application, and optionally requested_gpus, requested_batch, "
                                    "min_gpus, rigid, strong_scaling, gpu_types")
    parser.add_argument("--server", default=os.environ.get(SERVER_ENV, DEFAULT_SERVER),
                        help=f"NATS URL (default: ${SERVER_ENV}, else {DEFAULT_SERVER})")
    credentials.add_arguments(parser)
    parser.set_defaults(func=_submit)


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
    from shared import streams, subjects
    from shared.bus import Bus

    # A one-shot client: fail when the server is not there, rather than retry forever (nats-py reads
    # max_reconnect_attempts=0 as "no limit" while choosing a server; 1 gives up after one try).
    bus = await Bus.connect(server, "goodput-submit", allow_reconnect=False, max_reconnect_attempts=1, **options)
    try:
        await streams.ensure_jobs(bus)
        ack = await bus.js_publish(subjects.SUBMIT, spec, msg_id=spec.id)
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
