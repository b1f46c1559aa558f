"""`tiresias`: two-queue discretised least-attained-service (Tiresias, NSDI '19, as in Pollux's simulator).

Rigid jobs at their requested GPU count and batch. Every round:

1. Queues. A job is in queue 0 while its attained service (GPU-seconds received, JobView.attained_gpu_s)
   is below the threshold (default 16 GPU-hours, Pollux's setting), else in queue 1. Queue 0 comes
   first; within a queue, earlier submission first (then job_id).
2. Admission, in that priority order, counting GPUs per type: a job is admitted when its requested
   GPUs fit in what the jobs admitted before it left; a job that does not fit is skipped and the
   next one is tried (work-conserving, as Pollux's simulator does). A running job is admitted on its
   own type when that type still has room; otherwise, and for a waiting job, on the fastest type
   with room (`fifo.fastest_type`: the highest estimated throughput at the requested size).
3. Placement. An admitted job on the type it runs on keeps its exact placement; a running job that
   was not admitted is preempted (its placement ends); the other admitted jobs are packed, in
   priority order, on the nodes left free (`pack`, most free GPUs first). Step 2's per-type counts
   guarantee that they fit.

A job demoted past the threshold therefore loses its GPUs to any queue-0 job that needs them.

Stateless, unlike Pollux's version, which keeps its queues between rounds: there a demoted job joins
the tail of queue 1 in order of demotion, here queue 1 is ordered by submission time; Pollux's
starvation promotion is disabled by default (`_solve_starvation = 0`) and is not implemented. A job
mid checkpoint-restart is treated like any other running job (Pollux's simulator does the same).
"""

from __future__ import annotations

from policies.base import Decision, RoundState, decision_from_placements, free_gpus, pack, refuse_hybrid, refuse_teams
from policies.rigid import fastest_type, holds_request, requested_throughput_matrix
from shared.schema.base import Spots
from shared.settings import ROUND_S

THRESHOLD_GPU_H = 16.0


class TiresiasPolicy:
    """Two queues by attained GPU service (threshold in GPU-hours), FIFO within a queue, preemptive."""

    name = "tiresias"
    adaptive_batch = False
    honours_teams = False  # refuses a round with teams (policies.base.refuse_teams)

    def __init__(self, threshold_gpu_h: float = THRESHOLD_GPU_H, round_s: float = ROUND_S):
        if threshold_gpu_h < 0:
            raise ValueError(f"tiresias: threshold_gpu_h must be >= 0, got {threshold_gpu_h}")
        self.threshold_gpu_h = threshold_gpu_h
        self.round_s = round_s

    def queue(self, attained_gpu_s: float) -> int:
        """0 below the threshold, 1 at or past it."""
        return 0 if attained_gpu_s < self.threshold_gpu_h * 3600.0 else 1

    def allocate(self, state: RoundState) -> Decision:
        refuse_hybrid(self.name, state.jobs)
        refuse_teams(self.name, state)
        cluster = state.cluster
        order = sorted(state.jobs, key=lambda j: (self.queue(j.attained_gpu_s), j.submit_s, j.job_id))
        matrix = requested_throughput_matrix(order, cluster)
        room = {t: cluster.capacity(t) for t in cluster.gpu_types}
        admitted: list[tuple[str, str]] = []  # (job_id, gpu_type) in priority order
        events: list[str] = []
        for job, row in zip(order, matrix):
            gpus = job.requested_gpus
            current = cluster.placement_type(job.placement) if holds_request(job, cluster) else None
            if current is not None and room[current] >= gpus:
                gpu_type = current
            else:
                throughputs = dict(zip(cluster.gpu_types, row.tolist()))
                if not any(throughputs.values()):
                    events.append(
                        f"tiresias: {job.job_id} cannot run on this cluster ({gpus} GPUs on no modelled type); skipped"
                    )
                    continue
                gpu_type = fastest_type(throughputs, gpus, room)
                if gpu_type is None:
                    continue
            room[gpu_type] -= gpus
            admitted.append((job.job_id, gpu_type))

        jobs = {j.job_id: j for j in state.jobs}
        kept: dict[str, Spots] = {}
        for job_id, gpu_type in admitted:
            job = jobs[job_id]
            if holds_request(job, cluster) and cluster.placement_type(job.placement) == gpu_type:
                kept[job_id] = job.placement
        free = free_gpus(cluster, kept)
        placements: dict[str, Spots] = {}
        for job_id, gpu_type in admitted:
            spots = kept.get(job_id) or pack(cluster, free, gpu_type, jobs[job_id].requested_gpus)
            if spots is None:  # cannot happen: the per-type admission counts guarantee the fit
                raise RuntimeError(f"tiresias: admitted {job_id} does not fit on {gpu_type}")
            placements[job_id] = spots
        return decision_from_placements(cluster, placements, events)
