"""Discrete-time, round-based replay of a workload on a cluster, wiring the cores directly.

The simulator is a driver of the scheduler's own round loop (`services.policy.rounds.RoundLoop`:
the clock, the policy's decision grid, the metrics). What it adds is the world: the cluster state
(each job's placement, progress and counters: `services.simulated.world.SimulatedJob`, which plays the executors)
and `DirectWiring`, which carries a round's messages as calls in this process, with the estimator's
state as one `JobEstimate` per job. The policy service drives the same loop over NATS
(docs/services.md), so both wirings give the same schedule. In a round every job whose placement
changed pays its restart delay; adaptive jobs re-tune (m, s) with their model; every running job
advances at its true goodput, epoch by epoch (efficiency changes at epoch boundaries), and reports
the configuration it ran to its estimator.

The scheduler sees what a real one would: 1-GPU profiles per type, the iteration times of the
configurations a job actually ran, and the gradient statistics the job measures at the batch it
runs (the true ones of its epoch, as in the peers' simulators).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Mapping

from policies.base import Policy
from services.estimator.core import Estimator
from services.placer.core import place
from services.policy.rounds import Arrival, FixedTeams, RoundLoop, Wiring
from services.simulated.truth import ModelTruth
from services.simulated.world import SimulatedExecutors, SimulatedJob, request_observations
from shared.cluster import Cluster
from shared.schema.base import Config, Node, Spots
from shared.schema.estimates import Profile
from shared.schema.records import JobRecord
from shared.schema.rounds import AdvanceReply, ApplyRequest, FactsReply, JobFacts, ModelsReply, PlacementResult
from shared.schema.runs import RoundRecord
from shared.schema.teams import TeamFile
from shared.settings import FEEDBACK_ITERATIONS, SimSettings
from sim.reference import WorkloadJob

log = logging.getLogger(__name__)


class DirectWiring:
    """The stages as plain calls in this process: simulated executors and the estimator's state."""

    def __init__(
        self,
        workload: list[WorkloadJob],
        cluster: Cluster,
        settings: SimSettings,
        truths: Mapping[str, ModelTruth],
        profiles: Callable[[str, str], Profile],
        feedback_iterations: int,
    ):
        unknown = sorted({j.application for j in workload} - set(truths))
        if unknown:
            raise ValueError(f"workload uses models with no profile data: {', '.join(unknown)}")
        self.cluster = cluster
        self.executors = SimulatedExecutors(cluster, settings, feedback_iterations)
        self.estimator = Estimator(settings.max_local)
        for spec in workload:
            truth = truths[spec.application]
            usable = self.executors.add(spec, truth)
            self.estimator.add(spec.name, {t: profiles(spec.application, t) for t in usable})
            if settings.profile_request:
                for gpu_type, observation in request_observations(spec, truth, cluster):
                    self.estimator.observe(spec.name, gpu_type, observation)

    @property
    def jobs(self) -> dict[str, SimulatedJob]:
        return self.executors.jobs

    async def facts(self, now: float, jobs: list[str]) -> FactsReply:
        return FactsReply(tuple(self.executors.facts(now, jobs)))

    async def models(self, facts: list[JobFacts]) -> ModelsReply:
        return ModelsReply(tuple(self.estimator.models(facts)))

    async def place(
        self,
        round: int,
        allocations: dict[str, Config],
        previous: dict[str, Spots],
        groups: dict[str, int],
        nodes: tuple[Node, ...] | None = None,
    ) -> PlacementResult:
        return place(
            self.cluster if nodes is None else Cluster(self.cluster.name, nodes), allocations, previous, groups
        )

    async def apply(self, request: ApplyRequest) -> None:
        self.executors.apply(request)

    async def advance(self, now: float, step: float, jobs: list[str]) -> AdvanceReply:
        finished, observed = self.executors.advance(now, step, jobs)
        for job_id, gpu_type, observation in observed:  # the executors' reports reach the estimator
            self.estimator.observe(job_id, gpu_type, observation)
        return AdvanceReply(tuple(finished), self.executors.failures(jobs, now))


class Simulator:
    """A workload replayed by the round loop over a wiring (direct unless given)."""

    def __init__(
        self,
        workload: list[WorkloadJob],
        cluster: Cluster,
        policy: Policy,
        settings: SimSettings,
        truths: Mapping[str, ModelTruth] | None = None,
        profiles: Callable[[str, str], Profile] | None = None,
        feedback_iterations: int = FEEDBACK_ITERATIONS,
        wiring: Wiring | None = None,
        teams: TeamFile | None = None,
    ):
        """Over `wiring`, or, without one, a DirectWiring built from the jobs' `truths` and `profiles`;
        `teams`: the team file in force every round (checked by the caller: `sim.run.check_teams`)."""
        if feedback_iterations < 1:
            raise ValueError(f"feedback iterations must be at least 1, got {feedback_iterations}")
        self.cluster = cluster
        self.policy = policy
        self.settings = settings
        self.feedback_iterations = feedback_iterations
        self.wiring = wiring or DirectWiring(workload, cluster, settings, truths, profiles, feedback_iterations)
        self.loop = RoundLoop(
            [Arrival(j.name, j.time) for j in workload],
            cluster,
            policy,
            settings,
            self.wiring,
            teams=FixedTeams(teams) if teams is not None else None,
            policy_in_thread=False,
        )

    @property
    def rounds(self) -> list[RoundRecord]:
        return self.loop.rounds

    @property
    def events(self) -> list[str]:
        return self.loop.events

    def records(self) -> list[JobRecord]:
        """Every job's outcome (direct wiring: read from the simulated executors here)."""
        return [job.record() for job in self.wiring.jobs.values()]

    def run(self, progress: Callable[[float, int, int], None] | None = None) -> None:
        asyncio.run(self.loop.run(progress))
