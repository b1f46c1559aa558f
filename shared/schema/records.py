"""The executors' records of jobs: what they keep of a real job (NodeJob, in KV) and what they
answer anyone who asks for the jobs (JobsQuery -> JobRecords, or a Count)."""

from __future__ import annotations

from typing import Iterable

import msgspec

# The messages a job prints for its executor are the training library's (written once, there).
from goodput_train.protocol import JobStats
from shared.lifecycle import JobState
from shared.schema.base import Spots
from shared.schema.jobs import JobSpec, Profiled
from shared.schema.rounds import Reclaim
from shared.subjects import DEFAULT_TEAM

# A job's lifecycle: submitted and being profiled, then queued (accepted, waiting for GPUs), running,
# and one of the ends; `rejected` is the profiler's refusal of a submission.
JOB_STATES = tuple(JobState)  # the names of shared/lifecycle.py, in the order `goodput status` counts them


class JobRecord(msgspec.Struct, frozen=True):
    """A job's outcome, as the results report it."""

    name: str
    application: str
    submit_s: float
    finish_s: float | None
    restarts: int
    gpu_seconds: float
    feedback_s: float | None
    placement: tuple[tuple[str, int], ...] = ()  # where it runs now
    failure: str | None = None  # why it ended without finishing
    metric: float | None = None  # a real job's own measure of success, when it finished
    batches: tuple[int, ...] = ()  # a real job's total batches, as it re-tuned them
    state: str = ""  # its place in the lifecycle: one of JOB_STATES
    gpu_type: str | None = None  # while running: the type of its GPUs
    batch: int | None = None  # while running: its total batch
    placements: tuple[Placed, ...] = ()  # a real job's placements over time, each from its start
    reason: str | None = None  # a job not ended: what it waits for (where it is profiled)
    owner: str = ""  # the login that submitted it ("": the operator's)
    metrics: dict[str, float | str] = {}  # a real job's own metrics, the latest value of each
    progress: Progress | None = None  # a real job's, once its workers have reported
    team: str = DEFAULT_TEAM  # the team it belongs to (its name is `team.id` unless DEFAULT_TEAM's)
    borrowed: int = 0  # of its GPUs now, those beyond its team's guarantee
    reclaims: tuple[Reclaim, ...] = ()  # the last times it was shrunk or stopped for another team's guarantee
    # Refused: whether the refused submission held its id until the refusal (the profiler ran it and
    # its script failed there, say), so that what its run printed is its own. False for any refusal
    # kept apart from the job under its id, which may be another submission's, another login's.
    held: bool = False


class Placed(msgspec.Struct, frozen=True, array_like=True):
    """A placement a real job's workers were started on, and when (on the run's clock)."""

    at_s: float
    spots: tuple[tuple[str, int], ...]


class Progress(msgspec.Struct, frozen=True):
    """A real job's progress, as its workers last reported it (`goodput status JOB`)."""

    steps: int  # optimizer steps taken
    epochs: float  # statistical epochs: progress in M0-examples over the dataset's size
    target_epochs: float | None = None  # where it ends (None: it has no target)
    throughput: float | None = None  # examples per second, measured at its current batch and GPUs
    goodput: float | None = None  # ... times its statistical efficiency at that batch, once it is known
    remaining_s: float | None = None  # to its target, at its epoch rate since its workers last started


class JobsQuery(msgspec.Struct, frozen=True):
    """-> executors: their jobs (JobRecords, `select`) or how many have the profiler's verdict
    (Count), of those whose id begins with `prefix` (all: ""); `owner`: only that login's (None:
    every login's); `team`: only that team's (None: every team's); `state`, `application`, `offset` and `limit`: one page of those. An `Ack`
    reads as the query for all."""

    prefix: str = ""
    owner: str | None = None
    state: str | None = None
    application: str | None = None
    offset: int = 0
    limit: int | None = None
    team: str | None = None


class JobRecords(msgspec.Struct, frozen=True):
    jobs: tuple[JobRecord, ...]
    total: int | None = None  # a page's: the jobs that match, in all pages


def job_rows(records: Iterable[JobRecord]) -> list[JobRecord]:
    """The records a user sees, in their order: one per id, the job the id belongs to (the executors
    also keep refusals of other bodies sent under a taken id: those are left out); refusals whose id
    could not be read, each."""
    rows: dict[object, JobRecord] = {}
    for n, record in enumerate(records):
        key = record.name or n
        held = rows.get(key)
        if held is None or (held.state == JobState.REJECTED and record.state != JobState.REJECTED):
            rows[key] = record
    return list(rows.values())


