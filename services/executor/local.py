"""Real jobs over the node agents: the executor service's side of `--executors real`.

`LocalExecutors` keeps each job's workers where the rounds place it. A placement is a list of
(node, GPUs); each node's agent (`services.node.agent`) starts its share of the ranks, in
placement order, for one generation of the job: the node of rank 0 picks the rendezvous port and
the others are told it (torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; GOODPUT_NODES, GOODPUT_JOB_ID, GOODPUT_GPU_TYPE). A changed placement stops the
workers everywhere (SIGTERM: the library checkpoints, every rank at the same step) and starts them
on the new one (the library resumes from the checkpoint at the new world size); checkpoints are
files in a folder every node reads (`--checkpoints`; a job's in a folder of its own there,
`<job>/<job>.pt`, its user's alone), or objects in JetStream's object store that the agents copy in
and out (`--checkpoints jetstream:`).

It collects the `JobStats` and metrics the workers print and notices when a job finishes — every
worker has exited with code 0, none after the library's stopped mark (an outcome line is optional:
its numbers are metrics too) — or crashes: a worker that exits with an error, on any node, takes
the job's others down everywhere (they would wait for it in a collective, at most the library's
collective timeout) and the job restarts from its last checkpoint; after `max_crashes` it fails,
with the last lines its worker wrote to stderr. A stop it asked for is never the end: a worker
that was still running when its agent signalled it is to be resumed, whatever its exit code.
Workers that stopped unasked (the stopped mark, their agents alive: a SIGTERM from outside goodput)
restart, and each such stop counts toward `max_crashes`, so they cannot restart forever; workers a
node no longer knows (its agent restarted) restart with nothing counted. A node that is lost takes
its jobs' workers with it: those jobs stop everywhere and the next round places them again.

It is blocking code (the executor service runs it in a thread); `Nodes` is how it reaches the
agents: over the bus (`BusNodes`), or agents' `NodeWorkers` in this process (`InProcessNodes`, for tests).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Protocol

import msgspec
import nats.errors
from nats.micro.request import ServiceError

from goodput_train.protocol import (
    ADAPTIVE_ENV,
    CHECKPOINT_ENV,
    COLLECTIVE_TIMEOUT_ENV,
    OUTCOME_PREFIX,
    REPORT_ENV,
    REPORT_EVERY_S,
    STATS_PREFIX,
    clean_metrics,
)
from shared import subjects
from shared.bus import Bus
from shared.cluster import Cluster, Spots
from shared.metrics import JOB_RESTARTS, instrument
from shared.runtime import JOBS_PACKAGE, STOP_TIMEOUT_S, job_module
from shared.schema import CANCELLED, Ack, JobStats, NodeReport, Rendezvous, StartWorkers, StopWorkers, WorkersReport

MAX_CRASHES = 3
LOST_GRACE_S = 5.0  # a lost node's peers: this long to stop (they may be stuck waiting for it)
log = logging.getLogger(__name__)


class NodeGone(Exception):
    """A node's agent did not answer (lost, or stopping)."""


class Nodes(Protocol):
    def start(self, node: str, order: StartWorkers) -> Rendezvous: ...
    def stop(self, node: str, request: StopWorkers) -> WorkersReport: ...
    def poll(self, node: str) -> NodeReport: ...


class NodeAgent(Protocol):
    """One node's workers, as a node agent's `NodeWorkers` serves them."""

    def start(self, order: StartWorkers) -> Rendezvous: ...
    def stop(self, request: StopWorkers) -> WorkersReport: ...
    def poll(self) -> NodeReport: ...


class InProcessNodes:
    """Node agents' workers in this process (no bus), by node name."""

    def __init__(self, workers: Mapping[str, NodeAgent]):
        self.workers = dict(workers)

    def _node(self, node: str) -> NodeAgent:
        if node not in self.workers:
            raise NodeGone(node)
        return self.workers[node]

    def start(self, node: str, order: StartWorkers) -> Rendezvous:
        return self._node(node).start(order)

    def stop(self, node: str, request: StopWorkers) -> WorkersReport:
        return self._node(node).stop(request)

    def poll(self, node: str) -> NodeReport:
        return self._node(node).poll()


