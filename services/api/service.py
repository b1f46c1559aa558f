"""The user API: `goodput.api.*`, a NATS micro service (`api` in `$SRV.INFO`) that answers every
request, in the request's encoding (JSON or msgpack), so a client in any language needs only a NATS
client. It is a process of its own, `python -m services.api` (its replicas one queue group): the
gate of submissions, which validates one as the profiler would before anything is stored (against
the profiles on a simulated cluster; with real executors, against the applications the live node
agents say they run).

Every request is a login's, of its team (`login()`: the server's word, `shared.bus.requester`,
whose account names the team; a request from within the services' own account is the operator's).
A job belongs to its team: the API sets its `team` and stores it under `team.id`
(`shared.teams.scoped_id`), so ids are unique per team, and answers with the id as the team knows
it. A team's logins look up, list, follow and cancel the team's jobs; DEFAULT_TEAM's logins (a
stack without teams) each their own; anyone else looks one up, lists it or cancels it in vain
("not found", the very answer an unknown id gets); the operator sees all, by their ids within the
cluster.

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
- `teams`: each team's guaranteed GPUs per type, what its running jobs use, how many of those are
  borrowed and how many of its guarantee are lent to others now (`team_statuses`: the team file
  in KV against the live cluster, and the executors' records); a login's own team's, the
  operator's every team's.
- `explain`: {"id", "rounds"} -> Explanation: why the job has what it has, in sentences, from the
  decisions the policy leader recorded for it (`services.api.explain`); 404 unless it is the
  login's job; other teams' jobs it names are named by their team only.
- `rounds`: {"limit"} -> RoundsPage: the last rounds' summaries and the nodes of the latest (their
  events, which name jobs, to the operator only).
- `schemas`: every request's and answer's JSON Schema (generated from the Structs).

What a login and a team keep is bounded (`shared.storage.LoginLimits` and `TeamLimits`, counted by
JetStream under their subjects: `Kept`): beyond its submissions a submit is refused "over your
limit", beyond its team's "over your team's limit" (a team that floods fills only its own share,
and the other teams' logins still submit); a refusal is recorded (so `job` shows why) while the
login and its team keep fewer than their refusals' bounds, and answered all the same beyond them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Mapping, NamedTuple

import msgspec
from nats import micro
from opentelemetry import trace

from services.api.code import CodeGate
from services.api.explain import explanation, read_last
from services.api.logs import job_page
from shared import storage, subjects
from shared.bus import Bus, NotFound, Refused, RevisionConflict, TypedKV, explained, requester
from shared.cluster import Cluster, load_cluster
from shared.hardware import hardware_name
from shared.lifecycle import JobState
from shared.metrics import REFUSALS, SUBMISSIONS, instrument
from shared.permissions import account_team
from shared.profiles import profile_source
from shared.runner import add_profile_arguments, new_service
from shared.schema import (
    DEFAULT_TEAM,
    JOB_STATES,
    MARK_TTL_S,
    MAX_ID,
    MAX_REFUSALS,
    Ack,
    Cancel,
    CancelAnswer,
    CodeAnswer,
    CodeChunk,
    CodeRequest,
    JobOwner,
    JobRecord,
    JobRecords,
    JobRequest,
    JobsPage,
    JobSpec,
    JobsQuery,
    JobsRequest,
    JobStatus,
    LogsPage,
    LogsRequest,
    Node,
    NodeInfo,
    SubmitAnswer,
    TeamGpus,
    TeamsAnswer,
    TeamsRequest,
    TeamStatus,
    job_status,
    job_statuses,
    readable_fields,
    rejection,
    spec_digest,
    submission_msg_id,
)
from shared.schema.decisions import ExplainRequest, Explanation, JobDecision, RoundsPage, RoundsRequest, RoundSummary
from shared.storage import (
    KIB,
    LOGIN_LIMITS,
    MAX_STORED_BYTES,
    MAX_SUBMISSION_BYTES,
    TEAM_LIMITS,
    USERS_SHARE,
    LoginLimits,
    TeamLimits,
)
from shared.submissions import agents_models, id_taken, malformed_reason, submission_problem
from shared.teams import TeamFile, Teams, resolve, scoped_id, user_id

log = logging.getLogger(__name__)

ENDED = (JobState.FINISHED, JobState.FAILED, JobState.REJECTED)
ENCODING = "JSON or msgpack; answered in the request's encoding"
RECORDS_TIMEOUT_S = 10.0
CANCEL_WAIT_S = 10.0  # how long `cancel` waits for the executors to take the order before it answers
CANCEL_POLL_S = 0.2
CONCURRENCY = 64  # requests one replica serves at once: each mostly waits on JetStream and the executors
INTAKE_WINDOW = 64  # submissions from the intake stream one replica judges at once
REFUSAL_TIMEOUT_S = 2.0  # for a refusal's record to be acknowledged, each of its attempts
STORED_UNREAD = "stored: the profiler reads it next"  # a job's reason before the executors know it


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
        "a job's output, to its team: each rank's stdout and stderr lines, a page at a time",
    ),
    Endpoint(
        "code-put",
        subjects.API_CODE_PUT,
        CodeChunk,
        CodeAnswer,
        "upload a job's code archive in chunks; checked whole, then stored under your login and its sha256",
    ),
    Endpoint("code-has", subjects.API_CODE_HAS, CodeRequest, CodeAnswer, "whether your archive is stored already"),
    Endpoint(
        "teams",
        subjects.API_TEAMS,
        TeamsRequest,
        TeamsAnswer,
        "each team's guaranteed GPUs per type, their use, what it borrows and what it lends (your team's)",
    ),
    Endpoint(
        "explain",
        subjects.API_EXPLAIN,
        ExplainRequest,
        Explanation,
        "why a job has what it has, in sentences, from the rounds' recorded decisions (your team's jobs)",
    ),
    Endpoint(
        "rounds",
        subjects.API_ROUNDS,
        RoundsRequest,
        RoundsPage,
        "the last rounds' summaries (GPUs by type and state, goodput, times) and the latest's nodes",
    ),
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
KEPT_TTL_S = 1.0  # how long JetStream's count of a team's records is taken as it is


def refused(status: JobStatus) -> bool:
    return status.state == JobState.REJECTED


class Who(NamedTuple):
    """Whose request is being handled: a login and its team, as the server says. The operator's
    (OPERATOR, of DEFAULT_TEAM) sees every team's jobs, by their ids within the cluster."""

    login: str
    team: str = DEFAULT_TEAM

    @property
    def everyone(self) -> bool:
        return self.login == subjects.OPERATOR

    def scoped(self, job_id: str) -> str:
        """The id within the cluster of the job this requester names `job_id`."""
        return job_id if self.everyone else scoped_id(self.team, job_id)

    def shown(self, scoped: str) -> str:
        """The id this requester knows the job `scoped` by."""
        return scoped if self.everyone else user_id(self.team, scoped)

    def query(self, prefix: str = "", **filters: Any) -> JobsQuery:
        """The executors' records this requester may see, of those whose id (as it names them) begins
        with `prefix`: its team's (DEFAULT_TEAM's logins: each its own), every one for the operator."""
        if self.everyone:
            return JobsQuery(prefix, None, team=None, **filters)
        own = self.login if self.team == DEFAULT_TEAM else None
        return JobsQuery(scoped_id(self.team, prefix), own, team=self.team, **filters)

    def sees(self, subject: str) -> bool:
        """Whether a submission stored on `subject` (a JobOwner's) is one this requester may see."""
        _, team, login = subjects.owner_of(subject)
        return self.everyone or (team == self.team and (team != DEFAULT_TEAM or login == self.login))

    def status(self, status: JobStatus) -> JobStatus:
        """A job's status with its id as this requester knows it."""
        return status if status.id is None else msgspec.structs.replace(status, id=self.shown(status.id))


