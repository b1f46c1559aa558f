"""The simulated cluster's jobs: what a simulated executor runs in place of real training.

A `SimulatedJob` is a job's true state on its GPUs: placement, progress, counters. It reports
`JobFacts` (what a real executor knows and tells the scheduler), applies a placement (paying its
restart delay when it moves and re-tuning its batch size), and advances through a round at its
true goodput, returning the iteration time it measured, as an executor reports it to the estimator.

A hybrid-parallel job runs data-parallel replicas of a fixed model-parallel group of GPUs per type
(`group_gpus`): it tunes and reports in replicas (batch = replicas x m x (s + 1), m per replica),
and refuses a placement that splits a group across nodes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import msgspec

from goodput_train.goodput import BatchLimits, Observation, Retune, retune_all, split_batch
from services.simulated.truth import ModelTruth
from shared.cluster import Cluster, replica_count
from shared.lifecycle import JobState, check_transition, job_state
from shared.schema.base import Config, Spots
from shared.schema.jobs import CANCELLED, JobSpec
from shared.schema.nodes import ALIVE, NodeStatus, NodeStatuses
from shared.schema.records import JobRecord
from shared.schema.rounds import ApplyRequest, JobFacts, JobModels, Reclaim
from shared.subjects import DEFAULT_TEAM
from shared.submissions import named_types
from shared.waits import Needs, behind, free_reason, needs_of, unplaced_reason, unschedulable
from sim.reference import WorkloadJob

# A job's record keeps its last this many reclaims (who took GPUs back from it, and when).
KEPT_RECLAIMS = 8


class SimulatedJob(msgspec.Struct):
    """A job's whole state on the simulated cluster: plain data (so it can be kept in KV); its true
    behaviour, `ModelTruth`, is passed in where it is needed."""

    spec: WorkloadJob
    rigid: tuple[int, int] | None  # (GPUs, batch) a rigid model always runs at
    restart_delay_s: float  # what a checkpoint-restart really costs this job
    goodput_factor: float  # calibration: true goodput is multiplied by this
    progress: float = 0.0
    iterations: float = 0.0
    finish_s: float | None = None
    feedback_s: float | None = None  # when the first k iterations were done
    placement: Spots = ()
    config: Config | None = None
    m: int = 0
    s: int = 0
    restarts: int = 0
    started: bool = False
    restart_left_s: float = 0.0
    slice_start: float = 0.0  # iterations when the current placement began
    idle_since_s: float | None = None  # when it last stopped running (None while running)
    gpu_seconds: float = 0.0
    attained_by_type: dict[str, float] = {}
    max_gpus_seen: int = 0
    advanced_to: float | None = None  # the virtual time it has been run up to
    estimate_revision: int = 0  # the estimator's record after the last report it took
    live: bool = False  # submitted live: it arrives at the live round that first sees it
    group_gpus: dict[str, int] = {}  # hybrid-parallel: GPUs of one replica per type (absent: 1)
    failure: str | None = None  # why it ended without finishing
    min_gpus: int = 1  # the fewest GPUs its submission allows
    gpu_types: tuple[str, ...] = ()  # the types its submission names (none: any it has a profile on)
    cancelled: bool = False  # its user cancelled it (its failure says so)
    trace: str = ""  # its submission's traceparent
    ended_in: float | None = None  # the round (its now_s) that was told it failed
    unfit: str | None = None  # why the cluster cannot take it (shared/waits.py), if it cannot
    borrowed: int = 0  # of its GPUs, those beyond its team's guarantee (the last round's word)
    reclaims: tuple[Reclaim, ...] = ()  # the last times it was shrunk or stopped for another team
    # Where its time went, for the simulator's JCT decomposition (sim.decompose): when it first trained
    # (its first start's delay paid), the restarts it paid after that, and per GPU type and epoch
    # the progress it made there and the seconds it took.
    first_run_s: float | None = None
    restart_s: float = 0.0
    ran: dict[str, tuple[float, float]] = {}

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def replicas(self) -> int:
        """Data-parallel replicas of its placement (0 while waiting)."""
        if not self.placement:
            return 0
        group = self.group_gpus.get(self.config.gpu_type, 1)
        count = replica_count((g for _, g in self.placement), group)
        if not count:
            raise RuntimeError(
                f"job {self.name}: placement {self.placement} splits its model-parallel groups of {group} GPUs"
            )
        return count

    @property
    def batch(self) -> int:
        """Its total batch: replicas x m x (s + 1)."""
        return self.replicas * self.m * (self.s + 1)

    @property
    def state(self) -> JobState:
        """Its place in the lifecycle (it exists once the profiler accepted it)."""
        return job_state(
            finished=self.finish_s is not None,
            cancelled=self.cancelled,
            failed=bool(self.failure),
            profiled=True,
            placed=bool(self.placement),
            fits=self.unfit is None,
        )

    def record(self) -> JobRecord:
        state = self.state
        return JobRecord(
            self.spec.name,
            self.spec.application,
            self.spec.time,
            None if self.finish_s is None else float(self.finish_s),
            self.restarts,
            float(self.gpu_seconds),
            None if self.feedback_s is None else float(self.feedback_s),
            self.placement,
            self.failure,
            state=state,
            gpu_type=self.config.gpu_type if state == JobState.RUNNING else None,
            batch=self.batch if state == JobState.RUNNING else None,
            reason=self.unfit if state == JobState.UNSCHEDULABLE else None,
            team=self.spec.team,
            borrowed=self.borrowed if self.placement else 0,
            reclaims=self.reclaims,
        )

    def facts(self, truth: ModelTruth, now: float) -> JobFacts:
        spec = self.spec
        # Gradient statistics as the job measures them: at the batch it runs (M0 before it ever ran).
        batch = self.batch if self.placement and self.m else truth.init_batch
        sqr, var = truth.stats(self.progress, batch)
        return JobFacts(
            job_id=spec.name,
            application=spec.application,
            submit_s=spec.time,
            age_s=now - spec.time,
            requested_gpus=self.rigid[0] if self.rigid else spec.num_replicas,
            requested_batch=self.rigid[1] if self.rigid else spec.batch_size,
            rigid=self.rigid is not None,
            init_batch=truth.init_batch,
            max_batch=truth.max_batch,
            min_gpus=self.min_gpus,
            restarts=self.restarts,
            attained_gpu_s=float(self.gpu_seconds),
            attained_by_type={t: float(v) for t, v in self.attained_by_type.items()},
            placement=self.placement,
            mid_restart=self.restart_left_s > 0,
            iterations=self.iterations,
            slice_iterations=self.iterations - self.slice_start if self.placement else 0.0,
            idle_since_s=None if self.placement else (spec.time if self.idle_since_s is None else self.idle_since_s),
            max_gpus_seen=self.max_gpus_seen,
            grad_sqr=sqr,
            grad_var=var,
            epochs=truth.epochs(self.progress),
            target_epochs=spec.target_epochs,
            epoch_samples=truth.epoch_samples(self.progress),
            estimate_revision=self.estimate_revision,
            trace=self.trace,
            team=spec.team,
            priority=spec.priority,
        )

    def apply(
        self, cluster: Cluster, spots: Spots, models: JobModels, adaptive: bool, now: float, retune_threshold: float
    ) -> None:
        """Take a placement: a changed one costs a checkpoint-restart; then choose (m, s) for it."""
        question = self.place(cluster, spots, models, adaptive, now)
        if question is not None:
            self.choose(question, *question.retune(retune_threshold)[1:])

    def place(
        self, cluster: Cluster, spots: Spots, models: JobModels | None, adaptive: bool, now: float
    ) -> Retune | None:
        """`apply` up to the batch: a rigid or fixed-batch job's is chosen here, an adaptive job's by
        its model (the question returned, for `choose` with its answer: `SimulatedExecutors.apply`
        asks them all at once). `models`: needed only with `spots`."""
        if spots and models is None:
            raise ValueError("placed without its models")
        if spots != self.placement:
            if spots:
                self.restarts += self.started  # the first start is not a restart
                self.started = True
                self.restart_left_s = self.restart_delay_s
                self.slice_start = self.iterations
            else:
                self.idle_since_s = now
            self.placement, self.config = spots, cluster.config_of(spots)
        if not spots:
            self.m = self.s = 0
            return None
        cfg, replicas = self.config, self.replicas
        self.max_gpus_seen = max(self.max_gpus_seen, replicas)
        lo, hi = models.local_limits[cfg.gpu_type]
        if self.rigid or not adaptive:
            # The requested batch, split into micro-batches that fit; never past the model's largest batch.
            batch = min(self.rigid[1] if self.rigid else self.spec.batch_size, models.max_batch)
            self.m, self.s = split_batch(batch, replicas, hi)
            self.m = max(min(self.m, models.max_batch // (replicas * (self.s + 1))), 1)
            return None
        limits = BatchLimits(models.init_batch, models.max_batch, lo, hi)
        return Retune(models.model(cfg.gpu_type), cfg.nodes, replicas, limits, (self.m, self.s) if self.m else None)

    def cannot_apply(self, error: Exception) -> None:
        self.failure = f"its placement could not be applied: {type(error).__name__}: {error}"
        self.placement, self.config, self.m, self.s = (), None, 0, 0

    def choose(self, question: Retune, m: int, s: int) -> None:
        """The (m, s) its model chose for its question; the smallest batch that fits if none does."""
        self.m, self.s = m, s
        if self.m == 0:
            self.m, self.s = split_batch(question.limits.init_batch, question.gpus, question.limits.max_local)
            self.m = max(self.m, question.limits.min_local)

    def advance(
        self, truth: ModelTruth, now: float, step: float, feedback_iterations: int, slowdown: float = 0.0
    ) -> Observation | None:
        """Run for `step` seconds from `now`, epoch by epoch, `slowdown` slower than its configuration
        runs alone (interference); the configuration's iteration time, or None when the job did not
        train (waiting, or restarting the whole round)."""
        self.advanced_to = now + step
        if not self.placement:
            return None
        cfg = self.config
        delay = min(self.restart_left_s, step)
        self.restart_left_s -= delay
        run = step - delay
        used = delay
        observation = None
        if self.first_run_s is not None:
            self.restart_s += delay
        elif run > 0:
            self.first_run_s = now + delay
        if run > 0:
            t_iter, t_compute = truth.types[cfg.gpu_type].iteration_time([g for _, g in self.placement], self.m, self.s)
            observation = Observation(cfg.nodes, self.replicas, self.m, self.s, t_iter, t_compute)
            batch = self.batch
            steps_per_s = self.goodput_factor * (1.0 - slowdown) / t_iter
            elapsed = 0.0
            while elapsed < run:
                epoch = truth.epoch(self.progress)
                rate = truth.efficiency_in(epoch, batch) * batch / truth.init_batch * steps_per_s
                boundary = float(truth.boundaries[epoch])
                dt = min(max(boundary - self.progress, 0.0) / rate, run - elapsed)
                before, done = self.iterations, self.progress
                self.progress = boundary if dt < run - elapsed else self.progress + rate * dt
                key = ran_key(cfg.gpu_type, epoch)
                work, seconds = self.ran.get(key, (0.0, 0.0))
                self.ran[key] = (work + self.progress - done, seconds + dt)
                self.iterations += steps_per_s * dt
                if self.feedback_s is None and self.iterations >= feedback_iterations:
                    self.feedback_s = now + used + elapsed + (feedback_iterations - before) / steps_per_s
                elapsed += dt
                if self.progress >= truth.total_progress * (1 - 1e-12):
                    self.finish_s = now + used + elapsed
                    break
            used += elapsed
        self.gpu_seconds += cfg.gpus * used
        self.attained_by_type[cfg.gpu_type] = self.attained_by_type.get(cfg.gpu_type, 0.0) + cfg.gpus * used
        return observation


def ran_key(gpu_type: str, epoch: int) -> str:
    """`SimulatedJob.ran`'s key of a stretch on `gpu_type` in `epoch`."""
    return f"{gpu_type}|{epoch}"


