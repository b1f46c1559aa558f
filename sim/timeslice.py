"""An exact event simulator of time-slicing jobs on one accelerator (Gandiva-style, OSDI'18).

N jobs arrive together at t = 0. Job i needs I_i iterations of d seconds each. The accelerator
switches between jobs only at iteration boundaries (no mid-kernel preemption), and each switch to a
*different* job costs c seconds. There is no setup charge for the first job, no switch after the
last job finishes, and none when the only unfinished job simply keeps running.

Feedback is defined before schedules are compared: a job's feedback time is the completion time of
its k-th iteration (k = the feedback threshold). A job shorter than k gives its feedback when it
finishes, i.e. k is clamped to the job's iteration count, so that a mixed workload never has a job
without feedback. In the worked case every job has 4 iterations and k <= 4, so the clamp never bites.

Run-to-completion is round-robin with an unbounded quantum: one rule, `next_job` plus
`visit_iterations`, drives both. The scheduler's `timeslice` policy applies the same rule at round
boundaries, over jobs that arrive and leave (policies/timeslice.py).

Times are computed as (iterations run) * d + (switches made) * c rather than by accumulating
floats, so every figure is the same closed form a hand calculation gives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

RUN_TO_COMPLETION = "run_to_completion"
ROUND_ROBIN = "round_robin"

# The sweep the issue fixes: 8 jobs x 4 iterations x 1 s, thresholds x quanta x switch costs.
SWEEP_JOBS = 8
SWEEP_ITERATIONS = 4
SWEEP_ITERATION_S = 1.0
SWEEP_THRESHOLDS = (1, 3, 4)
SWEEP_QUANTA = (1, 2, 3, 4)
SWEEP_SWITCH_COSTS = (0.0, 0.1, 0.5, 1.0)
WORKED_SWITCH_COST = 0.1
WORKED_THRESHOLD = 1
WORKED_QUANTA = (None, 1, 2)  # None = run-to-completion

# Last-feedback times closer than this are ties (they differ only by float rounding).
TIE_TOLERANCE_S = 1e-9


@dataclass(frozen=True)
class Workload:
    """Jobs sharing one accelerator: iterations per job, one iteration time, one switch cost."""

    iterations: tuple[int, ...]
    iteration_s: float
    switch_cost_s: float

    def __post_init__(self) -> None:
        if len(self.iterations) == 0:
            raise ValueError("workload needs at least one job (got zero jobs)")
        for i, n in enumerate(self.iterations):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"job {i} must need a positive whole number of iterations, got {n!r}")
        if not (math.isfinite(self.iteration_s) and self.iteration_s > 0):
            raise ValueError(f"iteration time must be positive and finite, got {self.iteration_s!r} s")
        if not (math.isfinite(self.switch_cost_s) and self.switch_cost_s >= 0):
            raise ValueError(f"switch cost must be non-negative and finite, got {self.switch_cost_s!r} s")

    @classmethod
    def uniform(cls, jobs: int, iterations: int, iteration_s: float, switch_cost_s: float) -> Workload:
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise ValueError(f"workload needs at least one job, got jobs={jobs!r}")
        return cls((iterations,) * jobs, iteration_s, switch_cost_s)

    @property
    def useful_work_s(self) -> float:
        return sum(self.iterations) * self.iteration_s


@dataclass(frozen=True)
class JobResult:
    feedback_s: float  # completion of the job's k-th iteration (k clamped to its length)
    completion_s: float  # completion of its last iteration


@dataclass(frozen=True)
class ScheduleResult:
    schedule: str  # RUN_TO_COMPLETION or ROUND_ROBIN
    quantum: int | None  # iterations per visit; None for run-to-completion
    threshold: int
    switch_cost_s: float
    first_feedback_s: float
    last_feedback_s: float
    mean_feedback_s: float
    makespan_s: float
    switches: int
    useful_work_s: float
    jobs: tuple[JobResult, ...]


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive whole number of iterations, got {value!r}")


def next_job(remaining: Sequence[int], last: int | None) -> int | None:
    """The round-robin rule: the first unfinished job after `last` in submission order, wrapping
    around (so it is `last` itself when that is the only one left); None when all are done."""
    n = len(remaining)
    start = 0 if last is None else last + 1
    for step in range(n):
        j = (start + step) % n
        if remaining[j] > 0:
            return j
    return None


def visit_iterations(remaining: int, quantum: int | None) -> int:
    """Iterations one visit runs: min(q, remaining); all of them when there is no quantum."""
    return remaining if quantum is None else min(quantum, remaining)


def simulate(workload: Workload, quantum: int | None, threshold: int) -> ScheduleResult:
    """Run the workload round-robin with `quantum` iterations per visit (None = run-to-completion,
    in submission order) and measure feedback at `threshold` iterations."""
    if quantum is not None:
        _check_positive_int("quantum", quantum)
    _check_positive_int("feedback threshold", threshold)

    d, c = workload.iteration_s, workload.switch_cost_s
    remaining = list(workload.iterations)
    feedback_at = [min(threshold, n) for n in workload.iterations]
    feedback: list[float] = [0.0] * len(remaining)
    completion: list[float] = [0.0] * len(remaining)
    iterations_run = switches = 0
    last: int | None = None

    while (job := next_job(remaining, last)) is not None:
        if last is not None and job != last:
            switches += 1
        for _ in range(visit_iterations(remaining[job], quantum)):
            iterations_run += 1
            remaining[job] -= 1
            now = iterations_run * d + switches * c
            if workload.iterations[job] - remaining[job] == feedback_at[job]:
                feedback[job] = now
        if remaining[job] == 0:
            completion[job] = now
        last = job

    return ScheduleResult(
        schedule=RUN_TO_COMPLETION if quantum is None else ROUND_ROBIN,
        quantum=quantum,
        threshold=threshold,
        switch_cost_s=c,
        first_feedback_s=min(feedback),
        last_feedback_s=max(feedback),
        mean_feedback_s=sum(feedback) / len(feedback),
        makespan_s=max(completion),
        switches=switches,
        useful_work_s=workload.useful_work_s,
        jobs=tuple(JobResult(f, t) for f, t in zip(feedback, completion)),
    )


def worked_case(
    jobs: int = SWEEP_JOBS,
    iterations: int = SWEEP_ITERATIONS,
    iteration_s: float = SWEEP_ITERATION_S,
    switch_cost_s: float = WORKED_SWITCH_COST,
    threshold: int = WORKED_THRESHOLD,
    quanta: Sequence[int | None] = WORKED_QUANTA,
) -> list[ScheduleResult]:
    """Run-to-completion, quantum 1 and quantum 2 on 8 jobs x 4 iterations x 1 s, c = 0.1 s, k = 1."""
    workload = Workload.uniform(jobs, iterations, iteration_s, switch_cost_s)
    return [simulate(workload, q, threshold) for q in quanta]


def sweep(
    jobs: int = SWEEP_JOBS,
    iterations: int = SWEEP_ITERATIONS,
    iteration_s: float = SWEEP_ITERATION_S,
    thresholds: Sequence[int] = SWEEP_THRESHOLDS,
    quanta: Sequence[int] = SWEEP_QUANTA,
    switch_costs: Sequence[float] = SWEEP_SWITCH_COSTS,
) -> list[ScheduleResult]:
    """Round-robin over thresholds x quanta x switch costs (48 schedules by default), ordered by
    threshold, then switch cost, then quantum."""
    results = []
    for k in thresholds:
        for c in switch_costs:
            workload = Workload.uniform(jobs, iterations, iteration_s, c)
            results.extend(simulate(workload, q, k) for q in quanta)
    return results


@dataclass(frozen=True)
class OptimalQuanta:
    threshold: int
    switch_cost_s: float
    quanta: tuple[int | None, ...]  # every quantum within TIE_TOLERANCE_S of the best
    last_feedback_s: float


def optimal_quanta(results: Sequence[ScheduleResult], tolerance_s: float = TIE_TOLERANCE_S) -> list[OptimalQuanta]:
    """For each (threshold, switch cost), all quanta that minimise last-feedback time — every tied
    one, since at zero switch cost several quanta give exactly the same answer."""
    groups: dict[tuple[int, float], list[ScheduleResult]] = {}
    for r in results:
        groups.setdefault((r.threshold, r.switch_cost_s), []).append(r)
    best = []
    for (k, c), group in groups.items():
        low = min(r.last_feedback_s for r in group)
        tied = tuple(r.quantum for r in group if r.last_feedback_s - low <= tolerance_s)
        best.append(OptimalQuanta(k, c, tied, low))
    return best
