"""Where a finished job's time went: its JCT split into parts that add up to it exactly.

From the simulated world's truth (what each job did, epoch by epoch, and what each placement would
take alone: sim.bound), which no policy reads:

- compute: its work at each epoch's best placement and batch on the cluster, as if alone;
- slower type: what the GPU types it ran on cost over that best, at their own best placement;
- fewer GPUs: what its GPU count (and batch, and neighbours) cost over its type's best placement;
- restarts: the checkpoint-restarts it paid after its first start;
- waiting: the rounds it held no GPU after its first start (stopped or preempted);
- first start: from submission to its first step (the rounds it waited, then its start's delay).
"""

from __future__ import annotations

import numpy as np

from services.simulated.truth import ModelTruth
from services.simulated.world import SimulatedJob
from sim.bound import ModelTimes

PARTS = ("compute", "slower_type", "fewer_gpus", "restarts", "waiting", "first_start")


def job_parts(job: SimulatedJob, truth: ModelTruth, times: ModelTimes) -> dict[str, float] | None:
    """The parts of a finished job's JCT in seconds (None for a job that did not finish)."""
    if job.finish_s is None or job.first_run_s is None:
        return None
    work = np.diff(truth.boundaries, prepend=0.0)
    # Seconds per unit of progress in each epoch, on each placement alone.
    per_unit = {
        where: np.divide(seconds, work, out=np.zeros_like(work), where=work > 0)
        for where, seconds in times.per_epoch.items()
    }
    best = np.min(np.stack(list(per_unit.values())), axis=0)
    on_type: dict[str, np.ndarray] = {}
    for where, unit in per_unit.items():
        on_type[where.gpu_type] = np.minimum(on_type.get(where.gpu_type, unit), unit)
    compute = slower = running = 0.0
    for key, (done, seconds) in job.ran.items():
        gpu_type, epoch = key.split("|")
        ideal, typed = done * best[int(epoch)], done * on_type[gpu_type][int(epoch)]
        compute, slower, running = compute + ideal, slower + typed - ideal, running + seconds
    jct = job.finish_s - job.spec.time
    first = job.first_run_s - job.spec.time
    return {
        "compute": compute,
        "slower_type": slower,
        "fewer_gpus": running - compute - slower,
        "restarts": job.restart_s,
        "waiting": jct - first - job.restart_s - running,
        "first_start": first,
    }


def mean_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    """Each part's mean over jobs: the parts of the average JCT."""
    return {name: float(np.mean([p[name] for p in parts])) if parts else 0.0 for name in PARTS}
