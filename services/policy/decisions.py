"""What a decided round did to each job and why, as pure functions of what the round loop already has
(its facts, held and failed jobs, the policy's decision with its predictions, the placements, the
evictions, the ledger): one `JobOutcome` per job, from which both the `job.decision` span's
attributes (`span_attributes`) and the recorded `JobDecision` (`job_decisions`) are made, and the
round's `RoundSummary`, from which the policy leader's round metrics are recorded
(`record_round_metrics`).
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from goodput_train.goodput import pgns
from policies.base import Decision, Prediction
from shared import metrics
from shared.cluster import Cluster
from shared.hardware import hardware_name
from shared.schema.base import Spots
from shared.schema.decisions import MAX_HOLDERS, Holder, JobDecision, RoundSummary
from shared.schema.rounds import JobFacts, JobModels, Reclaim
from shared.schema.runs import RoundRecord
from shared.schema.teams import Teams
from shared.subjects import DEFAULT_TEAM
from shared.waits import Needs, beyond_team, team_full

MAX_SUMMARY_EVENTS = 50  # a round's summary keeps its first events; the rest are counted
GPU_STATES = ("allocated", "idle", "borrowed")  # the `state` label of goodput_gpus


@dataclass(frozen=True)
class JobOutcome:
    """One job in one decided round: where it was, where it is, and the round's word on it."""

    job: str
    facts: JobFacts | None
    spots: Spots  # sorted (node, GPUs); empty: no GPUs
    previous: Spots  # sorted, as its facts said before the round
    gpu_type: str | None  # of `spots` (None: none, or nodes the cluster does not know together)
    previous_type: str | None
    outcome: str  # one of shared.schema.decisions.OUTCOMES
    reason: str | None
    change: str  # one of shared.schema.decisions.CHANGES
    prediction: Prediction

    @cached_property
    def gpus(self) -> int:
        return sum(g for _, g in self.spots)

    @cached_property
    def previous_gpus(self) -> int:
        return sum(g for _, g in self.previous)

    @property
    def restart(self) -> bool:
        """It ran and runs on, elsewhere: a checkpoint-restart."""
        return bool(self.previous) and bool(self.spots) and self.spots != self.previous

    @property
    def team(self) -> str:
        return self.facts.team if self.facts is not None else DEFAULT_TEAM

    @property
    def priority(self) -> int:
        return self.facts.priority if self.facts is not None else 0


def change_of(spots: Spots, previous: Spots, gpu_type: str | None, previous_type: str | None) -> str:
    """How a job's GPUs changed: started, grew, shrunk, moved (another type, or other GPUs of the
    same count), stopped, same, or waiting (none before, none now)."""
    if not spots:
        return "stopped" if previous else "waiting"
    if not previous:
        return "started"
    if spots == previous:
        return "same"
    if gpu_type != previous_type:
        return "moved"
    now, before = sum(g for _, g in spots), sum(g for _, g in previous)
    return "grew" if now > before else "shrunk" if now < before else "moved"


def job_outcome(
    job: str,
    facts: JobFacts | None,
    held: Mapping[str, str],
    failed: Mapping[str, str],
    decision: Decision,
    placements: Mapping[str, Spots],
    evicted: Iterable[str],
    kept: str | None,
    cluster: Cluster,
    policy: str,
    waits: Mapping[str, str] | None = None,
) -> JobOutcome:
    """What the round decided for `job` and why (`evicted`: the jobs the placer found no node for;
    `kept`: why every job kept its placement, when the policy could not decide; `waits`: the jobs left
    without GPUs that wait on their team's limits, `team_waits`)."""
    spots = tuple(sorted(placements.get(job, ())))
    previous = tuple(sorted((node, gpus) for node, gpus in facts.placement)) if facts is not None else ()
    if job in failed:
        outcome, reason = "failed", failed[job]
    elif job in held:
        outcome, reason = "waits", held[job]
    elif facts is None:
        outcome, reason = "waits", "the executors reported nothing of it this round"
    elif kept is not None:
        outcome, reason = ("kept" if spots else "unallocated"), kept
    elif job in evicted:
        config = decision.allocations.get(job)
        given = f"{config.gpus} {config.gpu_type} GPUs" if config else "GPUs"
        outcome, reason = "evicted", f"allocated {given} by {policy}, but no node fits them"
    elif spots:
        outcome, reason = "allocated", None
    elif waits and job in waits:
        outcome, reason = "waits", waits[job]
    else:
        outcome, reason = "unallocated", f"no GPUs allocated by {policy}"
    gpu_type = cluster.placement_type(spots) if spots else None
    previous_type = cluster.placement_type(previous) if previous else None
    change = change_of(spots, previous, gpu_type, previous_type)
    if outcome == "failed" and change == "waiting":
        change = "same"  # it never ran and never will: nothing it waits for
    return JobOutcome(
        job,
        facts,
        spots,
        previous,
        gpu_type,
        previous_type,
        outcome,
        reason,
        change,
        decision.predictions.get(job) or Prediction(),
    )


