"""The one signature every policy has: the round's state in, a decision out.

A policy sees what a real scheduler would: per job its age, restarts, service received, current
allocation and placement, the user's request, and the estimator's models (`JobModels`, with the
goodput matrix of the round already evaluated over the cluster's configuration set). It returns
allocations (GPU type and count per job) for the placer, or, when it chooses physical GPUs itself
(Pollux searches per-node allocations; the rigid baselines pack requested GPU counts), placements.

Policies are looked up by name (`make_policy`), so the simulator, the policy service and the
evaluation switch between them with one string.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Mapping, Protocol

import numpy as np

from policies.table import GoodputTable, goodput_table
from shared.cluster import Cluster
from shared.schema.base import Config, Spots
from shared.schema.rounds import JobFacts, JobModels
from shared.schema.teams import Teams
from shared.subjects import DEFAULT_TEAM


@dataclass(frozen=True)
class JobView:
    """What a policy may know of one active (submitted, unfinished) job this round."""

    job_id: str
    model: str  # application name
    submit_s: float
    age_s: float  # seconds since submission
    restarts: int
    restart_cost_s: float  # S: the policy's estimate of one checkpoint-restart
    attained_gpu_s: float  # GPU-seconds received so far
    attained_by_type: Mapping[str, float]  # the same, per GPU type
    current: Config | None  # allocation in force (None: waiting)
    placement: Spots  # its physical GPUs (empty while waiting)
    mid_restart: bool  # checkpoint-restart in progress: keep the allocation
    requested_gpus: int  # the user's request (rigid baselines run with it)
    requested_batch: int
    models: JobModels  # the estimator's view: throughput per type, PGNS, limits
    iterations: float = 0.0  # optimizer steps done so far
    slice_iterations: float = 0.0  # steps done since its current placement began (time-slicing)
    idle_since_s: float | None = (
        None  # when it last stopped running (its submit time if it never ran); None while running
    )
    team: str = DEFAULT_TEAM  # the team it belongs to (shared/teams.py)
    priority: int = 0  # within its team: higher gets the team's guarantee first


def job_view(facts: JobFacts, models: JobModels, cluster: Cluster, restart_cost_s: float) -> JobView:
    """A policy's view of a job: its executors' facts, the estimator's models, and the policy's own
    estimate of what one checkpoint-restart costs it."""
    return JobView(
        job_id=facts.job_id,
        model=facts.application,
        submit_s=facts.submit_s,
        age_s=facts.age_s,
        restarts=facts.restarts,
        restart_cost_s=restart_cost_s,
        attained_gpu_s=facts.attained_gpu_s,
        attained_by_type=facts.attained_by_type,
        current=cluster.config_of(facts.placement) if facts.placement else None,
        placement=facts.placement,
        mid_restart=facts.mid_restart,
        requested_gpus=facts.requested_gpus,
        requested_batch=facts.requested_batch,
        models=models,
        iterations=facts.iterations,
        slice_iterations=facts.slice_iterations,
        idle_since_s=facts.idle_since_s,
        team=facts.team,
        priority=facts.priority,
    )


@dataclass(frozen=True)
class RoundState:
    now_s: float
    cluster: Cluster
    jobs: tuple[JobView, ...]
    teams: Teams | None = None  # the teams' guarantees (None: one team, no quotas)

    @cached_property
    def table(self) -> GoodputTable:
        """The estimator's goodput matrix: rows in the order of `jobs`, columns the cluster's
        configuration set. Evaluated on first use: only the policies that read it pay for it."""
        return goodput_table([j.models for j in self.jobs], self.cluster.configurations())


@dataclass(frozen=True)
class Prediction:
    """What a policy expected of one job when it decided, for the round's trace (each `None`: the
    policy does not say). Goodput is samples/s x statistical efficiency by the estimator's models."""

    goodput: float | None = None  # of its allocation, at the batch below
    normalized_goodput: float | None = None  # the same in the units the policy compared jobs in (Sia's matrix)
    speedup: float | None = None  # over its fair share (Pollux), restart factor not applied
    batch: int | None = None  # the total batch planned: replicas x per_gpu_batch x (steps + 1)
    per_gpu_batch: int | None = None
    accumulation_steps: int | None = None
    restart_factor: float | None = None  # what a move would have cost it (1: nothing)


