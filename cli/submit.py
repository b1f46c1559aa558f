"""`goodput submit JOB.yaml...` — submit jobs through the user API and print each answer;
`goodput cancel ID` — cancel one. `--stream` stores the submission in JetStream without waiting
for an answer (durable, fire-and-forget: taken even while the profiler is down).

A job that carries its code (`--code DIR`, or `code: DIR` in the job file, relative to it) has the
folder packed (`shared.code_archive`), uploaded through the API in chunks unless the code store
has it already, and submitted naming the archive's digest: `id` and `entrypoint` are then a whole
job file.

`teams_status` answers `goodput status --teams`: each team's guaranteed GPUs, their use and their
lending per GPU type, from `goodput.api.teams`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
import yaml

from shared import credentials
from shared.bus.connection import DEFAULT_SERVER, SERVER_ENV
from shared.bus.encoding import from_builtins
from shared.text import printable


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("submit", help="submit jobs (YAML or JSON JobSpecs) to a running goodput")
    parser.add_argument(
        "jobs",
        nargs="+",
        metavar="JOB",
        help="job files, each submitted in turn: id, application, and optionally requested_gpus, "
        "requested_batch, min_gpus, rigid, strong_scaling, gpu_types; a job with its own code: id, "
        "entrypoint (a script or module in the code), and optionally args, launcher (goodput or torchrun) and the others",
    )
    parser.add_argument(
        "--code",
        metavar="DIR",
        help="the job's own code: this folder is packed, uploaded (unless stored before) and run by "
        "the node agents; overrides `code:` in the job file",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="store it in the submissions stream and return without the API's answer "
        "(`goodput status ID` shows the verdict)",
    )
    add_connection_arguments(parser)
    parser.set_defaults(func=_submit)

    cancel = sub.add_parser("cancel", help="cancel a job: queued, it never starts; running, it checkpoints and stops")
    cancel.add_argument("id", help="the job's id")
    add_connection_arguments(cancel)
    cancel.set_defaults(func=_cancel)
    drain = sub.add_parser("drain", help="the operator's: move every job off a node and place nothing new there")
    drain.add_argument("node", help="the node's name, as its agent serves it (--node)")
    drain.add_argument("--undo", action="store_true", help="use the node again")
    add_connection_arguments(drain, role="operator")
    drain.set_defaults(func=_drain)


def add_connection_arguments(parser: argparse.ArgumentParser, role: str = "user") -> None:
    """--server and the credentials of a user's command: from the environment, else from the default
    data folder's user.env (a `goodput up` on this machine); the operator's command logs in as the
    operator there (its password file under the data folder's secrets)."""
    environ = credentials.user_environment(role=role)
    parser.add_argument(
        "--server",
        default=environ.get(SERVER_ENV, DEFAULT_SERVER),
        help=f"NATS URL (default: ${SERVER_ENV}, else {credentials.DEFAULT_DATA / credentials.USER_ENV}'s, "
        f"else {DEFAULT_SERVER})",
    )
    credentials.add_arguments(parser, environ)


PLACEHOLDER = "0" * 64  # a code job's digest while its folder is not yet packed: the rest is checked first


def code_folder(path: str | Path, code: str | Path | None = None) -> Path | None:
    """The folder of a job's own code: `code` (--code), else the job file's `code:` when it names a
    folder (relative to the file) rather than an archive's digest; None for a job without one."""
    import re

    if code is not None:
        return Path(code)
    named = _document(Path(path)).get("code")
    if isinstance(named, str) and not re.fullmatch(r"[0-9a-f]{64}", named):
        return Path(path).parent / named
    return None


def _document(path: Path) -> dict:
    """The job file's mapping: JSON for a `.json` file, else YAML; ValueError saying what is wrong."""
    text = path.read_text()
    if path.suffix.lower() == ".json":
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    else:
        try:
            document = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(document, dict):
        what = "nothing" if document is None else f"a {type(document).__name__}"
        raise ValueError(f"{path} holds {what}, not a job: a mapping of fields (id, application, ...)")
    return document


def load_job(path: str | Path, archive: str | None = None, folder: Path | None = None):
    """A JobSpec from a YAML or JSON file; ValueError with the field that is wrong. `archive`: the
    digest of the job's own code, in place of the file's `code:`; `folder`: that code, where a
    `requirements:` that names a file (a requirements.txt) is read."""
    from shared.schema.jobs import JobSpec

    path = Path(path)
    document = _document(path)
    if archive is not None:
        document = {**document, "code": archive}
    if isinstance(document.get("requirements"), str):
        document = {**document, "requirements": _requirements_file(path, document["requirements"], folder)}
    try:
        return from_builtins(document, JobSpec)  # as the bus reads JSON: 2.0 is 2, "2" is no number
    except msgspec.ValidationError as exc:
        from shared.submissions import malformed_reason

        hint = (
            "; its code is a folder: `goodput submit JOB --code DIR`, or `code: DIR` in the job file"
            if "entrypoint" in document and "code" not in document
            else ""
        )
        raise ValueError(f"{path}: {malformed_reason(exc).removeprefix('malformed submission: ')}{hint}") from None


def _requirements_file(path: Path, named: str, folder: Path | None) -> list[str]:
    """The requirements of the file `named` in the job's code `folder` (a requirements.txt), as lines."""
    from shared.requirements import lines

    if folder is None:
        raise ValueError(f"{path}: requirements: {named!r} names a file in the job's code, and it carries none")
    file = (folder / named).resolve()
    if folder.resolve() not in file.parents:
        raise ValueError(f"{path}: requirements: {named!r} is not a file in the job's code {folder}")
    try:
        return lines(file.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: requirements: cannot read {file}: {error}") from None


async def submit(spec, server: str, **options) -> None:
    """Publish the spec to the login's own intake subject, where it is stored. The gate then judges
    it as the API would (`goodput status ID` shows its verdict). `options`: nats-py connect options, e.g. `shared.credentials.connect_options()`: their
    user is the login (none: the operator's, on an insecure stack)."""
    from shared import subjects
    from shared.bus import Bus
    from shared.storage import MAX_INTAKE_BYTES

    bus = await Bus.connect_once(server, "goodput-submit", **options)
    try:
        if len(bus.encode(spec)) > MAX_INTAKE_BYTES:
            raise ValueError(
                f"job {spec.id}: a submission stored with --stream is at most {MAX_INTAKE_BYTES // 1024} KiB"
            )
        try:
            await bus.js_publish(
                subjects.submit(options["user"])
                if options.get("user")
                else subjects.intake(subjects.DEFAULT_TEAM, subjects.OPERATOR),
                spec,
                timeout=10,
            )
        except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
            raise ValueError(
                f"no intake stream at {credentials.redact(server)}: the operator sets it up "
                "(`goodput up` does at start)"
            ) from None
        except nats.js.errors.APIError as error:  # e.g. this login's backlog is full: it refuses, drops nothing
            raise ValueError(f"the intake stream refused job {spec.id}: {error.description}") from None
    finally:
        await bus.close()


API_UNANSWERED = (
    "no user API answers at {server} (the profiler serves it): is the stack up? `--stream` stores a "
    "submission without it"
)


async def ask(server: str, subject: str, request, answer_type, unanswered: str = API_UNANSWERED, **options):
    """One request to the user API (or the operator's), as a one-shot client; its answer."""
    from shared.bus import Bus

    bus = await Bus.connect_once(server, "goodput-cli", **options)
    try:
        return await ask_on(bus, server, subject, request, answer_type)
    except nats.errors.NoRespondersError:
        raise ValueError(unanswered.format(server=credentials.redact(server))) from None
    finally:
        await bus.close()


async def ask_on(bus, server: str, subject: str, request, answer_type):
    """One request on a connected bus; its answer, or ValueError at once when the server refuses the
    login the subject (no answer would come)."""
    answer = asyncio.ensure_future(bus.request(subject, request, answer_type, timeout=30))
    refused = asyncio.ensure_future(bus.refused.wait())
    try:
        await asyncio.wait({answer, refused}, return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():
            raise ValueError(
                f"NATS at {credentials.redact(server)} refused this login's request on {subject} "
                f"({next(e for e in reversed(bus.refusals) if 'permissions' in str(e).lower())})"
            )
        return answer.result()
    finally:
        for task in (answer, refused):
            task.cancel()


def _call(
    args: argparse.Namespace, subject: str, request, answer_type, unanswered: str = API_UNANSWERED, refused: str = ""
):
    """The answer; ValueError with the API's reason (after `refused`) when it refuses the request."""
    from nats.micro.request import ServiceError

    options = credentials.connect_options(credentials.from_args(args))  # ValueError: a missing file
    try:
        return asyncio.run(ask(args.server, subject, request, answer_type, unanswered, **options))
    except ServiceError as error:  # the API refused the request: its reason
        raise ValueError(refused + error.description) from None
    except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
        raise ValueError(credentials.unreachable(args.server, exc, options)) from None


def _submit(args: argparse.Namespace) -> int:
    """Each file in turn; one refused (or unreadable) is said on stderr and the others still go: exit
    status 2 if any was not accepted."""
    if len(args.jobs) == 1:
        return _submit_one(args, args.jobs[0])
    refused = 0
    for path in args.jobs:
        try:
            _submit_one(args, path)
        except (ValueError, FileNotFoundError) as error:
            print(f"goodput submit: error: {error}", file=sys.stderr)
            refused += 1
    if refused:
        print(f"goodput submit: {refused} of {len(args.jobs)} jobs not submitted", file=sys.stderr)
    return 2 if refused else 0


def _submit_one(args: argparse.Namespace, path: str) -> int:
    from shared import subjects
    from shared.schema.api import SubmitAnswer

    folder = code_folder(path, args.code)
    spec = load_job(path, None if folder is None else PLACEHOLDER, folder)  # refused now, before any upload
    if folder is not None:
        spec = load_job(path, _upload(args, folder, spec.id), folder)
    if args.stream:
        options = credentials.connect_options(credentials.from_args(args))
        try:
            asyncio.run(submit(spec, args.server, **options))
        except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
            raise ValueError(credentials.unreachable(args.server, exc, options)) from None
        print(f"{spec.id}: stored; the API judges it next (`goodput status {spec.id}`)")
        return 0
    refused = f"job {spec.id} refused: "
    answer = _call(args, subjects.API_SUBMIT, spec, SubmitAnswer, refused=refused)
    if not answer.accepted:  # an API of before refusals were service errors
        raise ValueError(refused + answer.reason)
    print(printable(f"{spec.id}: accepted ({answer.state}){'; ' + answer.reason if answer.reason else ''}"))
    for note in answer.notes:
        print(printable(f"  note: {note}"))
    return 0


def _upload(args: argparse.Namespace, folder: Path, job_id: str) -> str:
    """Pack `folder` and upload it through the API, unless the code store has it; its digest."""
    from nats.micro.request import ServiceError

    from shared.code_archive import ArchiveRefused, digest, pack

    try:
        data = pack(folder)
    except (ArchiveRefused, OSError) as error:
        raise ValueError(f"job {job_id}: its code {folder}: {error}") from None
    archive = digest(data)
    options = credentials.connect_options(credentials.from_args(args))
    try:
        stored = asyncio.run(upload(data, args.server, _progress(archive), **options))
    except ServiceError as error:
        raise ValueError(f"job {job_id}: its code {folder} refused: {error.description}") from None
    except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
        raise ValueError(credentials.unreachable(args.server, exc, options)) from None
    what = "uploaded" if stored else "stored before, not uploaded again"
    print(f"{job_id}: code {folder} ({len(data) / 1024:,.0f} KiB, sha256 {archive[:12]}): {what}", file=sys.stderr)
    return archive


def _progress(archive: str):
    """Say on stderr, on one line, how much of a large upload has gone."""
    from shared.schema.code import CHUNK_BYTES

    def progress(sent: int, size: int) -> None:
        if size > 4 * CHUNK_BYTES and sys.stderr.isatty():
            end = "\n" if sent >= size else ""
            print(
                f"\r  uploading {archive[:12]}: {sent / 2**20:.1f} of {size / 2**20:.1f} MiB", end=end, file=sys.stderr
            )

    return progress


async def upload(data: bytes, server: str, progress=lambda sent, size: None, **options) -> bool:
    """Upload an archive through the user API (`goodput.api.code.*`) in chunks, unless the code store
    has it: True if it was uploaded now, False if stored before. ServiceError: the API refused it."""
    from shared import subjects
    from shared.bus import Bus
    from shared.code_archive import digest
    from shared.schema.code import CHUNK_BYTES, CodeAnswer, CodeChunk, CodeRequest

    archive = digest(data)
    bus = await Bus.connect_once(server, "goodput-submit", **options)
    try:
        try:
            answer = await bus.request(subjects.API_CODE_HAS, CodeRequest(archive), CodeAnswer, timeout=30)
        except nats.errors.NoRespondersError:
            raise ValueError(API_UNANSWERED.format(server=credentials.redact(server))) from None
        if answer.stored:
            return False
        offset = 0
        while True:  # the API says when it has stored it: chunk after chunk, then its last answer
            chunk = CodeChunk(archive, len(data), offset, data[offset : offset + CHUNK_BYTES])
            answer = await bus.request(subjects.API_CODE_PUT, chunk, CodeAnswer, timeout=60)
            offset += len(chunk.data)
            progress(offset, len(data))
            if answer.stored:
                return not answer.reason  # "stored before": another upload of it was stored meanwhile
            if answer.received != offset:
                raise ValueError(f"the API holds {answer.received:,} bytes of the archive, not the {offset:,} sent")
    finally:
        await bus.close()


def _drain(args: argparse.Namespace) -> int:
    from shared import subjects
    from shared.schema.nodes import DrainAnswer, DrainRequest

    try:
        answer = _call(
            args,
            subjects.EXECUTOR_DRAIN,
            DrainRequest(args.node, args.undo),
            DrainAnswer,
            "no executor drains nodes at {server}: draining is for real executors (`goodput up --executors real`)",
        )
    except ValueError as error:
        if "refused this login" in str(error):  # a user's login may not ask
            raise ValueError(
                f"{error}: draining takes the operator's login (--nats-user operator, its "
                "password file under the data folder's secrets)"
            ) from None
        raise
    where = "" if answer.known else " (no agent serves it now)"
    if args.undo:
        print(f"node {args.node}{where}: used again from the next round")
    else:
        moving = f"; its jobs move in the next round: {', '.join(answer.jobs)}" if answer.jobs else ""
        print(f"node {args.node}{where}: drained, nothing new is placed there{moving}")
    return 0


def teams_status(args: argparse.Namespace) -> int:
    """`goodput status --teams`: per team and GPU type, its guarantee, what its running jobs use, how
    many of those are borrowed and how many of its guarantee are lent now (the login's own team;
    every team for the operator); `--json`: the answer as one JSON document."""
    import json

    from cli.job_view import teams_lines
    from shared import subjects
    from shared.schema.api import TeamsAnswer, TeamsRequest

    document = msgspec.to_builtins(_call(args, subjects.API_TEAMS, TeamsRequest(), TeamsAnswer))
    if getattr(args, "json", False):
        print(json.dumps(document, indent=2))
        return 0
    for line in teams_lines(document):
        print(line)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from shared import subjects
    from shared.schema.api import CancelAnswer, JobRequest

    try:
        request = msgspec.convert({"id": args.id}, JobRequest)
    except msgspec.ValidationError:
        from shared.submissions import ID_RULES

        raise ValueError(f"{args.id!r} is not a job id: {ID_RULES}") from None
    answer = _call(args, subjects.API_CANCEL, request, CancelAnswer)
    if not answer.cancelled:
        raise ValueError(f"job {args.id} not cancelled: {answer.reason}")
    print(printable(f"{args.id}: {answer.state}{' (' + answer.reason + ')' if answer.reason else ''}"))
    return 0
