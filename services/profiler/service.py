"""The profiler service: every stored submission, validated, bootstraps a job with its 1-GPU
profiles, or is refused with the reason. (The user API, `services.api`, is the gate in front of it:
it stores only what passes the same checks.)

A durable pull consumer on the submissions (live ones and a replay's): a submission is
acknowledged once the profiler's verdict is stored in the jobs stream, exactly one per submission:
`Profiled` (its profiles reached the estimator; the executors may run it) or `Rejected` (the reason:
malformed, an unknown application or GPU type, more GPUs than the cluster has, a submit time on a
live submission, a profiling run that failed). Only accepted jobs ever run. On a simulated cluster
the profiles are trace-backed (`sim/profiles.py`); with `--executors real` the job's own
script is run on one GPU of each type, by the agent of a node of that type (`services.profiler.measure`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from functools import partial

from nats import micro

from goodput_train.protocol import ProfileRun
from services.profiler.gathered import Gathered
from services.profiler.measure import (
    NodeTurns,
    ProfilingCancelled,
    ProfilingFailed,
    declared_profile,
    declared_run,
    measured_profile,
    profiling_run,
)
from shared import storage, subjects
from shared.bus import Bus
from shared.bus.kv import RevisionConflict, TypedKV
from shared.cluster import Cluster, load_cluster
from shared.code_archive import owned
from shared.metrics import VERDICTS, instrument
from shared.runner import add_profile_arguments, new_service, positive_float
from shared.schema.base import Ack
from shared.schema.estimates import JobProfiles, ProfilesAll, StoredAll
from shared.schema.jobs import TORCHRUN, Cancel, JobOwner, JobSpec, Profiled, readable_id, rejection, spec_digest
from shared.schema.nodes import NodeInfo, NodeStatuses
from shared.settings import JUDGED_AT_ONCE, PROFILES_IN_FLIGHT
from shared.submissions import id_taken, malformed_reason, named_types, submission_problem
from sim.profiles import ProfileSource, profile_source

log = logging.getLogger(__name__)

CANCELS_KEPT = 10_000  # cancel orders remembered, newest, so that a cancelled job's runs never start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(
        parser, "profile each job by running its script on one GPU of each type, on a node of that type (its agent)"
    )
    parser.add_argument(
        "--slot-memory",
        type=positive_float,
        help="real: the memory of one CPU slot in MB, as a GPU's (default: unlimited)",
    )


class Profiler:
    """The verdicts on stored submissions: trace-backed profiles (`source`), or real profiling runs
    on the live nodes (`turns`: each node lent to one run at a time)."""

    def __init__(
        self,
        bus: Bus,
        cluster: Cluster,
        owners: TypedKV[JobOwner],
        source: ProfileSource | None = None,
        turns: NodeTurns | None = None,
        slot_memory: float | None = None,
    ) -> None:
        if (source is None) == (turns is None):
            raise ValueError("a profiler reads profiles (source) or measures them (turns), one of the two")
        self.bus, self.cluster, self.owners = bus, cluster, owners
        self.source, self.turns, self.slot_memory = source, turns, slot_memory
        # Cancel orders as they pass (every replica sees each): a cancelled job's profiling runs do
        # not start, and its slots go to the next job's. Its end is the cancel; the executors ignore a verdict.
        self.cancels: dict[str, None] = {}
        self.stopping = asyncio.Event()
        # The profiles of submissions judged at once go to the estimator together.
        self.store_profiles = Gathered(self._store_all, JUDGED_AT_ONCE, PROFILES_IN_FLIGHT)

    async def _store_all(self, jobs: list[JobProfiles]) -> list[str | None]:
        """The jobs' profiles stored with the estimator: for each, None, or why it was not stored."""
        stored = await self.bus.request(subjects.PROFILES, ProfilesAll(tuple(jobs)), StoredAll, timeout=30)
        return [
            None if revision else stored.refused.get(job.job_id, "not stored")
            for job, revision in zip(jobs, stored.revisions, strict=True)
        ]

    @property
    def real(self) -> bool:
        """Whether jobs are profiled by running them (real executors)."""
        return self.turns is not None

    async def stop_runs(self) -> None:
        self.stopping.set()

    async def on_malformed(self, subject: str, data: bytes, error: Exception) -> None:
        # Recorded, with the reason, as the submission's verdict; the submission is then dropped.
        await self.bus.js_publish(
            subjects.REJECTED, rejection(subject, malformed_reason(error), data, readable_id(data))
        )
        instrument(VERDICTS).add(1, {"verdict": "rejected"})

    async def claim(self, spec: JobSpec, delivery) -> str | None:
        """Hold the job's id for this submission: None when it holds it (first, or delivered again),
        "repeat" for the same job sent again, else why it cannot have it."""
        mine = JobOwner(delivery.stream_sequence, spec_digest(spec), delivery.subject, application=spec.application)
        # The API claimed a stored submission's id before it stored it: read that first (a create
        # refused costs the server a write, and nats-py a read besides); a replay's is most likely free.
        stored = subjects.of_login(delivery.subject)[0] == subjects.STORED
        held = await self.owners.get(spec.id) if stored else None
        for _ in range(3):  # the holder may give it up meanwhile
            if held is None:
                try:
                    await self.owners.create(spec.id, mine)
                    return None
                except RevisionConflict:
                    held = await self.owners.get(spec.id)
                if held is None:
                    continue
            if held.value.submission == mine.submission:
                return None
            if held.value.marking:  # the API is storing one: this one was stored first (or is it)
                try:
                    await self.owners.update(spec.id, mine, held.revision)
                    return None
                except RevisionConflict:
                    held = await self.owners.get(spec.id)
                    continue
            if held.value.digest == mine.digest and held.value.login == mine.login:
                return "repeat"
            return id_taken(spec.id)
        raise RuntimeError(f"job {spec.id}: its id changes hands too fast to claim")

    async def reject(self, spec: JobSpec, reason: str, delivery, release: bool = True) -> None:
        """Refuse this submission, with the reason; the id it held is free again (`release`)."""
        await self.bus.js_publish(
            subjects.REJECTED, rejection(delivery.subject, reason, repr(spec), spec.id, delivery.stream_sequence)
        )
        instrument(VERDICTS).add(1, {"verdict": "rejected"})
        held = await self.owners.get(spec.id) if release else None
        if held is not None and held.value.submission == delivery.stream_sequence:
            with contextlib.suppress(RevisionConflict):
                await self.owners.delete(spec.id, held.revision)

    async def on_cancel(self, order: Cancel) -> None:
        self.cancels[order.job_id] = None
        while len(self.cancels) > CANCELS_KEPT:
            del self.cancels[next(iter(self.cancels))]

    async def measure(
        self, spec: JobSpec, types: list[str], owner: str, user: int | None = None
    ) -> tuple[tuple, ProfileRun | None]:
        """The job run on one slot of each type: its profiles, and the batch sizes it declares
        (`user`: its submission's number, its user's on the nodes)."""
        profiles, run = [], None
        for gpu_type in types:
            if self.stopping.is_set():
                raise RuntimeError(f"profiler stopping; {spec.id} is left to another replica")
            run = await profiling_run(
                self.bus,
                self.turns,
                spec.id,
                spec.model,
                gpu_type,
                self.slot_memory,
                cancelled=lambda: spec.id in self.cancels,
                code=owned(spec.own_code, owner),  # its login's archive
                user=user,
                whose=spec.team if spec.team not in (None, subjects.DEFAULT_TEAM) else owner,  # turns by team
                team=spec.team or subjects.DEFAULT_TEAM,
            )
            memory = f"{self.slot_memory:g} MB memory" if self.slot_memory else "memory"
            profiles.append(measured_profile(spec.id, spec.model, gpu_type, run, memory))
        return tuple(profiles), run

    async def on_submission(self, spec: JobSpec, delivery) -> None:
        taken = await self.claim(spec, delivery)
        if taken == "repeat":  # the first one's verdict stands
            return
        if taken is not None:
            await self.reject(spec, taken, delivery, release=False)
            return
        problem = submission_problem(
            spec,
            self.cluster,
            None if self.real else self.source.types,
            live=subjects.of_login(delivery.subject)[0] == subjects.STORED,
            own_code=self.real,
        )
        if problem is not None:
            await self.reject(spec, problem, delivery)
            return
        named = named_types(spec, self.cluster)[0]  # the types it may run on ("T4" or "aws"); none: any
        if self.real and spec.launcher == TORCHRUN:  # not profiled: it runs as declared
            run = declared_run(spec)
            types = [t for t in self.cluster.gpu_types if not named or t in named]
            profiles = tuple(declared_profile(spec.id, spec.model, t, run) for t in types)
        elif self.real:
            types = [t for t in self.cluster.gpu_types if not named or t in named]
            try:
                profiles, run = await self.measure(
                    spec, types, subjects.of_login(delivery.subject)[1], delivery.stream_sequence
                )
            except ProfilingCancelled as cancelled:
                log.info("%s", cancelled)
                return
            except ProfilingFailed as error:
                if self.stopping.is_set():  # we stopped its run: the submission goes back for another replica
                    raise RuntimeError(f"profiler stopping; {spec.id} is left to another replica") from None
                # The reason names no id: a login knows its job by another (`Who.shown`) than the cluster's.
                await self.reject(spec, f"it cannot run: {error}", delivery)
                return
        else:
            types = [
                t
                for t in self.cluster.gpu_types
                if t in self.source.types[spec.application] and (not named or t in named)
            ]
            profiles = tuple(self.source.profile(spec.application, t) for t in types)
        refused = await self.store_profiles(JobProfiles(spec.id, profiles))
        if refused is not None:  # the submission is delivered again, as when the request fails
            raise RuntimeError(f"the estimator did not store the profiles of {spec.id}: {refused}")
        sequence = delivery.stream_sequence
        verdict = (
            Profiled(spec.id, run.init_batch, run.max_batch, submission=sequence)
            if self.real
            else Profiled(spec.id, submission=sequence)
        )
        await self.bus.js_publish(subjects.PROFILED, verdict, msg_id=f"{spec.id}.profiled")  # not the submission's id
        instrument(VERDICTS).add(1, {"verdict": "accepted"})

    async def on_dead(self, delivery, error: Exception) -> None:
        # Tried MAX_DELIVER times: the job is refused with the reason, so it is not left unanswered.
        await self.reject(
            delivery.message,
            f"it could not be profiled after {delivery.num_delivered} tries: {type(error).__name__}: {error}",
            delivery,
        )


