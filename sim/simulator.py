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
import time
from collections import defaultdict, deque
from typing import Callable, Mapping, Protocol

from opentelemetry import trace
from opentelemetry.context import Context

from services.estimator.core import Estimator
from services.placer.core import place
from services.policy.base import Policy, RoundState, job_view
from shared.cluster import Cluster, Config, Spots
from shared.reference import WorkloadJob
from shared.schema import JobFacts, JobModels, JobRecord, PlacementResult, Profile, RoundRecord
from sim.settings import SimSettings
from sim.truth import ModelTruth
from sim.world import SimulatedExecutors, SimulatedJob

FEEDBACK_ITERATIONS = 1      # default k for "time to the first k iterations"
_TRACER = trace.get_tracer("goodput.round")


class Wiring(Protocol):
    """How a round's messages travel between the clock (with the policy) and the other stages."""

    async def facts(self, now: float, jobs: list[str]) -> list[JobFacts]: ...       # executors

    async def models(self, facts: list[JobFacts]) -> list[JobModels]: ...           # estimator

    async def place(self, allocations: dict[str, Config], previous: dict[str, Spots]) -> PlacementResult: ...

    async def apply(self, now: float, placements: dict[str, Spots], models: dict[str, JobModels],
                    adaptive: bool) -> None: ...                                    # executors

    async def advance(self, now: float, step: float) -> list[str]: ...              # executors: jobs finished


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

    async def place(self, allocations: dict[str, Config], previous: dict[str, Spots]) -> PlacementResult:
        return place(self.cluster, allocations, previous)

    async def apply(self, now: float, placements: dict[str, Spots], models: dict[str, JobModels],
                    adaptive: bool) -> None:
        self.executors.apply(now, placements, models, adaptive)

    async def advance(self, now: float, step: float) -> list[str]:
        finished, observed = self.executors.advance(now, step)
        for job_id, gpu_type, observation in observed:      # the executors' reports reach the estimator
            self.estimator.observe(job_id, gpu_type, observation)
        return finished


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

    async def run_async(self, progress: Callable[[float, int, int], None] | None = None) -> None:
        step = self.settings.round_s
        waiting = deque(self.workload)
        active: list[str] = []
        done = 0
        now, next_decision = 0.0, 0.0
        while waiting or active:
            if now > self.settings.horizon_s:
                self.events.append(f"horizon {self.settings.horizon_s:.0f} s reached with {len(active)} jobs active")
                break
            while waiting and waiting[0].time <= now:
                active.append(waiting.popleft().name)
            if not active:                       # idle: jump to the round of the next arrival
                now = step * -(-waiting[0].time // step)
                continue
            decide = now >= next_decision - 1e-9      # decisions on the policy's own grid of rounds
            # One trace per round: every stage's span, in every service, descends from this root.
            with _TRACER.start_as_current_span("round", context=Context(), attributes={
                    "round": len(self.rounds), "now_s": now, "jobs": len(active),
                    "gpus": self.cluster.total_gpus, "decides": decide}):
                if decide:
                    await self._decide(now, active)
                    next_decision = (now // self.policy.round_s + 1) * self.policy.round_s
                finished = set(await self.wiring.advance(now, step))
            active = [name for name in active if name not in finished]
            done += len(finished)
            now += step
            if progress:
                progress(now, done, len(self.workload))

    async def _decide(self, now: float, active: list[str]) -> None:
        start = time.perf_counter()
        facts = await self.wiring.facts(now, active)
        models = await self.wiring.models(facts)
        views = tuple(job_view(f, m, self.cluster, self.settings.restart_estimate(f.application))
                      for f, m in zip(facts, models))
        policy_start = time.perf_counter()
        with _TRACER.start_as_current_span("policy.solve", attributes={"policy": self.policy.name}):
            decision = self.policy.allocate(RoundState(now, self.cluster, views))
        policy_ms = (time.perf_counter() - policy_start) * 1e3
        if decision.placements is None:
            previous = {f.job_id: f.placement for f in facts if f.placement and f.job_id in decision.allocations}
            placed = await self.wiring.place(decision.allocations, previous)
            placements = placed.placements
            self.events.extend(f"{now:.0f}s: placer evicted {job}: no node fits its allocation"
                               for job in placed.evicted)
        else:
            placements = decision.placements
        self._check(placements)
        self.events.extend(f"{now:.0f}s: {e}" for e in decision.events)
        await self.wiring.apply(now, placements, {m.job_id: m for m in models}, self.policy.adaptive_batch)
        gpus = {job: sum(g for _, g in spots) for job, spots in placements.items() if spots and job in set(active)}
        self.rounds.append(RoundRecord(now, len(active), len(gpus), policy_ms,
                                       (time.perf_counter() - start) * 1e3, gpus))

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
