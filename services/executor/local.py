"""Real jobs over the node agents: the executor service's side of `--executors real`.

`LocalExecutors` keeps each job's workers where the rounds place it. A placement is a list of
(node, GPUs); each node's agent (`services.node.agent`) starts its share of the ranks, in
placement order, for one generation of the job: the node of rank 0 picks the rendezvous port and
the others are told it (torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; GOODPUT_NODES, GOODPUT_JOB_ID, GOODPUT_GPU_TYPE). A changed placement stops the
workers everywhere (SIGTERM: the library checkpoints, every rank at the same step; SIGKILL after
the grace) and starts them on the new one (the library resumes from the checkpoint at the new world
size), each job's transition beside the others': no job's stop holds up another's, nor the caller
when it does not block; a start waits only for the stops that hold its new GPUs. Checkpoints are
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

Its methods are called from one thread at a time (the executor service runs them in a thread, one
after another); each node call runs in a thread of its own. `Nodes` is how it reaches the agents:
over the bus (`BusNodes`), or agents' `NodeWorkers` in this process (`InProcessNodes`, for tests).
"""

from __future__ import annotations

import asyncio
import base64
import enum
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

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
    JobStats,
    clean_metrics,
)
from shared import subjects
from shared.bus import Bus
from shared.bus.encoding import Refused
from shared.cluster import Cluster
from shared.metrics import JOB_RESTARTS, instrument
from shared.runtime import ENVIRONMENT_FAILED_KEPT_S, ENVIRONMENT_MAX_S, JOBS_PACKAGE, STOP_TIMEOUT_S, job_module
from shared.schema.base import Ack, Spots
from shared.schema.jobs import CANCELLED
from shared.schema.nodes import CANNOT_RUN, NodeReport, Rendezvous, StartWorkers, StopWorkers, WorkersReport
from shared.subjects import DEFAULT_TEAM

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
            if error.code == CANNOT_RUN:
                raise Refused(error.description, None, CANNOT_RUN) from None
            raise ValueError(error.description) from None

    def start(self, node: str, order: StartWorkers) -> Rendezvous:
        building = ENVIRONMENT_MAX_S if order.requirements else 0.0  # its environment may be built first
        return self._call(node, "start", order, Rendezvous, self.timeout_s + STOP_TIMEOUT_S + building)

    def stop(self, node: str, request: StopWorkers) -> WorkersReport:
        return self._call(node, "stop", request, WorkersReport, self.timeout_s + request.grace_s)

    def poll(self, node: str) -> NodeReport:
        return self._call(node, "poll", Ack(), NodeReport, self.timeout_s)


class Why(enum.StrEnum):
    """Why a job's workers are stopped (as its record says it): what follows once every node has
    stopped them."""

    MOVE = "it was placed anew"  # they start again there (if anywhere), from their checkpoint
    ENDED = "they ended"  # exited, crashed, or a node forgot them: it finished, restarts or fails
    LOST = "a node of theirs left"  # lost or drained: the job waits for the round's placement
    CANCEL = "it was cancelled"  # its user's order: it ends cancelled
    FAILED_START = "its start failed"  # on a node: the workers it started elsewhere stop
    LEFTOVER = "the executor restarted"  # a predecessor's: the round places it again
    CLOSE = "the executor is stopping"  # for good


@dataclass
class Stop:
    """A stop of a job's workers under way: every node asked at once, each stops them with the
    grace (SIGTERM, then SIGKILL), and its answer comes in a thread of its own."""

    why: Why
    calls: dict[str, Future]  # node -> its WorkersReport
    grace_s: float
    kill: bool
    since: float  # monotonic
    counted: bool = False  # a restart was counted as it began (taken back if the job finished meanwhile)
    crashed: WorkersReport | None = None  # ENDED: the report of a node where one crashed
    complete: bool = True  # ENDED: every node still knew its workers

    def freed(self, node: str) -> bool:
        """Whether the job's workers on `node` are gone (its answer is in; a lost node is not asked)."""
        call = self.calls.get(node)
        return call is None or call.done()

    def left_s(self) -> float:
        """The seconds until its workers are killed at the latest."""
        return 0.0 if self.kill else max(0.0, self.since + self.grace_s - time.monotonic())