class BusNodes:
    """The node agents over NATS, from the executor's worker thread (its calls wait for the answer)."""

    def __init__(self, bus: Bus, loop: asyncio.AbstractEventLoop, timeout_s: float = 10.0):
        self.bus, self.loop, self.timeout_s = bus, loop, timeout_s

    def _call(self, node: str, endpoint: str, message, reply_type, timeout_s: float):
        request = self.bus.request(subjects.node_subject(node, endpoint), message, reply_type, timeout=timeout_s)
        try:
            return asyncio.run_coroutine_threadsafe(request, self.loop).result(timeout_s + 5)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError) as error:
            raise NodeGone(f"node {node} did not answer {endpoint}: {type(error).__name__}") from None
        except ServiceError as error:
            raise ValueError(error.description) from None

    def start(self, node: str, order: StartWorkers) -> Rendezvous:
        return self._call(node, "start", order, Rendezvous, self.timeout_s + STOP_TIMEOUT_S)

    def stop(self, node: str, request: StopWorkers) -> WorkersReport:
        return self._call(node, "stop", request, WorkersReport, self.timeout_s + request.grace_s)

    def poll(self, node: str) -> NodeReport:
        return self._call(node, "poll", Ack(), NodeReport, self.timeout_s)


@dataclass
class LocalJob:
    job_id: str
    application: str
    placement: Spots = ()
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()  # the nodes its workers run on now, and their ranks
    generation: int = 0  # one per start of its workers (a node ignores an older order)
    running: bool = False  # its workers of this generation were started, not yet seen ended
    stats: JobStats | None = None
    result: dict | None = None  # once it has finished: its outcome line ({} without one)
    outcome: dict | None = None  # the outcome line its workers of this run printed, if any
    metrics: dict[str, float | str] = field(default_factory=dict)  # the latest value of each it reported
    rate: float | None = None  # statistical epochs per second, over its current run's reports
    first_heard: tuple[float, float] | None = None  # (monotonic time, epochs) of its run's first report
    restarts: int = 0
    crashes: int = 0  # its workers' crashes, and their stops nobody asked for (`unasked`)
    unasked: int = 0
    failure: str | None = None
    announced: bool = False  # its finish returned by `poll` once
    heard: bool = False  # its workers have reported since they were last started
    adaptive: bool = True  # its workers re-tune their batch (else they keep it)
    code: str = ""  # its own code: the archive in the code store ("": `application` is a job module)
    entrypoint: str = ""  # ... what in it runs, with these arguments
    args: tuple[str, ...] = ()
    user: int | None = None  # its user's number on the nodes (its submission's: StartWorkers.user)

    @property
    def holds(self) -> Spots:
        """The GPUs it holds: none once it ended (its placement stays as it ended, for its record)."""
        return () if self.result is not None or self.failure else self.placement

    def restarted(self) -> None:
        """Its workers were stopped to start again from their checkpoint: one restart, counted."""
        self.restarts += 1
        instrument(JOB_RESTARTS).add(1)

    def batch(self) -> int | None:
        """The total batch its running workers train at, from a report of this run of theirs and its
        replicas (None until they report: the last run's word is not theirs, e.g. before it grew)."""
        if not (self.running and self.heard and self.stats):
            return None
        return self.stats.m * (self.stats.s + 1) * sum(len(ranks) for _, ranks in self.parts)


def node_parts(spots: Spots, real: Mapping[str, str]) -> list[tuple[str, int]]:
    """A placement on the cluster's (possibly virtual) nodes as GPUs per real node, in placement order."""
    parts: dict[str, int] = {}
    for node, gpus in spots:
        parts[real.get(node, node)] = parts.get(real.get(node, node), 0) + gpus
    return list(parts.items())