OPERATOR = Who(subjects.OPERATOR)


def login() -> Who:
    """Whose request is being handled: the login the server names, of the team its account holds;
    the operator for a request from within the services' own account."""
    who = requester()
    team = account_team(who.account) if who is not None else None
    return OPERATOR if team is None else Who(who.user, team)


class Kept:
    """What each login and each team keeps in the jobs stream, as JetStream counts it under the
    team's subjects (asked at most every KEPT_TTL_S a team, and counted on here meanwhile), and how
    full the stream is. `room` holds a place while a record is being stored, so that requests in
    hand at once cannot pass a bound together. The operator's records count for no one."""

    def __init__(self, bus: Bus, limits: LoginLimits = LOGIN_LIMITS, team_limits: TeamLimits = TEAM_LIMITS) -> None:
        self.bus, self.limits, self.team_limits = bus, limits, team_limits
        self.counts: dict[str, tuple[float, dict[tuple[str, str], int]]] = {}  # team -> (when, its counts)
        self.added: dict[tuple[str, str, str], int] = {}  # (team, login, subject) -> stored here, ever
        self.pending: dict[tuple[str, str, str], int] = {}  # ... being stored now
        self.fullness: tuple[float, float] = (-KEPT_TTL_S, 0.0)

    async def of(self, team: str) -> dict[tuple[str, str], int]:
        """(login, subject (STORED, REFUSED)) -> how many that login of `team` keeps."""
        now = time.monotonic()
        when, counts = self.counts.get(team, (-KEPT_TTL_S, {}))
        if now - when >= KEPT_TTL_S:
            before = self._added(team)
            info = await self.bus.js.stream_info(subjects.JOBS_STREAM, subjects_filter=subjects.of_team(team))
            fresh: dict[tuple[str, str], int] = {}
            for subject, n in (info.state.subjects or {}).items():
                base, _, who = subjects.owner_of(subject)
                fresh[who, base] = fresh.get((who, base), 0) + n
            # Those stored here while JetStream was asked may be in its count or not: taken as not.
            added = self._added(team)
            counts = {key: fresh.get(key, 0) + added.get(key, 0) - before.get(key, 0) for key in {*fresh, *added}}
            self.counts[team] = (now, counts)
        return counts

    def _added(self, team: str) -> dict[tuple[str, str], int]:
        return {(who, subject): n for (of, who, subject), n in self.added.items() if of == team}

    async def full(self) -> float:
        """How full the jobs stream is (0 to 1)."""
        now = time.monotonic()
        if now - self.fullness[0] >= KEPT_TTL_S:
            info = await self.bus.js.stream_info(subjects.JOBS_STREAM)
            self.fullness = (now, info.state.bytes / max(1, info.config.max_bytes or 1))
        return self.fullness[1]

    @contextlib.asynccontextmanager
    async def room(self, who: Who, subject: str) -> AsyncIterator[Room]:
        """A place for one more record of `who`'s on `subject` (STORED, REFUSED), held until the block
        ends; `Room.refusal` says why there is none (the operator always has one). The block says
        `Room.stored()` once the record is stored."""
        counts, fullness = await self.of(who.team), await self.full()
        key = (who.team, who.login, subject)
        mine = counts.get((who.login, subject), 0) + self.pending.get(key, 0)
        teams = sum(n for (login, base), n in counts.items() if base == subject and login != subjects.OPERATOR)
        teams += sum(n for (team, _, base), n in self.pending.items() if team == who.team and base == subject)
        place = Room(self._refusal(who, subject, mine, teams, fullness))
        if place.refusal is None:
            self.pending[key] = self.pending.get(key, 0) + 1
        try:
            yield place
        finally:
            if place.refusal is None:
                self.pending[key] -= 1
            if place.kept:
                self.added[key] = self.added.get(key, 0) + 1
                if who.team in self.counts:
                    held = self.counts[who.team][1]
                    held[who.login, subject] = held.get((who.login, subject), 0) + 1

    def _refusal(self, who: Who, subject: str, count: int, team_count: int, fullness: float) -> str | None:
        """Why `who` may not keep one more record on `subject`, keeping `count` and its team
        `team_count` (those being stored included)."""
        if who.everyone:
            return None
        stored = subject == subjects.STORED
        limit = self.limits.submissions if stored else self.limits.refusals
        team_limit = self.team_limits.submissions if stored else self.team_limits.refusals
        what = "submissions" if stored else "records of refused submissions"
        if count >= limit:
            return (
                f"over your limit: login {who.login} keeps {limit:,} {what} in the jobs stream at most (they leave "
                "as they age out, after 30 days); the operator may raise it"
            )
        if team_count >= team_limit:
            return (
                f"over your team's limit: team {who.team}'s logins keep {team_limit:,} {what} in the jobs stream "
                "at most, together (they leave as they age out, after 30 days); the operator may raise it"
            )
        if fullness >= USERS_SHARE:
            return (
                f"the jobs stream is {fullness:.0%} full: the rest is kept for the scheduler's verdicts; "
                "ask the operator"
            )
        return None


