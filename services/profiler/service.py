"""The profiler service: the gate every submission passes. Each one, validated, bootstraps a job
with its 1-GPU profiles, or is refused with the reason.

A durable pull consumer on the submissions (live ones and a replay's): a submission is
acknowledged once the profiler's verdict is stored in the jobs stream, exactly one per submission:
`Profiled` (its profiles reached the estimator; the executors may run it) or `Rejected` (the reason:
malformed, an unknown application or GPU type, more GPUs than the cluster has, a submit time on a
live submission, a profiling run that failed). Only accepted jobs ever run. On a simulated cluster
the profiles are trace-backed (`shared/profiles.py`); with `--executors local` the job's own
script is run on one GPU of each type, by the agent of a node of that type (`services.profiler.measure`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

from nats import micro

from services.api import service as api
from services.profiler.measure import NodeTurns, ProfilingCancelled, ProfilingFailed, measured_profile, profiling_run
from shared import storage, subjects
from shared.bus import Bus, RevisionConflict
from shared.cluster import load_cluster
from shared.profiles import profile_source
from shared.runner import new_service, positive_float
from shared.schema import (
    Cancel,
    JobOwner,
    JobProfiles,
    JobSpec,
    NodeInfo,
    Profiled,
    Stored,
    readable_id,
    rejection,
    spec_digest,
)
from shared.submissions import agents_models, id_taken, malformed_reason, named_types, submission_problem

log = logging.getLogger(__name__)

PROFILING_RUNS = 4  # real runs: submissions profiled at once (each holds one node of a type at a time)
CANCELS_KEPT = 10_000  # cancel orders remembered, newest, so that a cancelled job's runs never start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="sia-hetero-64", help="cluster preset or YAML/JSON file")
    parser.add_argument("--reference", help="reference folder the profiles are read from")
    parser.add_argument("--zoo", action="store_true", help="profiles from the built-in model zoo")
    parser.add_argument(
        "--executors",
        choices=["simulated", "local"],
        default="simulated",
        help="local: profile each job by running its script on one GPU of each type, on a node of "
        "that type (through its agent)",
    )
    parser.add_argument(
        "--slot-memory",
        type=positive_float,
        help="local: the memory of one CPU slot in MB, as a GPU's (default: unlimited)",
    )


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    cluster = load_cluster(args.cluster)
    local = args.executors == "local"
    source = None if local else profile_source(args.reference, args.zoo)
    turns = NodeTurns(await storage.open_kv(bus, subjects.NODES_BUCKET, NodeInfo)) if local else None
    stopping = asyncio.Event()

    async def stop_runs() -> None:
        stopping.set()

    bus.on_close(stop_runs)

    async def on_malformed(subject: str, data: bytes, error: Exception) -> None:
        # Recorded, with the reason, as the submission's verdict; the submission is then dropped.
        await bus.js_publish(subjects.REJECTED, rejection(subject, malformed_reason(error), data, readable_id(data)))

    owners = await storage.open_kv(bus, subjects.JOB_OWNERS_BUCKET, JobOwner)

    async def claim(spec: JobSpec, delivery) -> str | None:
        """Hold the job's id for this submission: None when it holds it (first, or delivered again),
        "repeat" for the same job sent again, else why it cannot have it."""
        mine = JobOwner(delivery.stream_sequence, spec_digest(spec), delivery.subject)
        for _ in range(3):  # the holder may give it up meanwhile
            try:
                await owners.create(spec.id, mine)
                return None
            except RevisionConflict:
                held = await owners.get(spec.id)
            if held is None:
                continue
            if held.value.submission == mine.submission:
                return None
            if held.value.marking:  # the API is storing one: this one was stored first (or is it)
                try:
                    await owners.update(spec.id, mine, held.revision)
                    return None
                except RevisionConflict:
                    continue
            if held.value.digest == mine.digest and held.value.login == mine.login:
                return "repeat"
            return id_taken(spec.id)
        raise RuntimeError(f"job {spec.id}: its id changes hands too fast to claim")

    async def reject(spec: JobSpec, reason: str, delivery, release: bool = True) -> None:
        """Refuse this submission, with the reason; the id it held is free again (`release`)."""
        await bus.js_publish(
            subjects.REJECTED, rejection(delivery.subject, reason, repr(spec), spec.id, delivery.stream_sequence)
        )
        held = await owners.get(spec.id) if release else None
        if held is not None and held.value.submission == delivery.stream_sequence:
            with contextlib.suppress(RevisionConflict):
                await owners.delete(spec.id, held.revision)

    # Cancel orders as they pass (every replica sees each): a cancelled job's profiling runs do not
    # start, and its slots go to the next job's. Its end is the cancel; the executors ignore a verdict.
    cancels: dict[str, None] = {}

    async def on_cancel(order: Cancel) -> None:
        cancels[order.job_id] = None
        while len(cancels) > CANCELS_KEPT:
            del cancels[next(iter(cancels))]

    if local:
        await bus.subscribe(subjects.CANCEL, Cancel, on_cancel, span_name="profiler.cancel-seen")

    async def measure(spec: JobSpec, types: list[str]) -> tuple:
        """The job run on one slot of each type: its profiles, and the batch sizes it declares."""
        profiles, run = [], None
        for gpu_type in types:
            if stopping.is_set():
                raise RuntimeError(f"profiler stopping; {spec.id} is left to another replica")
            run = await profiling_run(
                bus, turns, spec.id, spec.application, gpu_type, args.slot_memory, cancelled=lambda: spec.id in cancels
            )
            memory = f"{args.slot_memory:g} MB memory" if args.slot_memory else "memory"
            profiles.append(measured_profile(spec.id, spec.application, gpu_type, run, memory))
        return tuple(profiles), run

    async def on_submission(spec: JobSpec, delivery) -> None:
        taken = await claim(spec, delivery)
        if taken == "repeat":  # the first one's verdict stands
            return
        if taken is not None:
            await reject(spec, taken, delivery, release=False)
            return
        problem = submission_problem(
            spec,
            cluster,
            None if local else source.types,
            live=subjects.of_login(delivery.subject)[0] == subjects.STORED,
        )
        if problem is not None:
            await reject(spec, problem, delivery)
            return
        named = named_types(spec, cluster)[0]  # the types it may run on ("T4" or "aws"); none: any
        if local:
            types = [t for t in cluster.gpu_types if not named or t in named]
            try:
                profiles, run = await measure(spec, types)
            except ProfilingCancelled as cancelled:
                log.info("%s", cancelled)
                return
            except ProfilingFailed as error:
                if stopping.is_set():  # we stopped its run: the submission goes back for another replica
                    raise RuntimeError(f"profiler stopping; {spec.id} is left to another replica") from None
                await reject(spec, f"job {spec.id} cannot run: {error}", delivery)
                return
        else:
            types = [t for t in cluster.gpu_types if t in source.types[spec.application] and (not named or t in named)]
            profiles = tuple(source.profile(spec.application, t) for t in types)
        await bus.request(subjects.PROFILES, JobProfiles(spec.id, profiles), Stored, timeout=30)
        sequence = delivery.stream_sequence
        verdict = (
            Profiled(spec.id, run.init_batch, run.max_batch, submission=sequence)
            if local
            else Profiled(spec.id, submission=sequence)
        )
        await bus.js_publish(subjects.PROFILED, verdict, msg_id=f"{spec.id}.profiled")  # not the submission's id

    async def on_dead(delivery, error: Exception) -> None:
        # Tried MAX_DELIVER times: the job is refused with the reason, so it is not left unanswered.
        await reject(
            delivery.message,
            f"job {delivery.message.id} could not be profiled after "
            f"{delivery.num_delivered} tries: {type(error).__name__}: {error}",
            delivery,
        )

    async def problem(spec: JobSpec) -> str | None:
        """Why the API refuses a live submission at once: with real executors, an application no live
        node agent runs is unknown (from what they say; none says: its profiling run decides)."""
        models = agents_models((await turns.members.values()).values(), cluster.gpu_types) if local else source.types
        return submission_problem(spec, cluster, models, live=True)

    await api.start(bus, owners, problem)
    await storage.open_stream(bus, subjects.DEAD_LETTER_STREAM)
    # A submission being profiled (one run per GPU type) is kept in hand meanwhile (the consumer
    # says so to the server), not handed to another replica. Real runs: PROFILING_RUNS
    # submissions at once, one at a time each (none waits behind another's run on another node).
    for _ in range(PROFILING_RUNS if local else 1):
        consumer = await storage.open_consumer(
            bus,
            subjects.PROFILER_CONSUMER,
            JobSpec,
            span_name="profiler.bootstrap",
            on_invalid=on_malformed,
            dead_letters=subjects.dead_letters(subjects.PROFILER_CONSUMER),
        )
        asyncio.get_running_loop().create_task(
            consumer.consume(on_submission, with_delivery=True, on_dead=on_dead, **({"batch": 1} if local else {}))
        )
    return new_service(bus, subjects.PROFILER_SERVICE, "bootstrap profiles of submitted jobs")
