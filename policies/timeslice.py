"""`timeslice`: rigid jobs share the GPUs round-robin, a quantum of iterations at a time (Gandiva).

For early feedback from many trials rather than the fastest finish of one (docs/timeslice.md). Each
round, a running job keeps its GPUs until it has done `quantum` iterations since it (re)started;
then it goes to the back of the queue. The queue is the round-robin order of `sim/timeslice.py`:
jobs that have waited longest first (since they last ran, or since they were submitted), then the
jobs whose slice just ended. Jobs are placed from the queue while their requested GPUs fit, on the
fastest type with room (as `fifo` does); a job whose slice ended but that is picked again keeps its
exact placement, so it pays no switch. A switch is a suspend/resume through the executor's
checkpointing: the simulator charges the restart delay (`--restart-delay` sets it).

The scheduler acts at round boundaries, so a slice lasts at least one round: for quanta shorter
than a round, shorten the round (`--round-s`).
"""

from __future__ import annotations

from policies.base import Decision, RoundState, decision_from_placements, free_gpus, pack, refuse_hybrid, refuse_teams
from policies.rigid import fastest_type, holds_request, requested_throughput_matrix, type_room
from shared.schema.base import Spots
from shared.settings import ROUND_S

DEFAULT_QUANTUM = 100  # iterations


class TimeslicePolicy:
    name = "timeslice"
    adaptive_batch = False
    honours_teams = False  # refuses a round with teams (policies.base.refuse_teams)

    def __init__(self, quantum: int = DEFAULT_QUANTUM, round_s: float = ROUND_S):
        if quantum < 1:
            raise ValueError(f"quantum must be at least one iteration, got {quantum}")
        self.quantum = quantum
        self.round_s = round_s

    def allocate(self, state: RoundState) -> Decision:
        refuse_hybrid(self.name, state.jobs)
        refuse_teams(self.name, state)
        cluster = state.cluster
        running = [j for j in state.jobs if holds_request(j, cluster)]
        keep: dict[str, Spots] = {j.job_id: j.placement for j in running if j.slice_iterations < self.quantum}
        ended = sorted((j for j in running if j.job_id not in keep), key=lambda j: (j.submit_s, j.job_id))
        waiting = sorted(
            (j for j in state.jobs if not holds_request(j, cluster)),
            key=lambda j: (j.idle_since_s if j.idle_since_s is not None else j.submit_s, j.submit_s, j.job_id),
        )
        queue = waiting + ended
        free = free_gpus(cluster, keep)
        placements = dict(keep)
        events = []
        for job, row in zip(queue, requested_throughput_matrix(queue, cluster)):
            if job.placement and all(free[node] >= gpus for node, gpus in job.placement):
                placements[job.job_id] = job.placement  # picked again: no switch
                for node, gpus in job.placement:
                    free[node] -= gpus
                continue
            throughputs = dict(zip(cluster.gpu_types, row.tolist()))
            if not any(throughputs.values()):
                events.append(f"timeslice: {job.job_id} cannot run on this cluster; skipped")
                continue
            gpu_type = fastest_type(throughputs, job.requested_gpus, type_room(cluster, free))
            if gpu_type is not None:
                placements[job.job_id] = pack(cluster, free, gpu_type, job.requested_gpus)
        return decision_from_placements(cluster, placements, events)