async def nodes_training(bus: Bus) -> set[str]:
    """The nodes whose workers train jobs now, as the executor says (`goodput.executor.nodes`)."""
    statuses = await bus.request(subjects.EXECUTOR_NODES, Ack(), NodeStatuses, timeout=5)
    return {status.name for status in statuses.nodes if status.jobs}


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    real = args.executors == "real"
    profiler = Profiler(
        bus,
        load_cluster(args.cluster),
        await storage.open_kv(bus, subjects.JOB_OWNERS_BUCKET, JobOwner),
        source=None if real else profile_source(args.reference, args.zoo),
        turns=NodeTurns(await storage.open_kv(bus, subjects.NODES_BUCKET, NodeInfo), partial(nodes_training, bus))
        if real
        else None,
        slot_memory=args.slot_memory,
    )
    bus.on_close(profiler.stop_runs)
    if real:
        await bus.subscribe(subjects.CANCEL, Cancel, profiler.on_cancel, span_name="profiler.cancel-seen")
    await storage.open_stream(bus, subjects.DEAD_LETTER_STREAM)
    # A submission being profiled (one run per GPU type) is kept in hand meanwhile (the consumer
    # says so to the server), not handed to another replica. JUDGED_AT_ONCE submissions are in hand
    # at once: read from traces, judged together; real runs, each waiting for a node of its type in
    # turn by team (NodeTurns), so another team's job in hand waits one run, not all of a flood's.
    # Two submissions of one id race only for its owner's key, which one of them wins (`claim`).
    consumer = await storage.open_consumer(
        bus,
        subjects.PROFILER_CONSUMER,
        JobSpec,
        span_name="profiler.bootstrap",
        on_invalid=profiler.on_malformed,
        dead_letters=subjects.dead_letters(subjects.PROFILER_CONSUMER),
    )
    asyncio.get_running_loop().create_task(
        consumer.consume(
            profiler.on_submission,
            with_delivery=True,
            on_dead=profiler.on_dead,
            batch=JUDGED_AT_ONCE,
            concurrent=True,
        )
    )
    return await new_service(bus, subjects.PROFILER_SERVICE, "bootstrap profiles of submitted jobs")
