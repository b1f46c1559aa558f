"""The rounds' recorded decisions: what the policy leader decided for each job every round and why
(`JobDecision`), each round's summary (`RoundSummary`), both kept a bounded time in the decisions
stream; and the user API that reads them (goodput.api.explain, goodput.api.rounds)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.schema.base import Identifier, Node
from shared.subjects import DEFAULT_TEAM

# What a round decided for a job (`JobDecision.outcome`), as the `job.decision` span says it.
OUTCOMES = ("allocated", "kept", "unallocated", "waits", "evicted", "failed")
# How its GPUs changed from the round before (`JobDecision.change`).
CHANGES = ("started", "grew", "shrunk", "moved", "stopped", "same", "waiting")


class Holder(msgspec.Struct, frozen=True):
    """Another job, as a decision names it: it holds (or took) `gpus` GPUs of `gpu_type`."""

    job: str  # its id in the cluster (`team.id`); the API shows only what the asker may see
    team: str
    gpu_type: str
    gpus: int
    goodput: float | None = None  # its predicted goodput on them (samples/s x efficiency)
    priority: int = 0  # its priority within its team


class JobDecision(msgspec.Struct, frozen=True):
    """One job in one decided round: what it got, how that changed, and why."""

    round: int
    at_s: float  # on the run's clock
    job: str  # its id in the cluster (`team.id`)
    team: str = DEFAULT_TEAM
    outcome: str = "unallocated"  # one of OUTCOMES
    change: str = "same"  # one of CHANGES
    reason: str = ""  # the round's own words when it waits, failed or was kept
    gpus: int = 0
    gpu_type: str | None = None  # the cluster's key (aws, dgx-ext, ...)
    placement: tuple[tuple[str, int], ...] = ()  # (node, GPUs)
    batch: int | None = None  # the total batch the policy planned
    previous_gpus: int = 0
    previous_type: str | None = None
    goodput: float | None = None  # predicted, of its allocation (samples/s x statistical efficiency)
    previous_goodput: float | None = None  # predicted, of what it had (the round before's prediction)
    restart_factor: float | None = None  # what a move cost it (1: nothing)
    measured_goodput: float | None = None  # what it did over the round before, as previous_goodput predicted
    # Shrunk, moved or stopped: the jobs that took GPUs of the type it lost, the largest first. Waiting:
    # the jobs holding the GPUs it could use, the largest first. At most MAX_HOLDERS.
    holders: tuple[Holder, ...] = ()
    usable_types: tuple[str, ...] = ()  # the GPU types it may run on that the cluster has
    absent_types: tuple[str, ...] = ()  # the types it asked for that the cluster lacks
    idle_gpus: int = 0  # waiting: the GPUs of its usable types that no job holds after the round
    priority: int = 0  # its priority within its team


MAX_HOLDERS = 5


class RoundSummary(msgspec.Struct, frozen=True):
    """One decided round, as the dashboard and the metrics show it."""

    round: int
    at_s: float
    policy: str
    jobs: int  # considered
    allocated: int  # jobs given GPUs
    waiting: int  # jobs given none
    restarts: int  # jobs whose placement changed (restarted)
    gpus_total: int
    gpus_allocated: dict[str, int] = {}  # per GPU type
    gpus_idle: dict[str, int] = {}  # per GPU type
    gpus_borrowed: dict[str, int] = {}  # per GPU type, with teams
    team_gpus: dict[str, dict[str, int]] = {}  # with teams: per team, the GPUs of each type its jobs hold
    team_borrowed: dict[str, int] = {}  # ... of them, those beyond its guarantee
    team_reclaimed: dict[str, int] = {}  # ... its jobs the round shrank or stopped for another team
    goodput: float = 0.0  # the allocated jobs' predicted goodput, summed
    objective: float | None = None  # the policy's objective value, when it reports one
    solve_s: float = 0.0  # the policy's time
    duration_s: float = 0.0  # the whole decision's (facts to placement)
    stages_s: dict[str, float] = {}  # each stage's time (facts, models, solve, place)
    nodes: tuple[Node, ...] = ()  # the round's nodes
    events: tuple[str, ...] = ()


class ExplainRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """-> goodput.api.explain: why the job `id` (one of the asker's team's) has what it has."""

    id: Identifier
    rounds: Annotated[int, msgspec.Meta(ge=1, le=500)] = 50  # its last decisions to read


class Explanation(msgspec.Struct, frozen=True):
    """goodput.api.explain's answer: plain sentences, newest last, and the decisions they come from
    (the job's GPUs, type and batch over time). No job of that id: error 404."""

    id: str
    state: str
    sentences: tuple[str, ...]
    decisions: tuple[JobDecision, ...] = ()


class RoundsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """-> goodput.api.rounds: the last `limit` decided rounds, newest last."""

    limit: Annotated[int, msgspec.Meta(ge=1, le=500)] = 20


class RoundsPage(msgspec.Struct, frozen=True):
    rounds: tuple[RoundSummary, ...]
    nodes: tuple[Node, ...] = ()  # the newest round's nodes (the cluster as it was scheduled)
