"""A run of the policy rounds: the driver's request, the leader's checkpoint (KV) and lease, the
steps on the run's log that the driver folds into its report, and the status anyone may ask for."""

from __future__ import annotations

from typing import Any

import msgspec

from goodput_train.protocol import PositiveFloat
from shared.schema.base import Identifier
from shared.schema.rounds import ApplyRequest
from shared.schema.teams import TeamFile


class RoundRecord(msgspec.Struct):
    """One scheduling round, for the metrics: jobs active and running, and what deciding cost."""

    now_s: float
    active: int
    running: int
    policy_ms: float
    round_ms: float
    gpus: dict[str, int]  # GPUs of each running job after the decision
    types: dict[str, str] = {}  # ... their GPU type
    batches: dict[str, int] = {}  # ... the total batch the policy planned, when it plans one
    nodes: dict[str, int] = {}  # ... the nodes of each job spread over more than one
    # With teams: each team's GPUs of each type after the decision, of them those beyond its
    # guarantee, and how many of its jobs were shrunk or stopped for another team's guarantee.
    team_gpus: dict[str, dict[str, int]] = {}
    team_borrowed: dict[str, int] = {}
    team_reclaimed: dict[str, int] = {}
    # Each stage's time, ms: facts, models, solve, place (the decision), checkpoint, apply, advance.
    stages_ms: dict[str, float] = {}


class RunRequest(msgspec.Struct, frozen=True):
    """Driver -> policy leader (as the run's first checkpoint in KV): replay these submitted jobs
    on the virtual clock."""

    run_id: Identifier
    policy: str
    policy_options: dict[str, Any]
    calibration: str
    jobs: tuple[tuple[str, float], ...]  # (job id, submit time), in submission order
    round_s: float | None = None
    horizon_s: float | None = None
    request_timeout_s: float = 10.0  # each stage's request; a restarted service is asked again
    live: bool = False  # no end: the jobs submitted live, rounds paced by the wall clock
    speed: PositiveFloat = 1.0  # live: virtual seconds per wall-clock second
    # A replay's teams (the leader resolves them against its cluster); a live run reads the operator's
    # from the teams' KV bucket every round instead.
    teams: TeamFile | None = None


class DecidedRound(msgspec.Struct, frozen=True):
    """A round the leader has decided but not yet run: what a standby needs to finish it."""

    apply: ApplyRequest
    record: RoundRecord
    events: tuple[str, ...]


class RunClock(msgspec.Struct, frozen=True):
    """A replay's virtual clock between two steps: where a standby leader resumes."""

    round: int = 0  # rounds run so far
    now_s: float = 0.0
    next_decision_s: float = 0.0
    admitted: int = 0  # jobs (in submission order) that have arrived
    active: tuple[str, ...] = ()
    done: int = 0
    decisions: int = 0  # placer rounds asked
    decided: DecidedRound | None = None
    policy_state: bytes = b""  # the policy's state between rounds (Policy.snapshot)


class RunCheckpoint(msgspec.Struct, frozen=True):
    """KV, one per run: the request and the clock, written by the leader after every step; the
    revision fences a deposed leader out (its next write is refused). `problem`: why the run cannot
    go on now (it is being retried since `problem_since`, wall-clock seconds), or why it failed."""

    request: RunRequest
    clock: RunClock = msgspec.field(default_factory=RunClock)
    over: bool = False
    problem: str = ""
    problem_since: float | None = None


class RunStep(msgspec.Struct, frozen=True):
    """One round run, on the run's log (a stream): the driver folds the steps into the report."""

    round: int
    now_s: float
    record: RoundRecord | None  # the round's decision, if it decided
    events: tuple[str, ...]
    finished: tuple[str, ...]
    done: int
    total: int
    over: bool = False  # the last step: every job finished, the horizon passed, or it failed
    failure: str = ""  # why the run could not go on
    failed: tuple[str, ...] = ()  # jobs that ended without finishing (why: in `events`)


class RunReport(msgspec.Struct, frozen=True):
    rounds: tuple[RoundRecord, ...]
    events: tuple[str, ...]


class Lease(msgspec.Struct, frozen=True):
    """KV: who leads the policy rounds; the bucket's TTL ends a lease that is not renewed."""

    holder: str


class RunStatus(msgspec.Struct, frozen=True):
    """A run as `goodput status` shows it. state: `running`, `stalled` (a round keeps failing; it is
    retried, `reason` says why), `over` or `failed`."""

    id: str
    state: str
    reason: str
    round: int  # rounds run so far (the newest is round - 1: rounds count from 0)
    now_s: float
    jobs: int  # active now


class PolicyStatus(msgspec.Struct, frozen=True):
    """Policy -> anyone: who leads the rounds ("" when no one does) and the live run, if there is one."""

    leader: str
    run: RunStatus | None = None
