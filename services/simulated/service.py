"""The simulated executors as the executor service: `python -m services.simulated` (what `goodput up`,
`goodput simulate --bus nats` and the manifests' simulated cluster run in place of node agents).

The jobs of a simulated cluster run here on a virtual clock (`services.simulated.world`). They come from the jobs
stream, read in order by one durable consumer: a submission, then the profiler's verdict on it. A
job enters the rounds only once the profiler accepted it (`Profiled`: its profiles are with the
estimator); one it refused is kept with the reason, so `goodput status` shows it. The service
answers the policy leader's round — the jobs' facts, the placements to apply, a round to advance,
after which it reports every configuration a job ran to the estimator — and the status requests.
Every submission's state is written to KV before a request is answered (what a failed attempt left
unwritten, by the next), and before the events that changed it are acknowledged (a fetched batch's
together), so a restarted executor picks the cluster up where it was; a round asked
again runs only the jobs not yet run, and reports what the last attempt could not.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections import defaultdict
from typing import Iterable

import msgspec
from nats import micro

from services.simulated.truth import JobSources, job_sources
from services.simulated.world import SimulatedExecutors, SubmittedJob, as_workload_job, request_observations
from shared import executor_endpoints as endpoints
from shared import storage, subjects
from shared.bus import Bus
from shared.bus.kv import TypedKV
from shared.cluster import load_cluster
from shared.lifecycle import JobState, check_transition
from shared.metrics import JOB_RESTARTS, JOBS, instrument
from shared.schema.base import Ack
from shared.schema.estimates import Observed, ObservedAll
from shared.schema.jobs import Cancel, JobSpec, Profiled, Rejected, verdict_for
from shared.schema.nodes import NodeStatuses
from shared.schema.records import JobRecord, apart_key
from shared.schema.rounds import AdvanceReply, AdvanceRequest, ApplyRequest, FactsReply, LiveJobs, LiveJobsRequest
from shared.settings import FEEDBACK_ITERATIONS, simulation_settings

log = logging.getLogger(__name__)

SAVED_AT_ONCE = 256  # KV writes of the jobs' states in flight at once
SNAPSHOT = msgspec.msgpack.Encoder()  # an entry as it was saved, to tell whether it changed since


def off_gpus(job) -> bool:
    """A job that waits for GPUs: a round moves only the time it was run to (`advanced_to`)."""
    return job is not None and not job.placement and job.finish_s is None and job.failure is None


def snapshot(entry: SubmittedJob) -> bytes:
    """An entry as KV must hold it, to tell whether it changed since it was written. A job that
    waits for GPUs is compared without the round it was run to, which every round moves: it is
    not written for that alone (thousands of queued jobs a round), and a restart takes the round
    run back from the jobs that were written (`load`)."""
    job = entry.job
    if not off_gpus(job) or job.advanced_to is None:
        return SNAPSHOT.encode(entry)
    advanced_to, job.advanced_to = job.advanced_to, None
    try:
        return SNAPSHOT.encode(entry)
    finally:
        job.advanced_to = advanced_to


EVENTS_AT_ONCE = 256  # events of the jobs stream taken in one fetch, saved together before they are acknowledged


def add_world_arguments(parser) -> None:
    """A simulated cluster's options, for the services that play it (executor, profiler, estimator)."""
    parser.add_argument("--cluster", default="sia-hetero-64", help="cluster preset or YAML/JSON file")
    parser.add_argument("--reference", help="reference folder for the jobs' true behaviour")
    parser.add_argument("--zoo", action="store_true", help="the built-in model zoo as the jobs' true behaviour")
    parser.add_argument("--calibration", help="peer simulator calibration (default: the cluster's)")
    parser.add_argument("--feedback-iterations", type=int, default=FEEDBACK_ITERATIONS)
    parser.add_argument("--restart-delay", type=float, help="every job's checkpoint-restart delay, seconds")
    parser.add_argument(
        "--interference", type=float, default=0.0, help="distributed jobs sharing a node train this fraction slower"
    )
    parser.add_argument(
        "--profile-request",
        action="store_true",
        help="profile each job at its request on every type too (Gavel's throughput matrix)",
    )