def span_attributes(o: JobOutcome) -> dict:
    """A `job.decision` span's attributes (docs/services.md)."""
    attributes: dict = {"job.id": o.job, "gpu.count": o.gpus}
    if o.spots:
        attributes["gpu.type"] = o.gpu_type or "mixed"
        attributes["gpu.name"] = hardware_name(attributes["gpu.type"])  # T4, A100: as people say
        attributes["nodes"] = [node for node, _ in o.spots]
        if len(o.spots) > 1:  # GPUs per node, when it spans several
            attributes["placement"] = [f"{node}:{gpus}" for node, gpus in o.spots]
    f = o.facts
    if f is not None:
        attributes.update(
            {"job.application": f.application, "job.age_s": f.age_s, "job.restarts": f.restarts, "team": f.team}
        )
        if f.mid_restart:
            attributes["job.mid_restart"] = True
        if o.previous:
            attributes.update(
                {
                    "previous.gpu.type": o.previous_type or "mixed",
                    "previous.gpu.count": o.previous_gpus,
                    "previous.nodes": [node for node, _ in o.previous],
                }
            )
    attributes.update({"placement.changed": o.spots != o.previous, "restart": o.restart})
    if o.previous and not o.spots:
        attributes["preempted"] = True
    p = o.prediction
    for name, value in (
        ("goodput.predicted", p.goodput),
        ("goodput.normalized", p.normalized_goodput),
        ("speedup.predicted", p.speedup),
        ("batch", p.batch),
        ("batch.per_gpu", p.per_gpu_batch),
        ("batch.accumulation_steps", p.accumulation_steps),
        ("restart_factor", p.restart_factor),
    ):
        if value is not None and (o.spots or name == "restart_factor"):
            attributes[name] = value
    attributes["decision"] = o.outcome
    if o.reason is not None:
        attributes["reason"] = o.reason
    return attributes