@dataclass(frozen=True)
class Decision:
    """Allocations for the placer, or placements chosen by the policy itself; jobs absent get nothing."""

    allocations: dict[str, Config]
    placements: dict[str, Spots] | None = None
    events: tuple[str, ...] = field(default_factory=tuple)  # e.g. solver time-outs, for logs and traces
    # Per job, what the policy expected (for traces only: never part of what a decision is).
    predictions: Mapping[str, Prediction] = field(default_factory=dict, compare=False)
    # The value of the policy's objective for this decision, when it optimises one (for the metrics only).
    objective: float | None = field(default=None, compare=False)


class Policy(Protocol):
    """A policy decides from the round's state alone; one that also carries state from round to
    round (pollux's warm-started search) defines `snapshot() -> bytes` and `restore(bytes)`, so a
    standby leader resumes it exactly. A policy that cannot keep hybrid-parallel jobs' groups whole
    refuses them (`refuse_hybrid`)."""

    name: str
    round_s: float  # how often it re-decides (allocations hold in between)
    adaptive_batch: bool  # jobs re-tune (m, s) to their allocation; False: they keep the requested batch
    honours_teams: bool  # holds each team's guarantees and borrowing limits (`RoundState.teams`)

    def allocate(self, state: RoundState) -> Decision: ...


class HybridRefused(ValueError):
    """A policy that would split model-parallel groups refuses the hybrid-parallel jobs it was given."""


def refuse_hybrid(policy: str, jobs: Iterable[JobView]) -> None:
    """HybridRefused naming the hybrid-parallel jobs (Sia §5.3) among `jobs`: for the policies that
    choose GPU counts or placements outside Sia's configuration set, and would split their groups."""
    hybrid = [
        f"{j.job_id} ({j.model}: model-parallel groups of "
        + ", ".join(f"{g} GPUs on {t}" for t, g in j.models.group_gpus.items())
        + ")"
        for j in jobs
        if j.models.group_gpus
    ]
    if hybrid:
        raise HybridRefused(
            f"policy {policy!r} cannot schedule hybrid-parallel jobs: {'; '.join(hybrid)}. Use the sia policy"
        )


def refuse_teams(policy: str, state: RoundState | Teams | None) -> None:
    """ValueError for a policy that cannot honour teams (`honours_teams` False) given a round with
    teams (`state` a RoundState, or the Teams themselves)."""
    teams = state.teams if isinstance(state, RoundState) else state
    if teams is not None:
        raise ValueError(
            f"policy {policy!r} cannot honour the teams' guarantees, borrowing limits and priorities "
            f"({len(teams.teams)} teams in the team file): use the goodput or sia policy, or run without a team file"
        )


def check_honours_teams(policy: Policy, teams: Teams) -> None:
    """ValueError for a policy started with `teams` that cannot hold their guarantees (`refuse_teams`)."""
    if not policy.honours_teams:
        refuse_teams(policy.name, teams)


def team_policies() -> list[str]:
    """The policies that hold each team's guarantees and borrowing limits (`honours_teams`)."""
    return [name for name in POLICIES if _policy_class(name).honours_teams]


def snapshot_policy(policy: Policy) -> bytes:
    """The policy's state between rounds (b"" for a policy without any)."""
    snapshot = getattr(policy, "snapshot", None)
    return snapshot() if snapshot else b""


def restore_policy(policy: Policy, state: bytes) -> None:
    restore = getattr(policy, "restore", None)
    if restore and state:
        restore(state)


def decision_from_placements(cluster: Cluster, placements: Mapping[str, Spots], events: Iterable[str] = ()) -> Decision:
    """A Decision for a policy that chose physical GPUs: allocations read off the placements."""
    return Decision(
        {job: cluster.config_of(spots) for job, spots in placements.items()}, dict(placements), tuple(events)
    )


def restart_factor(age_s, restarts, restart_cost_s, free_while_young: bool = False):
    """The share of a job's time not lost to restarts if it restarts once more:
    max(age - restarts * S, 0) / (age + S) (Pollux's re-allocation factor, Sia's restart factor).
    `free_while_young`: 1 while age < S, as Sia's code has it. Vectorised over its arguments."""
    age_s, restarts, cost = (np.asarray(x, dtype=float) for x in (age_s, restarts, restart_cost_s))
    denominator = age_s + cost
    safe = np.where(denominator > 0, denominator, 1.0)
    factor = np.where(denominator > 0, np.maximum(age_s - restarts * cost, 0.0) / safe, 1.0)
    return np.where(age_s < cost, 1.0, factor) if free_while_young else factor


