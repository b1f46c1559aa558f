"""The `goodput` policy (in progress: docs/policy.md): Sia's ILP, with a new job's first allocation
allowed up to the GPUs its user asked for rather than one.

Sia lets a job at most twice the most GPUs it ever had, and a new job one: a job asked to run on 8
climbs 1, 2, 4, 8 over four rounds, each step a checkpoint-restart (25 to 250 s) and a round at a
fraction of its goodput. The request is what a real scheduler has at submission; it is still a
hint: the ILP gives the job anything from its minimum to that many, as the goodput matrix says, and
the doubling rule holds from then on.
"""

from __future__ import annotations

import dataclasses

import msgspec

from services.policy.base import Decision, RoundState
from services.policy.sia import SiaPolicy


class GoodputPolicy(SiaPolicy):
    name = "goodput"

    def allocate(self, state: RoundState) -> Decision:
        return super().allocate(RoundState(state.now_s, state.cluster, tuple(
            dataclasses.replace(view, models=msgspec.structs.replace(view.models, start_gpus=view.requested_gpus))
            if starts_at_request(view) else view for view in state.jobs)))


def starts_at_request(view) -> bool:
    """A job that never ran, asked for more than one GPU, and neither rigid nor hybrid-parallel (their
    GPU counts follow rules of their own)."""
    models = view.models
    return (models.max_gpus_seen == 0 and view.requested_gpus > 1 and models.fixed_gpus is None
            and not models.group_gpus)