@dataclass
class LocalJob:
    job_id: str
    application: str
    placement: Spots = ()  # where it should run (the round's word), or ran when it ended
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()  # the nodes its workers run on now, and their ranks
    generation: int = 0  # one per start of its workers (a node ignores an older order)
    running: bool = False  # its workers of this generation were started (or are starting), not yet seen ended
    started_on: Spots = ()  # the placement its running workers were started for
    stopping: Stop | None = None  # its workers' stop, under way
    starting: Future | None = None  # its workers' start, under way: the nodes started, and any error
    preparing: dict[str, float] = field(default_factory=dict)  # ... building its environment: node -> seconds so far
    waits: tuple[str, ...] = ()  # the jobs whose stopping workers hold the GPUs its start waits for
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
    requirements: tuple[str, ...] = ()  # ... in an environment with these packages
    user: int | None = None  # its user's number on the nodes (its submission's: StartWorkers.user)
    team: str = DEFAULT_TEAM  # its team's (StartWorkers.team: its output goes to its team's logs)

    @property
    def holds(self) -> Spots:
        """The GPUs it holds: none once it ended (its placement stays as it ended, for its record)."""
        return () if self.result is not None or self.failure else self.placement

    @property
    def busy(self) -> bool:
        """Whether its workers are being stopped or started (a node's answer is to come)."""
        return self.stopping is not None or self.starting is not None

    @property
    def in_transition(self) -> bool:
        """Between two placements: its workers stopping or starting, or its start waiting for GPUs."""
        return self.busy or bool(self.waits)

    def restarted(self) -> None:
        """Its workers were stopped to start again from their checkpoint: one restart, counted."""
        self.restarts += 1
        instrument(JOB_RESTARTS).add(1)

    def batch(self) -> int | None:
        """The total batch its running workers train at, from a report of this run of theirs and its
        replicas (None until they report: the last run's word is not theirs, e.g. before it grew)."""
        if not (self.running and self.heard and self.stats) or self.busy:
            return None
        return self.stats.m * (self.stats.s + 1) * sum(len(ranks) for _, ranks in self.parts)


def node_parts(spots: Spots, real: Mapping[str, str]) -> list[tuple[str, int]]:
    """A placement on the cluster's (possibly virtual) nodes as GPUs per real node, in placement order."""
    parts: dict[str, int] = {}
    for node, gpus in spots:
        parts[real.get(node, node)] = parts.get(real.get(node, node), 0) + gpus
    return list(parts.items())


def spots_text(spots: Spots) -> str:
    """`local-0:2, local-1:2`."""
    return ", ".join(f"{node}:{gpus}" for node, gpus in spots)


