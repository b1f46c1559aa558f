"""The user API's submissions (`Submissions`): a login's job is judged as the profiler would judge
it before anything is stored (against the profiles on a simulated cluster; with real executors,
against the applications the live node agents say they run), whether it came on `goodput.api.submit`
or on the intake stream.

- `submit`: a JobSpec -> SubmitAnswer. Only a valid submission is stored (in the jobs stream, on
  the login's own subject) under the Nats-Msg-Id `<id>.<digest of the body>`: a refused body
  reserves nothing, so the corrected one is taken under the same id; the same body again is a
  repeat. The id goes to the first valid submission stored: the API marks the id while it stores
  (so of two bodies racing here, the second is refused at once, storing nothing), and a body
  stored first by another replica takes the id over from the mark (the profiler reads the stream
  in order, as the executors do); that answer says so. The profiler's verdict follows (a real
  profiling run may still refuse it; `job` says so). A login's own submissions on the intake
  stream are judged by the same `submit` (`Submissions.judge`).

What a login and a team keep is bounded (`shared.storage.LoginLimits` and `TeamLimits`, counted by
JetStream under their subjects: `Kept`): beyond its submissions a submit is refused "over your
limit", beyond its team's "over your team's limit" (a team that floods fills only its own share,
and the other teams' logins still submit); a refusal is recorded (so `job` shows why) while the
login and its team keep fewer than their refusals' bounds, and answered all the same beyond them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

import msgspec
from opentelemetry import trace

from services.api.code import CodeGate
from services.api.queries import Queries
from services.api.who import Who, intake_owner
from shared import subjects
from shared.bus import Bus
from shared.bus.encoding import Refused, explained
from shared.bus.kv import RevisionConflict, TypedKV
from shared.cluster import Cluster
from shared.lifecycle import JobState
from shared.metrics import REFUSALS, SUBMISSIONS, instrument
from shared.schema.api import SubmitAnswer
from shared.schema.base import MAX_ID
from shared.schema.jobs import MARK_TTL_S, JobOwner, JobSpec, readable_fields, rejection, spec_digest, submission_msg_id
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
from shared.subjects import DEFAULT_TEAM
from shared.submissions import id_taken, malformed_reason, submission_problem
from shared.teams import scoped_id

log = logging.getLogger(__name__)

Problem = Callable[[JobSpec], str | None | Awaitable[str | None]]
Models = Mapping[str, Iterable[str]]  # application -> the GPU types it has profiles on
KEPT_TTL_S = 1.0  # how long JetStream's count of a team's records is taken as it is
REFUSAL_TIMEOUT_S = 2.0  # for a refusal's record to be acknowledged, each of its attempts


def live_problem(cluster: Cluster, models: Callable[[], Awaitable[Models | None]], own_code: bool = False) -> Problem:
    """Why a live submission cannot be scheduled on `cluster`, as the profiler would judge it;
    `models()`: application -> the GPU types it has profiles on (None: any application may be);
    `own_code`: the executors run a job's own code (real ones)."""

    async def problem(spec: JobSpec) -> str | None:
        return submission_problem(spec, cluster, await models(), live=True, own_code=own_code)

    return problem


def notes(spec: JobSpec) -> tuple[str, ...]:
    """What a submitter may not expect of an accepted job."""
    found = []
    if not spec.fixed_gpus and spec.requested_gpus > 1:
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


class Submissions:
    """The API's judge of submissions: `submit` (the endpoint's handler `answered`, of a request and
    its `Who`) and the intake stream's (`judge`). `queries`: the answers a repeat and a team's ids
    are read from; `code`: the code store (None: jobs may not carry their code here)."""

    def __init__(
        self,
        bus: Bus,
        owners: TypedKV[JobOwner],
        problem: Problem,
        queries: Queries,
        kept: Kept | None = None,
        code: CodeGate | None = None,
    ) -> None:
        self.bus, self.owners, self.problem, self.queries = bus, owners, problem, queries
        self.kept = kept or Kept(bus)
        self.code = code
        self.turns = Turns()

    async def answered(self, raw: msgspec.Raw, who: Who) -> SubmitAnswer:
        """`submit`'s answer; a refusal is service error 400 too, its answer the body (Refused)."""
        answer = await self.submit(bytes(raw), who)
        if not answer.accepted:
            raise Refused(answer.reason, answer)
        return answer

    async def unreadable(self, _: str, data: bytes, error: Exception, who: Who) -> None:
        """A body that is no JSON object nor msgpack map: refused like any malformed one."""
        answer = await self.refuse(data, malformed_reason(error), who, cause="malformed")
        raise Refused(answer.reason, answer)

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
        now = await self.queries.status_of(job_id, who)
        if now is not None and now.state == JobState.REJECTED:  # within JetStream's day, the same body refused before
            return SubmitAnswer(False, job_id, now.state, f"the same submission was refused before: {now.reason}")
        return SubmitAnswer(
            True,
            job_id,
            now.state if now else JobState.PROFILING,
            "the same submission was stored before: not stored again",
        )

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
        if (
            who.team == DEFAULT_TEAM
            and dot
            and (file := await self.queries.team_file()) is not None
            and first in file.teams
        ):
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