def select(records: Iterable[JobRecord], query: JobsQuery) -> JobRecords:
    """What the executors answer a query with: the records of its owner's jobs whose id begins with
    its prefix; with a state, an application or a limit, one page of the rows a user sees
    (`job_rows`) and how many match in all."""
    chosen = [
        r
        for r in records
        if r.name.startswith(query.prefix) and query.owner in (None, r.owner) and query.team in (None, r.team)
    ]
    if query.limit is None and query.state is None and query.application is None:
        return JobRecords(tuple(chosen))
    rows = [
        r for r in job_rows(chosen) if query.state in (None, r.state) and query.application in (None, r.application)
    ]
    end = query.offset + (len(rows) if query.limit is None else query.limit)
    return JobRecords(tuple(rows[query.offset : end]), len(rows))


class NodeJob(msgspec.Struct):
    """A real job as its node agent keeps it (KV): what the scheduler is told of it besides what its
    workers report, and what they reported last, so a restarted agent goes on with it (its workers
    resume from their checkpoint)."""

    spec: JobSpec
    profiled: Profiled | None = None
    submission: int = 0  # the stream sequence of its submission
    seen: int = 0  # ... of what it was first read from: listed in that order
    trace: str = ""  # its submission's traceparent (else its verdict's)
    cancelled: bool = False  # its user cancelled it (its failure says so)
    owner: str = ""  # the login that submitted it ("": the operator's)
    submitted_at: float = 0.0  # when it was read here, wall-clock (epoch) seconds
    arrival_s: float | None = None  # on the run's clock: when it entered the rounds, profiled
    submitted_s: float | None = None  # ... and when it was submitted, on the same clock
    finish_s: float | None = None
    failure: str | None = None
    ended_in: float | None = None  # the round (its now_s) whose advance reported the end
    advanced_to: float | None = None  # its slot-seconds are counted up to here
    gpu_seconds: float = 0.0
    by_type: dict[str, float] = {}
    idle_since_s: float | None = None
    max_gpus_seen: int = 0
    slice_steps: int = 0  # its steps when the current placement began
    estimate_revision: int = 0
    reported: tuple[tuple[int, int, int, int], ...] = ()  # configurations (nodes, GPUs, m, s) the estimator has
    reported_type: str = ""  # ... on this GPU type (a job moved to another reports them there again)
    placement: Spots = ()  # where its workers ran when this was saved
    placements: tuple[Placed, ...] = ()  # every placement its workers were started on
    generation: int = 0  # its workers' starts so far (a node ignores an older order)
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()  # the nodes its workers run on, and their ranks
    restarts: int = 0
    crashes: int = 0
    stats: JobStats | None = None
    metric: float | None = None  # its own measure of success, once finished
    metrics: dict[str, float | str] = {}  # the latest value of each metric it reported
    batches: tuple[int, ...] = ()  # the total batches it trained at, once finished
    # A refusal kept apart from any job: the id it names ("" when none could be read; its spec a
    # stand-in), listed for its sender, never held against the job of that id. None: a job.
    apart: str | None = None
    borrowed: int = 0  # of its GPUs, those beyond its team's guarantee, as the last round said
    reclaims: tuple[Reclaim, ...] = ()  # the latest times it was shrunk or stopped for another team's guarantee

    @property
    def key(self) -> str:
        """Where it is kept (KV) and listed from: its id; a refusal kept apart, its place in the stream."""
        return self.spec.id if self.apart is None else apart_key(self.seen)

    @property
    def name(self) -> str:
        """The id it is listed under: its own, or the one a refusal kept apart names."""
        return self.spec.id if self.apart is None else self.apart


APART = "_rejected"  # keys of refusals kept apart from any job (no job id starts with _): by their sequence


def apart_key(sequence: int) -> str:
    """The key (executors' KV, their records) of a refusal kept apart from any job: any refusal but
    the verdict on the submission that holds its id (a body never stored, one whose id could not be
    read, another body under an id a job holds). Two refusals naming one id, in whatever order they
    come, are two entries."""
    return f"{APART}.{sequence}"
