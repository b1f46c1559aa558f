"""`gavel`: heterogeneity-aware max-min fairness over normalised throughputs (Gavel, OSDI '20, as ported
to Sia's simulator): rigid jobs at their requested GPU count and batch, 360 s rounds.

`objective="max_sum_throughput"` swaps step 3's objective for Gavel's throughput-maximising one,
max sum X[j, t] * steps/s[j, t] (not normalised), which is what Sia's public port of Gavel runs by
default; the rest is the same.

1. Throughput matrix. thr[j, t] = the job's samples/s on type t at its requested GPU count g_j and
   requested batch (`fifo.requested_throughput_matrix`: the job's model on t, the batch split across
   accumulation steps so the per-GPU batch respects t's largest, on the fewest nodes that hold g_j);
   0 where the job cannot run on t (no model, or fewer than g_j GPUs of t in the cluster).

2. Normalisation (Gavel's `ProportionalPolicy`, exactly): the time-share matrix that gives every job
   an equal share of each type and every type in proportion to its size, x_eq[j, t] = cap_t / sum_t'
   cap_t' (Gavel computes cap_t / N and rescales rows to sum to 1; the 1/N is common to every job and
   cancels), so
        thr_eq[j] = sum_t cap_t * thr[j, t] / sum_t cap_t.
   Types the job cannot run on count in the denominator with 0 throughput, as in Gavel.

3. The allocation: X[j, t] = the fraction of time job j should run on type t,
        max_X  min_j  sum_t X[j, t] * thr[j, t] / thr_eq[j]
        s.t.   X >= 0,   X[j, t] = 0 where thr[j, t] = 0,   sum_t X[j, t] <= 1,
               sum_j X[j, t] * g_j <= cap_t                  for every type t,
   one LP (epigraph form) with HiGHS through scipy.optimize.linprog. Jobs that can run nowhere are
   left out of it. The max-min optimum is rarely unique; Gavel takes whatever point its solver
   returns. With `refine=True` (the default) a second LP picks, among the max-min optimal points
   (each job's normalised throughput >= the optimum, less 1e-6 relative or 1e-7), the one with the largest
   total normalised throughput: Pareto-efficient and independent of solver internals. `refine=False`
   is Gavel's single LP. On a solver failure X = 0 (the event is logged): priorities then all tie
   at 0 and the tie-breakers below give the GPUs to the jobs furthest behind.

4. Round-based mechanism (Gavel §5). The fraction of time job j has received on type t is
        f[j, t] = attained_by_type[t] / (g_j * age_s)
   (GPU-seconds over GPUs = seconds on t, over the job's age; counters never reset, as in Sia's
   port), and priority[j, t] = X[j, t] / f[j, t]: infinite where X > 0 and f = 0 (ordered among
   themselves by X, as Gavel's 1e9 * X does), 0 where X = 0. (job, type) pairs are taken in
   decreasing priority, ties by decreasing deficit X[j, t] * age_s - seconds on t, then decreasing
   X, then earlier submission, job_id and cluster type order; a pair is granted when the job has
   no type yet and the type still has g_j GPUs of room. Pairs with X = 0 (but thr > 0) come last, so
   GPUs left over still go to jobs that can use them (Gavel schedules them too). This is Gavel's
   global queue over all types; its per-type queue mode (each type's pairs in turn) is not offered.

5. Placement. A job granted the type it runs on keeps its exact placement; running jobs not granted
   any type are preempted; a job moved to another type restarts there. The others are packed on the
   nodes left free (`pack`), largest request first (Gavel assigns workers by decreasing scale factor
   for locality), ties in grant order; step 4's per-type counts guarantee the fit. A job
   mid checkpoint-restart is treated like any other (Sia's port charges restart costs, locks
   nothing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from policies.base import (
    Decision,
    JobView,
    RoundState,
    decision_from_placements,
    free_gpus,
    pack,
    refuse_hybrid,
    refuse_teams,
)
from policies.rigid import holds_request, requested_throughput_matrix
from shared.schema.base import Spots

log = logging.getLogger(__name__)

ROUND_S = 360.0  # Gavel's round
REFINE_TOLERANCE = 1e-6  # relative slack on the max-min value when refining ...
REFINE_SLACK = 1e-7  # ... and absolute, at least the solver's feasibility tolerance
ZERO = 1e-9  # time fractions below this are 0


@dataclass(frozen=True)
class FairAllocation:
    """The LP's answer. x: (J, T) time fractions; value: the max-min normalised throughput."""

    x: np.ndarray
    value: float
    status: str  # "optimal" or why not


