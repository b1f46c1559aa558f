"""Discrete-time, round-based replay of a workload on a cluster, wiring the cores directly.

Four small things, kept apart: the clock (rounds of `settings.round_s`), the cluster state (each
job's placement, progress and counters: `SimJob`), the policy (any `Policy`, by name), and the
metrics (`sim.results`). Every round:

1. jobs whose submit time has come join the queue;
2. on a policy round, the estimator's goodput matrix is evaluated for the active jobs, the policy
   decides, the placer (or the policy itself) picks physical GPUs, and every job whose placement
   changed pays its restart delay; adaptive jobs re-tune (m, s) with their own model;
3. every running job advances through the round at its true goodput, epoch by epoch (efficiency
   changes at epoch boundaries), and reports the configuration it ran to its estimator.

The scheduler sees what a real one would: 1-GPU profiles per type, the iteration times of the
configurations a job actually ran, and the job's gradient statistics (as in the peers' simulators,
the true ones of its current epoch).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

from services.estimator.core import JobEstimate, JobModels
from services.placer.core import place
from services.policy.base import JobView, Policy, RoundState
from shared.cluster import Cluster, Config, Spots
from shared.goodput import BatchLimits, Observation, split_batch
from shared.reference import WorkloadJob
from shared.schema import Profile
from sim.settings import SimSettings
from sim.truth import ModelTruth

FEEDBACK_ITERATIONS = 1      # default k for "time to the first k iterations"


@dataclass
class SimJob:
    """One job as the simulated cluster knows it."""

    spec: WorkloadJob
    truth: ModelTruth
    estimate: JobEstimate
    rigid: tuple[int, int] | None              # (GPUs, batch) a rigid model always runs at
    progress: float = 0.0
    iterations: float = 0.0
    finish_s: float | None = None
    feedback_s: float | None = None            # when the first k iterations were done
    placement: Spots = ()
    config: Config | None = None
    m: int = 0
    s: int = 0
    restarts: int = 0
    started: bool = False
    restart_left_s: float = 0.0
    slice_start: float = 0.0                   # iterations when the current placement began
    idle_since_s: float | None = None          # when it last stopped running (None while running)
    gpu_seconds: float = 0.0
    attained_by_type: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    max_gpus_seen: int = 0
    _models: tuple[JobEstimate, dict] | None = None     # the estimate's models, computed once per update

    @property
    def name(self) -> str:
        return self.spec.name

    def type_models(self) -> dict:
        if self._models is None or self._models[0] is not self.estimate:
            self._models = (self.estimate, self.estimate.models())
        return self._models[1]


def gpus_per_node(spots: Spots) -> list[int]:
    return [g for _, g in spots]


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
        self.jobs = [self._job(spec, truths[spec.application], profiles) for spec in workload]
        self.rounds: list[RoundRecord] = []
        self.events: list[str] = []

    def _job(self, spec: WorkloadJob, truth: ModelTruth, profiles) -> SimJob:
        usable = [t for t in self.cluster.gpu_types if t in truth.types]
        if not usable:
            raise ValueError(f"job {spec.name}: model {spec.application} has no profile on any GPU type of "
                             f"cluster {self.cluster.name}")
        estimate = JobEstimate.build({t: profiles(spec.application, t) for t in usable})
        return SimJob(spec, truth, estimate, self.settings.rigid.get(spec.application))

    # --- the clock ------------------------------------------------------------------------

    def run(self, progress: Callable[[float, int, int], None] | None = None) -> None:
        step = self.settings.round_s
        waiting = deque(sorted(self.jobs, key=lambda j: (j.spec.time, j.name)))
        active: list[SimJob] = []
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

    # --- the policy and the placer -------------------------------------------------------------

    def _limits(self, job: SimJob, gpu_type: str) -> tuple[int, int]:
        lo, hi = job.estimate.local_limits[gpu_type]
        cap = self.settings.max_local.get(job.spec.application)
        return (lo, min(hi, cap)) if cap else (lo, hi)

    def _job_models(self, job: SimJob) -> JobModels:
        # The statistics the job reports: measured at the batch it runs (M0 before it ever ran).
        batch = job.config.gpus * job.m * (job.s + 1) if job.placement and job.m else job.truth.init_batch
        sqr, var = job.truth.stats(job.progress, batch)
        fixed_gpus, fixed_batch = job.rigid or (None, None)
        return JobModels(
            job_id=job.name,
            params=job.type_models(),
            local_limits={t: self._limits(job, t) for t in job.estimate.profiles},
            init_batch=job.truth.init_batch,
            max_batch=job.truth.max_batch,
            grad_sqr=sqr,
            grad_var=var,
            min_gpus=fixed_gpus or 1,
            max_gpus_seen=job.max_gpus_seen,
            fixed_gpus=fixed_gpus,
            fixed_batch=fixed_batch,
        )

    def _view(self, job: SimJob, now: float) -> JobView:
        spec = job.spec
        return JobView(
            job_id=job.name, model=spec.application, submit_s=spec.time, age_s=now - spec.time,
            restarts=job.restarts, restart_cost_s=self.settings.restart_estimate(spec.application),
            attained_gpu_s=job.gpu_seconds, attained_by_type=dict(job.attained_by_type),
            current=job.config, placement=job.placement, mid_restart=job.restart_left_s > 0,
            requested_gpus=job.rigid[0] if job.rigid else spec.num_replicas,
            requested_batch=job.rigid[1] if job.rigid else spec.batch_size,
            models=self._job_models(job),
            iterations=job.iterations,
            slice_iterations=job.iterations - job.slice_start if job.placement else 0.0,
            idle_since_s=None if job.placement else (spec.time if job.idle_since_s is None else job.idle_since_s),
        )

    def _decide(self, now: float, active: list[SimJob]) -> None:
        start = time.perf_counter()
        views = tuple(self._view(j, now) for j in active)
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
            self._apply(job, tuple(placements.get(job.name, ())), view.models, now)
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

    def _apply(self, job: SimJob, spots: Spots, models: JobModels, now: float) -> None:
        if spots != job.placement:
            if spots:
                job.restarts += job.started          # the first start is not a restart
                job.started = True
                job.restart_left_s = self.settings.restart_delay(job.spec.application)
                job.slice_start = job.iterations
            else:
                job.idle_since_s = now
            job.placement, job.config = spots, self.cluster.config_of(spots)
        if not spots:
            job.m = job.s = 0
            return
        cfg = job.config
        job.max_gpus_seen = max(job.max_gpus_seen, cfg.gpus)
        lo, hi = models.local_limits[cfg.gpu_type]
        if job.rigid or not self.policy.adaptive_batch:
            # The requested batch, split into micro-batches that fit; never past the model's largest batch.
            batch = min(job.rigid[1] if job.rigid else job.spec.batch_size, models.max_batch)
            job.m, job.s = split_batch(batch, cfg.gpus, hi)
            job.m = max(min(job.m, models.max_batch // (cfg.gpus * (job.s + 1))), 1)
            return
        limits = BatchLimits(models.init_batch, models.max_batch, lo, hi)
        current = (job.m, job.s) if job.m else None
        _, job.m, job.s = models.model(cfg.gpu_type).retune(cfg.nodes, cfg.gpus, limits, current,
                                                            self.settings.retune_threshold)
        if job.m == 0:      # no batch fits this allocation: run the smallest one that does
            job.m, job.s = split_batch(models.init_batch, cfg.gpus, hi)
            job.m = max(job.m, lo)

    # --- the jobs' true progress ----------------------------------------------------------------

    def _advance(self, job: SimJob, now: float, step: float) -> None:
        if not job.placement:
            return
        cfg = job.config
        delay = min(job.restart_left_s, step)
        job.restart_left_s -= delay
        run = step - delay
        used = delay
        if run > 0:
            truth = job.truth
            t_iter, t_compute = truth.types[cfg.gpu_type].iteration_time(gpus_per_node(job.placement), job.m, job.s)
            job.estimate = job.estimate.observe(cfg.gpu_type, Observation(cfg.nodes, cfg.gpus, job.m, job.s,
                                                                          t_iter, t_compute))
            batch = cfg.gpus * job.m * (job.s + 1)
            factor = self.settings.goodput_factor(job.spec.application)
            steps_per_s = factor / t_iter
            elapsed = 0.0
            while elapsed < run:
                rate = truth.efficiency(job.progress, batch) * batch / truth.init_batch * steps_per_s
                boundary = truth.boundaries[truth.epoch(job.progress)]
                dt = min(max(boundary - job.progress, 0.0) / rate, run - elapsed)
                before = job.iterations
                job.progress = boundary if dt < run - elapsed else job.progress + rate * dt
                job.iterations += steps_per_s * dt
                if job.feedback_s is None and job.iterations >= self.feedback_iterations:
                    job.feedback_s = now + used + elapsed + (self.feedback_iterations - before) / steps_per_s
                elapsed += dt
                if job.progress >= truth.total_progress * (1 - 1e-12):
                    job.finish_s = now + used + elapsed
                    break
            used += elapsed
        job.gpu_seconds += cfg.gpus * used
        job.attained_by_type[cfg.gpu_type] += cfg.gpus * used
