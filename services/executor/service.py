"""The executor service. Simulated (the default): the jobs of a simulated cluster run here on a
virtual clock. With `--executors local`: real jobs on this machine's slots (`services.executor.agent`).

It takes submissions from the JetStream stream (its own durable consumer), and answers the policy
leader's round: the jobs' facts, the placements to apply, and a round to advance — after which it
reports every configuration a job ran to the estimator.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math

from nats import micro

from services.executor import agent
from services.executor import endpoints
from shared import subjects
from shared.bus import Bus
from shared.reference import WorkloadJob
from shared.schema import (
    Ack,
    AdvanceReply,
    AdvanceRequest,
    ApplyRequest,
    JobSpec,
    LiveJobs,
    LiveJobsRequest,
    Observed,
)
from sim.run import add_world_arguments, world_of
from sim.world import SimulatedJob

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_world_arguments(parser)
    parser.add_argument("--executors", choices=["simulated", "local"], default="simulated",
                        help="simulated jobs on a virtual clock, or real jobs on local CPU slots")
    agent.add_arguments(parser)


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    if args.executors == "local":
        return await agent.start(bus, args)
    # Every job's state is written to KV before a request is answered, so a restarted executor
    # picks the cluster up where it was; a round asked again runs only the jobs not yet run.
    executors, sources = world_of(args)
    states = await bus.kv(subjects.EXECUTOR_BUCKET, SimulatedJob)
    for key in await states.keys():
        entry = await states.get(key)
        if entry is not None:
            executors.restore(entry.value, sources.truths[entry.value.spec.application])

    # One request at a time: a request asked again while the first is still being answered waits
    # for it, and then finds its work done.
    turn = asyncio.Lock()

    async def save(names) -> None:
        for name in names:
            await states.put(name, executors.jobs[name])

    async def on_submission(spec: JobSpec) -> None:
        async with turn:
            await take(spec)

    async def take(spec: JobSpec) -> None:
        truth = sources.truths.get(spec.application)
        if truth is None:
            log.warning("job %s: no simulated behaviour for %r; not run", spec.id, spec.application)
            return
        batch = spec.requested_batch or truth.init_batch * spec.requested_gpus
        live = spec.submit_s is None             # arrives at the live round that first sees it
        arrival = math.inf if live else spec.submit_s
        if spec.id not in executors.jobs:
            executors.add(WorkloadJob(spec.id, arrival, spec.application, spec.requested_gpus, batch), truth)
            executors.jobs[spec.id].live = live
            await save([spec.id])

    async def on_advance(request: AdvanceRequest) -> AdvanceReply:
        async with turn:
            return await advance(request)

    async def advance(request: AdvanceRequest) -> AdvanceReply:
        before = {name: job.advanced_to for name, job in executors.jobs.items()}
        finished, observed = executors.advance(request.now_s, request.step_s, request.jobs)
        for job_id, gpu_type, observation in observed:      # in order: the estimator sees what direct wiring does
            await report(Observed(job_id, gpu_type, observation))
        await save(name for name, job in executors.jobs.items() if job.advanced_to != before[name])
        return AdvanceReply(tuple(finished))

    async def report(message: Observed) -> None:
        job = executors.jobs[message.job_id]
        job.estimate_revision = max(job.estimate_revision, await endpoints.report(bus, message))

    async def on_live(request: LiveJobsRequest) -> LiveJobs:
        async with turn:
            before = {name: job.spec.time for name, job in executors.jobs.items()}
            live = executors.arrive(request.now_s)
            await save(name for name, job in executors.jobs.items() if job.spec.time != before[name])
        return LiveJobs(tuple(live))

    async def on_apply(request: ApplyRequest) -> Ack:
        async with turn:
            executors.apply(request.now_s, request.placements, request.models, request.adaptive)
            await save(request.models)
        return Ack()

    await bus.ensure_stream(subjects.JOBS_STREAM, subjects.JOBS_STREAM_SUBJECTS,
                            duplicate_window=subjects.DEDUP_WINDOW_S)
    consumer = await bus.pull_consumer(subjects.JOBS_STREAM, subjects.EXECUTOR_CONSUMER, subjects.SUBMIT, JobSpec,
                                       span_name="executor.submission")
    asyncio.get_running_loop().create_task(consumer.consume(on_submission, timeout=0.2))

    return await endpoints.serve_round(
        bus, "simulated executors on a virtual clock", facts=executors.facts, apply=on_apply, advance=on_advance,
        live=on_live, records=lambda: (job.record() for job in executors.jobs.values()),
        count=lambda: len(executors.jobs))
