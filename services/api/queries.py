"""The user API's answers about jobs, teams and rounds (`Queries`), each handler a method that takes
the request and its requester's `Who`; what a requester may see is `Who`'s to say.

- `job`: {"id"} -> its JobStatus (404 when the login has no job of that id); `jobs`: filters and
  paging (a page at most MAX_PAGE jobs and PAGE_BYTES, asked of the executors as a page).
- `cancel`: {"id"} -> CancelAnswer: the order goes to the jobs stream, the executors end the job.
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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import msgspec
from opentelemetry import trace

from services.api.explain import explanation, read_last
from services.api.logs import job_page
from services.api.who import Who
from shared import subjects
from shared.bus import Bus
from shared.bus.encoding import NotFound
from shared.bus.kv import TypedKV
from shared.cluster import Cluster
from shared.hardware import hardware_name
from shared.lifecycle import JobState
from shared.schema.api import (
    MAX_REFUSALS,
    CancelAnswer,
    JobRequest,
    JobsPage,
    JobsRequest,
    JobStatus,
    TeamGpus,
    TeamsAnswer,
    TeamsRequest,
    TeamStatus,
    job_status,
    job_statuses,
)
from shared.schema.decisions import ExplainRequest, Explanation, JobDecision, RoundsPage, RoundsRequest, RoundSummary
from shared.schema.jobs import Cancel, JobOwner
from shared.schema.logs import LogsPage, LogsRequest
from shared.schema.records import JOB_STATES, JobRecord, JobRecords, JobsQuery
from shared.schema.teams import TeamFile, Teams
from shared.subjects import DEFAULT_TEAM
from shared.teams import resolve

log = logging.getLogger(__name__)

ENDED = (JobState.FINISHED, JobState.FAILED, JobState.REJECTED)
RECORDS_TIMEOUT_S = 10.0
CANCEL_WAIT_S = 10.0  # how long `cancel` waits for the executors to take the order before it answers
CANCEL_POLL_S = 0.2
PAGE_BYTES = 256 * 1024  # a page of `jobs` is cut short (its next_offset says where to go on) past this
STORED_UNREAD = "stored: the profiler reads it next"  # a job's reason before the executors know it


def refused(status: JobStatus) -> bool:
    return status.state == JobState.REJECTED


class Queries:
    """The API's answers about what is there, each handler a method of (request, `Who`). `teams`: the
    KV holding the operator's team file (None: no teams); `cluster()`: the cluster as it is now,
    which the team file is read against."""

    def __init__(
        self,
        bus: Bus,
        owners: TypedKV[JobOwner],
        teams: TypedKV[TeamFile] | None = None,
        cluster: Callable[[], Awaitable[Cluster]] | None = None,
    ) -> None:
        self.bus, self.owners = bus, owners
        self.team_files, self.cluster = teams, cluster

    async def records(self, query: JobsQuery) -> JobRecords:
        try:
            return await self.bus.request(subjects.RECORDS, query, JobRecords, timeout=RECORDS_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - no executor answers: the caller is told so
            raise ValueError(f"the executors do not answer ({type(error).__name__}); try again") from None

    async def team_file(self) -> TeamFile | None:
        """The operator's team file, as the teams' KV holds it; None without one."""
        if self.team_files is None:
            return None
        try:
            held = await self.team_files.get(subjects.TEAMS_KEY)
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
            raise NotFound(who.not_found(job_id))
        if not refused(now):
            return now, who.scoped(job_id)
        scoped = who.scoped(job_id)
        records = await self.records(who.query(job_id))
        own = any(r.name == scoped and r.state == JobState.REJECTED and r.held for r in records.jobs)
        return now, scoped if own else None

    # ---- the endpoints' handlers ----

    async def job(self, request: JobRequest, who: Who) -> JobStatus:
        return (await self.named_job(request.id, who))[0]

    async def jobs(self, request: JobsRequest, who: Who) -> JobsPage:
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

    async def logs(self, request: LogsRequest, who: Who) -> LogsPage:
        """The page of what the job `request.id` of `who`'s team printed, from that team's logs stream
        (404 for another's: no one learns of another's jobs); `end` is read first, so an ended job's
        last lines are in its pages. The operator reads any team's, the job's."""
        now, scoped = await self.named_job(request.id, who)
        ended = now.state in (*ENDED, JobState.CANCELLED)
        if scoped is None:
            return LogsPage((), request.after, False, ended)
        lines, cursor, more = await job_page(self.bus, who.logs_team(now), scoped, request)
        return LogsPage(tuple(lines), cursor, more, ended)

    async def cancel(self, request: JobRequest, who: Who) -> CancelAnswer:
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

    async def teams(self, _: TeamsRequest, who: Who) -> TeamsAnswer:
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
        return TeamsAnswer(who.teams(team_statuses(teams, who.counted_teams(named), cluster, running)), note)

    async def explain(self, request: ExplainRequest, who: Who) -> Explanation:
        """Why the job `request.id` of `who`'s has what it has, from its last `request.rounds` recorded
        decisions (404 for another's: the same answer as an unknown id)."""
        now, scoped = await self.named_job(request.id, who)
        decisions, kept = (
            ([], 0)
            if scoped is None
            else await read_last(self.bus, subjects.job_decisions(scoped), request.rounds, JobDecision)
        )
        known = await who.known_jobs({h.job: h.team for d in decisions for h in d.holders}, self.owners)
        return explanation(request.id, now, decisions, known, who, complete=kept <= request.rounds)

    async def rounds(self, request: RoundsRequest, who: Who) -> RoundsPage:
        """The last `request.limit` rounds' summaries, oldest first, as `who` may see them, and the
        latest's nodes once (not in each summary)."""
        summaries, _ = await read_last(self.bus, subjects.ROUND_DECISIONS, request.limit, RoundSummary)
        shown = tuple(msgspec.structs.replace(who.round(s), nodes=()) for s in summaries)
        return RoundsPage(shown, summaries[-1].nodes if summaries else ())


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
