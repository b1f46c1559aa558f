"""`fifo`: first come, first served, rigid jobs at their requested GPU count and batch, no preemption.

Each round, the waiting jobs are taken in arrival order (submit_s, then job_id). A job starts when
its requested GPUs fit on one GPU type among the GPUs left free by the running jobs; it runs there
until it finishes (a running job is never preempted or moved, and keeps its exact placement).

The GPU type is the fastest one with room for the request (`rigid.fastest_type`, shared with the
other rigid baselines). The per-GPU batch is not held to the type's smallest profiled one: a rigid
job runs at the batch its user asked for.

Backfill: off by default, the classic strict FIFO — once the oldest waiting job that can run at all
does not fit, no later job starts this round, so it cannot be starved by smaller jobs behind it.
`FifoPolicy(backfill=True)` lets later jobs start past a blocked head (with no reservation: the head
may then wait for as long as smaller jobs keep arriving). A job that could never run on this cluster
(no modelled type holds its request) is skipped rather than allowed to block the queue forever; the
decision's events name it.

New placements use `pack` (nodes with most free GPUs first, as in Pollux's simulator). A running job
whose placement does not match its request (say, placed by another policy before a switch) is
treated as waiting and re-placed at its request.
"""

from __future__ import annotations

from policies.base import Decision, RoundState, decision_from_placements, free_gpus, pack, refuse_hybrid, refuse_teams
from policies.rigid import arrival_order, fastest_type, holds_request, requested_throughput_matrix, type_room
from shared.schema.base import Spots
from shared.settings import ROUND_S


class FifoPolicy:
    """Arrival order, requested GPUs, no preemption; strict (no backfill) unless `backfill`."""

    name = "fifo"
    adaptive_batch = False
    honours_teams = False  # refuses a round with teams (policies.base.refuse_teams)

    def __init__(self, backfill: bool = False, round_s: float = ROUND_S):
        self.backfill = backfill
        self.round_s = round_s

    def allocate(self, state: RoundState) -> Decision:
        refuse_hybrid(self.name, state.jobs)
        refuse_teams(self.name, state)
        cluster = state.cluster
        placements: dict[str, Spots] = {j.job_id: j.placement for j in state.jobs if holds_request(j, cluster)}
        free = free_gpus(cluster, placements)
        events: list[str] = []
        waiting = arrival_order(j for j in state.jobs if j.job_id not in placements)
        for job, row in zip(waiting, requested_throughput_matrix(waiting, cluster)):
            throughputs = dict(zip(cluster.gpu_types, row.tolist()))
            if not any(throughputs.values()):
                events.append(
                    f"fifo: {job.job_id} cannot run on this cluster "
                    f"({job.requested_gpus} GPUs on no modelled type); skipped"
                )
                continue
            gpu_type = fastest_type(throughputs, job.requested_gpus, type_room(cluster, free))
            if gpu_type is None:
                if self.backfill:
                    continue
                break
            placements[job.job_id] = pack(cluster, free, gpu_type, job.requested_gpus)
        return decision_from_placements(cluster, placements, events)
