"""The goodput matrix of a round (Sia §3.4): every job against every configuration of the cluster.

What the estimator's models say of each job, evaluated over the cluster's configuration set; every
policy reads it through `RoundState.table`, so it is part of the contract, not a service's.

The matrix (Sia §3.4) has one row per job and one column per configuration of the cluster: the best
goodput over batch sizes, row-normalised so that rows are comparable: G_ij <- N_i^min * G_ij /
min_j G_ij over the row's valid cells. A cell is valid when the job may take it this round: its
type has a model, GPUs >= the job's minimum and <= twice the most GPUs it ever had (new jobs start
at one GPU, or at up to `JobModels.start_gpus`), rigid jobs at their fixed GPU count, and some
batch size fits.

Hybrid-parallel jobs (Sia §5.3) count in replicas, each a model-parallel group of P_t GPUs on one
node: their models are per replica (profiles and observations are), a configuration of type t is
valid only when each of its nodes holds whole groups, and it is evaluated, and held to the scaling
rules above, at its GPUs / P_t replicas. N_i^min is then the GPUs of the job's least replicas on
the type of its row's smallest cell (Sia's code scales the row by that type's unit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from goodput_train.goodput import BatchChoice, ThroughputParams, optimize_batch, pgns
from shared.schema.base import Config
from shared.schema.rounds import JobModels

# Strong-scaling jobs keep their total batch; with K GPUs it is rounded to K*m*(s+1), at most this much below.
FIXED_BATCH_SLACK = 0.1


@dataclass(frozen=True)
class GoodputTable:
    """The round's goodput matrix. Invalid cells hold 0 goodput (and 0 normalised)."""

    job_ids: tuple[str, ...]
    configs: tuple[Config, ...]
    goodput: np.ndarray  # (J, C) samples/s x efficiency at the best batch
    normalized: np.ndarray  # (J, C) row-normalised; the row's smallest valid cell is N_i^min
    valid: np.ndarray  # (J, C) bool
    m: np.ndarray  # (J, C) per-GPU batch at the best batch
    s: np.ndarray  # (J, C) accumulation steps at the best batch
    stats: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class StackedJobs:
    """Jobs' models as arrays, for evaluating many (job, GPU type, allocation) cells at once."""

    theta: np.ndarray  # (J, T, 7) throughput parameters per job and GPU type
    limits: np.ndarray  # (J, T, 2) per-replica batch (min, max)
    modelled: np.ndarray  # (J, T) bool: the job has a model for the type
    group: np.ndarray  # (J, T) GPUs of one replica (1 unless hybrid-parallel)
    phi: np.ndarray  # (J,) PGNS (inf: efficiency 1, as for strong-scaling jobs)
    init: np.ndarray  # (J,) smallest total batch
    top: np.ndarray  # (J,) largest total batch

    def best(self, rows, cols, nodes, gpus) -> BatchChoice:
        """The best batch of job rows[k] on type cols[k] with (nodes, gpus); all broadcast together."""
        return optimize_batch(
            ThroughputParams(*np.moveaxis(self.theta[rows, cols], -1, 0)),
            self.phi[rows],
            self.init[rows],
            self.top[rows],
            self.limits[rows, cols, 0],
            self.limits[rows, cols, 1],
            nodes,
            gpus,
        )


def stack_jobs(jobs: Sequence[JobModels], types: Sequence[str]) -> StackedJobs:
    theta = np.ones((len(jobs), len(types), 7))
    limits = np.ones((len(jobs), len(types), 2))
    modelled = np.zeros((len(jobs), len(types)), dtype=bool)
    group = np.array([[job.group(t) for t in types] for job in jobs], dtype=int).reshape(len(jobs), len(types))
    for i, job in enumerate(jobs):
        for t, gpu_type in enumerate(types):
            if gpu_type in job.params:
                theta[i, t] = job.params[gpu_type]
                limits[i, t] = job.local_limits[gpu_type]
                modelled[i, t] = True
    # Strong-scaling jobs: a batch within FIXED_BATCH_SLACK below their own, efficiency ignored.
    strong = np.array([job.fixed_batch is not None for job in jobs], dtype=bool)
    fixed_batch = np.array([job.fixed_batch or 1 for job in jobs], dtype=float)
    phi = np.where(strong, np.inf, [pgns(j.grad_sqr, j.grad_var, j.init_batch) for j in jobs])
    init = np.where(strong, np.maximum(1, np.ceil(fixed_batch * (1 - FIXED_BATCH_SLACK))), [j.init_batch for j in jobs])
    top = np.where(strong, fixed_batch, [j.max_batch for j in jobs])
    return StackedJobs(theta, limits, modelled, group, phi, init, top)