class LocalExecutors:
    def __init__(
        self,
        nodes: Nodes,
        checkpoints: Path | None,
        cluster: Cluster | None = None,
        real: Mapping[str, str] | None = None,
        max_crashes: int = MAX_CRASHES,
        report_every_s: float = REPORT_EVERY_S,
        jobs_package: str = JOBS_PACKAGE,
        checkpoint_every_s: float | None = None,
        collective_timeout_s: float | None = None,
    ):
        self.nodes = nodes
        self.checkpoints = checkpoints  # a folder every node reads; None: the checkpoints store
        self.cluster = cluster or Cluster("none", ())
        self.real = dict(real or {})  # a virtual node's real one (a node split in powers of two)
        self.max_crashes = max_crashes
        self.report_every_s = report_every_s
        self.jobs_package = jobs_package
        self.checkpoint_every_s = checkpoint_every_s  # None: each job's own (the library's 5 min)
        self.collective_timeout_s = collective_timeout_s  # None: the library's (60 s)
        self.jobs: dict[str, LocalJob] = {}
        self.closing = False  # stopping for good: a worker that exits is not restarted

    def add(
        self,
        job_id: str,
        application: str,
        code: str = "",
        entrypoint: str = "",
        args: tuple[str, ...] = (),
        user: int | None = None,
    ) -> None:
        """A job to run: a module of the jobs package (`application`), or its own code (`code`, the
        archive its node agents fetch; `entrypoint` and `args`, what they run of it). `user`: the
        number of its workers' user on every node (its submission's; None: each node hashes its id)."""
        try:
            if not code:
                job_module(application, self.jobs_package)
        except ValueError as error:
            raise ValueError(f"job {job_id}: {error}") from None
        self.jobs.setdefault(
            job_id, LocalJob(job_id, application, code=code, entrypoint=entrypoint, args=args, user=user)
        )

    def apply(self, placements: Mapping[str, Spots]) -> None:
        """Give each job its placement: every changed one stops its workers first (they checkpoint,
        and free their GPUs), then each starts again on its new nodes."""
        if self.closing:
            return
        changed = [
            job
            for job in self.jobs.values()
            if tuple(placements.get(job.job_id, ())) != job.placement and job.result is None and not job.failure
        ]
        for job in changed:
            if job.running:
                self._stop(job)
                if job.result is None:  # else it finished as it was being stopped
                    job.restarted()
        for job in changed:
            if job.result is None:
                job.placement = tuple(placements.get(job.job_id, ()))
                if job.placement:
                    self._start(job)

    def poll(self) -> list[str]:
        """Take the workers' reports; the jobs that finished since the last poll (also one that
        finished just as it was being stopped)."""
        running = [job for job in self.jobs.values() if job.running]
        reports: dict[str, dict[str, WorkersReport]] = {}
        for node in {node for job in running for node, _ in job.parts}:
            try:
                reports[node] = {report.job_id: report for report in self.nodes.poll(node).jobs}
            except NodeGone:
                reports[node] = None  # unknown this time: its jobs wait for the membership's word
        for job in running:
            if any(reports[node] is None for node, _ in job.parts):
                continue
            mine = [reports[node].get(job.job_id) for node, _ in job.parts]
            current = [r for r in mine if r is not None and r.generation == job.generation]
            for report in current:
                self._take(job, report)
            codes = [code for report in current for code in report.codes]
            crashed = next((r for r in current if any(c not in (None, 0) for c in r.codes)), None)
            if crashed is None and len(current) == len(mine) and None in codes:
                continue  # running
            self._stop(job, kill=crashed is not None or len(current) < len(mine))
            if job.result is not None or self.closing:
                continue
            if crashed is not None:
                job.crashes += 1
                if job.crashes >= self.max_crashes:
                    rank, code = next(
                        (rank, code) for rank, code in zip(crashed.ranks, crashed.codes) if code not in (None, 0)
                    )
                    job.failure = (
                        f"its workers crashed {job.crashes} times (exit code {code} on rank {rank}); "
                        f"the end of its stderr:\n{crashed.error or 'no error output'}"
                    )
                    job.placement = ()
                    continue
            elif len(current) == len(mine):  # the stopped mark, no stop asked and its agents alive
                job.crashes, job.unasked = job.crashes + 1, job.unasked + 1
                if job.crashes >= self.max_crashes:
                    job.failure = (
                        f"its workers stopped {job.unasked} times without being asked (the library's stopped "
                        "mark, but goodput asked no stop: a SIGTERM from outside goodput?)"
                        + ("" if job.unasked == job.crashes else f"; it also crashed {job.crashes - job.unasked} times")
                    )
                    job.placement = ()
                    continue
            else:  # a node no longer knows them (its agent restarted and stopped them): not the job's doing
                job.restarted()
            self._start(job)  # from its last checkpoint
        finished = [
            job for job in self.jobs.values() if job.result is not None and not job.running and not job.announced
        ]
        for job in finished:
            job.announced = True
        return [job.job_id for job in finished]

    def lose(self, nodes: set[str], lost: set[str] = frozenset()) -> list[str]:
        """Nodes gone from the round (drained, or `lost`: their agents are dead): each job with
        workers there stops everywhere and waits for the round's placement. On a drained node they
        checkpoint as on any stop; a lost node's are not asked, and their peers elsewhere get
        LOST_GRACE_S (they may be stuck waiting for them). The jobs it stopped."""
        hit = [job for job in self.jobs.values() if job.running and any(node in nodes for node, _ in job.parts)]
        for job in hit:
            touches_lost = any(node in lost for node, _ in job.parts)
            self._stop(job, grace_s=LOST_GRACE_S if touches_lost else STOP_TIMEOUT_S, skip=lost)
            if job.result is None:
                job.placement = ()
                job.restarted()
        return [job.job_id for job in hit]

    def cancel(self, job_id: str) -> None:
        """Stop a job for good, as its user asked: its workers checkpoint and stop; it gives up its GPUs."""
        job = self.jobs[job_id]
        if job.running:
            self._stop(job)
        # Cancelled, never finished: also when its workers ended as they were being stopped.
        job.failure, job.placement, job.result = CANCELLED, (), None

    def stop_leftovers(self) -> None:
        """After the executor restarted: the workers its predecessor left running on the nodes
        (restored jobs marked running) checkpoint and stop; the next apply starts them again."""
        for job in self.jobs.values():
            if job.running:
                self._stop(job)
                if job.result is None:
                    job.restarted()
                    job.placement = ()

    def stop_all(self) -> None:
        self.closing = True
        for job in self.jobs.values():
            if job.running:
                self._stop(job)

    # ---- workers --------------------------------------------------------------------------

    def _start(self, job: LocalJob) -> None:
        """Start the job's workers on its placement, rank 0's node first (it answers the rendezvous)."""
        parts = node_parts(job.placement, self.real)
        world = sum(gpus for _, gpus in parts)
        gpu_type = self.cluster.placement_type(job.placement) or ""
        job.generation += 1
        job.heard, job.outcome, job.first_heard = False, None, None
        env = {REPORT_ENV: str(self.report_every_s), ADAPTIVE_ENV: str(int(job.adaptive))}
        if self.checkpoint_every_s is not None:
            env[CHECKPOINT_ENV] = str(self.checkpoint_every_s)
        if self.collective_timeout_s is not None:
            env[COLLECTIVE_TIMEOUT_ENV] = str(self.collective_timeout_s)
        started, first, rendezvous = [], 0, None
        job.parts, job.running = (), True
        try:
            for node, gpus in parts:
                ranks = tuple(range(first, first + gpus))
                first += gpus
                order = StartWorkers(
                    job.job_id,
                    job.application,
                    job.generation,
                    ranks,
                    world,
                    len(parts),
                    gpu_type,
                    "" if self.checkpoints is None else str(self.checkpoints / job.job_id / f"{job.job_id}.pt"),
                    env,
                    *((rendezvous.address, rendezvous.port) if rendezvous else ()),
                    store=f"{job.job_id}.pt" if self.checkpoints is None else "",
                    code=job.code,
                    entrypoint=job.entrypoint,
                    args=job.args,
                    user=job.user,
                )
                answer = self.nodes.start(node, order)
                rendezvous = rendezvous or answer
                started.append((node, ranks))
                job.parts = tuple(started)
        except (NodeGone, ValueError) as error:
            log.warning("job %s could not start on %s: %s", job.job_id, job.placement, error)
            self._stop(job, kill=True)
            job.placement = ()
            if isinstance(error, ValueError):  # the job's own trouble (its code gone), not a node's
                job.crashes += 1
                if job.crashes >= self.max_crashes:
                    job.failure = f"its workers could not start {job.crashes} times: {error}"

    def _stop(
        self, job: LocalJob, kill: bool = False, grace_s: float = STOP_TIMEOUT_S, skip: set[str] = frozenset()
    ) -> None:
        """Stop its workers on every node they run on (not `skip`: lost), and read their last word:
        it finished if every one of them had exited with code 0 before it was signalled, none after
        the stopped mark (a node says `stopped` of workers it signalled while one ran)."""
        reports = []
        for node, _ in job.parts:
            if node in skip:
                continue
            try:
                report = self.nodes.stop(node, StopWorkers(job.job_id, grace_s, kill))
            except NodeGone as error:
                log.warning("job %s: %s", job.job_id, error)
                continue
            if report.generation == job.generation:
                self._take(job, report)
                reports.append(report)
        if job.result is None and finished(job.parts, reports):
            job.result = job.outcome or {}
        job.parts, job.running = (), False

    def _take(self, job: LocalJob, report: WorkersReport) -> None:
        """What a node's workers of the job printed: its latest stats (and the epoch rate since its
        run's first), its metrics, its outcome (whose numbers and short strings are metrics too)."""
        if report.metrics:
            job.metrics = clean_metrics({**job.metrics, **report.metrics})[0]
        try:
            if report.stats:
                stats = msgspec.msgpack.decode(base64.b64decode(report.stats[len(STATS_PREFIX) :]), type=JobStats)
                if stats != job.stats:
                    job.stats, job.heard = stats, True
                    self._measure_rate(job, stats)
            if report.outcome:
                outcome = json.loads(report.outcome[len(OUTCOME_PREFIX) :])
                if not isinstance(outcome, dict):
                    raise ValueError(f"an outcome is a JSON object, not {type(outcome).__name__}")
                if not outcome.get("stopped"):  # a SIGTERM's outcome: it will be started again
                    job.outcome = outcome
                    values = {k: v for k, v in outcome.items() if k != "stopped" and isinstance(v, (int, float, str))}
                    job.metrics = clean_metrics({**job.metrics, **values})[0]
        except (ValueError, RecursionError, msgspec.DecodeError) as error:  # a job's own output must not stop us
            log.warning("job %s: unreadable report: %s", job.job_id, error)

    @staticmethod
    def _measure_rate(job: LocalJob, stats: JobStats) -> None:
        """Epochs per second over this run's reports (a new placement trains at its own rate)."""
        now = time.monotonic()
        if job.first_heard is None:
            job.first_heard = (now, stats.epochs)
        elif now > job.first_heard[0] and stats.epochs > job.first_heard[1]:
            job.rate = (stats.epochs - job.first_heard[1]) / (now - job.first_heard[0])


def finished(parts: tuple[tuple[str, tuple[int, ...]], ...], reports: list[WorkersReport]) -> bool:
    """Whether a job's workers (its `parts`) all exited with code 0, none after the stopped mark nor
    after a stop the executor asked for (`stopped`, either way), as the nodes' `reports` of this run
    say: a job's end is its exit code, as for a Kubernetes Job."""
    ranks = {rank for _, ranks in parts for rank in ranks}
    exited = {rank for report in reports for rank, code in zip(report.ranks, report.codes) if code == 0}
    return bool(ranks) and exited == ranks and not any(report.stopped for report in reports)