def proportional_throughput(thr: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """thr_eq[j] = sum_t cap_t * thr[j, t] / sum_t cap_t (Gavel's proportional normaliser)."""
    return thr @ (capacity / capacity.sum())


def _polytope(thr: np.ndarray, gpus: np.ndarray, capacity: np.ndarray):
    """The feasible time shares of module step 3, over the (job, type) pairs that can run:
    (job_idx, type_idx, local row of each pair's job, LP rows, sum_t X <= 1 rows, capacity rows)."""
    n_types = thr.shape[1]
    runnable = (thr > 0) & (gpus[:, None] <= capacity[None, :])
    rows = np.flatnonzero(runnable.any(axis=1))
    job_idx, type_idx = np.nonzero(runnable[rows])
    job_idx = rows[job_idx]
    n_vars = job_idx.size
    local = np.searchsorted(rows, job_idx)  # the job's row among the LP's jobs
    cols = np.arange(n_vars)
    one_type = sp.csr_matrix((np.ones(n_vars), (local, cols)), shape=(rows.size, n_vars))
    cap_rows = sp.csr_matrix((gpus[job_idx], (type_idx, cols)), shape=(n_types, n_vars))
    return runnable, job_idx, type_idx, local, rows, one_type, cap_rows


def _finish(x: np.ndarray, job_idx, type_idx, solution: np.ndarray) -> np.ndarray:
    solution = np.clip(solution, 0.0, 1.0)
    solution[solution < ZERO] = 0.0
    x[job_idx, type_idx] = solution
    return x


def max_min_fair(thr: np.ndarray, gpus: np.ndarray, capacity: np.ndarray, refine: bool = True) -> FairAllocation:
    """max_X min_j sum_t X[j, t] thr[j, t] / thr_eq[j] over the polytope of module step 3.

    thr: (J, T) throughputs (0: cannot run); gpus: (J,) GPUs each job needs; capacity: (T,) GPUs a type.
    Rows with no positive throughput get X = 0 and do not take part.
    """
    thr = np.asarray(thr, dtype=float)
    gpus = np.asarray(gpus, dtype=float)
    capacity = np.asarray(capacity, dtype=float)
    n_jobs, n_types = thr.shape
    x = np.zeros((n_jobs, n_types))
    runnable, job_idx, type_idx, local, rows, one_type, cap_rows = _polytope(thr, gpus, capacity)
    if rows.size == 0:
        return FairAllocation(x, 0.0, "optimal")
    thr_eq = proportional_throughput(np.where(runnable, thr, 0.0), capacity)
    coef = thr[job_idx, type_idx] / thr_eq[job_idx]  # normalised throughput per unit of time
    n_vars = job_idx.size
    cols = np.arange(n_vars)
    # z - sum_t coef X[j, t] <= 0 per job (z is the last variable)
    fairness = sp.hstack(
        [sp.csr_matrix((-coef, (local, cols)), shape=(rows.size, n_vars)), sp.csr_matrix(np.ones((rows.size, 1)))]
    )
    a_ub = sp.vstack(
        [
            fairness,
            sp.hstack([one_type, sp.csr_matrix((rows.size, 1))]),
            sp.hstack([cap_rows, sp.csr_matrix((n_types, 1))]),
        ]
    ).tocsr()
    b_ub = np.concatenate([np.zeros(rows.size), np.ones(rows.size), capacity])
    c = np.zeros(n_vars + 1)
    c[-1] = -1.0
    bounds = np.column_stack([np.zeros(n_vars + 1), np.append(np.ones(n_vars), np.inf)])
    first = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if first.status != 0:
        return FairAllocation(x, 0.0, f"max-min LP failed: {first.message}")
    value = float(-first.fun)
    solution = first.x[:n_vars]
    if refine and value > 0:
        # Among the max-min optimal points, the most total normalised throughput.
        floor = sp.csr_matrix((-coef, (local, cols)), shape=(rows.size, n_vars))
        a2 = sp.vstack([floor, one_type, cap_rows]).tocsr()
        floor_value = value - max(REFINE_TOLERANCE * value, REFINE_SLACK)
        b2 = np.concatenate([np.full(rows.size, -floor_value), np.ones(rows.size), capacity])
        second = linprog(-coef, A_ub=a2, b_ub=b2, bounds=bounds[:n_vars], method="highs")
        if second.status == 0:
            solution = second.x
        else:
            log.warning("gavel: refining LP failed (%s); keeping the max-min point", second.message)
    return FairAllocation(_finish(x, job_idx, type_idx, solution), value, "optimal")


def max_sum_throughput(steps: np.ndarray, gpus: np.ndarray, capacity: np.ndarray) -> FairAllocation:
    """max_X sum_j,t X[j, t] steps[j, t] over the same polytope: Gavel's throughput-maximising
    objective (optimizer steps per second, not normalised), the one Sia's port of Gavel runs by
    default. `value` is the total."""
    steps = np.asarray(steps, dtype=float)
    gpus = np.asarray(gpus, dtype=float)
    capacity = np.asarray(capacity, dtype=float)
    x = np.zeros(steps.shape)
    _, job_idx, type_idx, _, rows, one_type, cap_rows = _polytope(steps, gpus, capacity)
    if rows.size == 0:
        return FairAllocation(x, 0.0, "optimal")
    a_ub = sp.vstack([one_type, cap_rows]).tocsr()
    b_ub = np.concatenate([np.ones(rows.size), capacity])
    result = linprog(-steps[job_idx, type_idx], A_ub=a_ub, b_ub=b_ub, bounds=(0.0, 1.0), method="highs")
    if result.status != 0:
        return FairAllocation(x, 0.0, f"max-throughput LP failed: {result.message}")
    return FairAllocation(_finish(x, job_idx, type_idx, result.x), float(-result.fun), "optimal")


def received_fraction(job: JobView, gpu_types: tuple[str, ...]) -> np.ndarray:
    """f[t] = seconds the job ran on t over its age (attained GPU-seconds / requested GPUs)."""
    if job.age_s <= 0 or job.requested_gpus < 1:
        return np.zeros(len(gpu_types))
    return np.array([job.attained_by_type.get(t, 0.0) / (job.requested_gpus * job.age_s) for t in gpu_types])


def priority_order(
    jobs: list[JobView], gpu_types: tuple[str, ...], x: np.ndarray, runnable: np.ndarray
) -> list[tuple[int, int]]:
    """(job index, type index) pairs that may run, in Gavel's order (module step 4)."""
    keyed = []
    for j, job in enumerate(jobs):
        f = received_fraction(job, gpu_types)
        for t in range(len(gpu_types)):
            if not runnable[j, t]:
                continue
            share = float(x[j, t])
            if share > 0 and f[t] <= ZERO:
                tier, value = 1, share  # never ran here: infinite priority
            else:
                tier, value = 0, (share / f[t] if share > 0 else 0.0)
            deficit = share * job.age_s - f[t] * job.age_s
            keyed.append(((-tier, -value, -deficit, -share, job.submit_s, job.job_id, t), (j, t)))
    keyed.sort(key=lambda item: item[0])
    return [pair for _, pair in keyed]


class GavelPolicy:
    """Max-min fairness over normalised throughputs, then Gavel's priority rounds (see the module)."""

    name = "gavel"
    adaptive_batch = False
    honours_teams = False  # refuses a round with teams (policies.base.refuse_teams)

    OBJECTIVES = ("max_min_fairness", "max_sum_throughput")

    def __init__(self, round_s: float = ROUND_S, refine: bool = True, objective: str = "max_min_fairness"):
        if objective not in self.OBJECTIVES:
            raise ValueError(f"unknown gavel objective {objective!r}; choose one of {', '.join(self.OBJECTIVES)}")
        self.round_s = round_s
        self.refine = refine
        self.objective = objective

    def allocate(self, state: RoundState) -> Decision:
        refuse_hybrid(self.name, state.jobs)
        refuse_teams(self.name, state)
        cluster = state.cluster
        types = cluster.gpu_types
        jobs = sorted(state.jobs, key=lambda j: (j.submit_s, j.job_id))  # canonical: input order never matters
        thr = requested_throughput_matrix(jobs, cluster)
        gpus = np.array([j.requested_gpus for j in jobs], dtype=float)
        capacity = np.array([cluster.capacity(t) for t in types], dtype=float)
        events: list[str] = []
        if self.objective == "max_min_fairness":
            fair = max_min_fair(thr, gpus, capacity, refine=self.refine)
        else:
            batch = np.array([j.requested_batch for j in jobs], dtype=float)[:, None]
            fair = max_sum_throughput(thr / batch, gpus, capacity)
        if fair.status != "optimal":
            log.warning("gavel: %s; priorities fall back to time received", fair.status)
            events.append(f"gavel: {fair.status}")
        runnable = (thr > 0) & (gpus[:, None] <= capacity[None, :])
        for j in np.flatnonzero(~runnable.any(axis=1)):
            events.append(
                f"gavel: {jobs[j].job_id} cannot run on this cluster "
                f"({jobs[j].requested_gpus} GPUs on no modelled type)"
            )

        room = {t: cluster.capacity(t) for t in types}
        granted: list[tuple[JobView, str]] = []
        taken: set[str] = set()
        for j, t in priority_order(jobs, types, fair.x, runnable):
            job, gpu_type = jobs[j], types[t]
            if job.job_id in taken or room[gpu_type] < job.requested_gpus:
                continue
            room[gpu_type] -= job.requested_gpus
            taken.add(job.job_id)
            granted.append((job, gpu_type))

        kept = {
            job.job_id: job.placement
            for job, gpu_type in granted
            if holds_request(job, cluster) and cluster.placement_type(job.placement) == gpu_type
        }
        free = free_gpus(cluster, kept)
        placements: dict[str, Spots] = {}
        # largest requests first, for locality (as Gavel assigns workers); ties in grant order
        for job, gpu_type in sorted(granted, key=lambda pair: -pair[0].requested_gpus):
            spots = kept.get(job.job_id) or pack(cluster, free, gpu_type, job.requested_gpus)
            if spots is None:  # cannot happen: the per-type grant counts guarantee the fit
                raise RuntimeError(f"gavel: granted {job.job_id} does not fit on {gpu_type}")
            placements[job.job_id] = spots
        return decision_from_placements(cluster, placements, events)
