"""A job's life in one place: its states (the strings a `JobRecord.state` carries), the moves an
executor may make between them (`TRANSITIONS`), and the one rule that tells a job's state from
what is known of it (`job_state`).

Both executors, the simulated ones and the real ones, derive a job's state with `job_state` and
pass every change through `check_transition`, so a move the table does not allow raises where it
is made. Nothing here knows the wire types: it imports no schema.
"""

from __future__ import annotations

import enum
from typing import Mapping


class JobState(enum.StrEnum):
    """A job's place in its life, as the records and the API name it (in the order `goodput status`
    counts them)."""

    QUEUED = "queued"  # accepted by the profiler, waiting for GPUs
    UNSCHEDULABLE = "unschedulable"  # accepted, but the live nodes as they are cannot take it (shared/waits.py)
    PROFILING = "profiling"  # submitted, the profiler's verdict not yet in
    RUNNING = "running"  # placed on GPUs
    FINISHED = "finished"  # trained to its end
    FAILED = "failed"  # ended without finishing, after the profiler accepted it
    REJECTED = "rejected"  # refused before it ever ran (by the profiler, the API or the executors)
    CANCELLED = "cancelled"  # ended by its user


# The moves a job may make (staying where it is is no move). A finish outranks every other end: a
# job's workers may finish as a cancel or a failure stops them, and the job did finish. A job the
# executors refused on submission (its code is not there) fails when the profiler accepts it after all.
# A waiting job is unschedulable while the nodes cannot take it, and queued again when they change
# (a node joins, a drain is lifted); a running job whose nodes are drained may become so at once.
_ENDS = frozenset({JobState.FINISHED, JobState.FAILED, JobState.CANCELLED})
TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    JobState.PROFILING: frozenset({JobState.QUEUED, JobState.UNSCHEDULABLE, JobState.REJECTED, JobState.CANCELLED}),
    JobState.QUEUED: _ENDS | {JobState.RUNNING, JobState.UNSCHEDULABLE},
    JobState.UNSCHEDULABLE: _ENDS | {JobState.RUNNING, JobState.QUEUED},
    JobState.RUNNING: _ENDS | {JobState.QUEUED, JobState.UNSCHEDULABLE},
    JobState.REJECTED: frozenset({JobState.FAILED}),
    JobState.FAILED: frozenset({JobState.FINISHED}),
    JobState.CANCELLED: frozenset({JobState.FINISHED}),
    JobState.FINISHED: frozenset(),
}


class IllegalTransition(ValueError):
    """A job asked to move between two states that `TRANSITIONS` does not connect."""


def check_transition(before: JobState, after: JobState, job: str = "") -> JobState:
    """`after`, when a job in `before` may move there (or stays); IllegalTransition otherwise."""
    if after != before and after not in TRANSITIONS[before]:
        raise IllegalTransition(f"job {job or '?'}: {before} -> {after} is not a move a job makes")
    return after


def job_state(
    *, finished: bool, cancelled: bool, failed: bool, profiled: bool, placed: bool, fits: bool = True
) -> JobState:
    """A job's state from what is known of it: whether it finished, its user cancelled it, it has a
    failure (a refusal included), the profiler accepted it, it holds GPUs, and the live nodes as
    they are could take it (`fits`). A finish stands whatever came after it (a cancel of an ended
    job does nothing); a cancel is told apart from the failure it is recorded as; a failure before
    the profiler accepted the job is a refusal."""
    if finished:
        return JobState.FINISHED
    if cancelled:
        return JobState.CANCELLED
    if failed:
        return JobState.FAILED if profiled else JobState.REJECTED
    if not profiled:
        return JobState.PROFILING
    if placed:
        return JobState.RUNNING
    return JobState.QUEUED if fits else JobState.UNSCHEDULABLE
