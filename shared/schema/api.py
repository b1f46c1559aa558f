"""The user API (goodput.api.*): what a client in any language sends and gets. The API service
answers from the executors' records (`records`), each job as a JobStatus."""

from __future__ import annotations

from typing import Annotated, Iterable

import msgspec

from shared.lifecycle import JobState
from shared.schema.base import Identifier
from shared.schema.records import JobRecord, Progress, job_rows
from shared.schema.rounds import Reclaim
from shared.subjects import DEFAULT_TEAM


class JobStatus(msgspec.Struct, frozen=True):
    """A job as a user sees it (`goodput status --json`, `goodput.api.job`). Times are seconds on
    the run's clock; `jct_s` is from its submission to its end."""

    id: str | None  # None: a refused submission whose id could not be read
    state: str  # one of JOB_STATES
    reason: str = ""  # why it ended without finishing, or was refused; while
    # profiling or queued, where it is profiled or what it waits for
    application: str | None = None
    gpu_type: str | None = None  # while running: its GPUs' hardware (T4, A100, ...)
    gpu_alias: str | None = None  # ... and their type's key in the cluster (aws, dgx-ext, ...)
    gpus: int = 0  # while running
    nodes: tuple[str, ...] = ()  # while running
    batch: int | None = None  # while running: its total batch
    submit_s: float | None = None
    finish_s: float | None = None
    jct_s: float | None = None
    restarts: int = 0
    gpu_seconds: float = 0.0
    metrics: dict[str, float | str] = {}  # a real job's own (`training.report`), the latest of each
    progress: Progress | None = None  # a real job's steps and epochs of its target, speed, expected end
    team: str = DEFAULT_TEAM  # the team it belongs to (the server's word of who submitted it)
    borrowed: int = 0  # while running: of its `gpus`, those beyond its team's guarantee (lent by others)
    reclaims: tuple[Reclaim, ...] = ()  # the last times it was shrunk or stopped for a team's guarantee
    placement: tuple[tuple[str, int], ...] = ()  # while running: (node, GPUs) on each of its `nodes`
    # goodput.api.job: other bodies sent under its id and refused, each's reason (the latest MAX_REFUSALS)
    refusals: tuple[str, ...] = ()


def job_status(record: JobRecord) -> JobStatus:
    """What a user sees of a job, from the executors' record of it."""
    import math

    from shared.hardware import hardware_name

    submitted = record.submit_s if record.submit_s is not None and math.isfinite(record.submit_s) else None
    running = record.state == JobState.RUNNING
    return JobStatus(
        record.name or None,
        record.state,
        record.failure or record.reason or "",
        record.application or None,
        record.gpu_type and hardware_name(record.gpu_type),
        record.gpu_type,
        sum(g for _, g in record.placement) if running else 0,
        tuple(node for node, _ in record.placement) if running else (),
        record.batch,
        submitted,
        record.finish_s,
        None if record.finish_s is None or submitted is None else record.finish_s - submitted,
        record.restarts,
        round(record.gpu_seconds, 3),
        metrics=record.metrics,
        progress=record.progress,
        team=record.team or DEFAULT_TEAM,
        borrowed=record.borrowed if running else 0,
        reclaims=record.reclaims,
        placement=tuple(record.placement) if running else (),
    )


def job_statuses(records: Iterable[JobRecord]) -> list[JobStatus]:
    """What a user sees of the jobs (`job_rows`), as statuses."""
    return [job_status(record) for record in job_rows(records)]


class JobRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """-> goodput.api.job (its JobStatus), goodput.api.cancel (a CancelAnswer)."""

    id: Identifier


MAX_PAGE = 500
MAX_REFUSALS = 5  # JobStatus.refusals


class JobsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """-> goodput.api.jobs: a page of the jobs, in submission order, of those matching every filter
    given (state: one of JOB_STATES; application; an id prefix)."""

    state: str | None = None
    application: str | None = None
    prefix: str = ""
    offset: Annotated[int, msgspec.Meta(ge=0)] = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGE)] = 100


class JobsPage(msgspec.Struct, frozen=True):
    jobs: tuple[JobStatus, ...]
    total: int  # jobs matching the filters, in all pages
    next_offset: int | None = None  # the next page's offset; None: this was the last


class SubmitAnswer(msgspec.Struct, frozen=True):
    """goodput.api.submit's answer. accepted: the submission is stored (or was, the same body
    before) and goes to the profiler; refused: `reason` says why, and nothing was stored, so the
    corrected body may use the same id."""

    accepted: bool
    id: str | None
    state: str  # profiling when just stored; else the job's state now
    reason: str = ""
    notes: tuple[str, ...] = ()  # what the submitter may not expect (e.g. a GPU count is a hint)


class CancelAnswer(msgspec.Struct, frozen=True):
    """goodput.api.cancel's answer: `cancelled` once the order is stored (or the job already was);
    false for a job that has ended, with why. No job of that id: error 404."""

    cancelled: bool
    id: str
    state: str
    reason: str = ""


class TeamsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """-> goodput.api.teams: each team's guaranteed GPUs, their use and their lending, per GPU type
    (a login: its own team's; the operator: every team's)."""


class TeamGpus(msgspec.Struct, frozen=True):
    """A team's GPUs of one type, now."""

    gpu_type: str  # the hardware (T4, A100, ...)
    gpu_alias: str  # ... and the type's key in the cluster (aws, dgx-ext, ...)
    quota: int  # guaranteed to it
    used: int  # held by its running jobs
    borrowed: int  # of `used`, those beyond its guarantee (lent by others, or no one's)
    lent: int  # of `quota`, those other teams' jobs hold now (it gets them back within a round)
    borrow_limit: int | None = None  # beyond `quota` it holds at most this many (None: any idle)


class TeamStatus(msgspec.Struct, frozen=True):
    """One team, as `goodput status --teams` shows it."""

    team: str
    gpus: tuple[TeamGpus, ...]  # one per GPU type of the cluster, and any its jobs hold besides
    weight: float = 1.0  # its share of what lies beyond all guarantees


class TeamsAnswer(msgspec.Struct, frozen=True):
    teams: tuple[TeamStatus, ...]
    note: str = ""  # no team file (one team, no guarantees), or why its guarantees cannot be shown
