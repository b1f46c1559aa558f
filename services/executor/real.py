"""The executor service over real training processes (`--executors real`), on the node agents.

It answers the round's requests as the simulated executors do — facts, apply, advance, live,
records — for jobs that really train (`LocalExecutors`: a worker process per GPU, or per CPU slot,
started by the agent of each node a placement touches: `services.node.agent`). The cluster
it schedules is the live nodes: each round, the agents whose membership entry has not lapsed,
less the drained ones (`goodput drain`), checked against `--cluster` when one is given. A node
lost or drained stops its jobs' workers, and the round places them again. The clock is the live run's, paced by the wall clock: a job arrives at the first live round
after the profiler has measured it (`Profiled`); a placement is applied by restarting its workers
at the new world size (they checkpoint first); each round reports the configurations the jobs ran,
with their measured step times, to the estimator, and the jobs that finished or failed since the
last. A job the profiler refused is kept as failed, with the profiler's reason. Every job is kept
in KV (`NodeJob`), so an agent started again (kill -9, an upgrade) goes on with them.

With teams, a job's facts carry its team and priority (its JobSpec's: the API's word), and its
record what the round said of it: the GPUs it holds beyond its team's guarantee (`borrowed`, each
apply's) and the last MAX_RECLAIMS times it was shrunk or stopped for another team's guarantee.

`RealExecutors` is the bookkeeping, without the bus; `RealExecutorService` answers the bus over
it, a handler a method; `start` builds it and wires the handlers to the bus.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import math
import tempfile
import time
import urllib.parse
from collections.abc import Collection, Iterable
from pathlib import Path

import msgspec
from nats import micro

from goodput_train.goodput import Observation
from goodput_train.protocol import REPORT_EVERY_S
from services.executor.local import BusNodes, LocalExecutors
from services.executor.progress import job_progress, main_metric, trained_batches
from shared import executor_endpoints as endpoints
from shared import storage, subjects
from shared.bus import Bus
from shared.bus.kv import TypedKV
from shared.cluster import Cluster, load_cluster, power_of_two_parts, real_node, real_nodes
from shared.code_archive import owned
from shared.lifecycle import JobState, check_transition, job_state
from shared.metrics import JOBS, NODES, instrument
from shared.runner import executors_kind, positive_float
from shared.runtime import JOBS_PACKAGE
from shared.schema.base import Ack, Node, Spots
from shared.schema.estimates import Observed
from shared.schema.jobs import CANCELLED, GOODPUT, Cancel, JobSpec, Profiled, Rejected, verdict_for
from shared.schema.nodes import (
    ALIVE,
    DRAINED,
    LOST,
    DrainAnswer,
    DrainRequest,
    NodeInfo,
    NodeStatus,
    NodeStatuses,
    ProfileRequest,
)
from shared.schema.records import JobRecord, NodeJob, Placed, apart_key
from shared.schema.rounds import (
    AdvanceReply,
    AdvanceRequest,
    ApplyRequest,
    FactsReply,
    JobFacts,
    LiveJobs,
    LiveJobsRequest,
    Reclaim,
)
from shared.subjects import DEFAULT_TEAM
from shared.waits import Needs, needs_of, unplaced_reason, unschedulable, wait_reason

POLL_S = 0.5  # how often the workers are looked at: finishes are timed to this
UNREADABLE = "unreadable"  # a refusal's stand-in id, and its application when none could be read
MAX_RECLAIMS = 5  # the reclaims a job's record keeps, the latest
log = logging.getLogger(__name__)


class RealExecutors:
    """The real jobs (`NodeJob`s beside `LocalExecutors`' workers), on the run's clock: its time is
    the last request's, plus the wall clock since. Its jobs' moves, one method each: `submitted`
    (-> profiling, or rejected: its code is not here), `profiled` (profiling -> queued), `rejected`
    (profiling -> rejected), `cancelled` (profiling, queued or running -> cancelled), `apply`
    (queued <-> running; -> failed), `poll` (running -> finished or failed), `serve_nodes` (running
    -> queued: its nodes are gone). Each passes its change through `check_transition`."""

    def __init__(self, executors: LocalExecutors, spec: Cluster | None = None):
        self.executors = executors
        self.spec = spec  # the cluster the live nodes must belong to, if any
        self.jobs: dict[str, NodeJob] = {}
        self.members: dict[str, NodeInfo] = {}  # the live nodes, as the last round saw them
        self.drained: set[str] = set()
        self.lost: set[str] = set()  # nodes that left unasked (their agents' membership lapsed)
        self.seen: dict[str, NodeInfo] = {}  # every node served since this executor started
        self.profiling: dict[str, str] = {}  # job -> the node the profiler last asked to profile it
        self._misfits: set[str] = set()  # nodes told off once for not being in `spec`
        self.served = False  # whether a round has served the live nodes yet (before: no job is judged)
        self.drained_nodes: tuple[Node, ...] = ()  # the live nodes drained, as the round would see them
        self.schedulable: tuple[Node, ...] = ()  # the live nodes undrained, profiling runs or not
        self._unfit: dict[Needs, str | None] = {}  # why the nodes served cannot take such a job, if so
        self.latest_s = -math.inf  # the newest round applied or run: an older one is stale
        self.team_waits: dict[str, str] = {}  # the last round's jobs waiting on their team's limits, and why
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

    # ---- a job's state ------------------------------------------------------------------------

    def state_of(self, job: NodeJob) -> JobState:
        """A job's place in the lifecycle: where its workers are, else where they were when saved. A
        cancelled job runs until its workers have stopped (they checkpoint, or are killed after the
        grace): its record says so meanwhile."""
        local = self.executors.jobs.get(job.key)
        stopping = self.cancelling(job)
        return job_state(
            finished=job.finish_s is not None,
            cancelled=job.cancelled and not stopping,
            failed=bool(job.failure) and not stopping,
            profiled=job.profiled is not None,
            placed=stopping or bool(local.placement if local is not None else job.placement),
            fits=self.unfit(job) is None,
        )

    def cancelling(self, job: NodeJob) -> bool:
        """Cancelled, its workers not yet stopped."""
        local = self.executors.jobs.get(job.key)
        return job.cancelled and job.finish_s is None and local is not None and local.running

    def unfit(self, job: NodeJob) -> str | None:
        """Why the live nodes, as the last round saw them, cannot take the job however the others
        move (shared/waits.py); None when they can, or before a round has served them."""
        if not self.served:
            return None
        spec = job.spec
        needs = needs_of(spec.requested_gpus, spec.gpu_range[0], spec.fixed_gpus, spec.gpu_types)
        if needs not in self._unfit:
            self._unfit[needs] = unschedulable(needs, self.schedulable, self.drained_nodes)
        return self._unfit[needs]

    def why_waiting(self, job: NodeJob, ahead: int) -> str:
        """What a queued job waits for: free GPUs that fit it, behind `ahead` queued jobs submitted
        before it (of equal worth to the policy, the longest-waiting start first)."""
        if job.name in self.team_waits:
            return self.team_waits[job.name]
        if not self.served:
            return unplaced_reason(ahead)
        spec = job.spec
        held = {name: local.holds for name, local in self.executors.jobs.items() if local.holds}
        needs = needs_of(spec.requested_gpus, spec.gpu_range[0], spec.fixed_gpus, spec.gpu_types)
        # Every schedulable node, the GPUs the profiler's runs take on them counted as theirs.
        return wait_reason(needs, self.schedulable, held, ahead, self.profiling_nodes())

    def _states(self) -> dict[str, JobState]:
        return {key: self.state_of(job) for key, job in self.jobs.items()}

    def _moved(self, before: dict[str, JobState]) -> None:
        """Every job's change since `before` is a move a job makes (else IllegalTransition)."""
        for key, state in before.items():
            job = self.jobs.get(key)
            if job is not None:
                check_transition(state, self.state_of(job), key)

    # ---- kept in KV -------------------------------------------------------------------------

    def saved(self) -> list[NodeJob]:
        """Every job, with what its workers reported so far: what a restarted agent needs."""
        for name, job in self.jobs.items():
            local = self.executors.jobs.get(name)
            if local is not None:
                job.placement, job.restarts, job.crashes, job.stats = (
                    local.placement,
                    local.restarts,
                    local.crashes,
                    local.stats,
                )
                job.generation, job.parts, job.metrics = local.generation, local.parts, local.metrics
                if local.result is not None:
                    job.metric = main_metric(local.result, local.metrics)
                    job.batches = tuple(local.result.get("batches") or trained_batches(local.stats))
        return list(self.jobs.values())

    def restore(self, job: NodeJob) -> None:
        """Take a job back after a restart. Its workers stopped with the old agent; the next apply
        starts them again from their checkpoint (a restart)."""
        self.jobs[job.key] = job
        if job.apart is not None:  # a refusal listed on its own: nothing ever runs
            return
        try:
            self.executors.add(
                job.spec.id,
                job.spec.model,
                *owned(job.spec.own_code, job.owner),
                user=job.submission,
                team=job.spec.team or DEFAULT_TEAM,
            )
        except ValueError as error:  # refused on submission, or its code is gone since
            job.failure = job.failure or str(error)
            return
        local = self.executors.jobs[job.spec.id]
        local.crashes, local.stats, local.failure, local.generation, local.metrics = (
            job.crashes,
            job.stats,
            job.failure,
            job.generation,
            dict(job.metrics),
        )
        if job.finish_s is not None or job.failure is not None:
            local.restarts, local.placement = job.restarts, job.placement  # as it ended
            if job.finish_s is not None:
                local.result, local.announced = {"metric": job.metric, "batches": list(job.batches)}, True
            elif job.parts:  # cancelled while its workers stopped: `stop_leftovers` ends what is left
                local.parts, local.running = job.parts, True
        else:
            # Its workers (still on their nodes, if the agents live) are stopped: they start again.
            local.restarts, local.placement, local.parts = job.restarts, job.placement, job.parts
            local.running = bool(job.parts)  # until `stop_leftovers`
            local.started_on = job.placement if job.parts else ()

    # ---- what the other services tell it ----------------------------------------------------

    # They come in the stream's order: a job's submission before its Profiled or Rejected. Each
    # takes the message, its stream sequence, its trace, and the login and team of its subject.

    def submitted(self, spec: JobSpec, sequence: int = 0, trace: str = "", owner: str = "", team: str = "") -> None:
        known = self.jobs.get(spec.id)
        if known is not None and not (known.failure is not None and known.profiled is None and not known.cancelled):
            return  # another submission holds the id (a refused one gives it up)
        self.executors.jobs.pop(spec.id, None)  # what a refused one under the id left
        self.jobs.pop(spec.id, None)  # ... listed where this one came
        if spec.team is None and team:  # the API sets it; a replay may leave it to the subject
            spec = msgspec.structs.replace(spec, team=team)
        job = self.jobs[spec.id] = NodeJob(
            spec, submission=sequence, seen=sequence, trace=trace, submitted_at=time.time(), owner=owner
        )
        try:
            self.executors.add(
                spec.id, spec.model, *owned(spec.own_code, owner), user=sequence, team=spec.team or DEFAULT_TEAM
            )
        except ValueError as error:
            job.failure = str(error)

    def profiled(self, message: Profiled, _: int = 0, trace: str = "", *__: str) -> None:
        self.profiling.pop(message.job_id, None)
        job = self.jobs.get(message.job_id)
        if job is None:
            log.warning("job %s profiled, but its submission was never read here; ignored", message.job_id)
        elif not verdict_for(message.submission, job.submission):
            log.warning("job %s: a verdict on another submission under its id is ignored", message.job_id)
        elif job.cancelled:
            return  # cancelled while it was being profiled: it never starts
        else:
            before = self.state_of(job)
            if message.init_batch is None:  # a trace-backed profiler's word
                job.failure = "profiled without a run of its own: real jobs need the profiler with --executors real"
            else:
                job.profiled, job.trace = message, job.trace or trace
            check_transition(before, self.state_of(job), job.key)

    def profile_asked(self, job_id: str, node: str) -> None:
        """The profiler asked `node` for a run of the job (what its status says while it is profiled)."""
        self.profiling[job_id] = node

    def profiling_nodes(self) -> list[str]:
        """The nodes running a profile now: of the jobs still waiting for the profiler's verdict."""
        return [
            node
            for job_id, node in self.profiling.items()
            if (job := self.jobs.get(job_id)) is not None and job.profiled is None and job.failure is None
        ]

    def waiting_for(self, job: NodeJob) -> str:
        """What a job being profiled waits for, as far as the executor sees it."""
        node = self.profiling.get(job.spec.id)
        if node is None:
            return "waiting for its profiling run (its script on one GPU of each type it may use)"
        if node in self.lost:
            return (
                f"profiling: node {node} was lost during its run; the profiler runs it again on another node "
                "of its type"
            )
        return f"profiling on node {node}"

    def cancelled(self, message: Cancel, *_: int | str) -> None:
        """Its user's order: a job not yet ended ends cancelled; its workers begin to checkpoint and
        stop (the job reads as cancelled once they have), and the next round hears it ended, so its
        GPUs go back (a job placed on them starts once its workers are gone)."""
        job = self.jobs.get(message.job_id)
        if job is None or job.finish_s is not None or job.failure is not None:
            return
        before = self.state_of(job)
        if message.job_id in self.executors.jobs:  # first: it reads as cancelled once its workers are gone
            self.executors.cancel(message.job_id)
        node = self.profiling.get(message.job_id) if job.profiled is None else None
        if node is not None:  # its profiling run ends now, not at its time limit: the node goes to the next
            self.executors.kill_run(node, message.job_id)
        job.failure, job.cancelled = CANCELLED, True
        check_transition(before, self.state_of(job), job.key)

    def rejected(self, message: Rejected, sequence: int = 0, _: str = "", owner: str = "", team: str = "") -> None:
        """The profiler's refusal of the submission that holds its job: the job's. Any other refusal
        (the API's of a body never stored, one whose id could not be read, another body under a held
        id) is kept apart, listed for its login and team with the id and application it names: no job
        is touched by it, and a submission stored under its id later takes the id whatever order the
        two came in."""
        job = self.jobs.get(message.job_id) if message.job_id is not None else None
        if job is not None and verdict_for(message.submission, job.submission):
            if job.profiled is None and job.failure is None:  # else it has its verdict (read again)
                self.profiling.pop(job.key, None)
                before = self.state_of(job)
                job.failure = message.reason
                check_transition(before, self.state_of(job), job.key)
            return
        owner, team = endpoints.refused_whose(message.subject, owner, team)
        self.jobs[apart_key(sequence)] = NodeJob(
            JobSpec(UNREADABLE, message.application or UNREADABLE, team=team),
            failure=message.reason,
            seen=sequence,
            apart=message.job_id or "",
            owner=owner,
        )

    # ---- the nodes --------------------------------------------------------------------------

    def serve_nodes(self, members: dict[str, NodeInfo], drained: set[str]) -> tuple[Node, ...]:
        """The round's nodes: the live members, less the drained ones and those `spec` does not
        know. A job with workers on a node that is not among them (lost, drained) waits for this
        round's placement, and its workers stop everywhere (in the background)."""
        usable = {name: info for name, info in members.items() if name not in drained and self._in_spec(info)}
        self.seen.update(members)
        for name in set(usable) - set(self.members):
            log.info("node %s joined: %d %s", name, usable[name].gpus, usable[name].gpu_type)
        for name in set(self.members) - set(usable):
            log.warning("node %s %s", name, "drained" if name in drained else "lost")
        self.lost = (self.lost | (set(self.members) - set(members))) - set(members)
        gone = {node for local in self.executors.jobs.values() for node, _ in local.parts} - set(usable)
        if gone:
            before = self._states()
            stopped = self.executors.lose(gone, lost=gone - set(members))
            self._moved(before)
            if stopped:
                log.warning(
                    "jobs %s stop: their nodes %s are gone; they are placed again",
                    ", ".join(stopped),
                    ", ".join(sorted(gone)),
                )
        self.members, self.drained = usable, set(drained)
        self.schedulable = cluster_nodes(usable.values())[0]
        self.drained_nodes = cluster_nodes(info for name, info in members.items() if name in drained)[0]
        self.served, self._unfit = True, {}
        training = {real_node(n) for local in self.executors.jobs.values() for n, _ in (*local.holds, *local.parts)}
        nodes, real = cluster_nodes(lent_to_profiling(usable.values(), self.profiling_nodes(), training))
        self.executors.cluster, self.executors.real = Cluster("live", nodes), real
        record_nodes(members, drained, self.seen)
        return nodes

    def _in_spec(self, info: NodeInfo) -> bool:
        if self.spec is None:
            return True
        machine = real_nodes(self.spec).get(info.name)
        fits = machine is not None and (machine.gpus, machine.gpu_type) == (info.gpus, info.gpu_type)
        if not fits and info.name not in self._misfits:
            self._misfits.add(info.name)
            log.warning(
                "node %s (%d %s) is not in cluster %s as it says: not used",
                info.name,
                info.gpus,
                info.gpu_type,
                self.spec.name,
            )
        return fits

    def node_statuses(self, members: dict[str, NodeInfo], drained: set[str]) -> NodeStatuses:
        """Every node: the live ones (alive or drained), and those seen since this executor started
        that are gone (lost), by name."""
        self.seen.update(members)
        return NodeStatuses(
            tuple(
                NodeStatus(
                    name,
                    info.gpu_type,
                    info.gpus,
                    LOST if name not in members else DRAINED if name in drained else ALIVE,
                    tuple(self.jobs_on(name)),
                )
                for name, info in sorted(self.seen.items())
            )
        )

    def jobs_on(self, node: str) -> list[str]:
        return sorted(name for name, local in self.executors.jobs.items() if any(n == node for n, _ in local.parts))

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
            job_id=spec.id,
            application=spec.model,
            submit_s=job.arrival_s,
            age_s=now - job.arrival_s,
            requested_gpus=spec.requested_gpus,
            requested_batch=spec.requested_batch or profiled.init_batch,
            rigid=spec.fixed_gpus,
            init_batch=profiled.init_batch,
            max_batch=profiled.max_batch,
            min_gpus=spec.gpu_range[0],
            max_gpus=spec.gpu_range[1],
            fixed_batch=spec.fixed_batch,
            restarts=local.restarts,
            attained_gpu_s=job.gpu_seconds,
            attained_by_type=dict(job.by_type),
            placement=local.placement,
            iterations=float(steps),
            # Stopping, waiting for its GPUs, or started and not yet heard from: restarting (a
            # torchrun script reports nothing: it runs once started).
            mid_restart=local.in_transition or (local.running and not local.heard and spec.launcher == GOODPUT),
            slice_iterations=float(max(steps - job.slice_steps, 0)) if local.placement else 0.0,
            idle_since_s=None if local.placement else job.arrival_s if job.idle_since_s is None else job.idle_since_s,
            max_gpus_seen=job.max_gpus_seen,
            grad_sqr=stats.grad_sqr if stats else None,
            grad_var=stats.grad_var if stats else None,
            epochs=stats.epochs if stats else 0.0,
            # The submission's declaration; else the target the job's own code reports.
            target_epochs=spec.target_epochs
            if spec.target_epochs is not None
            else stats.target_epochs
            if stats
            else None,
            estimate_revision=job.estimate_revision,
            trace=job.trace,
            team=spec.team or DEFAULT_TEAM,
            priority=spec.priority,
        )

    def apply(
        self,
        now: float,
        placements: dict[str, Spots],
        adaptive: bool = True,
        failed: dict[str, str] | None = None,
        borrowed: dict[str, int] | None = None,
        reclaims: dict[str, Reclaim] | None = None,
        waits: dict[str, str] | None = None,
    ) -> None:
        """Start, move, resize or stop workers: each changed job's transition begins (its workers
        checkpoint and stop, then start on its new GPUs once they are free). Under a
        policy that does not adapt batches, and for rigid and strong-scaling jobs, the workers keep
        their batch. An older round's placements (a late or repeated apply: a deposed leader's)
        never undo a newer's. `borrowed` (each job's GPUs beyond its team's guarantee: absent, none),
        `reclaims` (the jobs the round shrank or stopped for a team's guarantee) and `waits` (the
        jobs it left waiting on their team's limits) are the round's word on its jobs, kept for their
        records."""
        if now < self.latest_s:
            return
        self.latest_s = now
        self.team_waits = dict(waits or {})
        for name, job in self.jobs.items():
            job.borrowed = (borrowed or {}).get(name, 0)
            reclaim = (reclaims or {}).get(name)
            if reclaim is not None and reclaim not in job.reclaims:  # the same round applied again adds it once
                job.reclaims = (*job.reclaims, reclaim)[-MAX_RECLAIMS:]
        before = self._states()
        for name, reason in (failed or {}).items():  # the round gave up on it (or heard it was cancelled)
            job = self.jobs.get(name)
            if job is not None and job.finish_s is None:
                job.failure = job.failure or reason
                job.ended_in = now if job.ended_in is None else job.ended_in
        for name, job in self.jobs.items():
            spots = tuple(placements.get(name, ()))
            local = self.executors.jobs.get(name)
            if local is None or spots == local.placement or job.finish_s is not None or job.failure:
                continue
            local.adaptive = adaptive and not (job.spec.fixed_gpus or job.spec.fixed_batch)
            if spots:
                job.max_gpus_seen = max(job.max_gpus_seen, sum(g for _, g in spots))
                job.slice_steps = local.stats.steps if local.stats else 0
            else:
                job.idle_since_s = now
        self.executors.apply(placements)
        self._placed(now)
        self._moved(before)

    def _placed(self, now: float) -> bool:
        """Each job whose workers were started on a new placement since: that placement, from `now`.
        Whether there was one."""
        placed = False
        for name, job in self.jobs.items():
            local = self.executors.jobs.get(name)
            spots = tuple((node, len(ranks)) for node, ranks in local.parts) if local is not None else ()
            if spots and (not job.placements or job.placements[-1].spots != spots):
                job.placements += (Placed(now, spots),)
                placed = True
        return placed

    def poll(self) -> bool:
        """Look at the workers, and take in the stops and starts that have answered: a job that
        finished or failed is timed now, on the run's clock. Whether anything worth keeping changed
        (what KV holds of a job's workers included: where they run, their generation)."""
        before = self._states()
        finished = set(self.executors.poll())
        changed = bool(finished)
        for name, job in self.jobs.items():
            local = self.executors.jobs.get(name)
            if name in finished:
                job.finish_s = self.now()
            elif local is not None and local.failure and job.failure is None:
                job.failure, changed = local.failure, True
            changed |= local is not None and (
                local.crashes,
                local.restarts,
                local.placement,
                local.parts,
                local.generation,
            ) != (job.crashes, job.restarts, job.placement, job.parts, job.generation)
        changed |= self._placed(self.now())
        self._moved(before)
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
            local = self.executors.jobs.get(name)  # none: a job refused on submission
            stats = local.stats if local else None
            if stats is None or not stats.gpu_type:
                continue
            told = job.reported if job.reported_type == stats.gpu_type else ()  # moved: all new on this type
            for observation in stats.observations:
                if _key(observation) not in told:
                    new.append(Observed(name, stats.gpu_type, observation))
        return new

    def reported(self, message: Observed, revision: int) -> None:
        job = self.jobs[message.job_id]
        if job.reported_type != message.gpu_type:
            job.reported, job.reported_type = (), message.gpu_type
        job.reported += (_key(message.observation),)
        job.estimate_revision = max(job.estimate_revision, revision)

    def records(self) -> list[JobRecord]:
        records, queued = [], 0  # queued jobs so far, in submission order: those ahead of the next
        for job in self.saved():
            # Its time is from its submission (profiling and the wait included); refused before it arrived: none.
            submit = next((t for t in (job.submitted_s, job.arrival_s) if t is not None), math.nan)
            state = self.state_of(job)
            local = self.executors.jobs.get(job.key)
            cancelling = self.cancelling(job)
            # Where it runs: a cancelled job whose workers still stop, where they are.
            where = tuple((node, len(ranks)) for node, ranks in local.parts) if cancelling else job.placement
            reason = (
                self.waiting_for(job)
                if state == JobState.PROFILING
                else self.why_waiting(job, queued)
                if state == JobState.QUEUED
                else self.unfit(job)
                if state == JobState.UNSCHEDULABLE
                else None
            )
            moving = self.executors.transition(job.key) if local is not None else None
            if moving:
                reason = moving if reason is None else f"{reason}; {moving}"
            records.append(
                JobRecord(
                    job.name,
                    job.spec.model,
                    submit,
                    job.finish_s,
                    job.restarts,
                    job.gpu_seconds,
                    None,
                    where,
                    None if cancelling else job.failure,  # not ended yet: its reason says it was cancelled
                    job.metric,
                    job.batches,
                    state=state,
                    gpu_type=self.cluster.placement_type(where),
                    batch=local.batch() if local else None,
                    placements=job.placements,
                    reason=reason,
                    owner=job.owner,
                    team=job.spec.team or DEFAULT_TEAM,
                    held=job.apart is None and state == JobState.REJECTED,
                    borrowed=job.borrowed if state == JobState.RUNNING else 0,
                    reclaims=job.reclaims,
                    metrics=job.metrics,
                    progress=job_progress(
                        job.stats,
                        job.profiled.init_batch if job.profiled else None,
                        local.parts if local and local.heard and state == JobState.RUNNING else (),
                        local.rate if local else None,
                        job.spec.target_epochs,
                    ),
                )
            )
            queued += state == JobState.QUEUED
        return records