class LocalExecutors:
    """The real jobs' workers on the nodes. A job's way from the workers it has to the placement it
    should have is a transition of its own, run beside every other job's: its workers' stop (every
    node at once, each with the grace, then SIGKILL), then, once the GPUs of its new placement are
    free (another job's workers stopping there are waited for, no one else), its start. The node
    calls run in threads; what they answer is taken in, and each job's next step decided, by the
    caller's thread (`_settle`, in every method): nothing else touches the jobs.

    `blocking` (scripts, tests): each method returns once the transitions are done. The executor
    service runs with `blocking=False`: a method returns at once, the transitions go on, `poll`
    takes their answers in, and `wake` is called from a node call's thread when one has answered."""

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
        grace_s: float = STOP_TIMEOUT_S,
        blocking: bool = True,
        wake: Callable[[], None] | None = None,
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
        self.grace_s = grace_s  # a stop's: SIGTERM, then this long to checkpoint, then SIGKILL
        self.blocking = blocking
        self.wake = wake
        self.jobs: dict[str, LocalJob] = {}
        self.closing = False  # stopping for good: a worker that exits is not restarted
        self._answered = threading.Event()  # a node call has answered since it was cleared
        # A team's requirements a node could not install, lately: when (monotonic), and why (the
        # installer's lines). Another team's job asking the same is tried (its own trouble is its own).
        self.uninstallable: dict[tuple[str, tuple[str, ...]], tuple[float, str]] = {}

    def add(
        self,
        job_id: str,
        application: str,
        code: str = "",
        entrypoint: str = "",
        args: tuple[str, ...] = (),
        requirements: tuple[str, ...] = (),
        user: int | None = None,
        team: str = DEFAULT_TEAM,
    ) -> None:
        """A job to run: a module of the jobs package (`application`), or its own code (`code`, the
        archive its node agents fetch; `entrypoint` and `args`, what they run of it, with the
        Python packages `requirements`). `user`: the
        number of its workers' user on every node (its submission's; None: each node hashes its id);
        `team`: its team's."""
        try:
            if not code:
                job_module(application, self.jobs_package)
        except ValueError as error:
            raise ValueError(f"job {job_id}: {error}") from None
        self.jobs.setdefault(
            job_id,
            LocalJob(
                job_id,
                application,
                code=code,
                entrypoint=entrypoint,
                args=args,
                requirements=requirements,
                user=user,
                team=team,
            ),
        )

    def apply(self, placements: Mapping[str, Spots]) -> None:
        """Give each job its placement: a changed one's workers stop (they checkpoint, and free their
        GPUs) and start again on its new nodes, each job's transition beside the others'. A job whose
        workers are still stopping or starting takes the newest placement after that."""
        if self.closing:
            return
        for job in self.jobs.values():
            spots = tuple(placements.get(job.job_id, ()))
            if spots != job.placement and job.result is None and not job.failure:
                job.placement = spots
        self._settle()
        self._done()

    def poll(self) -> list[str]:
        """Take the node calls' answers and the workers' reports; the jobs that finished since the
        last poll (also one that finished just as it was being stopped). A job between two
        placements is left to its transition: a node that no longer lists its stopping workers is no crash."""
        self._settle()
        running = [job for job in self.jobs.values() if job.running and not job.busy]
        # Those whose start may be building their environment: how long it has taken, for their status.
        starting = [job for job in self.jobs.values() if job.starting is not None and job.requirements]
        reports: dict[str, dict[str, WorkersReport]] = {}
        preparing: dict[str, dict[str, float]] = {}
        for node in {node for job in (*running, *starting) for node, _ in job.parts}:
            try:
                polled = self.nodes.poll(node)
            except NodeGone:
                reports[node] = None  # unknown this time: its jobs wait for the membership's word
            else:
                reports[node] = {report.job_id: report for report in polled.jobs}
                preparing[node] = polled.preparing
        for job in starting:
            job.preparing = {
                node: preparing[node][job.job_id] for node, _ in job.parts if job.job_id in preparing.get(node, {})
            }
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
            complete = len(current) == len(mine)
            self._stop(job, Why.ENDED, kill=crashed is not None or not complete, crashed=crashed, complete=complete)
        self._done()
        finished = [
            job for job in self.jobs.values() if job.result is not None and not job.running and not job.announced
        ]
        for job in finished:
            job.announced = True
        return [job.job_id for job in finished]

    def lose(self, nodes: set[str], lost: set[str] = frozenset()) -> list[str]:
        """Nodes gone from the round (drained, or `lost`: their agents are dead): each job with
        workers there, or placed there, waits for the round's placement, and its workers stop
        everywhere. On a drained node they checkpoint as on any stop; a lost node's are not asked,
        and their peers elsewhere get LOST_GRACE_S (they may be stuck waiting for them). The jobs
        taken off them."""
        hit = []
        for job in self.jobs.values():
            there = any(node in nodes for node, _ in job.parts)
            placed = any(node in nodes for node, _ in node_parts(job.placement, self.real))
            if job.result is not None or job.failure or not (there or placed):
                continue
            hit.append(job.job_id)
            job.placement = ()
            if job.running and not job.busy:
                touches_lost = any(node in lost for node, _ in job.parts)
                self._stop(job, Why.LOST, grace_s=LOST_GRACE_S if touches_lost else None, skip=lost)
        self._settle()
        self._done()
        return hit

    def cancel(self, job_id: str) -> None:
        """Stop a job for good, as its user asked: its workers checkpoint and stop; it gives up its GPUs."""
        job = self.jobs[job_id]
        # Cancelled, never finished: also when its workers end as they are being stopped.
        job.failure, job.placement, job.result = CANCELLED, (), None
        self._settle()
        self._done()

    def kill_run(self, node: str, job_id: str) -> None:
        """End a job's run on a node where it has no workers (its profiling run): killed, nothing to save."""

        def told(call: Future) -> None:
            if call.exception() is not None:
                log.warning("job %s: its run on %s: %s", job_id, node, call.exception())

        call = self._call(f"kill {job_id} on {node}", self.nodes.stop, node, StopWorkers(job_id, kill=True))
        call.add_done_callback(told)
        if self.blocking:
            wait([call])

    def stop_leftovers(self) -> None:
        """After the executor restarted: the workers its predecessor left running on the nodes
        (restored jobs marked running) checkpoint and stop; the next apply starts them again (a
        cancelled job's, whose stop was under way, end)."""
        for job in self.jobs.values():
            if job.running and not job.busy:
                job.placement = ()
                self._stop(job, Why.CANCEL if job.failure else Why.LEFTOVER)
        self._done()

    def stop_all(self) -> None:
        """Stopping for good (blocking): every job's workers checkpoint and stop, all at once."""
        self.closing = True
        self._settle()
        self._wait()

    def transition(self, job_id: str) -> str | None:
        """What a job's workers are doing between two placements, in words; None when nothing."""
        job = self.jobs.get(job_id)
        if job is None:
            return None
        stop, starting = job.stopping, job.starting  # once each: `poll` may take them in meanwhile
        if stop is not None:
            nodes = ", ".join(node for node, call in stop.calls.items() if not call.done()) or "its nodes"
            how = (
                "killing them"
                if stop.kill
                else f"they checkpoint (SIGTERM) and are killed in {stop.left_s():.0f} s if still running"
            )
            then = f"; then it starts on {spots_text(job.placement)}" if job.placement and not job.failure else ""
            return f"stopping its workers on {nodes} ({stop.why}): {how}{then}"
        if starting is not None:
            building = dict(job.preparing)
            if building:
                where = ", ".join(f"{node} ({seconds:.0f} s so far)" for node, seconds in sorted(building.items()))
                return f"preparing its environment (its requirements) on {where}; then its workers start on {spots_text(job.placement)}"
            return f"starting its workers on {spots_text(job.placement)}"
        if job.waits:
            stops = [self.jobs[name].stopping for name in job.waits]
            left = max((stop.left_s() for stop in stops if stop is not None), default=0.0)
            return (
                f"starting on {spots_text(job.placement)} once the workers stopping there free its GPUs "
                f"(killed in {left:.0f} s at the latest)"
            )
        return None

    # ---- transitions --------------------------------------------------------------------------

    def _done(self) -> None:
        """Blocking: wait for every transition; else return at once."""
        if self.blocking:
            self._wait()

    def _wait(self) -> None:
        """Take answers in until no node call is under way (and so no start waits)."""
        while True:
            self._answered.clear()  # before looking: an answer from now on wakes the wait below
            self._settle()
            if not any(job.busy for job in self.jobs.values()):
                return
            self._answered.wait(1.0)

    def _settle(self) -> None:
        """Take in the stops and starts that have answered, then take each job's next step: a
        running job that should not run there (moved, cancelled, or the executor closing) stops; a
        job with no workers that should run starts, once the GPUs of its placement are free."""
        for job in self.jobs.values():
            if job.stopping is not None and all(call.done() for call in job.stopping.calls.values()):
                self._stopped(job)
            if job.starting is not None and job.starting.done():
                self._started(job)
        for job in self.jobs.values():
            if job.busy:
                continue
            job.waits = ()
            if job.running:
                if self.closing or job.failure or job.placement != job.started_on:
                    why = Why.CLOSE if self.closing else Why.CANCEL if job.failure else Why.MOVE
                    self._stop(job, why)
            elif job.placement and job.result is None and not job.failure and not self.closing:
                job.waits = self._held_by_stops(job)
                if not job.waits:
                    self._start(job)

    def _held_by_stops(self, job: LocalJob) -> tuple[str, ...]:
        """The jobs whose stopping workers hold GPUs the job's placement needs: on each of its
        nodes, those stopping there when the node's GPUs (all of them, when the cluster does not
        say) less what every other job's workers take there are fewer than it needs. Running jobs
        are never waited for: the round placed it beside them."""
        held: set[str] = set()
        others = [other for other in self.jobs.values() if other is not job]
        for node, gpus in node_parts(job.placement, self.real):
            stopping = [other.job_id for other in others if other.stopping and self._occupies(other, node)]
            if not stopping:
                continue
            capacity = sum(n.gpus for n in self.cluster.nodes if self.real.get(n.name, n.name) == node)
            if not capacity or sum(self._occupies(other, node) for other in others) + gpus > capacity:
                held.update(stopping)
        return tuple(sorted(held))

    @staticmethod
    def _occupies(job: LocalJob, node: str) -> int:
        """The GPUs the job's workers take on a node now (none once that node has stopped them)."""
        if job.stopping is not None and job.stopping.freed(node):
            return 0
        return sum(len(ranks) for n, ranks in job.parts if n == node)

    def _call(self, name: str, call: Callable, *args) -> Future:
        """`call(*args)` in a thread of its own (a node's answer may take a stop's grace); `wake` is
        called once it has answered."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(call(*args))
            except Exception as error:  # noqa: BLE001 - its reader decides
                future.set_exception(error)
            self._answered.set()
            if self.wake is not None:
                try:
                    self.wake()
                except Exception:  # noqa: BLE001 - the caller is gone (its loop closed): poll finds it
                    log.debug("could not wake the executor after %s", name)

        threading.Thread(target=run, name=name, daemon=True).start()
        return future

    def _stop(
        self,
        job: LocalJob,
        why: Why,
        kill: bool = False,
        grace_s: float | None = None,
        skip: set[str] = frozenset(),
        crashed: WorkersReport | None = None,
        complete: bool = True,
    ) -> None:
        """Begin stopping the job's workers on every node they run on (not `skip`: lost), all at once."""
        grace = self.grace_s if grace_s is None else grace_s
        counted = why in (Why.MOVE, Why.LOST, Why.LEFTOVER)
        if counted:
            job.restarted()
        calls = {
            node: self._call(
                f"stop {job.job_id} on {node}", self.nodes.stop, node, StopWorkers(job.job_id, grace, kill)
            )
            for node, _ in job.parts
            if node not in skip
        }
        job.stopping = Stop(why, calls, grace, kill, time.monotonic(), counted, crashed, complete)
        log.info("job %s: stopping its workers on %s (%s)", job.job_id, ", ".join(calls) or "no node", why)

    def _stopped(self, job: LocalJob) -> None:
        """Its workers have stopped everywhere: read their last word. It finished if every one of
        them had exited with code 0 before it was signalled, none after the stopped mark (a node says
        `stopped` of workers it signalled while one ran), and it was not cancelled; else what its
        stop was for follows."""
        stop, job.stopping = job.stopping, None
        reports = []
        for node, call in stop.calls.items():
            try:
                report = call.result()
            except (NodeGone, ValueError) as error:
                log.warning("job %s: %s", job.job_id, error)
                continue
            if report.generation == job.generation:
                self._take(job, report)
                reports.append(report)
        took = time.monotonic() - stop.since
        if not stop.kill and took >= stop.grace_s:
            log.warning(
                "job %s: its workers took %.0f s to stop (grace %.0f s): killed", job.job_id, took, stop.grace_s
            )
        ended_on = job.started_on
        done = job.result is None and not job.failure and finished(job.parts, reports)
        job.parts, job.running, job.started_on = (), False, ()
        if done:
            job.result, job.placement = job.outcome or {}, ended_on  # its placement as it ended
            if stop.counted:
                job.restarts -= 1  # it finished: no restart
            return
        if stop.why != Why.ENDED or job.result is not None or job.failure or self.closing:
            return
        if stop.crashed is not None:
            job.crashes += 1
            if job.crashes >= self.max_crashes:
                rank, code = next(
                    (rank, code) for rank, code in zip(stop.crashed.ranks, stop.crashed.codes) if code not in (None, 0)
                )
                job.failure = (
                    f"its workers crashed {job.crashes} times (exit code {code} on rank {rank}); "
                    f"the end of its stderr:\n{stop.crashed.error or 'no error output'}"
                )
                job.placement = ()
        elif stop.complete:  # the stopped mark, no stop asked and its agents alive
            job.crashes, job.unasked = job.crashes + 1, job.unasked + 1
            if job.crashes >= self.max_crashes:
                job.failure = (
                    f"its workers stopped {job.unasked} times without being asked (the library's stopped "
                    "mark, but goodput asked no stop: a SIGTERM from outside goodput?)"
                    + ("" if job.unasked == job.crashes else f"; it also crashed {job.crashes - job.unasked} times")
                )
                job.placement = ()
        else:  # a node no longer knows them (its agent restarted and stopped them): not the job's doing
            job.restarted()
        # Else it starts again from its last checkpoint, where it is placed (`_settle`).

    def _start(self, job: LocalJob) -> None:
        """Begin starting the job's workers on its placement, node after node, rank 0's first (it
        answers the rendezvous); a job whose requirements a node could not install lately fails at once."""
        failed = self.uninstallable.get((job.team, job.requirements)) if job.requirements else None
        if failed is not None and time.monotonic() - failed[0] < ENVIRONMENT_FAILED_KEPT_S:
            job.failure, job.placement = failed[1], ()
            return
        parts = node_parts(job.placement, self.real)
        world = sum(gpus for _, gpus in parts)
        gpu_type = self.cluster.placement_type(job.placement) or ""
        job.generation += 1
        job.heard, job.outcome, job.first_heard = False, None, None
        env = {
            REPORT_ENV: str(self.report_every_s),
            ADAPTIVE_ENV: str(int(job.adaptive)),
            # As torchrun counts them: the restarts after a crash so far, and how many it may have.
            "TORCHELASTIC_RESTART_COUNT": str(job.crashes),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_crashes - 1),
        }
        if self.checkpoint_every_s is not None:
            env[CHECKPOINT_ENV] = str(self.checkpoint_every_s)
        if self.collective_timeout_s is not None:
            env[COLLECTIVE_TIMEOUT_ENV] = str(self.collective_timeout_s)
        orders, first = [], 0
        for group, (node, gpus) in enumerate(parts):
            order = StartWorkers(
                job.job_id,
                job.application,
                job.generation,
                tuple(range(first, first + gpus)),
                world,
                len(parts),
                gpu_type,
                "" if self.checkpoints is None else str(self.checkpoints / job.job_id / f"{job.job_id}.pt"),
                env,
                store=f"{job.job_id}.pt" if self.checkpoints is None else "",
                code=job.code,
                entrypoint=job.entrypoint,
                args=job.args,
                requirements=job.requirements,
                user=job.user,
                team=job.team,
                group=group,
            )
            orders.append((node, order))
            first += gpus
        # Its GPUs are taken from now on: another job's start waits for them, and a successor's
        # stop finds them in KV.
        job.parts = tuple((node, order.ranks) for node, order in orders)
        job.running, job.started_on = True, job.placement
        job.starting = self._call(f"start {job.job_id}", self._start_nodes, orders)

    def _start_nodes(self, orders: list[tuple[str, StartWorkers]]) -> tuple[list[str], Exception | None]:
        """(In a thread.) The nodes told to start their workers, in order; and the error that ended it
        early, if any."""
        started, rendezvous = [], None
        for node, order in orders:
            if rendezvous is not None:
                order = msgspec.structs.replace(order, master_addr=rendezvous.address, master_port=rendezvous.port)
            try:
                answer = self.nodes.start(node, order)
            except Exception as error:  # noqa: BLE001 - NodeGone, ValueError: read by `_started`
                return started, error
            rendezvous = rendezvous or answer
            started.append(node)
        return started, None

    def _started(self, job: LocalJob) -> None:
        """Its start answered: its workers run on the nodes that started them; if one could not, those
        stop (killed) and it waits for the round's placement (or fails, when it cannot run anywhere)."""
        call, job.starting, job.preparing = job.starting, None, {}
        started, error = call.result()
        job.parts = tuple((node, ranks) for node, ranks in job.parts if node in started)
        if error is None:
            return
        log.warning("job %s could not start on %s: %s", job.job_id, spots_text(job.placement), error)
        job.placement = ()
        if isinstance(error, Refused) and error.code == CANNOT_RUN:  # its packages cannot be installed
            job.failure = str(error)
            self.uninstallable[job.team, job.requirements] = (time.monotonic(), job.failure)
        elif isinstance(error, ValueError):  # the job's own trouble (its code gone), not a node's
            job.crashes += 1
            if job.crashes >= self.max_crashes:
                job.failure = f"its workers could not start {job.crashes} times: {error}"
        if job.parts:
            self._stop(job, Why.FAILED_START, kill=True)
        else:
            job.running, job.started_on = False, ()

    # ---- what the workers say -----------------------------------------------------------------

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
