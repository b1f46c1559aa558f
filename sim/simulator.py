"""Discrete-time, round-based replay of a workload on a cluster, wiring the cores directly.

Four small things, kept apart: the clock (`Simulator`: rounds of `settings.round_s`, the policy's
decision grid, the metrics), the cluster state (each job's placement, progress and counters:
`sim.world.SimulatedJob`, which plays the executors), the policy (any `Policy`, by name), and the
wiring that carries a round's messages between them. `DirectWiring` calls the cores in this
process, with the estimator's state as one `JobEstimate` per job; a bus wiring carries the same
messages over NATS to the services (docs/services.md). Every round:

1. jobs whose submit time has come join the queue;
2. on a policy round, the executors' `JobFacts` and the estimator's `JobModels` make the policy's
   views, the policy decides, the placer (or the policy itself) picks physical GPUs, and every job
   whose placement changed pays its restart delay; adaptive jobs re-tune (m, s) with their model;
3. every running job advances through the round at its true goodput, epoch by epoch (efficiency
   changes at epoch boundaries), and reports the configuration it ran to its estimator.

These are the messages the services pass over NATS (docs/services.md). The scheduler sees what a
real one would: 1-GPU profiles per type, the iteration times of the configurations a job actually
ran, and the gradient statistics the job measures at the batch it runs (the true ones of its
epoch, as in the peers' simulators).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Callable, Mapping, Protocol

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context

from services.estimator.core import Estimator
from services.placer.core import place
from services.policy.base import (Decision, Policy, RoundState, decision_from_placements, job_view, restore_policy,
                                  snapshot_policy)
from shared.cluster import Cluster, Config, Spots
from shared.reference import WorkloadJob
from shared.schema import (
    AdvanceReply,
    ApplyRequest,
    DecidedRound,
    JobFacts,
    JobModels,
    JobRecord,
    PlacementResult,
    Profile,
    RoundRecord,
    RunClock,
    RunStep,
)
from sim.settings import SimSettings
from sim.truth import ModelTruth
from sim.world import SimulatedExecutors, SimulatedJob

FEEDBACK_ITERATIONS = 1      # default k for "time to the first k iterations"
_TRACER = trace.get_tracer("goodput.round")
log = logging.getLogger(__name__)


class Wiring(Protocol):
    """How a round's messages travel between the clock (with the policy) and the other stages."""

    async def facts(self, now: float, jobs: list[str]) -> list[JobFacts]: ...       # executors

    async def models(self, facts: list[JobFacts]) -> list[JobModels]: ...           # estimator

    async def place(self, round: int, allocations: dict[str, Config], previous: dict[str, Spots],
                    groups: dict[str, int]) -> PlacementResult: ...

    async def apply(self, now: float, placements: dict[str, Spots], models: dict[str, JobModels],
                    adaptive: bool) -> None: ...                                    # executors

    async def advance(self, now: float, step: float, jobs: list[str]) -> AdvanceReply: ...   # executors: jobs that ended


class Journal(Protocol):
    """Where a run's progress is kept (the policy leader's checkpoints and the run's log)."""

    async def decided(self, clock: RunClock) -> None: ...                  # before it is carried out

    async def stepped(self, clock: RunClock, step: RunStep) -> None: ...    # a round has run


class LiveFeed(Protocol):
    """A live run's jobs and pace (the policy leader's, over the bus: `sim.bus_wiring.LiveFeed`)."""

    async def wait(self, now: float) -> None: ...            # until the round at `now` is due

    async def jobs(self, now: float) -> list[str]: ...      # the live jobs not finished, arrived by `now`


class DirectWiring:
    """The stages as plain calls in this process: simulated executors and the estimator's state."""

    def __init__(self, workload: list[WorkloadJob], cluster: Cluster, settings: SimSettings,
                 truths: Mapping[str, ModelTruth], profiles: Callable[[str, str], Profile],
                 feedback_iterations: int):
        unknown = sorted({j.application for j in workload} - set(truths))
        if unknown:
            raise ValueError(f"workload uses models with no profile data: {', '.join(unknown)}")
        self.cluster = cluster
        self.executors = SimulatedExecutors(cluster, settings, feedback_iterations)
        self.estimator = Estimator(settings.max_local)
        for spec in workload:
            usable = self.executors.add(spec, truths[spec.application])
            self.estimator.add(spec.name, {t: profiles(spec.application, t) for t in usable})

    @property
    def jobs(self) -> dict[str, SimulatedJob]:
        return self.executors.jobs

    async def facts(self, now: float, jobs: list[str]) -> list[JobFacts]:
        return self.executors.facts(now, jobs)

    async def models(self, facts: list[JobFacts]) -> list[JobModels]:
        return self.estimator.models(facts)

    async def place(self, round: int, allocations: dict[str, Config], previous: dict[str, Spots],
                    groups: dict[str, int]) -> PlacementResult:
        return place(self.cluster, allocations, previous, groups)

    async def apply(self, now: float, placements: dict[str, Spots], models: dict[str, JobModels],
                    adaptive: bool) -> None:
        self.executors.apply(now, placements, models, adaptive)

    async def advance(self, now: float, step: float, jobs: list[str]) -> AdvanceReply:
        finished, observed = self.executors.advance(now, step, jobs)
        for job_id, gpu_type, observation in observed:      # the executors' reports reach the estimator
            self.estimator.observe(job_id, gpu_type, observation)
        return AdvanceReply(tuple(finished))


