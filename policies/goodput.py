"""The `goodput` policy, the default (docs/policy.md): Sia's ILP with three changes; teams' guarantees
hold as in sia (policies/teams.py).

1. A new job's first allocation may go up to the GPUs its user asked for rather than one. Sia lets a
   job at most twice the most GPUs it ever had, and a new job one: a job asked to run on 8 climbs
   1, 2, 4, 8 over four rounds, each step a checkpoint-restart (25 to 250 s) and a round at a
   fraction of its goodput. The request is what a real scheduler has at submission; it is still a
   hint: the ILP gives the job anything from its minimum to that many, as the goodput matrix says,
   and the doubling rule holds from then on.
2. No job waits, or is preempted, while the cluster holds every job's smallest allocation. Sia
   leaves a job out whenever making room for it, or keeping it, would cost the others more than
   lam - 1 = 0.1 of the objective, so on a full cluster small jobs can wait for hours behind jobs
   the restart factor pins (ncf jobs of a minute's work waited ~750 s on average on Pollux's
   workload-2), and a running one is stopped to let another grow (an ncf job 3 s from its end, to
   take a deepspeech2 job from 4 GPUs to 8). Then every job is marked must-run
   (`sia_ilp.problem.IlpProblem.must_run`): leaving one out costs more than moving any one job. Marking
   only the waiting ones would let the ILP make room by leaving out the pinned job instead (lam is
   cheaper than its move).
3. A shrink costs a large job what it costs a job of four GPUs' goodput. Sia prices a move of job i
   as its restart factor r_i applied to the goodput of the new cell, (r G)^p: at p = -0.5 the price
   G^p (r^p - 1) falls as the job's normalised goodput G grows, so a 24-GPU job is shrunk to give
   a 4-GPU job a small gain, and each such shrink stops all its GPUs for its restart (imagenet:
   250 s). goodput prices a shrink at max(G^p, SHRINK_FLOOR) (r^p - 1) (`IlpProblem.shrink_floor`):
   the same as Sia's for a job of normalised goodput up to 4, more for a larger one. Growing, and
   moving to a cell of more goodput, keep Sia's price.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np

from policies.base import Decision, RoundState
from policies.sia import SiaPolicy
from policies.sia_ilp.problem import IlpProblem

# Mechanism 3: the least G^p a shrink is priced at, that of a job of normalised goodput 4 at p = -0.5
# (0.25 and 1, the two measured beside it, did worse: docs/policy.md).
SHRINK_FLOOR = 0.5


class GoodputPolicy(SiaPolicy):
    name = "goodput"

    def allocate(self, state: RoundState) -> Decision:
        return super().allocate(
            RoundState(
                state.now_s,
                state.cluster,
                tuple(
                    dataclasses.replace(
                        view, models=msgspec.structs.replace(view.models, start_gpus=view.requested_gpus)
                    )
                    if starts_at_request(view)
                    else view
                    for view in state.jobs
                ),
                state.teams,
            )
        )

    def problem(self, state: RoundState) -> IlpProblem:
        """Sia's ILP with shrinks floored; every job must-run when all their smallest allocations fit."""
        fits = sum(smallest_gpus(view.models) for view in state.jobs) <= state.cluster.total_gpus
        problem = super().problem(state)  # its must-run jobs: those past max_wait_s, if any
        return dataclasses.replace(
            problem,
            shrink_floor=SHRINK_FLOOR,
            must_run=np.ones(len(state.jobs), dtype=bool) if fits else problem.must_run,
        )


def starts_at_request(view) -> bool:
    """A job that never ran, asked for more than one GPU, and neither rigid nor hybrid-parallel (their
    GPU counts follow rules of their own)."""
    models = view.models
    return models.max_gpus_seen == 0 and view.requested_gpus > 1 and models.fixed_gpus is None and not models.group_gpus


def smallest_gpus(models) -> int:
    """The fewest GPUs a job can run on: its fixed or least replicas, of its smallest model-parallel
    group (one GPU for a data-parallel job)."""
    return (models.fixed_gpus or models.min_gpus) * min(models.group_gpus.values(), default=1)
