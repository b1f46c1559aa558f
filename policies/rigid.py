"""What the rigid baselines (`fifo`, `tiresias`, `gavel`, `timeslice`) share: jobs run at their
requested GPU count and batch, on one GPU type, packed on the nodes with most free GPUs.

Choice of GPU type: among the types with room for the whole request, the one where the job's
estimated throughput at its requested size is highest (`fastest_type`); ties go to the type listed
first in the cluster. The estimate is the job's throughput model on that type at its requested GPU
count and batch, the batch split across accumulation steps to respect the type's largest per-GPU
batch (`goodput_train.goodput.split_batch`), on the fewest nodes that can hold the request (what packing
gives on an empty cluster). A type the job has no model for, or with fewer GPUs in total than the
request, can never run it.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np

from goodput_train.goodput import ThroughputParams, split_batch, throughput
from policies.base import JobView
from shared.cluster import Cluster


def requested_throughput_matrix(jobs: Sequence[JobView], cluster: Cluster) -> np.ndarray:
    """(J, T) samples/s of each job on each type of the cluster (cluster order) at its requested GPU
    count and batch, on the fewest nodes that hold it; 0 where it cannot run there (no model for the
    type, or the type has fewer GPUs than the request). One vectorised model evaluation."""
    types = cluster.gpu_types
    capacity = [cluster.capacity(t) for t in types]
    per_node = [cluster.gpus_per_node(t) for t in types]
    cells, params, shape = [], [], []
    for j, job in enumerate(jobs):
        gpus = job.requested_gpus
        for t, gpu_type in enumerate(types):
            if gpu_type in job.models.params and 1 <= gpus <= capacity[t]:
                m, s = split_batch(job.requested_batch, gpus, job.models.local_limits[gpu_type][1])
                cells.append((j, t))
                params.append(tuple(job.models.params[gpu_type]))
                shape.append((max(1, math.ceil(gpus / per_node[t])), gpus, m, s))
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


def holds_request(job: JobView, cluster: Cluster) -> bool:
    """True when the job runs with a placement that a rigid policy can keep: one GPU type, exactly
    its requested GPUs."""
    return (
        bool(job.placement)
        and sum(g for _, g in job.placement) == job.requested_gpus
        and cluster.placement_type(job.placement) is not None
    )


def arrival_order(jobs: Iterable[JobView]) -> list[JobView]:
    return sorted(jobs, key=lambda j: (j.submit_s, j.job_id))


def type_room(cluster: Cluster, free: Mapping[str, int]) -> dict[str, int]:
    """Free GPUs per type, from free GPUs per node."""
    room = {t: 0 for t in cluster.gpu_types}
    for node in cluster.nodes:
        room[node.gpu_type] += free[node.name]
    return room