class SubmittedJob(msgspec.Struct):
    """What the simulated executors keep of a submission (KV): its spec until the profiler's
    verdict, then the reason it was refused, or the job it became."""

    job_id: str  # "" for a refused submission whose id could not be read
    spec: JobSpec | None = None  # None: its submission could not be read
    rejected: str | None = None
    job: SimulatedJob | None = None
    submission: int = 0  # its stream sequence: the verdicts on it name it
    trace: str = ""  # its submission's traceparent (else its verdict's)
    cancelled: bool = False  # cancelled before the profiler's verdict: it never starts
    seen: int = 0  # the stream sequence it was first read from: listed in that order
    application: str = ""  # a refused submission's, when it could be read (spec: None)
    owner: str = ""  # the login that submitted it ("": the operator's)
    team: str = DEFAULT_TEAM  # a refused submission's login's team (spec: its own)

    @property
    def state(self) -> JobState:
        """Its job's state, or before the profiler's acceptance: profiling, rejected or cancelled."""
        if self.job is not None:
            return self.job.state
        return job_state(
            finished=False, cancelled=self.cancelled, failed=bool(self.rejected), profiled=False, placed=False
        )

    def record(self) -> JobRecord:
        if self.job is not None:
            return msgspec.structs.replace(self.job.record(), owner=self.owner)
        spec = self.spec
        state = self.state
        return JobRecord(
            self.job_id,
            spec.application if spec else self.application,
            math.nan,
            None,
            0,
            0.0,
            None,
            failure=CANCELLED if self.cancelled else self.rejected,
            state=state,
            team=(spec.team if spec else self.team) or DEFAULT_TEAM,
            owner=self.owner,
        )