def world_of(args) -> tuple[SimulatedExecutors, JobSources]:
    """The simulated executors and the jobs' truth that `add_world_arguments`' options describe."""
    settings = simulation_settings(
        args.calibration,
        args.cluster,
        args.restart_delay,
        interference=args.interference,
        profile_request=args.profile_request,
    )
    executors = SimulatedExecutors(load_cluster(args.cluster), settings, args.feedback_iterations)
    return executors, job_sources(args.reference, args.zoo)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_world_arguments(parser)


class SimulatedExecutorService:
    """The simulated executors' answers to the bus: every submission (`SubmittedJob`, kept in KV)
    and the jobs they became (`SimulatedExecutors`). A job's moves, one handler each:

    - `on_submitted`: a submission read -> profiling
    - `on_profiled`: profiling -> queued (rejected: no behaviour for it here, or no GPU type it runs on)
    - `on_rejected`: profiling -> rejected
    - `on_cancel`: profiling, queued or running -> cancelled
    - `on_apply` (a round's placements): queued <-> running; -> failed (the round gave up on it)
    - `on_advance` (a round run): running -> finished

    `facts`, `on_live`, `records` and `count` move no job. Every change is in KV before a request
    is answered (`save`)."""

    def __init__(self, bus: Bus, executors: SimulatedExecutors, sources: JobSources, states: TypedKV[SubmittedJob]):
        self.bus = bus
        self.executors = executors
        self.sources = sources
        self.states = states
        self.submitted: dict[str, SubmittedJob] = {}
        # One request at a time: a request asked again while the first is still being answered waits
        # for it, and then finds its work done.
        self.turn = asyncio.Lock()
        self.reporting = asyncio.Lock()  # one at a time reports the jobs' observations (`report`)
        self.dirty: set[str] = set()  # changed here, not yet in KV
        self.kept: dict[str, bytes] = {}  # each entry as last written to KV (or read from it)
        self.unreported: list[Observed] = []  # measured, not yet with the estimator
        # What the estimator has of each job, (type, nodes, GPUs, m, s): it learns a configuration
        # once (`Estimator.observe`), so a job's same configuration is not sent each round. Not
        # kept: a restarted executor tells it again, which changes nothing.
        self.told: dict[str, set[tuple]] = defaultdict(set)
        # Each submission's state as last saved, and how many are in each: goodput_jobs, kept as
        # entries change (every change is saved), never counted over all of them again.
        self.counted: dict[str, JobState] = {}
        self.by_state: dict[JobState, int] = dict.fromkeys(JobState, 0)

    async def load(self) -> None:
        """Take back what KV holds: the submissions, in the order they came, and their jobs."""
        states = self.states
        kept = [(key, entry.value) for key in await states.keys() if (entry := await states.get(key)) is not None]
        for key, value in sorted(kept, key=lambda item: item[1].seen):
            self.submitted[key] = value
            self.kept[key] = snapshot(value)
            if value.job is not None:
                self.executors.restore(value.job, self.sources.truths[value.job.spec.application])
            self.count_state(key)
        # A job waiting for GPUs was not written for each round run (`snapshot`): it was run to the
        # last round that ran, which every round's written jobs carry (one at least: `on_advance`).
        ran = max(
            (job.advanced_to for job in self.executors.jobs.values() if job.advanced_to is not None), default=None
        )
        for job in self.executors.jobs.values():
            if ran is not None and off_gpus(job) and (job.advanced_to is None or job.advanced_to < ran):
                job.advanced_to = ran
        self.record_states()

    async def save(self, names=()) -> None:
        """Write what changed (now, or in an attempt that failed half-way) to KV, SAVED_AT_ONCE
        writes in flight: a round moves thousands of jobs, each its own key. An entry named that is
        as KV holds it already (a queued job a round left queued) is not written again."""
        self.dirty.update(names)
        changed = []
        for name in sorted(self.dirty):
            entry = self.submitted[name]
            entry.job = self.executors.jobs.get(name)
            self.count_state(name)
            data = snapshot(entry)
            if self.kept.get(name) == data:
                self.dirty.discard(name)
            else:
                changed.append((name, data))
        for start in range(0, len(changed), SAVED_AT_ONCE):
            chunk = changed[start : start + SAVED_AT_ONCE]
            await asyncio.gather(*(self.states.put(name, self.submitted[name]) for name, _ in chunk))
            for name, data in chunk:
                self.kept[name] = data
                self.dirty.discard(name)
        self.record_states()

    def count_state(self, name: str) -> None:
        """Move the submission `name` to its state now in the count by state."""
        state, before = self.state_of(self.submitted[name]), self.counted.get(name)
        if state != before:
            if before is not None:
                self.by_state[before] -= 1
            self.by_state[state] += 1
            self.counted[name] = state

    def record_states(self) -> None:
        """goodput_jobs: every state's count, zeros included (a state that empties reads 0)."""
        jobs = instrument(JOBS)
        for state, count in self.by_state.items():
            jobs.set(count, {"state": state.value})

    def state_of(self, entry: SubmittedJob) -> JobState:
        """A submission's state: its job's as the executors hold it (in the entry once saved)."""
        job = self.executors.jobs.get(entry.job_id) if entry.spec is not None else None
        return job.state if job is not None else entry.state

    # ---- the jobs stream: each takes an event, and names the entry it changed ---------------

    def on_submitted(self, spec: JobSpec, sequence: int, trace: str, owner: str, _: str = "") -> str | None:
        known = self.submitted.get(spec.id)
        if known is not None and (known.job is not None or known.rejected is None):
            return None  # another submission holds the id (a refused one gives it up)
        self.submitted.pop(spec.id, None)  # a refusal it replaces: listed where this one came
        self.submitted[spec.id] = SubmittedJob(
            spec.id, spec, submission=sequence, trace=trace, seen=sequence, owner=owner
        )
        return spec.id

    def on_profiled(self, verdict: Profiled, _: int, trace: str, __: str, ___: str = "") -> str | None:
        entry = self.submitted.get(verdict.job_id)
        if entry is None or entry.spec is None:
            log.warning("job %s profiled, but its submission was never read here; ignored", verdict.job_id)
            return None
        if (
            entry.job is not None
            or entry.rejected is not None
            or entry.cancelled
            or not verdict_for(verdict.submission, entry.submission)
        ):
            return None
        before = self.state_of(entry)
        self._accept(entry, trace)
        check_transition(before, self.state_of(entry), entry.job_id)
        return entry.job_id

    def _accept(self, entry: SubmittedJob, trace: str) -> None:
        """The profiler accepted the submission: its job, or the reason it cannot run here."""
        spec = entry.spec
        truth = self.sources.truths.get(spec.application)
        if truth is None:
            entry.rejected = f"no simulated behaviour for application {spec.application!r} on this cluster"
            return
        try:
            self.executors.submit(spec, truth)  # live without submit_s; rigid as it asks
        except ValueError as error:
            entry.rejected = str(error)
        else:
            self.executors.jobs[spec.id].trace = entry.trace or trace

    def on_rejected(self, verdict: Rejected, sequence: int, _: str, owner: str, team: str = "") -> str | None:
        entry = self.submitted.get(verdict.job_id) if verdict.job_id is not None else None
        if entry is not None and verdict_for(verdict.submission, entry.submission):
            if entry.job is not None or entry.rejected is not None:
                return None  # it has its verdict (read again)
            before = self.state_of(entry)
            entry.rejected = verdict.reason
            check_transition(before, self.state_of(entry), entry.job_id)
            return entry.job_id
        # Any other refusal (of a body never stored, unreadable, another body under a held id) is kept
        # apart, under its place in the stream, for its sender to see: no job is touched by it, and a
        # submission stored under its id later takes the id whatever order the two came in.
        owner, team = endpoints.refused_whose(verdict.subject, owner, team)
        key = apart_key(sequence)
        self.submitted[key] = SubmittedJob(
            verdict.job_id or "",
            None,
            verdict.reason,
            seen=sequence,
            application=verdict.application or "",
            owner=owner,
            team=team,
        )
        return key

    def on_cancel(self, order: Cancel, _: int, __: str, ___: str, ____: str = "") -> str | None:
        entry = self.submitted.get(order.job_id)
        if entry is None or entry.rejected is not None or entry.cancelled:
            return None
        if entry.job is None:  # not yet profiled: it never starts
            before = self.state_of(entry)
            entry.cancelled = True
            check_transition(before, self.state_of(entry), order.job_id)
            return order.job_id
        return order.job_id if self.executors.cancel(order.job_id) else None

    async def measured_at_request(self, verdict: Profiled) -> int:
        """With --profile-request: the job's measurements at its request, to the estimator before
        the job is known here, so that its first round has them (as direct wiring adds them); the
        estimator's last revision, or 0."""
        entry = self.submitted.get(verdict.job_id)
        executors = self.executors
        if (
            not executors.settings.profile_request
            or entry is None
            or entry.spec is None
            or entry.job is not None
            or entry.rejected is not None
            or entry.cancelled
        ):
            return 0
        truth = self.sources.truths.get(entry.spec.application)
        measured = request_observations(as_workload_job(entry.spec, truth), truth, executors.cluster) if truth else []
        if not measured:
            return 0
        stored = await endpoints.report(
            self.bus, ObservedAll(tuple(Observed(verdict.job_id, gpu_type, seen) for gpu_type, seen in measured))
        )
        return max(stored.revisions)

    async def on_event(self, message: msgspec.Raw, delivery) -> None:
        """One event of the jobs stream taken; the entry it changed is saved with the rest of its
        batch (`save_events`), before any of them is acknowledged."""
        subject, team, owner = subjects.owner_of(delivery.subject)
        take, kind = EVENTS[subject]
        try:
            event = self.bus.decode(message, kind)
        except msgspec.DecodeError:
            return  # a malformed submission: the profiler's rejection of it follows
        async with self.turn:
            revision = await self.measured_at_request(event) if kind is Profiled else 0
            changed = take(self, event, delivery.stream_sequence, delivery.traceparent, owner, team)
            if revision and changed in self.executors.jobs:
                self.executors.jobs[changed].estimate_revision = revision
            if changed is not None:
                self.dirty.add(changed)

    async def save_events(self) -> None:
        """What a batch of events changed, to KV at once (then the batch is acknowledged)."""
        async with self.turn:
            await self.save()

    # ---- the round --------------------------------------------------------------------------

    def facts(self, now: float, names) -> FactsReply:
        known, held, failed = [], {}, {}
        executors = self.executors
        for name in names:
            entry = self.submitted.get(name)
            job = executors.jobs.get(name)
            if job is not None and job.failure is None:
                try:
                    known.append(job.facts(executors.truths[name], now))
                except Exception as error:  # noqa: BLE001 - a job whose facts cannot be made is that job's failure
                    failed[name] = f"its facts could not be made: {type(error).__name__}: {error}"
            elif job is not None:
                failed[name] = job.failure
            elif entry is not None and entry.rejected is not None:
                failed[name] = entry.rejected
            else:
                held[name] = (
                    "waiting for the profiler's verdict" if entry else "its submission has not reached the executors"
                )
        return FactsReply(tuple(known), held, failed)

    async def on_apply(self, request: ApplyRequest) -> Ack:
        jobs = self.executors.jobs
        async with self.turn:
            restarts = {name: jobs[name].restarts for name in request.decided if name in jobs}
            touched = self.executors.apply(request)
            if (restarted := sum(jobs[name].restarts - restarts[name] for name in touched if name in restarts)) > 0:
                instrument(JOB_RESTARTS).add(restarted)
            await self.save(name for name in touched if name in self.submitted)
        return Ack()

    async def on_advance(self, request: AdvanceRequest) -> AdvanceReply:
        executors = self.executors
        async with self.turn:
            before = {name: job.advanced_to for name, job in executors.jobs.items()}
            finished, observed = executors.advance(request.now_s, request.step_s, request.jobs)
            for name in finished:
                self.told.pop(name, None)
            self.unreported.extend(
                Observed(job_id, gpu_type, observation)
                for job_id, gpu_type, observation in observed
                if (gpu_type, *observation[:4]) not in self.told[job_id]
            )
            advanced = [name for name, job in executors.jobs.items() if job.advanced_to != before[name]]
            # A job that waits moved only the round it was run to (`snapshot`): not compared again.
            trained = [name for name in advanced if not off_gpus(executors.jobs[name])]
            if advanced and not trained:
                self.kept.pop(advanced[0], None)  # one written all the same: KV holds the round run (`load`)
                trained = advanced[:1]
            self.dirty.update(trained)
        # What they ran goes to the estimator before the round is written, so that a job is written
        # once, with the revision its estimate reached (a restart before the write runs the round
        # again, and reports it again, which changes nothing).
        await self.report()
        async with self.turn:
            await self.save()
            return AdvanceReply(tuple(finished), executors.failures(request.jobs, request.now_s))

    async def report(self) -> None:
        """What the jobs ran, to the estimator, each job's in order (it sees what direct wiring
        does; `endpoints.report_all`), each job then holding the revision its estimate reached. Not
        in the turn: the jobs stream's events are taken meanwhile (the estimator fits a model each).
        Reported twice (this failed half-way) changes nothing."""

        async def reported(message: Observed, revision: int) -> None:
            self.told[message.job_id].add((message.gpu_type, *message.observation[:4]))
            async with self.turn:
                job = self.executors.jobs[message.job_id]
                job.estimate_revision = max(job.estimate_revision, revision)
                self.dirty.add(message.job_id)

        async with self.reporting:
            if sending := len(self.unreported):
                await endpoints.report_all(self.bus, self.unreported[:sending], reported)
                del self.unreported[:sending]

    async def on_live(self, request: LiveJobsRequest) -> LiveJobs:
        executors = self.executors
        async with self.turn:
            before = {name: job.spec.time for name, job in executors.jobs.items()}
            live = executors.arrive(request.now_s)
            await self.save(name for name, job in executors.jobs.items() if job.spec.time != before[name])
        return LiveJobs(tuple(live))

    # ---- status -----------------------------------------------------------------------------

    async def on_nodes(self, _: Ack) -> NodeStatuses:
        """The simulated cluster's nodes, every one alive (none is lost or drained here), with the
        jobs running on each."""
        return self.executors.node_statuses()

    def records(self) -> Iterable[JobRecord]:
        waits = self.executors.waits()
        for entry in self.submitted.values():
            record = entry.record()
            yield msgspec.structs.replace(record, reason=waits[entry.job_id]) if entry.job_id in waits else record

    def count(self, prefix: str) -> int:
        """Submissions whose id begins with `prefix` that have the profiler's verdict."""
        return sum(
            1 for e in self.submitted.values() if e.job_id.startswith(prefix) and (e.job is not None or e.rejected)
        )


