"""Lower bounds on a workload's average JCT: how far any schedule on a cluster is from the best.

Both read the simulated world's truth (services.simulated.truth), which no policy reads: the
bounds measure policies, they never guide one.

- The infinite-cluster bound: each job as if it had the cluster to itself, from the first round at
  or after its submission, with every GPU type's whole capacity. A job's time there is the least of
      its best fixed placement (GPU type and count), each epoch at its best batch, and
      each epoch on its own best placement and batch, plus one more checkpoint-restart
      (a job that changes placement pays at least one),
  plus the first start's delay. No schedule on that cluster finishes the job sooner: sharing only
  takes GPUs away.
- The capacity LP (`capacity_lp`): a time-indexed relaxation over slots of `slot_s`. Each job
  runs, in each slot, fractions of the slot on placements of its choice (each at the rate of its
  whole run there), never more than the whole slot, after its release; each type's GPUs in use
  never exceed its capacity. A job's completion is bounded below by its work-weighted mean time
  plus half its fastest time (a job whose rate never passes 1/T cannot have its work's mean later
  than T/2 before its end), and by the infinite-cluster bound. The LP minimises their sum (HiGHS,
  through scipy). It prices capacity, which the infinite-cluster bound ignores; it relaxes the
  rest (a job's placement may change every slot, free; its rate is its whole run's average).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from goodput_train.goodput import efficiency, split_batch
from services.simulated.truth import JobSources, ModelTruth, job_sources
from shared.cluster import Cluster, load_cluster
from shared.settings import SimSettings, simulation_settings
from sim.reference import WorkloadJob, load_workload

BATCH_CANDIDATES = 48  # geometric batch sizes in [M0, max batch] tried per placement and epoch


@dataclass(frozen=True)
class Placement:
    """A job's GPUs in the bound: `gpus` of `gpu_type`, packed onto the fewest nodes."""

    gpu_type: str
    gpus: int


@dataclass(frozen=True)
class ModelTimes:
    """One model's least running time on each placement, from its first step to its last."""

    fixed: dict[Placement, float]  # seconds on that placement, each epoch at its best batch
    switching: float  # seconds with each epoch on its best placement and batch, switches free
    per_epoch: dict[Placement, np.ndarray] = field(default_factory=dict, compare=False)  # each epoch's seconds

    @property
    def best_fixed(self) -> float:
        return min(self.fixed.values())


@dataclass(frozen=True)
class JobBound:
    name: str
    application: str
    submit_s: float
    start_s: float  # the first round at or after submission, plus the first start's delay
    alone_s: float  # the least running time alone on the cluster (ModelTimes, a switch priced)

    @property
    def jct_s(self) -> float:
        return self.start_s - self.submit_s + self.alone_s


def packed(cluster: Cluster, gpu_type: str, gpus: int) -> list[int]:
    """GPUs per node of `gpus` of a type on the fewest nodes."""
    per_node = cluster.gpus_per_node(gpu_type)
    nodes = math.ceil(gpus / per_node)
    return [per_node] * (nodes - 1) + [gpus - per_node * (nodes - 1)]


def placements(cluster: Cluster, truth: ModelTruth, settings: SimSettings) -> list[Placement]:
    """Every placement the model can run on here: any GPU count up to a type's capacity (a rigid
    model only its count), whole model-parallel groups on every node."""
    rigid = settings.rigid.get(truth.name)
    out = []
    for gpu_type in cluster.gpu_types:
        if gpu_type not in truth.types:
            continue
        group = truth.group_gpus.get(gpu_type, 1)
        counts = [rigid[0]] if rigid else range(1, cluster.capacity(gpu_type) + 1)
        for n in counts:
            if n <= cluster.capacity(gpu_type) and all(g % group == 0 for g in packed(cluster, gpu_type, n)):
                out.append(Placement(gpu_type, n))
    return out