def as_workload_job(spec: JobSpec, truth: ModelTruth) -> WorkloadJob:
    """A submission as the simulated cluster runs it: its request, the batch M0 per GPU unless it
    names one; one without submit_s arrives when a live round first sees it (time inf until then)."""
    batch = spec.requested_batch or truth.init_batch * spec.requested_gpus
    return WorkloadJob(
        spec.id,
        math.inf if spec.submit_s is None else spec.submit_s,
        spec.application,
        spec.requested_gpus,
        batch,
        spec.team or DEFAULT_TEAM,
        spec.priority,
        spec.target_epochs,
    )


def request_observations(spec: WorkloadJob, truth: ModelTruth, cluster: Cluster) -> list[tuple[str, Observation]]:
    """What profiling a job at its request measures on each GPU type of the cluster it runs on
    (Gavel's profiled throughput matrix; `SimSettings.profile_request`): its requested GPUs and batch
    on the fewest nodes of the type that hold them, the batch split into accumulation steps that fit
    the type's largest per-GPU batch (as the rigid policies run it). Nothing for a one-GPU request
    (its profile has it), on a type with fewer GPUs than the request, or for a hybrid-parallel job."""
    gpus = spec.num_replicas
    if gpus < 2 or truth.group_gpus:
        return []
    measured = []
    for gpu_type in cluster.gpu_types:
        if gpu_type not in truth.types or cluster.capacity(gpu_type) < gpus:
            continue
        per_node = cluster.gpus_per_node(gpu_type)
        nodes = math.ceil(gpus / per_node)
        placement = [per_node] * (nodes - 1) + [gpus - per_node * (nodes - 1)]
        m, s = split_batch(spec.batch_size, gpus, truth.local_limits[gpu_type][1])
        t_iter, t_compute = truth.types[gpu_type].iteration_time(placement, m, s)
        measured.append((gpu_type, Observation(nodes, gpus, m, s, t_iter, t_compute)))
    return measured


