"""The profiler service: each submission, validated, bootstraps a job with its 1-GPU profiles.

A durable pull consumer on the submissions stream: a submission is acknowledged once its
profiles reached the estimator, or once its rejection is recorded on the dead-letter subject
with the reason. Profiles are trace-backed here (the real profiler comes with the executor issue).
"""

from __future__ import annotations

import argparse
import asyncio

from nats import micro

from services.profiler.core import submission_problem
from services.runner import new_service
from shared import subjects
from shared.bus import Bus
from shared.cluster import load_cluster
from shared.schema import JobProfiles, JobSpec, Stored, rejection
from sim.run import job_sources


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="sia-hetero-64", help="cluster preset or YAML/JSON file")
    parser.add_argument("--reference", help="reference folder the profiles are read from")
    parser.add_argument("--zoo", action="store_true", help="profiles from the built-in model zoo")


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    cluster = load_cluster(args.cluster)
    sources = job_sources(args.reference, args.zoo)

    async def on_malformed(subject: str, data: bytes, error: Exception) -> None:
        # Recorded, with the reason, on the dead-letter subject; the submission is then dropped.
        await bus.js_publish(subjects.REJECTED, rejection(subject, f"malformed submission: {error}", data))

    async def on_submission(spec: JobSpec) -> None:
        problem = submission_problem(spec, cluster.gpu_types, sources.truths)
        if problem is not None:
            await bus.js_publish(subjects.REJECTED, rejection(subjects.SUBMIT, problem, repr(spec), spec.id))
            return
        types = [t for t in cluster.gpu_types if t in sources.truths[spec.application].types
                 and (not spec.gpu_types or t in spec.gpu_types)]
        profiles = tuple(sources.profile(spec.application, t) for t in types)
        await bus.request(subjects.PROFILES, JobProfiles(spec.id, profiles), Stored, timeout=30)

    await bus.ensure_stream(subjects.JOBS_STREAM, subjects.JOBS_STREAM_SUBJECTS,
                            duplicate_window=subjects.DEDUP_WINDOW_S)
    consumer = await bus.pull_consumer(subjects.JOBS_STREAM, subjects.PROFILER_CONSUMER, subjects.SUBMIT, JobSpec,
                                       span_name="profiler.bootstrap", on_invalid=on_malformed)
    asyncio.get_running_loop().create_task(consumer.consume(on_submission, timeout=0.2))
    return new_service(bus, subjects.PROFILER_SERVICE, "bootstrap profiles of submitted jobs")
