"""Discrete-time, round-based replay of a workload on a cluster, wiring the cores directly.

Four small things, kept apart: the clock (rounds of `settings.round_s`, here), the cluster state
(each job's placement, progress and counters: `sim.world.SimulatedJob`, which also plays the
executors), the policy (any `Policy`, by name) and the metrics (`sim.run.results`). The estimator's
state is one `JobEstimate` per job. Every round:

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

import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Mapping

from services.estimator.core import JobEstimate, job_models
from services.placer.core import place
from services.policy.base import Policy, RoundState, job_view
from shared.cluster import Cluster, Spots
from shared.reference import WorkloadJob
from shared.schema import JobFacts, JobModels, Profile
from sim.settings import SimSettings
from sim.truth import ModelTruth
from sim.world import SimulatedJob

FEEDBACK_ITERATIONS = 1      # default k for "time to the first k iterations"


@dataclass
class RoundRecord:
    now_s: float
    active: int
    running: int
    policy_ms: float
    round_ms: float
    gpus: dict[str, int]          # GPUs of each running job after the decision


class Simulator:
    def __init__(self, workload: list[WorkloadJob], cluster: Cluster, policy: Policy, settings: SimSettings,
                 truths: Mapping[str, ModelTruth], profiles: Callable[[str, str], Profile],
                 feedback_iterations: int = FEEDBACK_ITERATIONS):
        if feedback_iterations < 1:
            raise ValueError(f"feedback iterations must be at least 1, got {feedback_iterations}")
        unknown = sorted({j.application for j in workload} - set(truths))
        if unknown:
            raise ValueError(f"workload uses models with no profile data: {', '.join(unknown)}")
        self.cluster = cluster
        self.policy = policy
        self.settings = settings
        self.feedback_iterations = feedback_iterations
        self.jobs: list[SimulatedJob] = []
        self.estimates: dict[str, JobEstimate] = {}      # the estimator's state, per job
        self._models: dict[str, tuple[JobEstimate, dict]] = {}
        for spec in workload:
            self._add(spec, truths[spec.application], profiles)
        self.rounds: list[RoundRecord] = []
        self.events: list[str] = []

    def _add(self, spec: WorkloadJob, truth: ModelTruth, profiles) -> None:
        usable = [t for t in self.cluster.gpu_types if t in truth.types]
        if not usable:
            raise ValueError(f"job {spec.name}: model {spec.application} has no profile on any GPU type of "
                             f"cluster {self.cluster.name}")
        model = spec.application
        self.jobs.append(SimulatedJob(spec, truth, self.settings.rigid.get(model), self.settings.restart_delay(model),
                                      self.settings.goodput_factor(model)))
        self.estimates[spec.name] = JobEstimate.build({t: profiles(model, t) for t in usable})

    # --- the clock ------------------------------------------------------------------------

    def run(self, progress: Callable[[float, int, int], None] | None = None) -> None:
        step = self.settings.round_s
        waiting = deque(sorted(self.jobs, key=lambda j: (j.spec.time, j.name)))
        active: list[SimulatedJob] = []
        now, next_decision = 0.0, 0.0
        while waiting or active:
            if now > self.settings.horizon_s:
                self.events.append(f"horizon {self.settings.horizon_s:.0f} s reached with {len(active)} jobs active")
                break
            while waiting and waiting[0].spec.time <= now:
                active.append(waiting.popleft())
            if not active:                       # idle: jump to the round of the next arrival
                now = step * -(-waiting[0].spec.time // step)
                continue
            if now >= next_decision - 1e-9:      # decisions on the policy's own grid of rounds
                self._decide(now, active)
                next_decision = (now // self.policy.round_s + 1) * self.policy.round_s
            for job in active:
                self._advance(job, now, step)
            active = [j for j in active if j.finish_s is None]
            now += step
            if progress:
                progress(now, len(self.jobs) - len(waiting) - len(active), len(self.jobs))

    # --- the estimator, the policy and the placer -------------------------------------------------

    def _type_models(self, job_id: str) -> dict:
        """The estimate's throughput model per type, fitted and projected once per update."""
        estimate = self.estimates[job_id]
        cached = self._models.get(job_id)
        if cached is None or cached[0] is not estimate:
            cached = self._models[job_id] = (estimate, estimate.models())
        return cached[1]

    def _job_models(self, facts: JobFacts) -> JobModels:
        limits = self.estimates[facts.job_id].local_limits
        cap = self.settings.max_local.get(facts.application)
        if cap:
            limits = {t: (lo, min(hi, cap)) for t, (lo, hi) in limits.items()}
        return job_models(facts, self._type_models(facts.job_id), limits)

    def _decide(self, now: float, active: list[SimulatedJob]) -> None:
        start = time.perf_counter()
        facts = [j.facts(now) for j in active]
        views = tuple(job_view(f, self._job_models(f), self.cluster, self.settings.restart_estimate(f.application))
                      for f in facts)
        state = RoundState(now, self.cluster, views)
        policy_start = time.perf_counter()
        decision = self.policy.allocate(state)
        policy_ms = (time.perf_counter() - policy_start) * 1e3
        if decision.placements is None:
            previous = {j.name: j.placement for j in active if j.placement and j.name in decision.allocations}
            placed = place(self.cluster, decision.allocations, previous)
            placements = placed.placements
            self.events.extend(f"{now:.0f}s: placer evicted {job}: no node fits its allocation"
                               for job in placed.evicted)
        else:
            placements = decision.placements
        self._check(placements)
        self.events.extend(f"{now:.0f}s: {e}" for e in decision.events)
        for job, view in zip(active, views):
            job.apply(self.cluster, tuple(placements.get(job.name, ())), view.models, self.policy.adaptive_batch,
                      now, self.settings.retune_threshold)
        gpus = {j.name: j.config.gpus for j in active if j.placement}
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

    # --- the jobs' true progress ----------------------------------------------------------------

    def _advance(self, job: SimulatedJob, now: float, step: float) -> None:
        observation = job.advance(now, step, self.feedback_iterations)
        if observation is not None:      # the executor's report reaches the estimator
            self.estimates[job.name] = self.estimates[job.name].observe(job.config.gpu_type, observation)
