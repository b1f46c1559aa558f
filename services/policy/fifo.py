"""`fifo`: first come, first served, rigid jobs at their requested GPU count and batch, no preemption.

Each round, the waiting jobs are taken in arrival order (submit_s, then job_id). A job starts when
its requested GPUs fit on one GPU type among the GPUs left free by the running jobs; it runs there
until it finishes (a running job is never preempted or moved, and keeps its exact placement).

Choice of GPU type (shared with `tiresias`): among the types with room for the whole request, the
one where the job's estimated throughput at its requested size is highest (`fastest_type`); ties go
to the type listed first in the cluster. The estimate is the job's throughput model on that type at
its requested GPU count and batch, with the batch split across accumulation steps to respect the
type's largest per-GPU batch (`rigid_micro_batch`), on the fewest nodes that can hold the request
(what packing gives on an empty cluster; `requested_throughput_matrix`). A type the job has no
model for, or with fewer GPUs in total than the request, can never run it. The per-GPU batch is not
held to the type's smallest profiled one: a rigid job runs at the batch its user asked for.

Backfill: off by default, the classic strict FIFO — once the oldest waiting job that can run at all
does not fit, no later job starts this round, so it cannot be starved by smaller jobs behind it.
`FifoPolicy(backfill=True)` lets later jobs start past a blocked head (with no reservation: the head
may then wait for as long as smaller jobs keep arriving). A job that could never run on this cluster
(no modelled type holds its request) is skipped rather than allowed to block the queue forever; the
decision's events name it.

New placements use `pack` (nodes with most free GPUs first, as in Pollux's simulator). A running job
whose placement does not match its request (say, placed by another policy before a switch) is
treated as waiting and re-placed at its request.

The helpers here are the rigid baselines' common ground: `tiresias` and `gavel` import them.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np

from services.policy.base import Decision, JobView, RoundState, Spots, free_gpus, pack
from shared.cluster import Cluster, Config
from shared.goodput import ThroughputParams, throughput

ROUND_S = 60.0


# --- the rigid baselines' common ground ---------------------------------------------------------

def rigid_micro_batch(batch: int, gpus: int, max_local: int) -> tuple[int, int]:
    """(m, s) for a fixed total batch on `gpus` GPUs: the fewest accumulation steps s whose per-GPU
    micro-batch fits `max_local`, then the smallest m that covers the batch:
    s = ceil(batch / (gpus * max_local)) - 1,  m = ceil(batch / (gpus * (s + 1)))."""
    s = max(math.ceil(batch / (gpus * max_local)) - 1, 0)
    m = math.ceil(batch / (gpus * (s + 1)))
    return max(m, 1), s


def requested_throughput_matrix(jobs: Sequence[JobView], cluster: Cluster) -> np.ndarray:
    """(J, T) samples/s of each job on each type of the cluster (cluster order) at its requested GPU
    count and batch, on the fewest nodes that hold it; 0 where it cannot run there (no model for the
    type, or the type has fewer GPUs than the request). One vectorised model evaluation."""
    types = cluster.gpu_types
    capacity = [cluster.capacity(t) for t in types]
    nodes_needed = [cluster.gpus_per_node(t) for t in types]
    cells, params, shape = [], [], []
    for j, job in enumerate(jobs):
        gpus = job.requested_gpus
        for t, gpu_type in enumerate(types):
            if gpu_type in job.models.params and 1 <= gpus <= capacity[t]:
                m, s = rigid_micro_batch(job.requested_batch, gpus, job.models.local_limits[gpu_type][1])
                cells.append((j, t))
                params.append(tuple(job.models.params[gpu_type]))
                shape.append((max(1, math.ceil(gpus / nodes_needed[t])), gpus, m, s))
    out = np.zeros((len(jobs), len(types)))
    if cells:
        nodes, gpus, m, s = np.asarray(shape, dtype=float).T
        values = throughput(ThroughputParams(*np.asarray(params, dtype=float).T), nodes, gpus, m, s)
        values = np.where(np.isfinite(values) & (values > 0), values, 0.0)
        rows, cols = np.asarray(cells).T
        out[rows, cols] = values
    return out


def fastest_type(throughputs: Mapping[str, float], gpus: int, room: Mapping[str, int]) -> str | None:
    """The type with the highest throughput among those that run the job and have `gpus` GPUs of
    room; ties to the first in `throughputs`' order. None when none has room."""
    best = None
    for gpu_type, value in throughputs.items():
        if value > 0 and room.get(gpu_type, 0) >= gpus and (best is None or value > throughputs[best]):
            best = gpu_type
    return best


def placement_type(cluster: Cluster, spots: Spots) -> str | None:
    """The single GPU type of a placement (None if empty, unknown nodes, or mixed types)."""
    node_type = {n.name: n.gpu_type for n in cluster.nodes}
    types = {node_type.get(node) for node, _ in spots}
    return types.pop() if len(types) == 1 and None not in types else None


def holds_request(job: JobView, cluster: Cluster) -> bool:
    """True when the job runs with a placement that a rigid policy can keep: one GPU type, exactly
    its requested GPUs."""
    return (bool(job.placement) and sum(g for _, g in job.placement) == job.requested_gpus
            and placement_type(cluster, job.placement) is not None)


def arrival_order(jobs: Iterable[JobView]) -> list[JobView]:
    return sorted(jobs, key=lambda j: (j.submit_s, j.job_id))


def type_room(cluster: Cluster, free: Mapping[str, int]) -> dict[str, int]:
    """Free GPUs per type, from free GPUs per node."""
    room = {t: 0 for t in cluster.gpu_types}
    for node in cluster.nodes:
        room[node.gpu_type] += free[node.name]
    return room


def make_decision(cluster: Cluster, placements: dict[str, Spots], events: Iterable[str] = ()) -> Decision:
    """A Decision whose allocations are read off the placements: (type, nodes used, GPUs)."""
    allocations = {job_id: Config(placement_type(cluster, spots), len(spots), sum(g for _, g in spots))
                   for job_id, spots in placements.items()}
    return Decision(allocations, dict(placements), tuple(events))


# --- the policy ---------------------------------------------------------------------------------

class FifoPolicy:
    """Arrival order, requested GPUs, no preemption; strict (no backfill) unless `backfill`."""

    name = "fifo"
    adaptive_batch = False

    def __init__(self, backfill: bool = False, round_s: float = ROUND_S):
        self.backfill = backfill
        self.round_s = round_s

    def allocate(self, state: RoundState) -> Decision:
        cluster = state.cluster
        placements: dict[str, Spots] = {j.job_id: j.placement for j in state.jobs if holds_request(j, cluster)}
        free = free_gpus(cluster, placements)
        events: list[str] = []
        waiting = arrival_order(j for j in state.jobs if j.job_id not in placements)
        for job, row in zip(waiting, requested_throughput_matrix(waiting, cluster)):
            throughputs = dict(zip(cluster.gpu_types, row.tolist()))
            if not any(throughputs.values()):
                events.append(f"fifo: {job.job_id} cannot run on this cluster "
                              f"({job.requested_gpus} GPUs on no modelled type); skipped")
                continue
            gpu_type = fastest_type(throughputs, job.requested_gpus, type_room(cluster, free))
            if gpu_type is None:
                if self.backfill:
                    continue
                break
            placements[job.job_id] = pack(cluster, free, gpu_type, job.requested_gpus)
        return make_decision(cluster, placements, events)