def epoch_times(cluster: Cluster, truth: ModelTruth, settings: SimSettings, where: Placement) -> np.ndarray:
    """Seconds of each epoch on `where` at that epoch's best batch (inf where no batch fits)."""
    spread = packed(cluster, where.gpu_type, where.gpus)
    replicas = where.gpus // truth.group_gpus.get(where.gpu_type, 1)
    lo, hi = truth.local_limits[where.gpu_type]
    hi = min(hi, settings.max_local.get(truth.name, hi))
    rigid = settings.rigid.get(truth.name)
    if rigid:
        batch = min(rigid[1], truth.max_batch)
        m, s = split_batch(batch, replicas, hi)
        choices = [(max(min(m, truth.max_batch // (replicas * (s + 1))), 1), s)]
    else:
        choices = []
        for total in np.unique(np.geomspace(truth.init_batch, truth.max_batch, BATCH_CANDIDATES).round()):
            m, s = split_batch(int(total), replicas, hi)
            if lo <= m <= hi and truth.init_batch <= replicas * m * (s + 1) <= truth.max_batch:
                choices.append((m, s))
    if not choices:
        return np.full(len(truth.boundaries), np.inf)
    choices = sorted(set(choices))  # one order for the batches and their step times
    batches = np.array([replicas * m * (s + 1) for m, s in choices], dtype=float)
    steps = np.array([truth.types[where.gpu_type].iteration_time(spread, m, s)[0] for m, s in choices])
    speed = (
        settings.goodput_factor(truth.name) * batches / truth.init_batch / steps
    )  # progress a second at efficiency 1
    work = np.diff(truth.boundaries, prepend=0.0)
    sqr, var = (between(batches, truth.batches, stats) for stats in (truth.grad_sqr, truth.grad_var))
    usable = np.isfinite(sqr) & np.isfinite(var) & (sqr > 0) & (var >= 0)  # as pgns: else no noise scale
    with np.errstate(all="ignore"):
        noise = np.where(usable, truth.init_batch * var / np.where(usable, sqr, 1.0), np.inf)
    rate = speed[:, None] * efficiency(noise, truth.init_batch, batches[:, None])  # (batches, epochs)
    return np.divide(work, rate.max(axis=0), out=np.zeros_like(work), where=work > 0)


def between(x: np.ndarray, xp: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """(len(x), columns): each column of `rows` (len(xp), columns) interpolated at x over xp, as
    np.interp does column by column (the ends held)."""
    if len(xp) == 1:
        return np.repeat(rows[:1], len(x), axis=0)
    right = np.clip(np.searchsorted(xp, x, side="right"), 1, len(xp) - 1)
    left = right - 1
    share = np.clip((x - xp[left]) / (xp[right] - xp[left]), 0.0, 1.0)[:, None]
    return rows[left] * (1.0 - share) + rows[right] * share


def model_times(cluster: Cluster, truth: ModelTruth, settings: SimSettings) -> ModelTimes:
    per_epoch = {p: epoch_times(cluster, truth, settings, p) for p in placements(cluster, truth, settings)}
    if not per_epoch:
        raise ValueError(f"model {truth.name} has no profile on any GPU type of cluster {cluster.name}")
    fixed = {p: float(t.sum()) for p, t in per_epoch.items()}
    switching = float(np.min(np.stack(list(per_epoch.values())), axis=0).sum())
    return ModelTimes(fixed, switching, per_epoch)


def job_bounds(
    workload: Sequence[WorkloadJob],
    cluster: Cluster,
    truths: dict[str, ModelTruth],
    settings: SimSettings,
    times: dict[str, ModelTimes] | None = None,
) -> tuple[list[JobBound], dict[str, ModelTimes]]:
    """Each job's infinite-cluster bound, and each model's times, computed once a model (into
    `times`, when given: a cache for one cluster and settings)."""
    times = {} if times is None else times
    bounds = []
    for job in workload:
        if job.application not in truths:
            raise ValueError(f"job {job.name}: model {job.application} has no profile data")
        if job.application not in times:
            times[job.application] = model_times(cluster, truths[job.application], settings)
        t = times[job.application]
        delay = settings.restart_delay(job.application)
        first_round = settings.round_s * math.ceil(job.time / settings.round_s - 1e-9)
        bounds.append(
            JobBound(job.name, job.application, job.time, first_round + delay, min(t.best_fixed, t.switching + delay))
        )
    return bounds, times


def workload_bounds(
    workload: str | Sequence[WorkloadJob],
    cluster: str,
    *,
    sources: JobSources | None = None,
    reference: str | None = None,
    use_zoo: bool = False,
    calibration: str | None = None,
    restart_delay_s: float | None = None,
    round_s: float | None = None,
    lp: bool = False,
    slot_s: float = 120.0,
    progress: Callable[[str], None] | None = None,
    times: dict[str, ModelTimes] | None = None,
) -> dict:
    """The bounds of one workload on one cluster, in the world `goodput simulate` would replay it
    in (the same calibration, restart delays and round), as a result document: the
    infinite-cluster bound, each model's best time alone, and with `lp` the capacity LP's bound."""
    jobs = load_workload(workload) if isinstance(workload, (str, Path)) else list(workload)
    if not jobs:
        raise ValueError("the workload has no jobs")
    spec = load_cluster(cluster)
    settings = simulation_settings(calibration, cluster, restart_delay_s, round_s)
    sources = sources or job_sources(reference, use_zoo)
    bounds, model_times = job_bounds(jobs, spec, sources.truths, settings, times)
    counts = Counter(b.application for b in bounds)
    result = {
        "workload": str(workload) if isinstance(workload, (str, Path)) else "<in memory>",
        "cluster": spec.name,
        "calibration": settings.name,
        "truth": sources.origin,
        "jobs": len(jobs),
        "models": {
            model: {
                "jobs": counts[model],
                "best_fixed": {**asdict(min(t.fixed, key=t.fixed.get)), "seconds": round(t.best_fixed, 3)},
                "switching_s": round(t.switching, 3),
            }
            for model, t in model_times.items()
            if model in counts
        },
    }
    if lp:
        solved = capacity_lp(bounds, model_times, spec, slot_s, progress)
        result["capacity_lp"] = {**asdict(solved), "average_jct_s": round(solved.average_jct_s, 3)}
        result["capacity_lp_s"] = round(solved.average_jct_s, 3)
    result["infinite_cluster_s"] = round(infinite_cluster_s(bounds), 3)
    return result


def infinite_cluster_s(bounds: Sequence[JobBound]) -> float:
    """The infinite-cluster bound on the average JCT."""
    return float(np.mean([b.jct_s for b in bounds]))


@dataclass(frozen=True)
class LPResult:
    average_jct_s: float
    slot_s: float
    slots: int
    variables: int
    solve_s: float


def capacity_lp(
    bounds: Sequence[JobBound],
    times: dict[str, ModelTimes],
    cluster: Cluster,
    slot_s: float = 120.0,
    progress: Callable[[str], None] | None = None,
) -> LPResult:
    """The capacity LP's bound on the average JCT (module docstring), `progress` told what it solves."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    say = progress or (lambda _: None)
    useful = {model: hull(t.fixed, cluster.gpu_types) for model, t in times.items()}
    types = list(cluster.gpu_types)
    capacity = np.array([cluster.capacity(t) for t in types], dtype=float)
    least = {m: min(s for _, s in kept) for m, kept in useful.items()}
    # Slots to the last release, then as long as the longest job alone plus all the jobs' least
    # GPU-seconds spread over the whole cluster; work past the horizon is priced at the horizon.
    gpu_seconds = sum(min(p.gpus * s for p, s in useful[b.application]) for b in bounds)
    horizon = max(b.start_s for b in bounds) + max(b.alone_s for b in bounds) + gpu_seconds / cluster.total_gpus
    slots = max(1, math.ceil(horizon / slot_s))
    say(f"capacity LP: {len(bounds)} jobs, {slots} slots of {slot_s:g} s, solving with HiGHS")
    t0 = time.perf_counter()
    value, variables = _solve_lp(bounds, useful, least, types, capacity, slot_s, slots, linprog, coo_matrix)
    return LPResult(float(value), slot_s, slots, variables, round(time.perf_counter() - t0, 3))


def hull(fixed: dict[Placement, float], gpu_types: Sequence[str]) -> list[tuple[Placement, float]]:
    """The placements an LP would use, with their seconds: per type, those on the upper concave
    hull of (GPUs, rate) from (0, 0). Any other is beaten by sharing a slot between two of these
    (more rate for no more GPUs)."""
    kept: list[tuple[Placement, float]] = []
    for gpu_type in gpu_types:
        chain: list[tuple[Placement, float]] = []
        for p in sorted((p for p in fixed if p.gpu_type == gpu_type), key=lambda p: p.gpus):
            rate = 1.0 / fixed[p]
            while chain:
                last, last_s = chain[-1]
                before_g, before_r = (chain[-2][0].gpus, 1.0 / chain[-2][1]) if len(chain) > 1 else (0, 0.0)
                # Drop the last point when it lies on or under the line from the one before it to p.
                if (1.0 / last_s - before_r) * (p.gpus - before_g) <= (rate - before_r) * (last.gpus - before_g):
                    chain.pop()
                else:
                    break
            if not chain or rate > 1.0 / chain[-1][1]:
                chain.append((p, fixed[p]))
        kept += chain
    return kept


def _solve_lp(bounds, useful, least, types, capacity, slot_s, slots, linprog, coo_matrix):
    """The LP: (average JCT bound, variables).

    Variables: x (a job's fraction of a slot on a placement), each job's work left at the horizon,
    then z_j >= 0 per job. Rows (<=):
    each type's GPUs per slot, each job's time per slot, and per job -mean_j - z_j <= T_j/2 - C*_j
    (C*_j its infinite-cluster completion); rows (==): each job's work done is 1. The objective,
    sum(mean_j) + sum(z_j), plus sum(T_j/2), is the sum of the completions' bounds."""
    n_jobs, n_cap = len(bounds), len(types) * slots
    n_time = n_jobs * slots
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    eq_cols: list[int] = []
    eq_rows: list[int] = []
    eq_vals: list[float] = []
    cost: list[float] = []
    starts = np.arange(slots) * slot_s
    for j, b in enumerate(bounds):
        for p, seconds in useful[b.application]:
            k = types.index(p.gpu_type)
            for t in range(int(b.start_s // slot_s), slots):
                covered = slot_s - max(b.start_s - starts[t], 0.0)  # the release's slot only from the release
                if covered <= 0:
                    continue
                v = len(cost)
                work = covered / seconds  # the job's fraction done in the whole slot
                at = max(starts[t], b.start_s)  # its work there at the earliest
                rows += [k * slots + t, n_cap + j * slots + t, n_cap + n_time + j]
                cols += [v, v, v]
                vals += [p.gpus * covered / slot_s, 1.0, -work * at]
                eq_rows.append(j)
                eq_cols.append(v)
                eq_vals.append(work)
                cost.append(work * at)
    # Per job, its work left at the horizon, at the horizon's time (no capacity: a relaxation).
    end = slots * slot_s
    for j in range(n_jobs):
        v = len(cost)
        rows.append(n_cap + n_time + j)
        cols.append(v)
        vals.append(-end)
        eq_rows.append(j)
        eq_cols.append(v)
        eq_vals.append(1.0)
        cost.append(end)
    n_x = len(cost)
    for j in range(n_jobs):
        rows.append(n_cap + n_time + j)
        cols.append(n_x + j)
        vals.append(-1.0)
    half = np.array([least[b.application] / 2 for b in bounds])
    finish = np.array([b.start_s + b.alone_s for b in bounds])
    upper = np.concatenate([np.repeat(capacity, slots), np.ones(n_time), half - finish])
    n_vars = n_x + n_jobs
    a_ub = coo_matrix((vals, (rows, cols)), shape=(len(upper), n_vars)).tocsr()
    a_eq = coo_matrix((eq_vals, (eq_rows, eq_cols)), shape=(n_jobs, n_vars)).tocsr()
    c = np.concatenate([cost, np.ones(n_jobs)])
    bounds_x = [(0.0, 1.0)] * n_x + [(0.0, None)] * n_jobs
    solved = linprog(c, A_ub=a_ub, b_ub=upper, A_eq=a_eq, b_eq=np.ones(n_jobs), bounds=bounds_x, method="highs")
    if solved.status != 0:
        raise RuntimeError(f"the capacity LP failed: {solved.message}")
    completions = solved.fun + half.sum()
    return (completions - sum(b.submit_s for b in bounds)) / n_jobs, n_vars