def replicas_per_cell(group: np.ndarray, nodes: np.ndarray, gpus: np.ndarray) -> np.ndarray:
    """(J, C) replicas of each job in each configuration: GPUs / group when every node holds whole
    groups (a configuration spreads its GPUs evenly over its nodes), else 0."""
    per_node = (gpus // nodes)[None, :]
    return np.where(per_node % group == 0, gpus[None, :] // group, 0)


def usable_columns(jobs: Sequence[JobModels], configs: Sequence[Config]) -> np.ndarray:
    """The indices, in order, of the configurations some job may take this round: its type modelled,
    whole groups on each node, its replicas within its bounds (the cells `goodput_table` searches;
    a column outside is invalid for every job). Evaluated over the jobs' distinct bounds, not J x C:
    on a large cluster most columns (a type's n-node allocations) are larger than any job may grow,
    and 10,000 jobs x 2,824 configurations of sia-hetero-16384 are 28 million cells."""
    if not jobs or not configs:
        return np.arange(0)
    types = list(dict.fromkeys(c.gpu_type for c in configs))
    col_type = np.array([types.index(c.gpu_type) for c in configs])
    nodes = np.array([c.nodes for c in configs])
    gpus = np.array([c.gpus for c in configs])
    bounds = np.unique(
        np.array(
            [
                [job.fixed_gpus or 0, job.min_gpus, job.gpu_limit]
                + [job.group(t) if t in job.params else 0 for t in types]  # 0: no model of the type
                for job in jobs
            ],
            dtype=np.int64,
        ),
        axis=0,
    )
    fixed, lowest, highest = bounds[:, :1], bounds[:, 1:2], bounds[:, 2:3]
    group = bounds[:, 3:][:, col_type]
    modelled = group > 0
    group = np.maximum(group, 1)
    replicas = np.where(((gpus // nodes)[None, :] % group == 0) & modelled, gpus[None, :] // group, 0)
    allowed = np.where(fixed > 0, replicas == fixed, (replicas >= lowest) & (replicas <= highest)) & (replicas > 0)
    return np.flatnonzero(allowed.any(axis=0))


def batch_key(job: JobModels) -> tuple:
    """What a cell's best batch depends on besides its configuration: two jobs of one key have the
    same best batch and goodput in every configuration (the GPU bounds decide only which cells are
    searched, so they are not part of it)."""
    return (
        tuple(sorted((t, tuple(p)) for t, p in job.params.items())),
        tuple(sorted(job.local_limits.items())),
        job.init_batch,
        job.max_batch,
        job.grad_sqr,
        job.grad_var,
        job.fixed_batch,
        tuple(sorted(job.group_gpus.items())),
    )


class BatchCache:
    """The best batches of the last round's cells, by (the job's `batch_key`, configuration): a
    round searches only the cells of a key and configuration it has not seen, once however many jobs
    share the key. Exact: a cell's search depends on nothing else (`optimize_batch` works cell by
    cell). Holds the cells of the last round only."""

    # A cell's code: key id * this + configuration id.
    STRIDE = 1 << 32

    def __init__(self) -> None:
        self.keys: dict[tuple, int] = {}
        self.config_ids: dict[Config, int] = {}
        self.codes = np.zeros(0, dtype=np.int64)
        self.values: BatchChoice | None = None
        self.searched = 0  # cells searched in the last call, and in all
        self.cells = 0

    def best(self, jobs, configs, stacked: StackedJobs, rows, cols, col_type, nodes, replicas) -> BatchChoice:
        if len(self.keys) > 4 * len(jobs) + 4096:  # ids of jobs long gone: start afresh
            self.__init__()
        kid = np.array([self.keys.setdefault(batch_key(j), len(self.keys)) for j in jobs], dtype=np.int64)
        cid = np.array([self.config_ids.setdefault(c, len(self.config_ids)) for c in configs], dtype=np.int64)
        codes = kid[rows] * self.STRIDE + cid[cols]
        unique, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
        at = np.minimum(np.searchsorted(self.codes, unique), max(self.codes.size - 1, 0))
        hit = (self.codes[at] == unique) if self.codes.size else np.zeros(unique.size, dtype=bool)
        miss = first[~hit]
        found = stacked.best(rows[miss], col_type[cols[miss]], nodes[cols[miss]], replicas[rows[miss], cols[miss]])
        values = []
        for k, part in enumerate(found):
            whole = np.zeros(unique.size, dtype=part.dtype)
            whole[~hit] = part
            if self.values is not None:
                whole[hit] = self.values[k][at[hit]]
            values.append(whole)
        self.codes, self.values = unique, BatchChoice(*values)
        self.searched, self.cells = int(miss.size), int(rows.size)
        return BatchChoice(*(v[inverse] for v in values))


def goodput_table(
    jobs: Sequence[JobModels], configs: Sequence[Config], cache: BatchCache | None = None
) -> GoodputTable:
    """Evaluate every (job, configuration) cell in one vectorised pass; with a `cache`, search only
    the cells it does not hold (the same table)."""
    types = list(dict.fromkeys(c.gpu_type for c in configs))
    col_type = np.array([types.index(c.gpu_type) for c in configs])
    nodes = np.array([c.nodes for c in configs])
    gpus = np.array([c.gpus for c in configs])
    stacked = stack_jobs(jobs, types)
    group = stacked.group[:, col_type]
    replicas = replicas_per_cell(group, nodes, gpus)
    modelled = stacked.modelled[:, col_type] & (replicas > 0)

    fixed_gpus = np.array([job.fixed_gpus or 0 for job in jobs])[:, None]
    lowest = np.array([job.min_gpus for job in jobs])[:, None]
    highest = np.array([job.gpu_limit for job in jobs])[:, None]
    allowed = np.where(fixed_gpus > 0, replicas == fixed_gpus, (replicas >= lowest) & (replicas <= highest))
    # The batch search runs on the cells a job may take only (new jobs: one GPU), not all J x C: at
    # 10,000 jobs x 360 configurations the full search took a minute and gigabytes.
    cell_rows, cell_cols = np.nonzero(modelled & allowed)
    if cache is None:
        found = stacked.best(cell_rows, col_type[cell_cols], nodes[cell_cols], replicas[cell_rows, cell_cols])
    else:
        found = cache.best(jobs, configs, stacked, cell_rows, cell_cols, col_type, nodes, replicas)
    best = BatchChoice(*(np.zeros(replicas.shape, dtype=part.dtype) for part in found))
    for whole, part in zip(best, found):
        whole[cell_rows, cell_cols] = part
    valid = modelled & allowed & (best.goodput > 0)
    goodput = np.where(valid, best.goodput, 0.0)
    masked = np.where(valid, goodput, np.inf)
    smallest = np.argmin(masked, axis=1)[:, None]
    row_min = np.take_along_axis(masked, smallest, axis=1)
    # N_min in GPUs: the least replicas, in groups of the type of the row's smallest cell (as Sia's code).
    min_replicas = np.array([job.fixed_gpus or job.min_gpus for job in jobs], dtype=float)[:, None]
    min_gpus = min_replicas * np.take_along_axis(group, smallest, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        normalized = np.where(valid, min_gpus * goodput / row_min, 0.0)
    return GoodputTable(
        tuple(j.job_id for j in jobs),
        tuple(configs),
        goodput,
        normalized,
        valid,
        np.where(valid, best.m, 0),
        np.where(valid, best.s, 0),
    )