def record_nodes(members: Collection[str], drained: Collection[str], seen: Iterable[str]) -> None:
    """goodput_nodes: the live nodes (`members`) alive or drained, and those `seen` since this
    executor started that are gone (lost), as `node_statuses` tells them."""
    counts = dict.fromkeys((ALIVE, DRAINED, LOST), 0)
    for name in seen:
        counts[LOST if name not in members else DRAINED if name in drained else ALIVE] += 1
    nodes = instrument(NODES)
    for state, count in counts.items():
        nodes.set(count, {"state": state})


# What the node agent takes from the jobs stream, by subject: a submission, then the profiler's word on it.
EVENTS = {
    subjects.STORED: (RealExecutors.submitted, JobSpec),
    subjects.REPLAY_SUBMIT: (RealExecutors.submitted, JobSpec),
    subjects.PROFILED: (RealExecutors.profiled, Profiled),
    subjects.REJECTED: (RealExecutors.rejected, Rejected),
    subjects.REFUSED: (RealExecutors.rejected, Rejected),
    subjects.CANCEL: (RealExecutors.cancelled, Cancel),
}


def lent_to_profiling(members, profiling: Iterable[str], training: Collection[str]) -> list[NodeInfo]:
    """The nodes a round may place jobs on while profiling runs go on: each run takes one GPU of a
    node that trains no job (a node of one is left out); a node training jobs is left whole (their
    placements stand, and the profiler takes a node that trains nothing when there is one)."""
    runs: dict[str, int] = {}
    for name in profiling:
        runs[name] = runs.get(name, 0) + 1
    lent = [
        info if info.name in training else msgspec.structs.replace(info, gpus=info.gpus - runs.get(info.name, 0))
        for info in members
    ]
    return [info for info in lent if info.gpus > 0]