# What the executors take from the jobs stream, by subject: a submission, then the profiler's word on it.
EVENTS = {
    subjects.STORED: (SimulatedExecutorService.on_submitted, JobSpec),
    subjects.REPLAY_SUBMIT: (SimulatedExecutorService.on_submitted, JobSpec),
    subjects.PROFILED: (SimulatedExecutorService.on_profiled, Profiled),
    subjects.REJECTED: (SimulatedExecutorService.on_rejected, Rejected),
    subjects.REFUSED: (SimulatedExecutorService.on_rejected, Rejected),
    subjects.CANCEL: (SimulatedExecutorService.on_cancel, Cancel),
}


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    executors, sources = world_of(args)
    states = await storage.open_kv(bus, subjects.EXECUTOR_BUCKET, SubmittedJob)
    service = SimulatedExecutorService(bus, executors, sources, states)
    await service.load()

    # The jobs stream read in order, EVENTS_AT_ONCE events a fetch: each taken, then what they
    # changed saved at once, then they are acknowledged (a burst: thousands of submissions and verdicts).
    await storage.open_stream(bus, subjects.DEAD_LETTER_STREAM)
    events = await storage.open_consumer(
        bus,
        subjects.EXECUTOR_CONSUMER,
        msgspec.Raw,
        span_name="executor.job-event",
        dead_letters=subjects.dead_letters(subjects.EXECUTOR_CONSUMER),
    )
    asyncio.get_running_loop().create_task(
        events.consume(service.on_event, batch=EVENTS_AT_ONCE, with_delivery=True, after_batch=service.save_events)
    )

    return await endpoints.serve_round(
        bus,
        "simulated executors on a virtual clock",
        facts=service.facts,
        apply=service.on_apply,
        advance=service.on_advance,
        live=service.on_live,
        records=service.records,
        count=service.count,
        nodes=service.on_nodes,
    )