class SimulatedExecutors:
    """The executors of a simulated cluster: every job's `SimulatedJob`, in submission order.
    Its jobs' moves, one method each: `apply` (queued <-> running; -> failed), `advance` (running ->
    finished), `cancel` (queued or running -> cancelled)."""

    def __init__(self, cluster: Cluster, settings, feedback_iterations: int):
        self.cluster = cluster
        self.settings = settings  # shared.settings.SimSettings: the world's restart delays, calibration
        self.feedback_iterations = feedback_iterations
        self.jobs: dict[str, SimulatedJob] = {}
        self.truths: dict[str, ModelTruth] = {}
        self.order: dict[str, int] = {}  # each job's place in `jobs`
        self.team_waits: dict[str, str] = {}  # the last round's jobs waiting on their team's limits, and why

    def add(self, spec: WorkloadJob, truth: ModelTruth, rigid: bool = False) -> list[str]:
        """Start tracking a submitted job (again: nothing changes); the GPU types it can run on here.
        A `rigid` one runs at exactly its request (GPUs and batch), like a rigid model of the calibration."""
        usable = [t for t in self.cluster.gpu_types if t in truth.types]
        if not usable:
            raise ValueError(
                f"job {spec.name}: model {spec.application} has no profile on any GPU type of "
                f"cluster {self.cluster.name}"
            )
        if spec.name not in self.jobs:
            model, settings = spec.application, self.settings
            fixed = (spec.num_replicas, spec.batch_size) if rigid else settings.rigid.get(model)
            self.restore(
                SimulatedJob(
                    spec,
                    fixed,
                    settings.restart_delay(model),
                    settings.goodput_factor(model),
                    group_gpus=dict(truth.group_gpus),
                ),
                truth,
            )
        return usable

    def submit(self, spec: JobSpec, truth: ModelTruth) -> list[str]:
        """A submission the profiler accepted, as `add` takes it (`as_workload_job`), `rigid` as a
        real job reports it; one without submit_s is live (it arrives at the live round that first
        sees it)."""
        usable = self.add(as_workload_job(spec, truth), truth, rigid=spec.rigid)
        job = self.jobs[spec.id]
        job.live, job.min_gpus = spec.submit_s is None, spec.min_gpus
        job.gpu_types = tuple(named_types(spec, self.cluster)[0])
        self.judge(job)
        return usable

    def restore(self, job: SimulatedJob, truth: ModelTruth) -> None:
        self.jobs[job.name] = job
        self.order.setdefault(job.name, len(self.order))
        self.truths[job.name] = truth
        self.judge(job)

    def judge(self, job: SimulatedJob) -> None:
        """Whether the cluster, which does not change, can ever take the job (a rigid job of 3 GPUs
        on nodes of 4 cannot); a hybrid-parallel job's counts are replicas, left to the policy."""
        if not job.group_gpus:
            job.unfit = unschedulable(self._needs(job), self.cluster.nodes)

    def _needs(self, job: SimulatedJob) -> Needs:
        """A job's needs on the types it may run on (profiled and named): a rigid one's GPUs exactly,
        else its minimum."""
        truth = self.truths[job.name]
        types = [t for t in self.cluster.gpu_types if t in truth.types and (not job.gpu_types or t in job.gpu_types)]
        gpus = job.rigid[0] if job.rigid else job.min_gpus
        return needs_of(gpus, gpus, job.rigid is not None, types)

    def node_statuses(self) -> NodeStatuses:
        """Each node of the cluster, alive, with the jobs running there."""
        on: dict[str, list[str]] = defaultdict(list)
        for name, job in self.jobs.items():
            if job.state == JobState.RUNNING:
                for node, _ in job.placement:
                    on[node].append(name)
        return NodeStatuses(
            tuple(NodeStatus(n.name, n.gpu_type, n.gpus, ALIVE, tuple(on[n.name])) for n in self.cluster.nodes)
        )

    def waits(self) -> dict[str, str]:
        """Why each queued job waits (shared/waits.py): what is free around the running jobs, behind
        the queued jobs submitted before it."""
        held = {name: job.placement for name, job in self.jobs.items() if job.state == JobState.RUNNING}
        queued = [job for job in self.jobs.values() if job.state == JobState.QUEUED]
        queued.sort(key=lambda job: (job.spec.time, self.order[job.name]))
        said: dict[Needs, str] = {}  # the same for every job of the same needs: thousands queue
        reasons = {}
        for ahead, job in enumerate(queued):
            if job.name in self.team_waits:
                reasons[job.name] = self.team_waits[job.name]
                continue
            if job.group_gpus:  # its counts are replicas: what fits is the policy's to say
                reasons[job.name] = unplaced_reason(ahead)
                continue
            needs = self._needs(job)
            if needs not in said:
                said[needs] = free_reason(needs, self.cluster.nodes, held)
            reasons[job.name] = said[needs] + behind(ahead)
        return reasons

    def facts(self, now: float, names) -> list[JobFacts]:
        return [self.jobs[name].facts(self.truths[name], now) for name in names]

    def apply(self, request: ApplyRequest) -> set[str]:
        """Take a round's placements. A job already run past `now` ignores them: a late or repeated
        apply (a deposed leader's, a duplicate on the bus) must not undo a newer round's. A job the
        round gave up on, or whose placement cannot be taken, fails with the reason; the others go on.
        The jobs it may have changed: not those that wait and go on waiting (thousands a round)."""
        now = request.now_s
        self.team_waits = dict(request.waits)
        touched = set(request.failed)
        for name, reason in request.failed.items():
            job = self.jobs.get(name)
            if job is not None and job.finish_s is None and job.failure is None:
                before = job.state
                job.failure, job.placement, job.config = reason, (), None
                check_transition(before, job.state, name)
            if job is not None and job.failure is not None and job.ended_in is None:
                job.ended_in = now  # the round has heard of it: it leaves the live jobs
        questions: dict[str, tuple[Retune, JobState]] = {}
        for name in request.decided:
            job = self.jobs.get(name)
            if job is None or job.failure or (job.advanced_to is not None and job.advanced_to > now + 1e-9):
                continue
            if not job.placement and not request.placements.get(name) and name not in request.reclaims:
                continue  # it waits and goes on waiting: nothing to take (a waiting job borrows nothing)
            touched.add(name)
            before = job.state
            question = None
            try:
                placement = tuple(request.placements.get(name, ()))
                question = job.place(self.cluster, placement, request.models.get(name), request.adaptive, now)
            except Exception as error:  # noqa: BLE001 - one job's bad placement is that job's failure
                job.cannot_apply(error)
            if question is not None:
                questions[name] = (question, before)  # its batch is chosen with the others', then its state checked
            else:
                check_transition(before, job.state, name)
            job.borrowed = request.borrowed.get(name, 0)
            reclaim = request.reclaims.get(name)
            if reclaim is not None and reclaim not in job.reclaims:  # an apply asked twice records it once
                job.reclaims = (*job.reclaims, reclaim)[-KEPT_RECLAIMS:]
        self._choose_batches(questions)
        return touched

    def _choose_batches(self, questions: dict[str, tuple[Retune, JobState]]) -> None:
        """The adaptive jobs' batches, all chosen at once (`retune_all`: thousands of jobs a round);
        should that fail, each alone, so that one job's trouble stays its own."""
        threshold = self.settings.retune_threshold
        try:
            answers = retune_all([question for question, _ in questions.values()], threshold)
        except Exception:  # noqa: BLE001 - asked again one by one below
            answers = [None] * len(questions)
        for (name, (question, before)), answer in zip(questions.items(), answers):
            job = self.jobs[name]
            try:
                job.choose(question, *(answer or question.retune(threshold))[1:])
            except Exception as error:  # noqa: BLE001 - one job's bad model is that job's failure
                job.cannot_apply(error)
            check_transition(before, job.state, name)

    def cancel(self, name: str) -> bool:
        """End a job that has not ended, as its user asked: it leaves its GPUs at once."""
        job = self.jobs.get(name)
        if job is None or job.finish_s is not None or job.failure is not None:
            return False
        before = job.state
        job.failure, job.cancelled, job.placement, job.config = CANCELLED, True, (), None
        check_transition(before, job.state, name)
        return True

    def failures(self, names, now: float | None = None) -> dict[str, str]:
        """The jobs among `names` that failed, and why (the round at `now` is told: `ended_in`)."""
        failed = {name: self.jobs[name].failure for name in names if name in self.jobs and self.jobs[name].failure}
        for name in failed:
            if now is not None and self.jobs[name].ended_in is None:
                self.jobs[name].ended_in = now
        return failed

    def arrive(self, now: float) -> list[str]:
        """Live jobs not yet arrived arrive now; every live job not finished, in arrival order."""
        for job in self.jobs.values():
            if job.live and job.spec.time == math.inf:
                job.spec = dataclasses.replace(job.spec, time=now)
        # A job that failed (or was cancelled) between rounds stays until a round has been told of it.
        live = [
            job
            for job in self.jobs.values()
            if job.live
            and job.finish_s is None
            and (job.failure is None or job.ended_in is None or job.ended_in >= now)
        ]
        return [job.name for job in sorted(live, key=lambda j: (j.spec.time, j.name))]

    def interfered(self, names) -> set[str]:
        """The distributed jobs among `names` that share a node with another distributed job."""
        if not self.settings.interference:
            return set()
        distributed = [name for name in names if len(self.jobs[name].placement) > 1]
        holders = defaultdict(list)
        for name in distributed:
            for node, _ in self.jobs[name].placement:
                holders[node].append(name)
        return {name for jobs in holders.values() if len(jobs) > 1 for name in jobs}

    def advance(self, now: float, step: float, names) -> tuple[list[str], list[tuple[str, str, Observation]]]:
        """Run the jobs `names` (submitted, unfinished) for the round [now, now + step): (jobs that
        finished in it, (job, type, observation) for each job that trained). Asking again for the
        same round runs only the jobs not run yet, so a round is never run twice."""
        finished, observed = [], []
        names = set(names).intersection(self.jobs)
        interfered = self.interfered(names)
        for name in sorted(names, key=self.order.__getitem__):  # in submission order, as `jobs` holds them
            job = self.jobs[name]
            if job.spec.time > now:
                continue
            if (
                job.finish_s is None
                and job.failure is None
                and (job.advanced_to is None or job.advanced_to < now + step)
            ):
                slowdown = self.settings.interference if name in interfered else 0.0
                before = job.state
                observation = job.advance(self.truths[name], now, step, self.feedback_iterations, slowdown)
                check_transition(before, job.state, name)
                if observation is not None:
                    observed.append((name, job.config.gpu_type, observation))
            if job.finish_s is not None and now < job.finish_s <= now + step:
                finished.append(name)
        return finished, observed