def cluster_nodes(members) -> tuple[tuple[Node, ...], dict[str, str]]:
    """The nodes the policy sees for live members (by type, then name): a node whose GPU count is no
    power of two is split into virtual nodes that are (6 -> `<name>-v0` of 4, `<name>-v1` of 2),
    as a cluster file's are; and each virtual node's real one."""
    nodes, real = [], {}
    for info in sorted(members, key=lambda info: (info.gpu_type, info.name)):
        parts = power_of_two_parts(info.gpus)
        for v, gpus in enumerate(parts):
            name = f"{info.name}-v{v}" if len(parts) > 1 else info.name
            nodes.append(Node(name, info.gpu_type, gpus))
            real[name] = info.name
    return tuple(nodes), real


def _key(observation: Observation) -> tuple[int, int, int, int]:
    return tuple(observation[:4])  # nodes, GPUs, m, s: one configuration


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--executors",
        type=executors_kind,
        choices=["real"],
        default="real",
        help="real jobs on the node agents' GPUs or CPU slots (simulated executors: python -m services.simulated)",
    )
    parser.add_argument(
        "--cluster",
        help="the cluster the nodes must belong to: a preset or YAML/JSON file (default: any node an agent serves)",
    )
    parser.add_argument(
        "--jobs-package", default=JOBS_PACKAGE, help="the package whose modules jobs may run (default: %(default)s)"
    )
    parser.add_argument(
        "--checkpoints",
        default=f"file://{Path(tempfile.gettempdir()) / 'goodput-checkpoints'}",
        help="where jobs checkpoint: a folder every node reads and writes (file:///shared/dir or a "
        "path), or jetstream: for JetStream's object store, which the node agents copy "
        "checkpoints in and out of (default: %(default)s)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=positive_float,
        help="seconds between a job's periodic checkpoints (default: the job's own, 300)",
    )
    parser.add_argument(
        "--report-every",
        type=positive_float,
        default=REPORT_EVERY_S,
        help="seconds between a job's reports of what it measured (default: %(default)s)",
    )
    parser.add_argument(
        "--collective-timeout",
        type=positive_float,
        help="seconds a job's collective waits for a lost peer (default: the library's, 60)",
    )


