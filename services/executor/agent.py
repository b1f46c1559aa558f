"""The node agent: the executor service over real training processes (`--executors local`).

It answers the round's requests as the simulated executors do — facts, apply, advance, live,
records — for jobs that really train (`LocalExecutors`: a worker process per GPU, here per CPU
slot). The clock is the live run's, paced by the wall clock: a job arrives at the first live round
after the profiler has measured it (`Profiled`); a placement is applied by restarting its workers
at the new world size (they checkpoint first); each round reports the configurations the jobs ran,
with their measured step times, to the estimator, and the jobs that finished or failed since the
last. A job the profiler refused is kept as failed, with the profiler's reason. Every job is kept
in KV (`NodeJob`), so an agent started again (kill -9, an upgrade) goes on with them.

`NodeAgent` is the bookkeeping, without the bus; `start` is the service around it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import tempfile
import time
from pathlib import Path

import msgspec
from nats import micro

from services.executor import endpoints
from services.executor.local import JOBS_PACKAGE, LocalExecutors
from goodput_train.protocol import REPORT_EVERY_S
from services.runner import positive_float
from shared import storage, subjects
from shared.bus import Bus
from shared.cluster import Cluster, Spots, load_cluster
from goodput_train.goodput import Observation
from shared.schema import (
    CANCELLED,
    Ack,
    AdvanceReply,
    FactsReply,
    AdvanceRequest,
    ApplyRequest,
    Cancel,
    JobFacts,
    JobRecord,
    JobSpec,
    LiveJobs,
    LiveJobsRequest,
    NodeJob,
    Observed,
    Profiled,
    Rejected,
    verdict_for,
)

POLL_S = 0.5            # how often the workers are looked at: finishes are timed to this
UNREADABLE = "unreadable"   # the application of a job whose submission could not be read
log = logging.getLogger(__name__)


class NodeAgent:
    """The real jobs of this node (`NodeJob`s beside `LocalExecutors`' processes), on the run's
    clock: its time is the last request's, plus the wall clock since."""

    def __init__(self, executors: LocalExecutors):
        self.executors = executors
        self.jobs: dict[str, NodeJob] = {}
        self.latest_s = -math.inf                   # the newest round applied or run: an older one is stale
        self._clock = (0.0, time.monotonic())

    @property
    def cluster(self) -> Cluster:
        return self.executors.cluster

    def now(self) -> float:
        virtual, wall = self._clock
        return virtual + time.monotonic() - wall

    def tick(self, now: float) -> None:
        """A request at `now`: the clock is set by it (never back: a late request is an old round's)."""
        if now >= self.now():
            self._clock = (now, time.monotonic())

    # ---- kept in KV -------------------------------------------------------------------------

    def saved(self) -> list[NodeJob]:
        """Every job, with what its workers reported so far: what a restarted agent needs."""
        for name, job in self.jobs.items():
            local = self.executors.jobs.get(name)
            if local is not None:
                job.placement, job.restarts, job.crashes, job.stats = (local.placement, local.restarts, local.crashes,
                                                                       local.stats)
                if local.result is not None:
                    job.metric, job.batches = local.result.get("metric"), tuple(local.result.get("batches", ()))
        return list(self.jobs.values())

    def restore(self, job: NodeJob) -> None:
        """Take a job back after a restart. Its workers stopped with the old agent; the next apply
        starts them again from their checkpoint (a restart)."""
        self.jobs[job.spec.id] = job
        try:
            self.executors.add(job.spec.id, job.spec.application)
        except ValueError as error:                  # refused on submission, or its code is gone since
            job.failure = job.failure or str(error)
            return
        local = self.executors.jobs[job.spec.id]
        local.crashes, local.stats, local.failure = job.crashes, job.stats, job.failure
        if job.finish_s is not None or job.failure is not None:
            local.restarts, local.placement = job.restarts, job.placement      # as it ended
            if job.finish_s is not None:
                local.result, local.announced = {"metric": job.metric, "batches": list(job.batches)}, True
        else:
            local.restarts = job.restarts + bool(job.placement)               # its workers start again

    # ---- what the other services tell it ----------------------------------------------------

    # They come in the stream's order: a job's submission before its Profiled or Rejected.

    def submitted(self, spec: JobSpec, sequence: int = 0, trace: str = "") -> None:
        known = self.jobs.get(spec.id)
        if known is not None and not (known.failure is not None and known.profiled is None and not known.cancelled):
            return                                   # another submission holds the id (a refused one gives it up)
        self.executors.jobs.pop(spec.id, None)           # what a refused one under the id left
        self.jobs.pop(spec.id, None)                     # ... listed where this one came
        job = self.jobs[spec.id] = NodeJob(spec, submission=sequence, seen=sequence, trace=trace,
                                           submitted_at=time.time())
        try:
            self.executors.add(spec.id, spec.application)
        except ValueError as error:
            job.failure = str(error)

    def profiled(self, message: Profiled, _: int = 0, trace: str = "") -> None:
        job = self.jobs.get(message.job_id)
        if job is None:
            log.warning("job %s profiled, but its submission was never read here; ignored", message.job_id)
        elif not verdict_for(message.submission, job.submission):
            log.warning("job %s: a verdict on another submission under its id is ignored", message.job_id)
        elif job.cancelled:
            return                                       # cancelled while it was being profiled: it never starts
        elif message.init_batch is None:                 # a trace-backed profiler's word
            job.failure = "profiled without a run of its own: real jobs need the profiler with --executors local"
        else:
            job.profiled, job.trace = message, job.trace or trace

    def cancelled(self, message: Cancel, _: int = 0, __: str = "") -> None:
        """Its user's order: a job not yet ended ends cancelled; its workers checkpoint and stop now
        (blocking), and the next round hears it ended, so its GPUs go back."""
        job = self.jobs.get(message.job_id)
        if job is None or job.finish_s is not None or job.failure is not None:
            return
        if message.job_id in self.executors.jobs:       # first: it reads as cancelled once its workers are gone
            self.executors.cancel(message.job_id)
        job.failure, job.cancelled = CANCELLED, True

    def rejected(self, message: Rejected, sequence: int = 0, _: str = "") -> None:
        if message.job_id is None:
            return
        job = self.jobs.get(message.job_id)
        if job is None:            # its submission could not be read (malformed): kept as failed all the same
            self.jobs[message.job_id] = NodeJob(JobSpec(message.job_id, UNREADABLE), failure=message.reason,
                                                seen=sequence)
        elif job.profiled is not None or job.failure is not None or not verdict_for(message.submission, job.submission):
            # A verdict on another submission (a second body under the id, a malformed message naming it):
            # the job the id belongs to is untouched; the refusal is on the stream, for its sender.
            log.warning("job %s: a refusal of another submission under its id leaves it as it is: %s",
                        message.job_id, message.reason)
        else:
            job.failure = message.reason

    # ---- the round ----------------------------------------------------------------------------

    def arrive(self, now: float) -> list[str]:
        """Jobs measured and not yet arrived arrive now; every arrived job whose end the clock had
        not been told of before this round."""
        for job in self.jobs.values():
            if job.arrival_s is None and job.profiled is not None and job.failure is None:
                job.arrival_s = now
                # Real jobs run in real time: the run's clock at its submission is that long before.
                job.submitted_s = now - max(0.0, time.time() - job.submitted_at) if job.submitted_at else now
        live = [j for j in self.jobs.values() if j.arrival_s is not None and (j.ended_in is None or j.ended_in >= now)]
        return [j.spec.id for j in sorted(live, key=lambda j: (j.arrival_s, j.spec.id))]

    def facts(self, now: float, names) -> FactsReply:
        """The facts of the jobs that may run; the others held (not arrived here) or failed, with why."""
        known, held, failed = [], {}, {}
        for name in names:
            job = self.jobs.get(name)
            if job is None or job.arrival_s is None:
                held[name] = "not arrived at this node agent"
            elif job.failure is not None:
                failed[name] = job.failure
            else:
                known.append(self._facts(job, now))
        return FactsReply(tuple(known), held, failed)

    def _facts(self, job: NodeJob, now: float) -> JobFacts:
        local, spec, profiled = self.executors.jobs[job.spec.id], job.spec, job.profiled
        stats = local.stats
        steps = stats.steps if stats else 0
        return JobFacts(
            job_id=spec.id, application=spec.application, submit_s=job.arrival_s, age_s=now - job.arrival_s,
            requested_gpus=spec.requested_gpus, requested_batch=spec.requested_batch or profiled.init_batch,
            rigid=spec.rigid, init_batch=profiled.init_batch, max_batch=profiled.max_batch, min_gpus=spec.min_gpus,
            restarts=local.restarts, attained_gpu_s=job.gpu_seconds, attained_by_type=dict(job.by_type),
            placement=local.placement, iterations=float(steps),
            mid_restart=local.running and not local.heard,      # started, not yet heard from: restarting
            slice_iterations=float(max(steps - job.slice_steps, 0)) if local.placement else 0.0,
            idle_since_s=None if local.placement else job.arrival_s if job.idle_since_s is None else job.idle_since_s,
            max_gpus_seen=job.max_gpus_seen, grad_sqr=stats.grad_sqr if stats else None,
            grad_var=stats.grad_var if stats else None, estimate_revision=job.estimate_revision, trace=job.trace)

    def apply(self, now: float, placements: dict[str, Spots], adaptive: bool = True,
              failed: dict[str, str] | None = None) -> None:
        """Start, move, resize or stop workers (blocking: a moved job checkpoints first). Under a
        policy that does not adapt batches, and for rigid and strong-scaling jobs, the workers keep
        their batch. An older round's placements (a late or repeated apply: a deposed leader's)
        never undo a newer's."""
        if now < self.latest_s:
            return
        self.latest_s = now
        for name, reason in (failed or {}).items():       # the round gave up on it (or heard it was cancelled)
            job = self.jobs.get(name)
            if job is not None and job.finish_s is None:
                job.failure = job.failure or reason
                job.ended_in = now if job.ended_in is None else job.ended_in
        for name, job in self.jobs.items():
            spots = tuple(placements.get(name, ()))
            local = self.executors.jobs.get(name)
            if local is None or spots == local.placement or job.finish_s is not None or job.failure:
                continue
            local.adaptive = adaptive and not (job.spec.rigid or job.spec.strong_scaling)
            if spots:
                job.max_gpus_seen = max(job.max_gpus_seen, sum(g for _, g in spots))
                job.slice_steps = local.stats.steps if local.stats else 0
            else:
                job.idle_since_s = now
        self.executors.apply(placements)

    def poll(self) -> bool:
        """Look at the workers: a job that finished or failed is timed now, on the run's clock.
        Whether anything worth keeping changed."""
        finished = set(self.executors.poll())
        changed = bool(finished)
        for name, job in self.jobs.items():
            local = self.executors.jobs.get(name)
            if name in finished:
                job.finish_s = self.now()
            elif local is not None and local.failure and job.failure is None:
                job.failure, changed = local.failure, True
            changed |= local is not None and (local.crashes, local.restarts) != (job.crashes, job.restarts)
        return changed

    def advance(self, now: float, step: float, names) -> AdvanceReply:
        """The round [now, now + step) runs in real time: count what it uses; the jobs that ended.
        A round asked again (its reply lost; or the agent restarted) gets the same jobs ended, and
        nothing is counted twice; an older round (a deposed leader's) changes nothing."""
        if now < self.latest_s:
            return AdvanceReply(())
        self.latest_s = now
        self.poll()
        finished, failed = [], {}
        for name in names:
            job, local = self.jobs[name], self.executors.jobs[name]
            gpu_type = self.cluster.placement_type(local.placement)
            ended = job.finish_s is not None or job.failure is not None
            if gpu_type is not None and not ended and (job.advanced_to is None or job.advanced_to <= now):
                used = step * sum(g for _, g in local.placement)
                job.gpu_seconds += used
                job.by_type[gpu_type] = job.by_type.get(gpu_type, 0.0) + used
                job.advanced_to = now + step
            if ended and job.ended_in is None:
                job.ended_in = now
            if job.ended_in == now:
                if job.finish_s is not None:
                    finished.append(name)
                else:
                    failed[name] = job.failure
        return AdvanceReply(tuple(finished), failed)

    def observations(self) -> list[Observed]:
        """The configurations the jobs measured that the estimator has not been told of."""
        new = []
        for name, job in self.jobs.items():
            local = self.executors.jobs.get(name)          # none: a job refused on submission
            stats = local.stats if local else None
            if stats is None or not stats.gpu_type:
                continue
            for observation in stats.observations:
                if _key(observation) not in job.reported:
                    new.append(Observed(name, stats.gpu_type, observation))
        return new

    def reported(self, message: Observed, revision: int) -> None:
        job = self.jobs[message.job_id]
        job.reported += (_key(message.observation),)
        job.estimate_revision = max(job.estimate_revision, revision)

    def records(self) -> list[JobRecord]:
        records = []
        for job in self.saved():
            # Its time is from its submission (profiling and the wait included); refused before it arrived: none.
            submit = next((t for t in (job.submitted_s, job.arrival_s) if t is not None), math.nan)
            state = ("finished" if job.finish_s is not None else "cancelled" if job.cancelled
                     else ("failed" if job.profiled is not None else "rejected") if job.failure
                     else "profiling" if job.profiled is None
                     else "running" if job.placement else "queued")
            stats = job.stats
            records.append(JobRecord(job.spec.id, job.spec.application, submit, job.finish_s, job.restarts,
                                     job.gpu_seconds, None, job.placement, job.failure, job.metric, job.batches,
                                     state=state, gpu_type=self.cluster.placement_type(job.placement),
                                     batch=stats.m * (stats.s + 1) * sum(g for _, g in job.placement)
                                     if stats and job.placement else None))
        return records


# What the node agent takes from the jobs stream, by subject: a submission, then the profiler's word on it.
EVENTS = {subjects.SUBMIT: (NodeAgent.submitted, JobSpec), subjects.REPLAY_SUBMIT: (NodeAgent.submitted, JobSpec),
          subjects.PROFILED: (NodeAgent.profiled, Profiled), subjects.REJECTED: (NodeAgent.rejected, Rejected),
          subjects.CANCEL: (NodeAgent.cancelled, Cancel)}


def _key(observation: Observation) -> tuple[int, int, int, int]:
    return tuple(observation[:4])          # nodes, GPUs, m, s: one configuration


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="local", help="cluster preset or YAML/JSON file (default: %(default)s)")
    parser.add_argument("--executors", choices=["local"], default="local",
                        help="real jobs on this machine's slots (simulated executors: python -m sim.executor)")
    parser.add_argument("--jobs-package", default=JOBS_PACKAGE,
                        help="local: the package whose modules jobs may run (default: %(default)s)")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "goodput-node"),
                        help="local: checkpoints and worker logs; a restarted agent must find them (default: %(default)s)")
    parser.add_argument("--checkpoint-every", type=positive_float,
                        help="local: seconds between a job's periodic checkpoints (default: the job's own, 300)")
    parser.add_argument("--report-every", type=positive_float, default=REPORT_EVERY_S,
                        help="local: seconds between a job's reports of what it measured (default: %(default)s)")


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    agent = NodeAgent(LocalExecutors(load_cluster(args.cluster), workdir, report_every_s=args.report_every,
                                     jobs_package=args.jobs_package, checkpoint_every_s=args.checkpoint_every))
    # Every job is in KV, written before a request is answered: a restarted agent goes on with them,
    # once the workers its predecessor left have checkpointed and stopped.
    states = await storage.open_kv(bus, subjects.NODE_JOBS_BUCKET, NodeJob)
    kept = [entry.value for key in await states.keys() if (entry := await states.get(key)) is not None]
    for job in sorted(kept, key=lambda job: job.seen):       # in the order they came
        agent.restore(job)
    await asyncio.to_thread(agent.executors.stop_leftovers)
    turn = asyncio.Lock()          # one change at a time: a request asked again waits, then finds it done

    kept: dict[str, bytes] = {}          # what KV holds of each job: only a job that changed is written

    async def save() -> None:
        for job in agent.saved():
            state = msgspec.msgpack.encode(job)
            if kept.get(job.spec.id) != state:
                await states.put(job.spec.id, job)
                kept[job.spec.id] = state

    async def on_event(message: msgspec.Raw, delivery) -> None:
        """A submission, or the profiler's word on one (in the stream's order), kept before it is acked."""
        take, kind = EVENTS[delivery.raw.subject]
        try:
            event = bus.decode(message, kind)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return                 # a malformed submission: the profiler records it, with the reason
        async with turn:                 # in a thread: a cancel waits for its workers to checkpoint
            await asyncio.to_thread(take, agent, event, delivery.stream_sequence, delivery.traceparent)
            await save()

    async def on_apply(request: ApplyRequest) -> Ack:
        async with turn:
            agent.tick(request.now_s)
            await asyncio.to_thread(agent.apply, request.now_s, request.placements, request.adaptive, request.failed)
            await save()
        return Ack()

    async def on_advance(request: AdvanceRequest) -> AdvanceReply:
        async with turn:
            agent.tick(request.now_s)
            reply = await asyncio.to_thread(agent.advance, request.now_s, request.step_s, request.jobs)
            await save()                       # the round's counts, before the estimator is waited for
            for message in agent.observations():
                agent.reported(message, await endpoints.report(bus, message))
            await save()
        return reply

    async def on_live(request: LiveJobsRequest) -> LiveJobs:
        async with turn:
            agent.tick(request.now_s)
            live = agent.arrive(request.now_s)
            await save()
        return LiveJobs(tuple(live))

    async def watch() -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                async with turn:
                    if await asyncio.to_thread(agent.poll):
                        await save()
            except Exception:  # noqa: BLE001 - e.g. KV unreachable for a moment: look again next time
                log.exception("looking at the workers failed")

    async def stop_workers() -> None:
        watching.cancel()
        async with turn:                  # no request half done; then no worker is started again
            await asyncio.to_thread(agent.executors.stop_all)

    loop = asyncio.get_running_loop()
    await storage.open_stream(bus, subjects.DEAD_LETTER_STREAM)
    consumer = await storage.open_consumer(bus, subjects.NODE_AGENT_CONSUMER, msgspec.Raw,
                                           span_name="executor.job-event",
                                           dead_letters=subjects.dead_letters(subjects.NODE_AGENT_CONSUMER))
    loop.create_task(consumer.consume(on_event, with_delivery=True))
    watching = loop.create_task(watch())
    bus.on_close(stop_workers)

    return await endpoints.serve_round(
        bus, f"real jobs on {agent.cluster.total_gpus} local slots", facts=agent.facts, apply=on_apply,
        advance=on_advance, live=on_live, records=agent.records,
        count=lambda prefix: sum(1 for name, job in agent.jobs.items()
                                 if name.startswith(prefix) and (job.profiled is not None or job.failure)))