# name -> "module:class"; modules are imported on first use.
POLICIES: dict[str, str] = {
    "sia": "policies.sia:SiaPolicy",
    "goodput": "policies.goodput:GoodputPolicy",  # the default (shared.settings.DEFAULT_POLICY): docs/policy.md
    "pollux": "policies.pollux:PolluxPolicy",
    "gavel": "policies.gavel:GavelPolicy",
    "tiresias": "policies.tiresias:TiresiasPolicy",
    "fifo": "policies.fifo:FifoPolicy",
    "timeslice": "policies.timeslice:TimeslicePolicy",
    "chaos": "chaos.policy:ChaosPolicy",  # fault injection only (docs/chaos.md)
}


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for a close misspelling of one of `choices`, else ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _policy_class(name: str) -> type:
    try:
        module, cls = POLICIES[name].split(":")
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}{_did_you_mean(name, POLICIES)}; choose one of {', '.join(POLICIES)}"
        ) from None
    return getattr(importlib.import_module(module), cls)


def policy_options(name: str) -> dict[str, object]:
    """A policy's options and their defaults (its constructor's keyword parameters; a parameter
    without a default maps to `inspect.Parameter.empty`). ValueError for an unknown policy."""
    parameters = inspect.signature(_policy_class(name)).parameters.values()
    return {
        p.name: p.default
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def check_policy(name: str, options: Mapping[str, object] | None = None) -> None:
    """ValueError naming the valid policies for an unknown name, and the valid options of the policy
    (with their defaults) for an option it does not take, with a "did you mean" for a misspelling."""
    parameters = inspect.signature(_policy_class(name)).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return  # e.g. chaos: hands the rest to the policy it wraps
    valid = policy_options(name)
    unknown = [key for key in options or {} if key not in valid]
    if unknown:
        hints = "; ".join(f"{key!r}{_did_you_mean(key, valid)}" for key in unknown)
        listed = ", ".join(
            key if default is inspect.Parameter.empty else f"{key}={default!r}" for key, default in valid.items()
        )
        raise ValueError(f"policy {name!r} has no option {hints}; its options (with defaults): {listed or 'none'}")
    for key, value in (options or {}).items():  # of the kind its default is: p=abc is no number
        default = valid[key]
        kinds = (
            (bool,)
            if isinstance(default, bool)
            else (int, float)
            if isinstance(default, (int, float))
            else (str,)
            if isinstance(default, str)
            else None
        )
        if kinds is not None and (not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool))):
            kind = "true or false" if bool in kinds else "a number" if int in kinds else "a string"
            raise ValueError(f"policy {name!r}: option {key} is {kind} (default {default!r}), got {value!r}")


def make_policy(name: str, **options) -> Policy:
    """A policy by name, with its options (e.g. p=-1 for the fairness exponent). ValueError for an
    unknown name or option, naming the valid ones."""
    check_policy(name, options)
    try:
        return _policy_class(name)(**options)
    except TypeError as exc:
        raise ValueError(f"policy {name!r} does not take these options {sorted(options)}: {exc}") from None


def free_gpus(cluster: Cluster, placements: Mapping[str, Spots]) -> dict[str, int]:
    """GPUs left on each node once `placements` are in force."""
    free = {n.name: n.gpus for n in cluster.nodes}
    for spots in placements.values():
        for node, gpus in spots:
            free[node] -= gpus
    return free


def pack(cluster: Cluster, free: dict[str, int], gpu_type: str, gpus: int) -> Spots | None:
    """`gpus` GPUs of one type on the nodes with most free GPUs first (the rigid baselines' placement,
    as in Pollux's simulator); updates `free`. None, and `free` untouched, when they do not fit."""
    nodes = sorted(
        (n for n in cluster.nodes if n.gpu_type == gpu_type and free[n.name] > 0), key=lambda n: (-free[n.name], n.name)
    )
    if sum(free[n.name] for n in nodes) < gpus:
        return None
    spots, need = [], gpus
    for node in nodes:
        take = min(need, free[node.name])
        spots.append((node.name, take))
        need -= take
        if need == 0:
            break
    for name, take in spots:
        free[name] -= take
    return tuple(sorted(spots))


def policy_spec(spec: str) -> tuple[str, dict]:
    """'gavel:objective=max_sum_throughput,round_s=60' -> ('gavel', {...}); values parsed as JSON when they can be.
    ValueError naming the valid policies, or the policy's valid options, for a name it does not know."""
    name, _, rest = spec.partition(":")
    check_policy(name)
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"policy option {item!r} in {spec!r} is not KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    check_policy(name, options)
    return name, options
