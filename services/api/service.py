"""The user API: `goodput.api.*`, a NATS micro service (`api` in `$SRV.INFO`) that answers every
request, in the request's encoding (JSON or msgpack), so a client in any language needs only a NATS
client. It is a process of its own, `python -m services.api` (its replicas one queue group): the
gate of submissions, which validates one as the profiler would before anything is stored (against
the profiles on a simulated cluster; with real executors, against the applications the live node
agents say they run).

Every request is a login's (`login()`: the server's word, `shared.bus.requester`; a request from
within the services' own account is the operator's), and a job is the login's that submitted it:
another login looks it up, lists it or cancels it in vain ("not found"); the operator sees all.

- `submit`: a JobSpec -> SubmitAnswer. Only a valid submission is stored (in the jobs stream, on
  the login's own subject) under the Nats-Msg-Id `<id>.<digest of the body>`: a refused body
  reserves nothing, so the corrected one is taken under the same id; the same body again is a
  repeat. The id goes to the first valid submission stored: the API marks the id while it stores
  (so of two bodies racing here, the second is refused at once, storing nothing), and a body
  stored first by another replica takes the id over from the mark (the profiler reads the stream
  in order, as the executors do); that answer says so. The profiler's verdict follows (a real
  profiling run may still refuse it; `job` says so). A login's own submissions on the intake
  stream are judged by the same `submit` (`Gate.judge`).
- `job`: {"id"} -> its JobStatus (404 when the login has no job of that id); `jobs`: filters and
  paging (a page at most MAX_PAGE jobs and PAGE_BYTES, asked of the executors as a page).
- `cancel`: {"id"} -> CancelAnswer: the order goes to the jobs stream, the executors end the job.
- `code.put`, `code.has`: a job's own code, uploaded in chunks, checked whole and stored in the
  code store under its sha256 (`services.api.code`); a submission naming `code` is refused unless
  that archive is there.
- `logs`: {"id", "rank", "after", "limit"} -> LogsPage: what the job's ranks printed, stored by their
  node agents, a page at a time from the cursor `after` (`services.api.logs`); 404 unless it is
  the login's job.
- `schemas`: every request's and answer's JSON Schema (generated from the Structs).

What a login keeps is bounded (`shared.storage.LoginLimits`, counted by JetStream under its
subjects: `Kept`): beyond its submissions a submit is refused "over your limit"; a refusal is
recorded (so `job` shows why) while the login keeps fewer than its refusals' bound, and answered
all the same beyond it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Mapping

import msgspec
from nats import micro
from opentelemetry import trace

from services.api.code import CodeGate
from services.api.logs import read_page, stream_reader
from shared import storage, subjects
from shared.bus import Bus, NotFound, Refused, RevisionConflict, TypedKV, explained, requester
from shared.cluster import Cluster, load_cluster
from shared.lifecycle import JobState
from shared.permissions import LOGINS_ACCOUNT
from shared.profiles import profile_source
from shared.runner import add_profile_arguments, new_service
from shared.schema import (
    JOB_STATES,
    MARK_TTL_S,
    Ack,
    Cancel,
    CancelAnswer,
    CodeAnswer,
    CodeChunk,
    CodeRequest,
    JobOwner,
    JobRecords,
    JobRequest,
    JobsPage,
    JobSpec,
    JobsQuery,
    JobsRequest,
    JobStatus,
    LogsPage,
    LogsRequest,
    NodeInfo,
    SubmitAnswer,
    job_status,
    job_statuses,
    readable_fields,
    rejection,
    spec_digest,
    submission_msg_id,
)
from shared.storage import LOGIN_LIMITS, MAX_SUBMISSION_BYTES, USERS_SHARE, LoginLimits
from shared.submissions import agents_models, id_taken, malformed_reason, submission_problem

log = logging.getLogger(__name__)

ENDED = (JobState.FINISHED, JobState.FAILED, JobState.REJECTED)
ENCODING = "JSON or msgpack; answered in the request's encoding"
RECORDS_TIMEOUT_S = 10.0
CANCEL_WAIT_S = 10.0  # how long `cancel` waits for the executors to take the order before it answers
CANCEL_POLL_S = 0.2
CONCURRENCY = 64  # requests one replica serves at once: each mostly waits on JetStream and the executors


@dataclass(frozen=True)
class Endpoint:
    name: str
    subject: str
    request: type
    response: type
    description: str

    @property
    def metadata(self) -> dict[str, str]:
        """What $SRV.INFO says of it: its messages (by their names in the `schemas` answer), encoding."""
        return {
            "request": self.request.__name__,
            "response": _name(self.response),
            "encoding": ENCODING,
            "schemas": subjects.API_SCHEMAS,
            "description": self.description,
        }


ENDPOINTS = (
    Endpoint(
        "submit",
        subjects.API_SUBMIT,
        JobSpec,
        SubmitAnswer,
        "submit a job; only a valid submission is stored, a refused one gets the reason",
    ),
    Endpoint("job", subjects.API_JOB, JobRequest, JobStatus, "a job's state, as `goodput status --json` shows it"),
    Endpoint("jobs", subjects.API_JOBS, JobsRequest, JobsPage, "the jobs in submission order: filters and paging"),
    Endpoint(
        "cancel",
        subjects.API_CANCEL,
        JobRequest,
        CancelAnswer,
        "cancel a job: queued, it never starts; running, its workers checkpoint and stop",
    ),
    Endpoint("schemas", subjects.API_SCHEMAS, Ack, dict, "the JSON Schema of every request and answer"),
    Endpoint(
        "logs",
        subjects.API_LOGS,
        LogsRequest,
        LogsPage,
        "a job's output, to its submitter: each rank's stdout and stderr lines, a page at a time",
    ),
    Endpoint(
        "code-put",
        subjects.API_CODE_PUT,
        CodeChunk,
        CodeAnswer,
        "upload a job's code archive in chunks; checked whole, then stored under your login and its sha256",
    ),
    Endpoint("code-has", subjects.API_CODE_HAS, CodeRequest, CodeAnswer, "whether your archive is stored already"),
)


def _name(kind: type) -> str:
    return "object" if kind is dict else kind.__name__


@functools.cache
def schemas() -> dict[str, Any]:
    """{"$defs": every message's JSON Schema, "endpoints": subject -> its request's and answer's names}."""
    types = list(dict.fromkeys(t for e in ENDPOINTS for t in (e.request, e.response) if t is not dict))
    _, definitions = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    return {
        "$defs": definitions,
        "endpoints": {
            e.subject: {"request": e.request.__name__, "response": _name(e.response), "description": e.description}
            for e in ENDPOINTS
        },
    }


def notes(spec: JobSpec) -> tuple[str, ...]:
    """What a submitter may not expect of an accepted job."""
    found = []
    if not spec.rigid and spec.requested_gpus > 1:
        found.append(
            f"requested_gpus {spec.requested_gpus} is a hint: the scheduler gives the job the GPUs (and "
            "batch) that maximise its goodput, which change as it trains; `rigid: true` holds it to exactly "
            "that many"
        )
    if spec.min_gpus > spec.requested_gpus:
        found.append(
            f"min_gpus {spec.min_gpus} is more than requested_gpus {spec.requested_gpus}: it never runs on "
            f"fewer than {spec.min_gpus}"
        )
    return tuple(found)


Problem = Callable[[JobSpec], str | None | Awaitable[str | None]]
Models = Mapping[str, Iterable[str]]  # application -> the GPU types it has profiles on
PAGE_BYTES = 256 * 1024  # a page of `jobs` is cut short (its next_offset says where to go on) past this
KEPT_TTL_S = 1.0  # how long JetStream's count of a login's records is taken as it is


def login() -> str:
    """Whose request is being handled: the login the server names, or the operator."""
    who = requester()
    return who.user if who is not None and who.account == LOGINS_ACCOUNT else subjects.OPERATOR


class Kept:
    """What each login keeps in the jobs stream, as JetStream counts it under the login's subjects
    (asked at most every KEPT_TTL_S a login, and counted on here meanwhile), and how full the stream
    is. `room` holds a place while a record is being stored, so that requests in hand at once cannot
    pass a bound together."""

    def __init__(self, bus: Bus, limits: LoginLimits = LOGIN_LIMITS) -> None:
        self.bus, self.limits = bus, limits
        self.counts: dict[str, tuple[float, dict[str, int]]] = {}
        self.added: dict[tuple[str, str], int] = {}  # (login, subject) -> stored here, ever
        self.pending: dict[tuple[str, str], int] = {}  # ... being stored now
        self.fullness: tuple[float, float] = (-KEPT_TTL_S, 0.0)

    async def of(self, who: str) -> dict[str, int]:
        """Subject (STORED, REFUSED) -> how many the login keeps."""
        now = time.monotonic()
        when, counts = self.counts.get(who, (-KEPT_TTL_S, {}))
        if now - when >= KEPT_TTL_S:
            before = {subject: self.added.get((who, subject), 0) for subject in (subjects.STORED, subjects.REFUSED)}
            info = await self.bus.js.stream_info(
                subjects.JOBS_STREAM, subjects_filter=f"{subjects.PREFIX}.jobs.*.*.{who}"
            )
            fresh = {subjects.of_login(subject)[0]: n for subject, n in (info.state.subjects or {}).items()}
            # Those stored here while JetStream was asked may be in its count or not: taken as not.
            counts = {
                subject: fresh.get(subject, 0) + self.added.get((who, subject), 0) - n for subject, n in before.items()
            }
            self.counts[who] = (now, counts)
        return counts

    async def full(self) -> float:
        """How full the jobs stream is (0 to 1)."""
        now = time.monotonic()
        if now - self.fullness[0] >= KEPT_TTL_S:
            info = await self.bus.js.stream_info(subjects.JOBS_STREAM)
            self.fullness = (now, info.state.bytes / max(1, info.config.max_bytes or 1))
        return self.fullness[1]

    @contextlib.asynccontextmanager
    async def room(self, who: str, subject: str) -> AsyncIterator[Room]:
        """A place for one more record of `who`'s on `subject` (STORED, REFUSED), held until the block
        ends; `Room.refusal` says why there is none (the operator always has one). The block says
        `Room.stored()` once the record is stored."""
        counts, fullness = await self.of(who), await self.full()
        place = Room(self._refusal(who, subject, counts.get(subject, 0), fullness))
        key = (who, subject)
        if place.refusal is None:
            self.pending[key] = self.pending.get(key, 0) + 1
        try:
            yield place
        finally:
            if place.refusal is None:
                self.pending[key] -= 1
            if place.kept:
                self.added[key] = self.added.get(key, 0) + 1
                if who in self.counts:
                    self.counts[who][1][subject] = self.counts[who][1].get(subject, 0) + 1

    def _refusal(self, who: str, subject: str, count: int, fullness: float) -> str | None:
        if who == subjects.OPERATOR:
            return None
        limit = self.limits.submissions if subject == subjects.STORED else self.limits.refusals
        what = "submissions" if subject == subjects.STORED else "records of refused submissions"
        if count + self.pending.get((who, subject), 0) >= limit:
            return (
                f"over your limit: login {who} keeps {limit:,} {what} in the jobs stream at most (they leave "
                "as they age out, after 30 days); the operator may raise it"
            )
        if fullness >= USERS_SHARE:
            return (
                f"the jobs stream is {fullness:.0%} full: the rest is kept for the scheduler's verdicts; "
                "ask the operator"
            )
        return None


@dataclass
class Room:
    refusal: str | None
    kept: bool = False

    def stored(self) -> None:
        self.kept = True


class Gate:
    """The API's handlers, each a method; `login` the requester's, as the server says."""

    def __init__(
        self,
        bus: Bus,
        owners: TypedKV[JobOwner],
        problem: Problem,
        kept: Kept | None = None,
        code: CodeGate | None = None,
    ) -> None:
        self.bus, self.owners, self.problem = bus, owners, problem
        self.kept = kept or Kept(bus)
        self.code = code  # the code store (None: jobs may not carry their code here)

    async def records(self, query: JobsQuery) -> JobRecords:
        try:
            return await self.bus.request(subjects.RECORDS, query, JobRecords, timeout=RECORDS_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - no executor answers: the caller is told so
            raise ValueError(f"the executors do not answer ({type(error).__name__}); try again") from None

    async def status_of(self, job_id: str, who: str) -> JobStatus | None:
        """The job `job_id` of `who`'s (any login's, for the operator); None when there is none."""
        trace.get_current_span().set_attribute("job.id", job_id)
        everyone = who == subjects.OPERATOR
        records = await self.records(JobsQuery(job_id, owner=None if everyone else who))
        found = next((j for j in job_statuses(records.jobs) if j.id == job_id), None)
        if found is None or found.state == JobState.REJECTED:
            held = await self.owners.get(job_id)
            # Stored, not yet read by the executors. A refusal they show is then an earlier body's (a
            # refused stored submission gives the id up): the corrected one is profiling.
            if held is not None and (everyone or held.value.login == who) and (found is None or not held.value.marking):
                return JobStatus(job_id, JobState.PROFILING)
        return found

    async def refuse(
        self, data: bytes, reason: str, who: str, job_id: str | None = None, came: str = subjects.API_SUBMIT
    ) -> SubmitAnswer:
        """Record the refusal as the profiler records one (listed for its login, with what could be read
        of the body: its id and application, and where it `came`), while the login keeps fewer than
        its bound; answer it."""
        if job_id is None:
            job_id = readable_fields(data).get("id")
        async with self.kept.room(who, subjects.REFUSED) as room:
            if room.refusal is not None:
                return SubmitAnswer(
                    False, job_id, JobState.REJECTED, reason, notes=(f"this refusal is not recorded: {room.refusal}",)
                )
            await self.bus.js_publish(
                subjects.refused(subjects.DEFAULT_TEAM, who), rejection(came, reason, data, job_id)
            )
            room.stored()
        return SubmitAnswer(False, job_id, JobState.REJECTED, reason)

    async def repeat(self, job_id: str, who: str) -> SubmitAnswer:
        now = await self.status_of(job_id, who)
        if now is not None and now.state == JobState.REJECTED:  # within JetStream's day, the same body refused before
            return SubmitAnswer(False, job_id, now.state, f"the same submission was refused before: {now.reason}")
        return SubmitAnswer(
            True,
            job_id,
            now.state if now else JobState.PROFILING,
            "the same submission was stored before: not stored again",
        )

    async def answered(self, raw: msgspec.Raw) -> SubmitAnswer:
        """`submit`'s answer; a refusal is service error 400 too, its answer the body (Refused)."""
        answer = await self.submit(bytes(raw), login())
        if not answer.accepted:
            raise Refused(answer.reason, answer)
        return answer

    async def submit(self, data: bytes, who: str, came: str = subjects.API_SUBMIT) -> SubmitAnswer:
        """Judge a body of `who`'s (that `came` on that subject): refused with the reason, or stored on
        its login's subject and accepted."""
        if len(data) > MAX_SUBMISSION_BYTES:
            return await self.refuse(
                data,
                f"a submission is at most {MAX_SUBMISSION_BYTES // 1024} KiB; this one is {len(data) / 1024:.0f} KiB",
                who,
                came=came,
            )
        try:
            spec = self.bus.decode(data, JobSpec)
        except msgspec.DecodeError as error:
            return await self.refuse(data, malformed_reason(explained(error, data)), who, came=came)
        trace.get_current_span().set_attribute("job.id", spec.id)
        reason = self.problem(spec)
        if inspect.isawaitable(reason):
            reason = await reason
        if reason is None and spec.code is not None:
            reason = await self.code_problem(who, spec.code)
        if reason is not None:
            return await self.refuse(data, reason, who, spec.id, came)
        async with self.kept.room(who, subjects.STORED) as room:
            if room.refusal is not None:
                return await self.refuse(data, room.refusal, who, spec.id, came)
            return await self.store(spec, who, room, data, came)

    async def code_problem(self, who: str, archive: str) -> str | None:
        """Why a job of `who`'s may not name `archive` as its code: it is not one of `who`'s in the
        code store (another login's is not), or it is about to age out."""
        if self.code is not None and await self.code.stored(who, archive):
            return None
        return (
            f"no archive {archive} of yours in the code store, or it ages out within a week: upload it "
            "(again) first (`goodput submit --code DIR` does; docs/api.md says how with any NATS client)"
        )

    async def store(self, spec: JobSpec, who: str, room: Room, data: bytes, came: str) -> SubmitAnswer:
        """Store a valid submission of `who`'s (`data`, that `came` on that subject), unless its id is
        held: its answer (a repeat's, or the refusal, recorded)."""
        digest = spec_digest(spec)
        mark = await self.claim(spec.id, digest, who)
        if mark is None:
            return await self.refuse(data, id_taken(spec.id), who, spec.id, came)
        if isinstance(mark, SubmitAnswer):
            return mark
        try:
            ack = await self.bus.js_publish(
                subjects.stored(subjects.DEFAULT_TEAM, who), spec, msg_id=submission_msg_id(spec), timeout=10
            )
        except BaseException:
            with contextlib.suppress(Exception):  # not stored: the id is free again
                await self.owners.delete(spec.id, mark)
            raise
        if ack.duplicate:  # stored before, and then refused (else it would hold the id)
            with contextlib.suppress(RevisionConflict):
                await self.owners.delete(spec.id, mark)
            return await self.repeat(spec.id, who)
        room.stored()
        try:  # the mark becomes this submission's claim, unless one stored before took the id
            await self.owners.update(
                spec.id, JobOwner(ack.seq, digest, subjects.stored(subjects.DEFAULT_TEAM, who)), mark
            )
        except RevisionConflict:
            held = await self.owners.get(spec.id)
            if held is None or (held.value.submission != ack.seq and held.value.digest != digest):
                return SubmitAnswer(False, spec.id, JobState.REJECTED, id_taken(spec.id))  # the profiler refuses it
        return SubmitAnswer(True, spec.id, JobState.PROFILING, notes=notes(spec))

    async def claim(self, job_id: str, digest: str, who: str) -> int | SubmitAnswer | None:
        """Mark the id as being stored (the mark's revision), or, when it is held, a repeat's answer
        (the same body of the same login's), or None (another body's)."""
        mark = JobOwner(0, digest, subjects.stored(subjects.DEFAULT_TEAM, who), since=time.time())
        for _ in range(3):
            try:
                return await self.owners.create(job_id, mark)
            except RevisionConflict:
                held = await self.owners.get(job_id)
            if held is None:
                continue
            if held.value.marking and time.time() - held.value.since > MARK_TTL_S:  # its replica died
                with contextlib.suppress(RevisionConflict):
                    return await self.owners.update(job_id, mark, held.revision)
                continue
            if held.value.digest == digest and held.value.login == who:
                return await self.repeat(job_id, who)
            return None
        raise RuntimeError(f"job {job_id}: its id changes hands too fast to claim")

    async def unreadable(self, _: str, data: bytes, error: Exception) -> None:
        """A body that is no JSON object nor msgpack map: refused like any malformed one."""
        answer = await self.refuse(data, malformed_reason(error), login())
        raise Refused(answer.reason, answer)

    async def job(self, request: JobRequest) -> JobStatus:
        found = await self.status_of(request.id, login())
        if found is None:
            raise NotFound(f"no job {request.id!r} of yours: none was submitted under this id by this login")
        return found

    async def logs(self, request: LogsRequest) -> LogsPage:
        return await self.logs_of(request, login())

    async def logs_of(self, request: LogsRequest, who: str) -> LogsPage:
        """The page of what the job `request.id` of `who`'s printed (404 for another's: no one learns
        of another's jobs); `end` is read first, so an ended job's last lines are in its pages."""
        now = await self.status_of(request.id, who)
        if now is None:
            raise NotFound(f"no job {request.id!r} of yours: none was submitted under this id by this login")
        ended = now.state in (*ENDED, JobState.CANCELLED)
        subject = subjects.job_logs(request.id, "*" if request.rank is None else request.rank)
        lines, cursor, more = await read_page(stream_reader(self.bus), subject, request.after, request.limit)
        return LogsPage(tuple(lines), cursor, more, ended)

    async def jobs(self, request: JobsRequest) -> JobsPage:
        if request.state is not None and request.state not in JOB_STATES:
            raise ValueError(f"unknown state {request.state!r}: one of {', '.join(JOB_STATES)}")
        who = login()
        page = await self.records(
            JobsQuery(
                request.prefix,
                None if who == subjects.OPERATOR else who,
                request.state,
                request.application,
                request.offset,
                request.limit,
            )
        )
        return cut(tuple(job_status(r) for r in page.jobs), request.offset, page.total or 0, self.bus.encode)

    async def cancel(self, request: JobRequest) -> CancelAnswer:
        who = login()
        now = await self.status_of(request.id, who)
        if now is None:
            raise NotFound(f"no job {request.id!r} of yours: none was submitted under this id by this login")
        if now.state == JobState.CANCELLED:
            return CancelAnswer(True, request.id, now.state, "it was cancelled before")
        if now.state in ENDED:
            return CancelAnswer(
                False, request.id, now.state, f"job {request.id} has ended ({now.state}): nothing to cancel"
            )
        await self.bus.js_publish(subjects.CANCEL, Cancel(request.id), msg_id=f"{request.id}.cancel", timeout=10)
        deadline = asyncio.get_running_loop().time() + CANCEL_WAIT_S
        while now is not None and now.state != JobState.CANCELLED and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(CANCEL_POLL_S)
            now = await self.status_of(request.id, who)
        if now is not None and now.state == JobState.CANCELLED:
            return CancelAnswer(True, request.id, now.state)
        return CancelAnswer(
            True,
            request.id,
            now.state if now else "unknown",
            "the order is stored; the executors end the job as they read it",
        )

    async def judge(self, data: msgspec.Raw, delivery) -> None:
        """A login's own submission from the intake stream, judged as `submit` judges one."""
        who = subjects.of_login(delivery.subject)[1]
        answer = await self.submit(bytes(data), who, delivery.subject)
        if not answer.accepted:
            log.info("%s's submission %s from the intake stream refused: %s", who, answer.id, answer.reason)

    async def unjudgeable(self, subject: str, data: bytes, error: Exception) -> None:
        """A body on the intake stream that is not even msgpack or JSON: refused, recorded for its login."""
        await self.refuse(data, malformed_reason(error), subjects.of_login(subject)[1], came=subject)


def cut(jobs: tuple[JobStatus, ...], offset: int, total: int, encode: Callable[[Any], bytes]) -> JobsPage:
    """The page of `jobs` (from `offset`, of `total`), cut short to PAGE_BYTES."""
    size, kept = 0, 0
    for job in jobs:
        size += len(encode(job))
        if size > PAGE_BYTES and kept:
            break
        kept += 1
    end = offset + kept
    return JobsPage(jobs[:kept], total, end if end < total else None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser, "an application is known when a live node agent says it runs it")


def live_problem(cluster: Cluster, models: Callable[[], Awaitable[Models | None]], own_code: bool = False) -> Problem:
    """Why a live submission cannot be scheduled on `cluster`, as the profiler would judge it;
    `models()`: application -> the GPU types it has profiles on (None: any application may be);
    `own_code`: the executors run a job's own code (real ones)."""

    async def problem(spec: JobSpec) -> str | None:
        return submission_problem(spec, cluster, await models(), live=True, own_code=own_code)

    return problem


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    """The API service of `python -m services.api`: the applications it knows are the profiles'
    (simulated executors) or those the live node agents say they run (real ones)."""
    cluster = load_cluster(args.cluster)
    if args.executors == "real":
        nodes = await storage.open_kv(bus, subjects.NODES_BUCKET, NodeInfo)

        async def models() -> Models | None:
            return agents_models((await nodes.values()).values(), cluster.gpu_types)

    else:
        types = profile_source(args.reference, args.zoo).types

        async def models() -> Models | None:
            return types

    await storage.open_stream(bus, subjects.DEAD_LETTER_STREAM)
    await storage.open_stream(bus, subjects.LOGS_STREAM)  # what jobs print, read to their submitters
    owners = await storage.open_kv(bus, subjects.JOB_OWNERS_BUCKET, JobOwner)
    return (await open_gate(bus, owners, live_problem(cluster, models, own_code=args.executors == "real")))[1]


async def open_gate(bus: Bus, owners: TypedKV[JobOwner], problem: Problem) -> tuple[Gate, micro.Service]:
    """The API's endpoints on a service of their own (for the caller to start), and the logins' own
    submissions from the intake stream judged from now on. `problem(spec)`: why a well-formed live
    submission cannot be scheduled on this cluster, or None (a coroutine function when it asks,
    e.g. which applications the live node agents run)."""
    gate = Gate(bus, owners, problem, code=CodeGate(bus))
    handlers = {
        "submit": gate.answered,
        "job": gate.job,
        "jobs": gate.jobs,
        "cancel": gate.cancel,
        "schemas": lambda _: schemas(),
        "logs": gate.logs,
        "code-put": lambda chunk: gate.code.put(chunk, login()),
        "code-has": lambda request: gate.code.has(request, login()),
    }
    request_types = {"submit": msgspec.Raw}  # decoded by `submit` itself, to answer a bad body
    service = new_service(bus, subjects.API_SERVICE, "the user API: submit, look up, list and cancel jobs")
    for endpoint in ENDPOINTS:
        await bus.add_endpoint(
            service,
            endpoint.name,
            endpoint.subject,
            request_types.get(endpoint.name, endpoint.request),
            handlers[endpoint.name],
            span_name=f"api.{endpoint.name}",
            metadata=endpoint.metadata,
            on_invalid=gate.unreadable if endpoint.name == "submit" else None,
            concurrency=CONCURRENCY,
        )
    intake = await storage.open_consumer(
        bus,
        subjects.INTAKE_CONSUMER,
        msgspec.Raw,
        span_name="api.intake",
        on_invalid=gate.unjudgeable,
        dead_letters=subjects.dead_letters(subjects.INTAKE_CONSUMER),
    )
    asyncio.get_running_loop().create_task(intake.consume(gate.judge, with_delivery=True))
    return gate, service


async def serve(bus: Bus, owners: TypedKV[JobOwner], problem: Problem) -> Gate:
    """`open_gate`, its service started at once and stopped with the bus: the API within another
    process (a test's)."""
    gate, service = await open_gate(bus, owners, problem)
    await service.start()
    bus.on_close(service.stop)
    return gate


# ---- docs/api.md's generated part ---------------------------------------------------------------

DOCS = "docs/api.md"
BEGIN, END = "<!-- schemas: begin (python -m services.api.service writes this part) -->", "<!-- schemas: end -->"


def schemas_markdown() -> str:
    """The endpoints and every message's JSON Schema, as docs/api.md shows them."""
    import json

    document = schemas()
    lines = [BEGIN, "", "| subject | request | answer | what |", "|---|---|---|---|"]
    lines += [
        f"| `{e.subject}` | `{e.request.__name__}` | `{_name(e.response)}` | {e.description} |" for e in ENDPOINTS
    ]
    for name, schema in document["$defs"].items():
        lines += ["", f"### {name}", "", "```json", json.dumps(schema, indent=2, sort_keys=True), "```"]
    return "\n".join([*lines, "", END])


def write_docs(path: str = DOCS) -> bool:
    """Bring the generated part of `path` up to date; whether it changed."""
    from pathlib import Path

    text = Path(path).read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    updated = text[:start] + schemas_markdown() + text[end:]
    Path(path).write_text(updated)
    return updated != text


if __name__ == "__main__":
    print(f"{DOCS}: {'updated' if write_docs() else 'up to date'}")