def hybrid_groups(allocations: Mapping[str, Config], models: list[JobModels]) -> dict[str, int]:
    """The GPUs of one model-parallel group of each allocated hybrid-parallel job, on its allocated type."""
    by_id = {m.job_id: m for m in models}
    groups = {job: by_id[job].group(config.gpu_type) for job, config in allocations.items() if job in by_id}
    return {job: group for job, group in groups.items() if group > 1}


class Simulator:
    """The clock, the policy and the metrics, over a wiring (direct unless given)."""

    def __init__(self, workload: list[WorkloadJob], cluster: Cluster, policy: Policy, settings: SimSettings,
                 truths: Mapping[str, ModelTruth] | None = None, profiles: Callable[[str, str], Profile] | None = None,
                 feedback_iterations: int = FEEDBACK_ITERATIONS, wiring: Wiring | None = None):
        """Over `wiring`, or, without one, a DirectWiring built from the jobs' `truths` and `profiles`."""
        if feedback_iterations < 1:
            raise ValueError(f"feedback iterations must be at least 1, got {feedback_iterations}")
        self.workload = sorted(workload, key=lambda j: (j.time, j.name))
        self.cluster = cluster
        self.policy = policy
        self.settings = settings
        self.feedback_iterations = feedback_iterations
        self.wiring = wiring or DirectWiring(workload, cluster, settings, truths, profiles, feedback_iterations)
        self.rounds: list[RoundRecord] = []
        self.events: list[str] = []

    def records(self) -> list[JobRecord]:
        """Every job's outcome (direct wiring: read from the simulated executors here)."""
        return [job.record() for job in self.wiring.jobs.values()]

    def run(self, progress: Callable[[float, int, int], None] | None = None) -> None:
        asyncio.run(self.run_async(progress))

    async def run_async(self, progress: Callable[[float, int, int], None] | None = None,
                        clock: RunClock | None = None, journal: Journal | None = None,
                        live: LiveFeed | None = None) -> RunClock:
        """Run to the end from `clock` (the start unless given: a standby resuming a run passes the
        last checkpoint). `journal` is told of each decision before it is carried out and of each
        round once it has run, so a run can be resumed from any point; returns the final clock.
        With `live`, the jobs are those `live` reports each round, rounds keep its pace, and the run
        has no end."""
        step = self.settings.round_s
        clock = clock or RunClock()
        if clock.policy_state:
            restore_policy(self.policy, clock.policy_state)
        while live or clock.admitted < len(self.workload) or clock.active:
            if live:
                await live.wait(clock.now_s)
                clock = msgspec.structs.replace(clock, active=tuple(await live.jobs(clock.now_s)))
                if not clock.active:             # idle: the next round, on the wall clock
                    clock = msgspec.structs.replace(clock, now_s=clock.now_s + step)
                    continue
            now = clock.now_s
            if not live and now > self.settings.horizon_s:
                event = f"horizon {self.settings.horizon_s:.0f} s reached with {len(clock.active)} jobs active"
                self.events.append(event)
                if journal:
                    await journal.stepped(clock, RunStep(clock.round, now, None, (event,), (), clock.done,
                                                         len(self.workload), over=True))
                return clock
            arrived = [j.name for j in self.workload[clock.admitted:] if j.time <= now]
            if arrived:
                clock = msgspec.structs.replace(clock, admitted=clock.admitted + len(arrived),
                                                active=clock.active + tuple(arrived))
            if not clock.active:                 # idle: jump to the round of the next arrival
                clock = msgspec.structs.replace(clock, now_s=step * -(-self.workload[clock.admitted].time // step))
                continue
            decide = clock.decided is None and now >= clock.next_decision_s - 1e-9   # on the policy's grid
            # One trace per round: every stage's span, in every service, descends from this root.
            with _TRACER.start_as_current_span("round", context=Context(), attributes={
                    "round": clock.round, "now_s": now, "jobs": len(clock.active),
                    "gpus": self.cluster.total_gpus, "decides": decide}):
                if decide:
                    decided = await self._decide(now, list(clock.active), clock.decisions)
                    clock = msgspec.structs.replace(
                        clock, decided=decided, decisions=clock.decisions + 1,
                        next_decision_s=(now // self.policy.round_s + 1) * self.policy.round_s)
                    if journal:
                        clock = msgspec.structs.replace(clock, policy_state=snapshot_policy(self.policy))
                        await journal.decided(clock)
                if clock.decided is not None:
                    apply = clock.decided.apply
                    await self.wiring.apply(apply.now_s, apply.placements, apply.models, apply.adaptive)
                ended = await self.wiring.advance(now, step, list(clock.active))
            ended_jobs = set(ended.finished) | set(ended.failed)          # a failed job is done with, too
            record, events = (clock.decided.record, clock.decided.events) if clock.decided else (None, ())
            events += tuple(f"{now:.0f}s: {job} failed: {reason}" for job, reason in sorted(ended.failed.items()))
            if record is not None:
                self.rounds.append(record)
            self.events.extend(events)
            clock = msgspec.structs.replace(
                clock, round=clock.round + 1, now_s=now + step, done=clock.done + len(ended_jobs), decided=None,
                active=tuple(name for name in clock.active if name not in ended_jobs))
            over = not live and clock.admitted == len(self.workload) and not clock.active
            total = clock.done + len(clock.active) if live else len(self.workload)
            if journal:
                await journal.stepped(clock, RunStep(clock.round - 1, now, record, events, tuple(sorted(ended.finished)),
                                                     clock.done, total, over, failed=tuple(sorted(ended.failed))))
            if progress:
                progress(clock.now_s, clock.done, total)
        return clock

    async def _decide(self, now: float, active: list[str], decisions: int) -> DecidedRound:
        """The round's decision: facts, models, the policy, then the placer unless the policy placed."""
        start = time.perf_counter()
        events: list[str] = []
        facts = await self.wiring.facts(now, active)
        models = await self.wiring.models(facts)
        views = tuple(job_view(f, m, self.cluster, self.settings.restart_estimate(f.application))
                      for f, m in zip(facts, models))
        policy_start = time.perf_counter()
        with _TRACER.start_as_current_span("policy.solve", attributes={"policy": self.policy.name}):
            # In a thread: the event loop meanwhile answers pings and renews the leader's lease.
            try:
                decision = await asyncio.to_thread(self.policy.allocate, RoundState(now, self.cluster, views))
            except Exception as error:  # noqa: BLE001 - a failed solve costs a round, not the run
                if type(error) is ValueError:   # the policy refuses these jobs (e.g. hybrid): the run cannot go on
                    raise                       # (a LinAlgError or a validation error is a failed solve)
                decision = self._keep(facts, f"policy {self.policy.name} failed ({type(error).__name__}: "
                                             f"{error}); previous allocation kept")
        policy_ms = (time.perf_counter() - policy_start) * 1e3
        if decision.placements is None:
            previous = {f.job_id: f.placement for f in facts if f.placement and f.job_id in decision.allocations}
            placed = await self.wiring.place(decisions + 1, decision.allocations, previous,
                                             hybrid_groups(decision.allocations, models))
            placements = placed.placements
            events.extend(f"{now:.0f}s: placer evicted {job}: no node fits its allocation" for job in placed.evicted)
        else:
            placements = decision.placements
        self._check(placements)
        events.extend(f"{now:.0f}s: {e}" for e in decision.events)
        gpus = {job: sum(g for _, g in spots) for job, spots in placements.items() if spots and job in set(active)}
        record = RoundRecord(now, len(active), len(gpus), policy_ms, (time.perf_counter() - start) * 1e3, gpus)
        apply = ApplyRequest(now, dict(placements), {m.job_id: m for m in models}, self.policy.adaptive_batch)
        return DecidedRound(apply, record, tuple(events))

    def _keep(self, facts: list[JobFacts], event: str) -> Decision:
        """The round's decision when the policy could not make one: every job stays where it is."""
        log.warning(event)
        return decision_from_placements(self.cluster, {f.job_id: f.placement for f in facts if f.placement}, (event,))

    def _check(self, placements: Mapping[str, Spots]) -> None:
        used: dict[str, int] = defaultdict(int)
        for job, spots in placements.items():
            if self.cluster.placement_type(spots) is None:
                raise RuntimeError(f"policy {self.policy.name} placed {job} on unknown or mixed nodes: {spots}")
            for node, gpus in spots:
                used[node] += gpus
        capacity = {n.name: n.gpus for n in self.cluster.nodes}
        over = [n for n, g in used.items() if g > capacity[n]]
        if over:
            raise RuntimeError(f"policy {self.policy.name} over-filled nodes {over}")
