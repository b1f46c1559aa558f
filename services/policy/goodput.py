"""The `goodput` policy (in progress: docs/policy.md): Sia's ILP with two changes.

1. A new job's first allocation may go up to the GPUs its user asked for rather than one. Sia lets a
   job at most twice the most GPUs it ever had, and a new job one: a job asked to run on 8 climbs
   1, 2, 4, 8 over four rounds, each step a checkpoint-restart (25 to 250 s) and a round at a
   fraction of its goodput. The request is what a real scheduler has at submission; it is still a
   hint: the ILP gives the job anything from its minimum to that many, as the goodput matrix says,
   and the doubling rule holds from then on.
2. No job waits while the cluster holds every job's smallest allocation. Sia leaves a waiting job
   out whenever making room would cost a running job a restart worth more than lam - 1 = 0.1 of
   the objective, so on a full cluster small jobs can wait for hours behind jobs the restart factor
   pins (ncf jobs of a minute's work waited ~750 s on average on Pollux's workload-2). Then every
   job is marked must-run (`sia_ilp.IlpProblem.must_run`): leaving one out costs more than moving
   any one job. Marking only the waiting ones would let the ILP make room by leaving out the pinned
   job instead (lam is cheaper than its move).
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np

from services.policy.base import Decision, RoundState
from services.policy.sia import SiaPolicy
from services.policy.sia_ilp import IlpProblem


class GoodputPolicy(SiaPolicy):
    name = "goodput"

    def allocate(self, state: RoundState) -> Decision:
        return super().allocate(RoundState(state.now_s, state.cluster, tuple(
            dataclasses.replace(view, models=msgspec.structs.replace(view.models, start_gpus=view.requested_gpus))
            if starts_at_request(view) else view for view in state.jobs)))

    def problem(self, state: RoundState) -> IlpProblem:
        """Sia's ILP; every job must-run when one waits and all their smallest allocations fit."""
        problem = super().problem(state)
        waiting = any(view.current is None for view in state.jobs)
        if waiting and sum(smallest_gpus(view.models) for view in state.jobs) <= state.cluster.total_gpus:
            problem = dataclasses.replace(problem, must_run=np.ones(problem.jobs, dtype=bool))
        return problem


def starts_at_request(view) -> bool:
    """A job that never ran, asked for more than one GPU, and neither rigid nor hybrid-parallel (their
    GPU counts follow rules of their own)."""
    models = view.models
    return (models.max_gpus_seen == 0 and view.requested_gpus > 1 and models.fixed_gpus is None
            and not models.group_gpus)


def smallest_gpus(models) -> int:
    """The fewest GPUs a job can run on: its fixed or least replicas, of its smallest model-parallel
    group (one GPU for a data-parallel job)."""
    return (models.fixed_gpus or models.min_gpus) * min(models.group_gpus.values(), default=1)
