"""The simulated executors as the executor service: `python -m services.simulated` (what `goodput up`,
`goodput simulate --bus nats` and the manifests' simulated cluster run in place of node agents).

The jobs of a simulated cluster run here on a virtual clock (`services.simulated.world`). They come from the jobs
stream, read in order by one durable consumer: a submission, then the profiler's verdict on it. A
job enters the rounds only once the profiler accepted it (`Profiled`: its profiles are with the
estimator); one it refused is kept with the reason, so `goodput status` shows it. The service
answers the policy leader's round — the jobs' facts, the placements to apply, a round to advance,
after which it reports every configuration a job ran to the estimator — and the status requests.
Every submission's state is written to KV before a request is answered (what a failed attempt left
unwritten, by the next), so a restarted executor picks the cluster up where it was; a round asked
again runs only the jobs not yet run, and reports what the last attempt could not.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import msgspec
from nats import micro

from services.simulated.truth import JobSources, job_sources
from services.simulated.world import SimulatedExecutors, SubmittedJob, as_workload_job, request_observations
from shared import executor_endpoints as endpoints
from shared import storage, subjects
from shared.bus import Bus
from shared.cluster import load_cluster
from shared.schema import (
    Ack,
    AdvanceReply,
    AdvanceRequest,
    ApplyRequest,
    Cancel,
    FactsReply,
    JobSpec,
    LiveJobs,
    LiveJobsRequest,
    Observed,
    Profiled,
    Rejected,
    unnamed_key,
    verdict_for,
)
from shared.settings import FEEDBACK_ITERATIONS, simulation_settings

log = logging.getLogger(__name__)


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


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    executors, sources = world_of(args)
    states = await storage.open_kv(bus, subjects.EXECUTOR_BUCKET, SubmittedJob)
    submitted: dict[str, SubmittedJob] = {}
    kept = [(key, entry.value) for key in await states.keys() if (entry := await states.get(key)) is not None]
    for key, value in sorted(kept, key=lambda item: item[1].seen):  # in the order they came
        submitted[key] = value
        if value.job is not None:
            executors.restore(value.job, sources.truths[value.job.spec.application])

    # One request at a time: a request asked again while the first is still being answered waits
    # for it, and then finds its work done.
    turn = asyncio.Lock()

    dirty: set[str] = set()  # changed here, not yet in KV
    unreported: list[Observed] = []  # measured, not yet with the estimator

    async def save(names=()) -> None:
        """Write what changed (now, or in an attempt that failed half-way) to KV."""
        dirty.update(names)
        for name in sorted(dirty):
            entry = submitted[name]
            entry.job = executors.jobs.get(name)
            await states.put(name, entry)
            dirty.discard(name)

    def on_submitted(spec: JobSpec, sequence: int, trace: str, owner: str) -> str | None:
        known = submitted.get(spec.id)
        if known is not None and (known.job is not None or known.rejected is None):
            return None  # another submission holds the id (a refused one gives it up)
        submitted.pop(spec.id, None)  # a refusal it replaces: listed where this one came
        submitted[spec.id] = SubmittedJob(spec.id, spec, submission=sequence, trace=trace, seen=sequence, owner=owner)
        return spec.id

    def on_profiled(verdict: Profiled, _: int, trace: str, __: str) -> str | None:
        entry = submitted.get(verdict.job_id)
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
        spec = entry.spec
        truth = sources.truths.get(spec.application)
        if truth is None:
            entry.rejected = f"no simulated behaviour for application {spec.application!r} on this cluster"
            return spec.id
        try:
            executors.submit(spec, truth)  # live without submit_s; rigid as it asks
        except ValueError as error:
            entry.rejected = str(error)
        else:
            executors.jobs[spec.id].trace = entry.trace or trace
        return spec.id

    def on_rejected(verdict: Rejected, sequence: int, _: str, owner: str) -> str | None:
        application = verdict.application or ""
        owner = owner or subjects.of_login(verdict.subject)[1]  # the API's record, or the submission judged
        if verdict.job_id is None:  # unreadable: kept under its place in the stream
            key = unnamed_key(sequence)
            submitted[key] = SubmittedJob("", None, verdict.reason, seen=sequence, application=application, owner=owner)
            return key
        entry = submitted.get(verdict.job_id)
        if entry is None:  # its submission was never read as one: refused under its id
            submitted[verdict.job_id] = SubmittedJob(
                verdict.job_id, None, verdict.reason, seen=sequence, application=application, owner=owner
            )
            return verdict.job_id
        if entry.job is None and entry.rejected is None and verdict_for(verdict.submission, entry.submission):
            entry.rejected = verdict.reason
            return verdict.job_id
        # A verdict on another submission under a known id (a second body, a malformed message naming
        # it): kept on its own, for the sender to see; the job the id belongs to is untouched.
        key = unnamed_key(sequence)
        submitted[key] = SubmittedJob(
            verdict.job_id, None, verdict.reason, seen=sequence, application=application, owner=owner
        )
        return key

    def on_cancel(order: Cancel, _: int, __: str, ___: str) -> str | None:
        entry = submitted.get(order.job_id)
        if entry is None or entry.rejected is not None or entry.cancelled:
            return None
        if entry.job is None:  # not yet profiled: it never starts
            entry.cancelled = True
            return order.job_id
        return order.job_id if executors.cancel(order.job_id) else None

    events = {
        subjects.STORED: (on_submitted, JobSpec),
        subjects.REPLAY_SUBMIT: (on_submitted, JobSpec),
        subjects.PROFILED: (on_profiled, Profiled),
        subjects.REJECTED: (on_rejected, Rejected),
        subjects.REFUSED: (on_rejected, Rejected),
        subjects.CANCEL: (on_cancel, Cancel),
    }

    async def measured_at_request(verdict: Profiled) -> int:
        """With --profile-request: the job's measurements at its request, to the estimator before
        the job is known here, so that its first round has them (as direct wiring adds them); the
        estimator's last revision, or 0."""
        entry = submitted.get(verdict.job_id)
        if (
            not executors.settings.profile_request
            or entry is None
            or entry.spec is None
            or entry.job is not None
            or entry.rejected is not None
            or entry.cancelled
        ):
            return 0
        truth = sources.truths.get(entry.spec.application)
        measured = request_observations(as_workload_job(entry.spec, truth), truth, executors.cluster) if truth else []
        revision = 0
        for gpu_type, observation in measured:
            revision = max(revision, await endpoints.report(bus, Observed(verdict.job_id, gpu_type, observation)))
        return revision

    async def on_event(message: msgspec.Raw, delivery) -> None:
        subject, owner = subjects.of_login(delivery.subject)
        take, kind = events[subject]
        try:
            event = bus.decode(message, kind)
        except msgspec.DecodeError:
            return  # a malformed submission: the profiler's rejection of it follows
        async with turn:
            revision = await measured_at_request(event) if kind is Profiled else 0
            changed = take(event, delivery.stream_sequence, delivery.traceparent, owner)
            if revision and changed in executors.jobs:
                executors.jobs[changed].estimate_revision = revision
            await save([changed] if changed is not None else [])

    def facts(now: float, names) -> FactsReply:
        known, held, failed = [], {}, {}
        for name in names:
            entry = submitted.get(name)
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

    async def on_advance(request: AdvanceRequest) -> AdvanceReply:
        async with turn:
            before = {name: job.advanced_to for name, job in executors.jobs.items()}
            finished, observed = executors.advance(request.now_s, request.step_s, request.jobs)
            unreported.extend(Observed(job_id, gpu_type, observation) for job_id, gpu_type, observation in observed)
            await save(name for name, job in executors.jobs.items() if job.advanced_to != before[name])
            while unreported:  # in order: the estimator sees what direct wiring does
                message = unreported[0]
                job = executors.jobs[message.job_id]
                job.estimate_revision = max(job.estimate_revision, await endpoints.report(bus, message))
                dirty.add(message.job_id)
                unreported.pop(0)
            await save()
            return AdvanceReply(tuple(finished), executors.failures(request.jobs, request.now_s))

    async def on_live(request: LiveJobsRequest) -> LiveJobs:
        async with turn:
            before = {name: job.spec.time for name, job in executors.jobs.items()}
            live = executors.arrive(request.now_s)
            await save(name for name, job in executors.jobs.items() if job.spec.time != before[name])
        return LiveJobs(tuple(live))

    async def on_apply(request: ApplyRequest) -> Ack:
        async with turn:
            executors.apply(request)
            await save(name for name in {*request.models, *request.failed} if name in submitted)
        return Ack()

    await storage.open_stream(bus, subjects.DEAD_LETTER_STREAM)
    consumer = await storage.open_consumer(
        bus,
        subjects.EXECUTOR_CONSUMER,
        msgspec.Raw,
        span_name="executor.job-event",
        dead_letters=subjects.dead_letters(subjects.EXECUTOR_CONSUMER),
    )
    asyncio.get_running_loop().create_task(consumer.consume(on_event, with_delivery=True))

    return await endpoints.serve_round(
        bus,
        "simulated executors on a virtual clock",
        facts=facts,
        apply=on_apply,
        advance=on_advance,
        live=on_live,
        records=lambda: (entry.record() for entry in submitted.values()),
        count=lambda prefix: sum(
            1 for e in submitted.values() if e.job_id.startswith(prefix) and (e.job is not None or e.rejected)
        ),
    )