# Why a submission is refused, as goodput_refusals_total counts it (a bounded set: the reason's
# text names the job): unreadable or not a JobSpec; over MAX_SUBMISSION_BYTES; not schedulable on
# this cluster (the profiler's checks); its team or id within the team; its code archive; over its
# login's, its team's or the stream's bound; its id held by another submission.
REFUSAL_CAUSES = ("malformed", "too_large", "unschedulable", "team", "code", "over_limit", "id_taken")


def count_submission(outcome: str, cause: str | None = None) -> None:
    """One submission answered (accepted, duplicate or refused), and a refusal's cause."""
    instrument(SUBMISSIONS).add(1, {"outcome": outcome})
    if cause is not None:
        instrument(REFUSALS).add(1, {"reason": cause})


@dataclass
class Room:
    refusal: str | None
    kept: bool = False

    def stored(self) -> None:
        self.kept = True


class Turns:
    """One lock per key, held in the order asked (a lock free at once is taken without waiting):
    what is done under one key is done in turn, under others at once."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[asyncio.Lock, int]] = {}  # key -> its lock, and those holding or awaiting it

    @contextlib.asynccontextmanager
    async def turn(self, key: str) -> AsyncIterator[None]:
        lock, users = self.held.get(key, (None, 0))
        lock = lock or asyncio.Lock()
        self.held[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            users = self.held[key][1] - 1
            if users:
                self.held[key] = (lock, users)
            else:
                del self.held[key]


class Gate:
    """The API's handlers, each a method; `login` the requester's, as the server says. `teams`: the
    KV holding the operator's team file (None: no teams); `cluster()`: the cluster as it is now,
    which the team file is read against."""

    def __init__(
        self,
        bus: Bus,
        owners: TypedKV[JobOwner],
        problem: Problem,
        kept: Kept | None = None,
        code: CodeGate | None = None,
        teams: TypedKV[TeamFile] | None = None,
        cluster: Callable[[], Awaitable[Cluster]] | None = None,
    ) -> None:
        self.bus, self.owners, self.problem = bus, owners, problem
        self.kept = kept or Kept(bus)
        self.code = code  # the code store (None: jobs may not carry their code here)
        self.teams, self.cluster = teams, cluster
        self.turns = Turns()

    async def records(self, query: JobsQuery) -> JobRecords:
        try:
            return await self.bus.request(subjects.RECORDS, query, JobRecords, timeout=RECORDS_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - no executor answers: the caller is told so
            raise ValueError(f"the executors do not answer ({type(error).__name__}); try again") from None

    async def team_file(self) -> TeamFile | None:
        """The operator's team file, as the teams' KV holds it; None without one."""
        if self.teams is None:
            return None
        try:
            held = await self.teams.get(subjects.TEAMS_KEY)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            log.warning("the team file in KV cannot be read (%s): taken as none", error)
            return None
        return None if held is None else held.value

    async def status_of(self, job_id: str, who: Who) -> JobStatus | None:
        """The job `who` names `job_id`: its team's (DEFAULT_TEAM's logins: their own; any job, for
        the operator), with its id as `who` knows it; None when there is none. Another team's job
        takes the very same steps as an unknown id: none is found."""
        scoped = who.scoped(job_id)
        trace.get_current_span().set_attribute("job.id", scoped)
        records = await self.records(who.query(job_id))
        # The job under the id before a refusal recorded under it (the operator sees both).
        found = min((j for j in job_statuses(records.jobs) if j.id == scoped), key=refused, default=None)
        # The refusals of other bodies sent under the id (a body sent on the durable subject learns
        # its verdict here): every refusal under it but the job's own.
        others = [r.failure or "" for r in records.jobs if r.name == scoped and r.state == JobState.REJECTED]
        if found is not None and refused(found) and found.reason in others:
            others.remove(found.reason)
        if found is not None and others:
            found = msgspec.structs.replace(found, refusals=tuple(others[-MAX_REFUSALS:]))
        if found is None or found.state == JobState.REJECTED:
            held = await self.owners.get(scoped)
            # Stored, not yet read by the executors. A refusal they show is then an earlier body's (a
            # refused stored submission gives the id up): the corrected one is profiling.
            if held is not None and who.sees(held.value.subject) and (found is None or not held.value.marking):
                team = subjects.owner_of(held.value.subject)[1] or DEFAULT_TEAM
                return JobStatus(
                    job_id, JobState.PROFILING, STORED_UNREAD, application=held.value.application, team=team
                )
        return None if found is None else who.status(found)

    async def named_job(self, job_id: str, who: Who) -> tuple[JobStatus, str | None]:
        """The job `who` names `job_id` (NotFound when none, as `status_of` finds it), and the id
        under which the cluster keeps its output, decisions and orders: none for a submission refused
        apart from any job (its id may be another's: a refusal of an id that is taken, or of another
        team's prefix). A job refused after its profiling run (its script failed there) keeps that
        run's output under its id."""
        now = await self.status_of(job_id, who)
        if now is None:
            raise NotFound(not_found(job_id, who))
        if not refused(now):
            return now, who.scoped(job_id)
        scoped = who.scoped(job_id)
        records = await self.records(who.query(job_id))
        own = any(r.name == scoped and r.state == JobState.REJECTED and r.held for r in records.jobs)
        return now, scoped if own else None

    async def refuse(
        self,
        data: bytes,
        reason: str,
        who: Who,
        job_id: str | None = None,
        came: str = subjects.API_SUBMIT,
        *,
        cause: str,
    ) -> SubmitAnswer:
        """Record the refusal as the profiler records one (listed for its login and team, with what
        could be read of the body: its id, within its team, and application, and where it `came`),
        while the login and its team keep fewer than their bound; answer it (`job_id` as `who`
        names it). `cause`: one of REFUSAL_CAUSES, counted."""
        count_submission("refused", cause)
        if job_id is None:
            job_id = readable_fields(data).get("id")
        async with self.kept.room(who, subjects.REFUSED) as room:
            if room.refusal is not None:
                return SubmitAnswer(
                    False, job_id, JobState.REJECTED, reason, notes=(f"this refusal is not recorded: {room.refusal}",)
                )
            scoped = None if job_id is None else scoped_id(who.team, job_id)
            # Its own id: sent again when its acknowledgement is lost (the server may close this
            # connection while one login floods it), it is recorded once and answered all the same.
            await self.bus.js_publish(
                subjects.refused(who.team, who.login),
                rejection(came, reason, data, scoped if scoped is None or len(scoped) <= MAX_ID else None),
                msg_id=f"refused.{uuid.uuid4().hex}",
                timeout=REFUSAL_TIMEOUT_S,
                attempts=3,
            )
            room.stored()
        return SubmitAnswer(False, job_id, JobState.REJECTED, reason)

    async def repeat(self, job_id: str, who: Who) -> SubmitAnswer:
        count_submission("duplicate")  # the same body again, whatever the first one's answer
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

    async def submit(self, data: bytes, who: Who, came: str = subjects.API_SUBMIT) -> SubmitAnswer:
        """Judge a body of `who`'s (that `came` on that subject): refused with the reason, or stored,
        as its team's job under its id within the team, on its login's subject and accepted."""
        if len(data) > MAX_SUBMISSION_BYTES:
            return await self.refuse(
                data,
                f"a submission is at most {MAX_SUBMISSION_BYTES // 1024} KiB; this one is {len(data) / 1024:.0f} KiB",
                who,
                came=came,
                cause="too_large",
            )
        try:
            spec = self.bus.decode(data, JobSpec)
        except msgspec.DecodeError as error:
            return await self.refuse(data, malformed_reason(explained(error, data)), who, came=came, cause="malformed")
        trace.get_current_span().set_attribute("job.id", scoped_id(who.team, spec.id))
        # Taken before anything is awaited: bodies under one id are judged in the order they came
        # (the first valid one holds the id), others at once.
        async with self.turns.turn(scoped_id(who.team, spec.id)):
            return await self.judged(spec, data, who, came)

    async def judged(self, spec: JobSpec, data: bytes, who: Who, came: str) -> SubmitAnswer:
        """`submit`'s judgement of a well-formed body: refused with the reason, or stored."""
        scoped = msgspec.structs.replace(spec, id=scoped_id(who.team, spec.id), team=who.team)
        if (size := len(self.bus.encode(scoped))) > MAX_STORED_BYTES:  # what a login's limits count
            reason = (
                f"a job's submission, as stored, is at most {MAX_STORED_BYTES // KIB} KiB (its id, names and "
                f"args); this one is {size / KIB:.1f} KiB"
            )
            return await self.refuse(data, reason, who, spec.id, came, cause="too_large")
        reason, cause = await self.team_problem(spec, who), "team"
        if reason is None:
            reason, cause = self.problem(spec), "unschedulable"
            if inspect.isawaitable(reason):
                reason = await reason
        if reason is None and spec.code is not None:
            reason, cause = await self.code_problem(who.login, spec.code), "code"
        if reason is not None:
            return await self.refuse(data, reason, who, spec.id, came, cause=cause)
        async with self.kept.room(who, subjects.STORED) as room:
            if room.refusal is not None:
                return await self.refuse(data, room.refusal, who, spec.id, came, cause="over_limit")
            return await self.store(scoped, who, room, data, came)

    async def team_problem(self, spec: JobSpec, who: Who) -> str | None:
        """Why `who`'s job cannot be its team's as it stands: it names another team, its id within
        the team is too long, or (DEFAULT_TEAM's) its id begins with a team's name and a dot: that
        team's ids look so within the cluster."""
        if spec.team is not None and spec.team != who.team:
            return f"job {spec.id} names team {spec.team}; your login belongs to team {who.team}"
        scoped = scoped_id(who.team, spec.id)
        if len(scoped) > MAX_ID:
            return (
                f"job {spec.id}: within the cluster a job of team {who.team} is {who.team}.<id>, and an id is at "
                f"most {MAX_ID} characters, so your team's ids are at most {MAX_ID - len(who.team) - 1}"
            )
        first, dot, _ = spec.id.partition(".")
        if who.team == DEFAULT_TEAM and dot and (file := await self.team_file()) is not None and first in file.teams:
            return f"job {spec.id}: ids beginning {first}. are team {first}'s within the cluster; choose another id"
        return None

    async def code_problem(self, login: str, archive: str) -> str | None:
        """Why a job of `login`'s may not name `archive` as its code: it is not one of `login`'s in the
        code store (another login's is not), or it is about to age out."""
        if self.code is not None and await self.code.stored(login, archive):
            return None
        return (
            f"no archive {archive} of yours in the code store, or it ages out within a week: upload it "
            "(again) first (`goodput submit --code DIR` does; docs/api.md says how with any NATS client)"
        )

    async def store(self, spec: JobSpec, who: Who, room: Room, data: bytes, came: str) -> SubmitAnswer:
        """Store a valid submission of `who`'s (`spec`, its id within the cluster; `data`, that `came`
        on that subject), unless its id is held: its answer (a repeat's, or the refusal, recorded)."""
        job_id, subject = who.shown(spec.id), subjects.stored(who.team, who.login)
        digest = spec_digest(spec)
        mark = await self.claim(spec.id, digest, who, spec.application)
        if mark is None:
            return await self.refuse(data, id_taken(job_id), who, job_id, came, cause="id_taken")
        if isinstance(mark, SubmitAnswer):
            return mark
        try:
            ack = await self.bus.js_publish(subject, spec, msg_id=submission_msg_id(spec), timeout=10)
        except BaseException:
            with contextlib.suppress(Exception):  # not stored: the id is free again
                await self.owners.delete(spec.id, mark)
            raise
        if ack.duplicate:  # stored before, and then refused (else it would hold the id)
            with contextlib.suppress(RevisionConflict):
                await self.owners.delete(spec.id, mark)
            return await self.repeat(job_id, who)
        room.stored()
        try:  # the mark becomes this submission's claim, unless one stored before took the id
            await self.owners.update(spec.id, JobOwner(ack.seq, digest, subject, application=spec.application), mark)
        except RevisionConflict:
            held = await self.owners.get(spec.id)
            if held is None or (held.value.submission != ack.seq and held.value.digest != digest):
                count_submission("refused", "id_taken")
                return SubmitAnswer(False, job_id, JobState.REJECTED, id_taken(job_id))  # the profiler refuses it
        count_submission("accepted")
        return SubmitAnswer(True, job_id, JobState.PROFILING, notes=notes(spec))

    async def claim(
        self, scoped: str, digest: str, who: Who, application: str | None = None
    ) -> int | SubmitAnswer | None:
        """Mark the id (within the cluster) as being stored (the mark's revision), or, when it is held,
        a repeat's answer (the same body of the same login's), or None (another body's)."""
        subject = subjects.stored(who.team, who.login)
        mark = JobOwner(0, digest, subject, since=time.time(), application=application)
        for _ in range(3):
            try:
                return await self.owners.create(scoped, mark)
            except RevisionConflict:
                held = await self.owners.get(scoped)
            if held is None:
                continue
            if held.value.marking and time.time() - held.value.since > MARK_TTL_S:  # its replica died
                with contextlib.suppress(RevisionConflict):
                    return await self.owners.update(scoped, mark, held.revision)
                continue
            if held.value.digest == digest and held.value.subject == subject:
                return await self.repeat(who.shown(scoped), who)
            return None
        raise RuntimeError(f"job {scoped}: its id changes hands too fast to claim")

    async def unreadable(self, _: str, data: bytes, error: Exception) -> None:
        """A body that is no JSON object nor msgpack map: refused like any malformed one."""
        answer = await self.refuse(data, malformed_reason(error), login(), cause="malformed")
        raise Refused(answer.reason, answer)

    async def job(self, request: JobRequest) -> JobStatus:
        return await self.job_of(request, login())

    async def job_of(self, request: JobRequest, who: Who) -> JobStatus:
        return (await self.named_job(request.id, who))[0]

    async def logs(self, request: LogsRequest) -> LogsPage:
        return await self.logs_of(request, login())

    async def logs_of(self, request: LogsRequest, who: Who) -> LogsPage:
        """The page of what the job `request.id` of `who`'s team printed, from that team's logs stream
        (404 for another's: no one learns of another's jobs); `end` is read first, so an ended job's
        last lines are in its pages. The operator reads any team's, the job's."""
        now, scoped = await self.named_job(request.id, who)
        ended = now.state in (*ENDED, JobState.CANCELLED)
        if scoped is None:
            return LogsPage((), request.after, False, ended)
        lines, cursor, more = await job_page(self.bus, now.team if who.everyone else who.team, scoped, request)
        return LogsPage(tuple(lines), cursor, more, ended)

    async def jobs(self, request: JobsRequest) -> JobsPage:
        return await self.jobs_of(request, login())

    async def jobs_of(self, request: JobsRequest, who: Who) -> JobsPage:
        if request.state is not None and request.state not in JOB_STATES:
            raise ValueError(f"unknown state {request.state!r}: one of {', '.join(JOB_STATES)}")
        page = await self.records(
            who.query(
                request.prefix,
                state=request.state,
                application=request.application,
                offset=request.offset,
                limit=request.limit,
            )
        )
        statuses = tuple(who.status(job_status(r)) for r in page.jobs)
        return cut(statuses, request.offset, page.total or 0, self.bus.encode)

    async def cancel(self, request: JobRequest) -> CancelAnswer:
        return await self.cancel_of(request, login())

    async def cancel_of(self, request: JobRequest, who: Who) -> CancelAnswer:
        now, scoped = await self.named_job(request.id, who)
        if now.state == JobState.CANCELLED:
            return CancelAnswer(True, request.id, now.state, "it was cancelled before")
        if now.state in ENDED or scoped is None:
            return CancelAnswer(
                False, request.id, now.state, f"job {request.id} has ended ({now.state}): nothing to cancel"
            )
        await self.bus.js_publish(subjects.CANCEL, Cancel(scoped), msg_id=f"{scoped}.cancel", timeout=10)
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

    async def team_gpus(self, _: TeamsRequest) -> TeamsAnswer:
        return await self.teams_of(login())

    async def teams_of(self, who: Who) -> TeamsAnswer:
        """Each team's GPUs per type now (`team_statuses`): `who`'s team's, every team's for the
        operator. The team file is read against the cluster as it is now."""
        file = await self.team_file()
        cluster = await self.cluster() if self.cluster is not None else Cluster("none", ())
        teams, note = None, ""
        if file is None:
            note = f"no team file: every job is team {DEFAULT_TEAM}'s, and no team has guaranteed GPUs"
        else:
            try:
                teams = resolve(file, cluster)
            except ValueError as error:
                note = f"the team file does not fit the cluster as it is now, so no guarantee is shown: {error}"
        running = (await self.records(JobsQuery(state=JobState.RUNNING))).jobs
        named = list(file.teams) if file is not None else []
        rows = team_statuses(teams, named if who.everyone else [*named, who.team], cluster, running)
        return TeamsAnswer(tuple(row for row in rows if who.everyone or row.team == who.team), note)

    async def explain(self, request: ExplainRequest) -> Explanation:
        return await self.explain_of(request, login())

    async def explain_of(self, request: ExplainRequest, who: Who) -> Explanation:
        """Why the job `request.id` of `who`'s has what it has, from its last `request.rounds` recorded
        decisions (404 for another's: the same answer as an unknown id)."""
        now, scoped = await self.named_job(request.id, who)
        decisions, kept = (
            ([], 0)
            if scoped is None
            else await read_last(self.bus, subjects.job_decisions(scoped), request.rounds, JobDecision)
        )
        shown = await self.known_jobs({h.job: h.team for d in decisions for h in d.holders}, who)
        return explanation(request.id, now, decisions, shown, who.team, complete=kept <= request.rounds)

    async def known_jobs(self, jobs: Mapping[str, str], who: Who) -> dict[str, str]:
        """Of `jobs` (cluster id -> its team), those `who` may know, by the id `who` knows each by: its
        team's (DEFAULT_TEAM's logins: their own, as the owners' KV says), every one for the operator."""
        known = {}
        for job, team in jobs.items():
            if who.everyone or (team == who.team and team != DEFAULT_TEAM):
                known[job] = who.shown(job)
            elif team == who.team:
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    held = await self.owners.get(job)
                    if held is not None and who.sees(held.value.subject):
                        known[job] = job
        return known

    async def rounds(self, request: RoundsRequest) -> RoundsPage:
        return await self.rounds_of(request, login())

    async def rounds_of(self, request: RoundsRequest, who: Who) -> RoundsPage:
        """The last `request.limit` rounds' summaries, oldest first, and the latest's nodes once (not
        in each summary); their events name jobs, so only the operator has them, and a team sees its
        own use only, as `goodput.api.teams` shows it."""
        summaries, _ = await read_last(self.bus, subjects.ROUND_DECISIONS, request.limit, RoundSummary)

        def seen(by_team: dict) -> dict:
            return by_team if who.everyone else {team: v for team, v in by_team.items() if team == who.team}

        shown = tuple(
            msgspec.structs.replace(
                s,
                nodes=(),
                events=s.events if who.everyone else (),
                team_gpus=seen(s.team_gpus),
                team_borrowed=seen(s.team_borrowed),
                team_reclaimed=seen(s.team_reclaimed),
            )
            for s in summaries
        )
        return RoundsPage(shown, summaries[-1].nodes if summaries else ())

    async def judge(self, data: msgspec.Raw, delivery) -> None:
        """A login's own submission from the intake stream, judged as `submit` judges one: its team
        and login are the subject's (the server's mapping)."""
        who = intake_owner(delivery.subject)
        answer = await self.submit(bytes(data), who, delivery.subject)
        if not answer.accepted:
            log.info("%s's submission %s from the intake stream refused: %s", who.login, answer.id, answer.reason)

    async def unjudgeable(self, subject: str, data: bytes, error: Exception) -> None:
        """A body on the intake stream that is not even msgpack or JSON: refused, recorded for its login."""
        await self.refuse(data, malformed_reason(error), intake_owner(subject), came=subject, cause="malformed")


def not_found(job_id: str, who: Who) -> str:
    """What a lookup of an id `who` has no job under is answered: the same for an unknown id and
    another's job."""
    whose = "by this login" if who.team == DEFAULT_TEAM else f"by team {who.team}"
    return f"no job {job_id!r} of yours: none was submitted under this id {whose}"


def intake_owner(subject: str) -> Who:
    """Whose submission came on an intake subject (`goodput.jobs.submit.<team>.<login>`)."""
    _, team, who = subjects.owner_of(subject)
    return Who(who, team or DEFAULT_TEAM)


def team_statuses(
    teams: Teams | None, named: Iterable[str], cluster: Cluster, running: Iterable[JobRecord]
) -> tuple[TeamStatus, ...]:
    """Each team's GPUs per type now: the teams `named` (the team file's), then any other whose jobs
    run (DEFAULT_TEAM's); DEFAULT_TEAM alone when there is none. Per type of the cluster (and any a
    job holds besides): its guarantee (`teams`; None: none), what its `running` jobs use and how many
    of those are borrowed (the round's word, on each record), and how many of its guarantee other
    teams' jobs hold. Borrowers take first what no team is guaranteed; what they hold beyond it
    is lent by the teams whose guarantee is idle, in proportion to their idle GPUs."""
    used: dict[tuple[str, str], int] = {}
    borrowed: dict[tuple[str, str], int] = {}
    for record in running:
        if record.state != JobState.RUNNING or record.gpu_type is None:
            continue
        key, gpus = (record.team or DEFAULT_TEAM, record.gpu_type), sum(g for _, g in record.placement)
        used[key] = used.get(key, 0) + gpus
        borrowed[key] = borrowed.get(key, 0) + min(record.borrowed, gpus)
    names = list(dict.fromkeys([*named, *(team for team, _ in used)])) or [DEFAULT_TEAM]
    types = list(dict.fromkeys([*cluster.gpu_types, *(gpu_type for _, gpu_type in used)]))
    rows: dict[str, list[TeamGpus]] = {name: [] for name in names}
    for gpu_type in types:
        quota = {name: teams.quota(name, gpu_type) if teams is not None else 0 for name in names}
        idle = {
            name: max(0, quota[name] - used.get((name, gpu_type), 0) + borrowed.get((name, gpu_type), 0))
            for name in names
        }
        unguaranteed = max(0, cluster.capacity(gpu_type) - sum(quota.values()))
        taken = sum(borrowed.get((name, gpu_type), 0) for name in names)
        lent = _shares(min(sum(idle.values()), max(0, taken - unguaranteed)), idle)
        for name in names:
            rows[name].append(
                TeamGpus(
                    hardware_name(gpu_type),
                    gpu_type,
                    quota[name],
                    used.get((name, gpu_type), 0),
                    borrowed.get((name, gpu_type), 0),
                    lent[name],
                    teams.borrow_limit(name, gpu_type) if teams is not None else None,
                )
            )
    return tuple(
        TeamStatus(name, tuple(gpus), teams.weight(name) if teams is not None else 1.0) for name, gpus in rows.items()
    )


def _shares(total: int, weights: Mapping[str, int]) -> dict[str, int]:
    """`total` shared in proportion to `weights`, in whole numbers (the largest remainders round up)."""
    whole = sum(weights.values())
    if not total or not whole:
        return {name: 0 for name in weights}
    exact = {name: total * w / whole for name, w in weights.items()}
    shares = {name: int(x) for name, x in exact.items()}
    for name in sorted(weights, key=lambda n: shares[n] - exact[n])[: total - sum(shares.values())]:
        shares[name] += 1
    return shares


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
    (simulated executors) or those the live node agents say they run (real ones), and the cluster
    the team file is read against is `--cluster` (simulated) or the live nodes (real ones)."""
    cluster = load_cluster(args.cluster)
    if args.executors == "real":
        nodes = await storage.open_kv(bus, subjects.NODES_BUCKET, NodeInfo)

        async def models() -> Models | None:
            return agents_models((await nodes.values()).values(), cluster.gpu_types)

        async def now() -> Cluster:
            live = tuple(Node(n.name, n.gpu_type, n.gpus) for n in (await nodes.values()).values() if n.gpus > 0)
            return Cluster("live", live) if live else cluster

    else:
        types = profile_source(args.reference, args.zoo).types

        async def models() -> Models | None:
            return types

        async def now() -> Cluster:
            return cluster

    await storage.open_stream(bus, subjects.DEAD_LETTER_STREAM)
    await storage.open_stream(bus, subjects.LOGS_STREAM)  # what jobs print, read to their submitters
    owners = await storage.open_kv(bus, subjects.JOB_OWNERS_BUCKET, JobOwner)
    teams = await storage.open_kv(bus, subjects.TEAMS_BUCKET, TeamFile)
    problem = live_problem(cluster, models, own_code=args.executors == "real")
    return (await open_gate(bus, owners, problem, teams, now))[1]


async def open_gate(
    bus: Bus,
    owners: TypedKV[JobOwner],
    problem: Problem,
    teams: TypedKV[TeamFile] | None = None,
    cluster: Callable[[], Awaitable[Cluster]] | None = None,
) -> tuple[Gate, micro.Service]:
    """The API's endpoints on a service of their own (for the caller to start), and the logins' own
    submissions from the intake stream judged from now on. `problem(spec)`: why a well-formed live
    submission cannot be scheduled on this cluster, or None (a coroutine function when it asks,
    e.g. which applications the live node agents run); `teams`, `cluster`: Gate's."""
    gate = Gate(bus, owners, problem, code=CodeGate(bus), teams=teams, cluster=cluster)
    handlers = {
        "submit": gate.answered,
        "job": gate.job,
        "jobs": gate.jobs,
        "cancel": gate.cancel,
        "schemas": lambda _: schemas(),
        "logs": gate.logs,
        "code-put": lambda chunk: gate.code.put(chunk, (who := login()).login, who.team),
        "code-has": lambda request: gate.code.has(request, login().login),
        "teams": gate.team_gpus,
        "explain": gate.explain,
        "rounds": gate.rounds,
    }
    request_types = {"submit": msgspec.Raw}  # decoded by `submit` itself, to answer a bad body
    service = await new_service(
        bus, subjects.API_SERVICE, "the user API: submit, look up, list and cancel jobs; each team's GPUs"
    )
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
    # Judged 64 at once (each mostly waits on JetStream); bodies under one id in the stream's order.
    asyncio.get_running_loop().create_task(
        intake.consume(gate.judge, with_delivery=True, batch=INTAKE_WINDOW, concurrent=True)
    )
    return gate, service


async def serve(
    bus: Bus,
    owners: TypedKV[JobOwner],
    problem: Problem,
    teams: TypedKV[TeamFile] | None = None,
    cluster: Callable[[], Awaitable[Cluster]] | None = None,
) -> Gate:
    """`open_gate`, its service started at once and stopped with the bus: the API within another
    process (a test's)."""
    gate, service = await open_gate(bus, owners, problem, teams, cluster)
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