def usable_and_absent(models: JobModels | None, gpu_types: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The GPU types a job may run on that the cluster has (`gpu_types`, in its order), and those it was
    measured for (the types it asked for) that the cluster lacks; both empty when the estimator has no
    model of it."""
    if models is None:
        return (), ()
    return tuple(t for t in gpu_types if t in models.params), tuple(t for t in models.params if t not in gpu_types)


@dataclass(frozen=True)
class Measuring:
    """Where a running job's measurement over the next round starts: its placement, the time and its
    steps there at the round's decision, and the batch planned for the round. `clean`: it ran on that
    placement already and was not restarting, so the round is all training (a round that began with
    a start or a restart would count the restart's seconds as slowness)."""

    spots: Spots
    at_s: float
    iterations: float
    batch: int | None
    clean: bool


def measuring(o: JobOutcome, now: float) -> Measuring:
    """The measurement a running job's round starts now."""
    clean = o.spots == o.previous and o.facts is not None and not o.facts.mid_restart
    return Measuring(o.spots, now, o.facts.slice_iterations if clean else 0.0, o.prediction.batch, clean)


def measured_goodput(
    facts: JobFacts | None, since: Measuring | None, models: JobModels | None, now: float
) -> float | None:
    """What a job did over the round since `since`: its steps x the round's batch / the time, times
    the statistical efficiency of that batch by its models (goodput, as predictions are; a job of a
    fixed batch is predicted by its throughput, and so measured). None when the round does not allow
    it: another placement, a start or restart in it, no batch, no time passed."""
    if facts is None or since is None or not since.clean or not facts.placement:
        return None
    steps = facts.slice_iterations - since.iterations
    if tuple(sorted(facts.placement)) != since.spots or since.batch is None or now <= since.at_s or steps < 0:
        return None
    samples_s = steps * since.batch / (now - since.at_s)
    if models is None or models.fixed_batch is not None:
        return samples_s
    # The statistical efficiency of the batch, (phi + M0) / (phi + M), as GoodputModel.efficiency has it.
    phi = pgns(models.grad_sqr, models.grad_var, models.init_batch)
    return samples_s * ((phi + models.init_batch) / (phi + since.batch) if math.isfinite(phi) else 1.0)


def _by_type(gpus: Iterable[tuple[str, str | None, int]]) -> dict[str, dict[str, int]]:
    """(job, type, GPUs) -> type -> job -> GPUs."""
    table: dict[str, dict[str, int]] = defaultdict(dict)
    for job, gpu_type, count in gpus:
        if gpu_type is not None and count:
            table[gpu_type][job] = count
    return table


def job_decisions(
    round_number: int,
    now: float,
    outcomes: Sequence[JobOutcome],
    cluster: Cluster,
    models: Mapping[str, JobModels],
    reclaims: Mapping[str, Reclaim] | None = None,
    previous_goodput: Mapping[str, float] | None = None,
    measured: Mapping[str, float] | None = None,
) -> list[JobDecision]:
    """Each job's JobDecision: its outcome and change, and who has what it lost or waits for.

    A job shrunk, moved or stopped names the jobs that gained GPUs of the type it lost this round
    (most GPUs first); a job waiting, the jobs holding GPUs of the types it may use, with the idle
    ones; each named with its predicted goodput. `previous_goodput`: each job's
    prediction of the round before; `measured`: its goodput since its placement began; `reclaims`:
    the ledger's."""
    reclaims, previous_goodput, measured = reclaims or {}, previous_goodput or {}, measured or {}
    by_id = {o.job: o for o in outcomes}
    now_held = _by_type((o.job, o.gpu_type, o.gpus) for o in outcomes)
    before = _by_type((o.job, o.previous_type, o.previous_gpus) for o in outcomes)
    gained = {
        t: {job: n - before.get(t, {}).get(job, 0) for job, n in jobs.items() if n > before.get(t, {}).get(job, 0)}
        for t, jobs in now_held.items()
    }

    def holders(table: Mapping[str, int], gpu_type: str) -> list[Holder]:
        top = heapq.nlargest(MAX_HOLDERS, table.items(), key=lambda item: (item[1], item[0]))
        return [
            Holder(job, by_id[job].team, gpu_type, n, by_id[job].prediction.goodput, by_id[job].priority)
            for job, n in top
        ]

    takers = {t: holders(jobs, t) for t, jobs in gained.items()}
    holding = {t: holders(jobs, t) for t, jobs in now_held.items()}
    gpu_types = cluster.gpu_types
    idle = {t: cluster.capacity(t) - sum(now_held.get(t, {}).values()) for t in gpu_types}
    decisions = []
    for o in outcomes:
        usable, absent = usable_and_absent(models.get(o.job), gpu_types)
        named: list[Holder] = []
        idle_gpus = 0
        if o.change in ("shrunk", "moved", "stopped") and o.previous_type is not None:
            named = [h for h in takers.get(o.previous_type, []) if h.job != o.job]
        elif o.change == "waiting":
            types = usable
            named = heapq.nlargest(
                MAX_HOLDERS, (h for t in types for h in holding.get(t, [])), key=lambda h: (h.gpus, h.job)
            )
            idle_gpus = sum(idle.get(t, 0) for t in types)
        reason = o.reason or ""
        reclaim = reclaims.get(o.job)
        if (
            reclaim is not None
            and reclaim.gpus_after < reclaim.gpus_before
            and o.outcome in ("allocated", "unallocated")
        ):
            reason = f"team {reclaim.by_team} took back GPUs of its guarantee"
        p = o.prediction
        decisions.append(
            JobDecision(
                round=round_number,
                at_s=now,
                job=o.job,
                team=o.team,
                priority=o.priority,
                outcome=o.outcome,
                change=o.change,
                reason=reason,
                gpus=o.gpus,
                gpu_type=o.gpu_type,
                placement=o.spots,
                batch=p.batch if o.spots else None,
                previous_gpus=o.previous_gpus,
                previous_type=o.previous_type,
                goodput=p.goodput if o.spots else None,
                previous_goodput=previous_goodput.get(o.job),
                restart_factor=p.restart_factor,
                measured_goodput=measured.get(o.job),
                holders=tuple(named),
                usable_types=usable,
                absent_types=absent,
                idle_gpus=idle_gpus,
            )
        )
    return decisions


def team_waits(
    jobs: Iterable[JobModels],
    placements: Mapping[str, Spots],
    cluster: Cluster,
    teams: Teams,
    team_of: Mapping[str, str],
    holds: Mapping[str, Mapping[str, int]],
) -> dict[str, str]:
    """The jobs a round left without GPUs that wait on their team's limits, and why: those that need
    more GPUs of one type than their team may hold of any type they may use (`shared.waits.beyond_team`),
    and those for which the GPUs their team's jobs hold this round (`holds`: team -> type -> GPUs,
    the round's record's) leave too few (`team_full`). A hybrid-parallel job is left out (its counts
    are replicas: what fits is the policy's to say)."""
    configs = cluster.configurations()
    capacity = {t: cluster.capacity(t) for t in cluster.gpu_types}
    said: dict[tuple, str | None] = {}  # the same for every job of one team and the same needs
    waits = {}
    for m in jobs:
        if placements.get(m.job_id) or m.group_gpus:
            continue
        team = team_of.get(m.job_id, DEFAULT_TEAM)
        usable = tuple(t for t in cluster.gpu_types if t in m.params)
        needs = Needs(m.fixed_gpus or m.min_gpus, bool(m.fixed_gpus), usable)
        if (team, needs) not in said:
            most = {t: teams.most(team, t, capacity[t]) for t in usable}
            said[team, needs] = beyond_team(needs, configs, team, most) or team_full(
                needs, configs, team, most, holds.get(team, {}), capacity
            )
        if said[team, needs] is not None:
            waits[m.job_id] = said[team, needs]
    return waits


def round_summary(
    round_number: int,
    now: float,
    policy: str,
    outcomes: Sequence[JobOutcome],
    cluster: Cluster,
    borrowed: Mapping[str, int],
    objective: float | None,
    stages_s: Mapping[str, float],
    duration_s: float,
    events: Sequence[str] = (),
    record: RoundRecord | None = None,
) -> RoundSummary:
    """The round as the dashboard and the metrics show it: its jobs, GPUs per type and state (every
    type of the cluster, each state, zeros too), the predicted goodput, its times; with teams, each
    team's use (`record`'s: the GPUs its jobs hold, borrowed, its jobs reclaimed)."""
    allocated = dict.fromkeys(cluster.gpu_types, 0)
    lent = dict.fromkeys(cluster.gpu_types, 0)
    goodput = 0.0
    for o in outcomes:
        if o.gpu_type is None:
            continue
        allocated[o.gpu_type] = allocated.get(o.gpu_type, 0) + o.gpus
        lent[o.gpu_type] = lent.get(o.gpu_type, 0) + min(borrowed.get(o.job, 0), o.gpus)
        goodput += o.prediction.goodput or 0.0
    idle = {t: max(0, cluster.capacity(t) - allocated.get(t, 0)) for t in cluster.gpu_types}
    kept = tuple(events[:MAX_SUMMARY_EVENTS])
    if len(events) > MAX_SUMMARY_EVENTS:
        kept += (f"... and {len(events) - MAX_SUMMARY_EVENTS} more events",)
    return RoundSummary(
        round=round_number,
        at_s=now,
        policy=policy,
        jobs=len(outcomes),
        allocated=sum(1 for o in outcomes if o.spots),
        waiting=sum(1 for o in outcomes if not o.spots and o.outcome != "failed"),
        restarts=sum(1 for o in outcomes if o.restart),
        gpus_total=cluster.total_gpus,
        gpus_allocated=allocated,
        gpus_idle=idle,
        gpus_borrowed=lent,
        goodput=goodput,
        objective=objective,
        solve_s=stages_s.get("solve", 0.0),
        duration_s=duration_s,
        stages_s=dict(stages_s),
        nodes=cluster.nodes,
        events=kept,
        team_gpus=record.team_gpus if record is not None else {},
        team_borrowed=record.team_borrowed if record is not None else {},
        team_reclaimed=record.team_reclaimed if record is not None else {},
    )


def record_round_metrics(
    summary: RoundSummary, types_seen: set[str] | None = None, teams_seen: set[tuple[str, str]] | None = None
) -> None:
    """The policy leader's round metrics from its summary (shared.metrics' catalog). `types_seen`: the
    GPU types recorded before (updated here): a type the cluster no longer has is set to 0, so
    goodput_gpus never shows GPUs that are gone; `teams_seen`, the (team, GPU type) pairs, likewise
    for a team the team file no longer names."""
    metrics.instrument(metrics.ROUNDS).add(1)
    metrics.instrument(metrics.ROUND_DURATION).record(summary.duration_s)
    stage = metrics.instrument(metrics.STAGE_DURATION)
    for name, seconds in summary.stages_s.items():
        stage.record(seconds, {"stage": name})
    policy = {"policy": summary.policy}
    metrics.instrument(metrics.SOLVER_DURATION).record(summary.solve_s, policy)
    if summary.objective is not None:
        metrics.instrument(metrics.OBJECTIVE).set(summary.objective, policy)
    metrics.instrument(metrics.RESTARTS_ORDERED).add(summary.restarts)
    metrics.instrument(metrics.CLUSTER_GOODPUT).set(summary.goodput)
    allocated = sum(summary.gpus_allocated.values())
    metrics.instrument(metrics.UTILIZATION).set(allocated / summary.gpus_total if summary.gpus_total else 0.0)
    gpus = metrics.instrument(metrics.GPUS)
    by_state = {"allocated": summary.gpus_allocated, "idle": summary.gpus_idle, "borrowed": summary.gpus_borrowed}
    types = set(summary.gpus_allocated) | set(summary.gpus_idle)
    for gpu_type in sorted(types | (types_seen or set())):
        for state in GPU_STATES:
            gpus.set(by_state[state].get(gpu_type, 0), {"gpu_type": gpu_type, "state": state})
    if types_seen is not None:
        types_seen |= types
    held = {(team, t): n for team, by_type in summary.team_gpus.items() for t, n in by_type.items()}
    pairs = set(held) | {(team, t) for team in summary.team_borrowed for t in summary.gpus_allocated}
    shown = pairs | (teams_seen or set())
    team_gpus, team_borrowed = metrics.instrument(metrics.TEAM_GPUS), metrics.instrument(metrics.TEAM_BORROWED)
    for team, gpu_type in sorted(shown):
        team_gpus.set(held.get((team, gpu_type), 0), {"team": team, "gpu_type": gpu_type})
    for team in sorted({team for team, _ in shown}):
        team_borrowed.set(summary.team_borrowed.get(team, 0), {"team": team})
    reclaimed = metrics.instrument(metrics.TEAM_RECLAIMED)
    for team, jobs in summary.team_reclaimed.items():
        reclaimed.add(jobs, {"team": team})
    if teams_seen is not None:
        teams_seen |= pairs


def record_stage(stage: str, seconds: float) -> None:
    """One stage's time outside the decision (apply, advance, checkpoint, log)."""
    metrics.instrument(metrics.STAGE_DURATION).record(seconds, {"stage": stage})