JETSTREAM_CHECKPOINTS = "jetstream:"


def checkpoint_folder(url: str) -> Path | None:
    """The folder a checkpoint URL names (`file:///a/b` or a plain path), or None for JetStream's
    object store (`jetstream:`); ValueError for anything else."""
    if url == JETSTREAM_CHECKPOINTS:
        return None
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("", "file") or (parsed.scheme == "file" and parsed.netloc not in ("", "localhost")):
        raise ValueError(
            f"--checkpoints {url!r}: checkpoints go to a folder every node reads (file:///path "
            f"or a path, e.g. a ReadWriteMany volume) or to JetStream's object store "
            f"({JETSTREAM_CHECKPOINTS})"
        )
    return Path(urllib.parse.unquote(parsed.path) if parsed.scheme else url)


async def live_members(
    members: TypedKV[NodeInfo], drained: TypedKV[DrainRequest]
) -> tuple[dict[str, NodeInfo], set[str]]:
    """The nodes whose agents renewed their entry within its time to live, and the drained ones."""
    return await members.values(), set(await drained.keys())


class RealExecutorService:
    """The real executors' answers to the bus, over `RealExecutors` (the jobs' bookkeeping, kept in
    KV) and the node agents' membership. A job's moves, one handler each:

    - `on_event`, by the jobs stream's subject: a submission read -> profiling; the profiler's
      acceptance: profiling -> queued; a refusal: profiling -> rejected; a cancel: profiling,
      queued or running -> cancelled
    - `on_apply` (a round's placements): queued <-> running; -> failed (the round gave up on it)
    - `watch` (the workers looked at, the stops and starts that answered taken in, at once when
      one does): running -> finished or failed; a job whose workers finished as they were being
      stopped -> finished; a cancelled job whose workers have stopped -> cancelled
    - `on_live` (a round begins): running -> queued for the jobs on nodes lost or drained

    `on_advance` looks at the workers as `watch` does, counts the round and reports what the jobs
    measured; `on_drain`, `on_nodes` and `on_profile_request` concern the nodes. Every change is in
    KV before a request is answered (`save`)."""

    def __init__(
        self,
        bus: Bus,
        agent: RealExecutors,
        states: TypedKV[NodeJob],
        members: TypedKV[NodeInfo],
        drained: TypedKV[DrainRequest],
    ):
        self.bus = bus
        self.agent = agent
        self.states = states
        self.members = members
        self.drained = drained
        self.turn = asyncio.Lock()  # one change at a time: a request asked again waits, then finds it done
        self.kept: dict[str, bytes] = {}  # what KV holds of each job: only a job that changed is written
        self.watching: asyncio.Task | None = None
        self.woken = asyncio.Event()  # a node answered a stop or a start: look now, not at the next POLL_S

    def wake(self, loop: asyncio.AbstractEventLoop) -> None:
        """(From a node call's thread.) Let `watch` take its answer in now."""
        loop.call_soon_threadsafe(self.woken.set)

    async def load(self) -> None:
        """Take back the jobs KV holds; the workers a predecessor left checkpoint and stop (in the
        background, unless the executors block), and the rounds place them again."""
        for job in sorted((await self.states.values()).values(), key=lambda job: job.seen):  # in the order they came
            self.agent.restore(job)
        await asyncio.to_thread(self.agent.executors.stop_leftovers)

    async def save(self) -> None:
        """Write the jobs that changed to KV; goodput_jobs counts them by state as they pass (every
        state, zeros included: a state that empties reads 0)."""
        by_state = dict.fromkeys(JobState, 0)
        for job in self.agent.saved():
            by_state[self.agent.state_of(job)] += 1
            encoded = msgspec.msgpack.encode(job)
            if self.kept.get(job.key) != encoded:
                await self.states.put(job.key, job)
                self.kept[job.key] = encoded
        jobs = instrument(JOBS)
        for state, count in by_state.items():
            jobs.set(count, {"state": state.value})

    async def on_event(self, message: msgspec.Raw, delivery) -> None:
        """A submission, or the profiler's word on one (in the stream's order), kept before it is acked."""
        subject, team, owner = subjects.owner_of(delivery.raw.subject)
        take, kind = EVENTS[subject]
        try:
            event = self.bus.decode(message, kind)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # a malformed submission: the profiler records it, with the reason
        async with self.turn:  # in a thread; a cancel's stop goes on in the background
            await asyncio.to_thread(
                take, self.agent, event, delivery.stream_sequence, delivery.traceparent, owner, team
            )
            await self.save()

    async def on_apply(self, request: ApplyRequest) -> Ack:
        agent = self.agent
        async with self.turn:
            agent.tick(request.now_s)
            await asyncio.to_thread(
                agent.apply,
                request.now_s,
                request.placements,
                request.adaptive,
                request.failed,
                request.borrowed,
                request.reclaims,
                request.waits,
            )
            await self.save()
        return Ack()

    async def on_advance(self, request: AdvanceRequest) -> AdvanceReply:
        agent = self.agent
        async with self.turn:
            agent.tick(request.now_s)
            reply = await asyncio.to_thread(agent.advance, request.now_s, request.step_s, request.jobs)
            await self.save()  # the round's counts, before the estimator is waited for

            async def reported(message: Observed, revision: int) -> None:
                agent.reported(message, revision)

            await endpoints.report_all(self.bus, agent.observations(), reported)
            await self.save()
        return reply

    async def live_members(self) -> tuple[dict[str, NodeInfo], set[str]]:
        return await live_members(self.members, self.drained)

    async def on_live(self, request: LiveJobsRequest) -> LiveJobs:
        """A round begins: its nodes (the live ones; jobs on lost or drained ones stop), its jobs."""
        live_nodes = await self.live_members()
        agent = self.agent
        async with self.turn:
            agent.tick(request.now_s)
            nodes = await asyncio.to_thread(agent.serve_nodes, *live_nodes)
            live = agent.arrive(request.now_s)
            await self.save()
        return LiveJobs(tuple(live), nodes)

    async def on_drain(self, request: DrainRequest) -> DrainAnswer:
        if not subjects.NODE_NAME.match(request.node):
            raise ValueError(f"{request.node[:100]!r} is no node name: 1-64 letters, digits, '-' or '_'")
        if request.undo:
            await self.drained.delete(request.node)
        else:
            await self.drained.put(request.node, request)
        known = request.node in (await self.live_members())[0]
        return DrainAnswer(request.node, not request.undo, tuple(self.agent.jobs_on(request.node)), known)

    async def on_nodes(self, _: Ack) -> NodeStatuses:
        return self.agent.node_statuses(*await self.live_members())

    async def on_profile_request(self, request: ProfileRequest, raw) -> None:
        """Where the profiler runs a job (its requests to the agents, read as they pass): its status says so."""
        profiled_on = subjects.node_of_subject(raw.subject, "profile")
        if profiled_on is not None:
            self.agent.profile_asked(request.job_id, profiled_on)

    async def watch(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.woken.wait(), POLL_S)
            self.woken.clear()
            try:
                async with self.turn:
                    if await asyncio.to_thread(self.agent.poll):
                        await self.save()
            except Exception:
                log.exception("looking at the workers failed")

    async def stop_workers(self) -> None:
        if self.watching is not None:
            self.watching.cancel()
        async with self.turn:  # no request half done; then no worker is started again
            await asyncio.to_thread(self.agent.executors.stop_all)

    def count(self, prefix: str) -> int:
        """Jobs whose id begins with `prefix` that have the profiler's verdict."""
        return sum(
            1
            for name, job in self.agent.jobs.items()
            if name.startswith(prefix) and (job.profiled is not None or job.failure)
        )


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    try:
        checkpoints = checkpoint_folder(args.checkpoints)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if checkpoints is not None:  # made private (the umask) if new; an operator's own folder keeps its mode
        checkpoints.mkdir(parents=True, exist_ok=True)
    loop = asyncio.get_running_loop()
    executors = LocalExecutors(
        BusNodes(bus, loop),
        checkpoints,
        report_every_s=args.report_every,
        jobs_package=args.jobs_package,
        checkpoint_every_s=args.checkpoint_every,
        collective_timeout_s=args.collective_timeout,
        blocking=False,  # no round waits for a job's stop: each job's transition goes on on its own
    )
    agent = RealExecutors(executors, load_cluster(args.cluster) if args.cluster else None)
    # Every job is in KV, written before a request is answered: a restarted executor goes on with
    # them, once the workers its predecessor left have checkpointed and stopped.
    service = RealExecutorService(
        bus,
        agent,
        await storage.open_kv(bus, subjects.NODE_JOBS_BUCKET, NodeJob),
        await storage.open_kv(bus, subjects.NODES_BUCKET, NodeInfo),
        await storage.open_kv(bus, subjects.DRAINED_BUCKET, DrainRequest),
    )
    executors.wake = functools.partial(service.wake, loop)
    await service.load()

    await bus.subscribe(
        subjects.node_subject("*", "profile"),
        ProfileRequest,
        service.on_profile_request,
        with_raw=True,
        span_name="executor.profile-seen",
    )
    await endpoints.consume_job_events(bus, subjects.NODE_AGENT_CONSUMER, service.on_event)
    service.watching = loop.create_task(service.watch())
    bus.on_close(service.stop_workers)

    endpoint_service = await endpoints.serve_round(
        bus,
        "real jobs on the node agents",
        facts=agent.facts,
        apply=service.on_apply,
        advance=service.on_advance,
        live=service.on_live,
        records=agent.records,
        count=service.count,
        nodes=service.on_nodes,
    )
    await bus.add_endpoint(
        endpoint_service, "drain", subjects.EXECUTOR_DRAIN, DrainRequest, service.on_drain, parts=False
    )
    return endpoint_service
