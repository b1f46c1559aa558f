"""The policy service: the round leader, one replica at a time, and its standbys.

Replicas campaign for a KV lease (services.policy.lease); the one holding it runs the rounds. On a
simulated cluster a run is a whole replay on the virtual clock — the next round starts as soon as
the executors have applied and advanced the last — each stage a request to its service
(sim.bus_wiring), each decision by the named policy. The run's checkpoint (its request and clock,
`RunCheckpoint`) lives in KV and is rewritten after every decision and every round; each round run
is appended to the run's log, which the driver follows. A standby that takes the lease resumes
every unfinished run from its checkpoint: a decided round is carried out as decided (every stage
may be asked twice), so the schedule is the one the old leader would have made. Checkpoints are
written compare-and-set, so a deposed leader that wakes up is refused at its next step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket

import msgspec
import nats.errors
from nats import micro

from services.policy.base import make_policy
from services.policy.lease import Leadership, LeaseLost
from services.runner import new_service, positive_float
from shared import subjects
from shared.bus import Bus, RevisionConflict, TypedKV
from shared.cluster import Cluster, load_cluster
from shared.reference import WorkloadJob
from shared.schema import Ack, Lease, RunCheckpoint, RunClock, RunStep
from sim.bus_wiring import BusWiring, LiveFeed
from sim.run import simulation_settings
from sim.simulator import Simulator

LEASE_TTL_S = 5.0
IDLE_POLL_S = 0.1
RESUME_AFTER_S = 0.5
# A run that fails is resumed from its checkpoint (the NATS server restarting fails a round's
# requests and writes); only when it fails this often in a row at the same round does it fail.
RESUME_TRIES = 3
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="sia-hetero-64", help="cluster preset or YAML/JSON file")
    parser.add_argument("--lease-ttl", type=positive_float, default=LEASE_TTL_S,
                        help="seconds a leader's lease lasts unrenewed: a standby takes over within it "
                             "(default: %(default)s)")


class RunJournal:
    """A run's progress, written as the leader makes it: the checkpoint (compare-and-set on our own
    last revision, and only while we lead) and the run's log."""

    def __init__(self, bus: Bus, runs: TypedKV[RunCheckpoint], checkpoint: RunCheckpoint, revision: int,
                 leadership: Leadership):
        self.bus = bus
        self.runs = runs
        self.request = checkpoint.request
        self.revision = revision
        self.leadership = leadership
        self.clock = checkpoint.clock           # as last checkpointed

    async def decided(self, clock: RunClock) -> None:
        await self._save(clock)

    async def stepped(self, clock: RunClock, step: RunStep) -> None:
        self.leadership.check()
        run_id = self.request.run_id
        await self.bus.js_publish(subjects.run_log(run_id), step, msg_id=f"{run_id}.{step.round}")
        await self._save(clock, over=step.over)

    async def fail(self, reason: str) -> None:
        # At the last checkpoint's round: the log has not had it, so the step is neither
        # de-duplicated nor skipped by the driver.
        clock = self.clock
        step = RunStep(clock.round, clock.now_s, None, (), (), clock.done, len(self.request.jobs),
                       over=True, failure=reason)
        await self.stepped(clock, step)

    async def _save(self, clock: RunClock, over: bool = False) -> None:
        self.leadership.check()
        try:
            self.revision = await self.runs.update(self.request.run_id, RunCheckpoint(self.request, clock, over),
                                                   self.revision)
            self.clock = clock
        except RevisionConflict:
            raise LeaseLost(f"run {self.request.run_id} was checkpointed by another leader") from None


async def run(bus: Bus, cluster: Cluster, cluster_arg: str, journal: RunJournal, clock: RunClock) -> None:
    """Run (or resume) one replay to its end."""
    request = journal.request
    try:
        policy = make_policy(request.policy, **request.policy_options)
        settings = simulation_settings(request.calibration, cluster_arg, round_s=request.round_s,
                                       horizon_s=request.horizon_s)
    except ValueError as error:
        await journal.fail(str(error))
        return
    # The clock needs each job's name and submit time only; the executors hold the rest.
    workload = [WorkloadJob(name, submit_s, "", 1, 1) for name, submit_s in request.jobs]
    wiring = BusWiring(bus, request.request_timeout_s)
    sim = Simulator(workload, cluster, policy, settings, wiring=wiring)
    live = LiveFeed(wiring, clock.now_s, request.speed) if request.live else None
    log.info("run %s: %s from round %d (%d jobs done)", request.run_id, "resumed" if clock.round else "started",
             clock.round, clock.done)
    await sim.run_async(clock=clock, journal=journal, live=live)
    log.info("run %s: over", request.run_id)


async def _next_run(runs: TypedKV[RunCheckpoint], unreadable: set[str]):
    """The first run not over; an unreadable checkpoint is skipped (warned of once), not fatal."""
    for key in await runs.keys():
        try:
            entry = await runs.get(key)
        except msgspec.DecodeError as error:
            if key not in unreadable:
                unreadable.add(key)
                log.warning("run %s: unreadable checkpoint, skipped: %s", key, error)
            continue
        if entry is not None and not entry.value.over:
            return entry
    return None


async def lead(bus: Bus, leadership: Leadership, runs: TypedKV[RunCheckpoint], cluster: Cluster,
               cluster_arg: str, stop: asyncio.Event) -> None:
    """While we lead: run each unfinished run in turn."""
    unreadable: set[str] = set()
    failures: dict[str, tuple[int, int]] = {}       # run -> (round it last failed at, failures there in a row)
    while not stop.is_set():
        pending = None
        if leadership.held:
            try:
                pending = await _next_run(runs, unreadable)
            except Exception:  # noqa: BLE001 - a failed read must not end the leading; try again
                log.exception("reading the runs failed")
        if pending is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), IDLE_POLL_S)
            continue
        journal = RunJournal(bus, runs, pending.value, pending.revision, leadership)
        try:
            await run(bus, cluster, cluster_arg, journal, pending.value.clock)
        except LeaseLost as error:
            log.warning("stepping down: %s", error)
        except Exception as error:  # noqa: BLE001 - resumed, or failed with its reason; the service goes on
            at = journal.clock.round
            last, count = failures.get(pending.key, (-1, 0))
            failures[pending.key] = (at, count + 1 if last == at else 1)
            if failures[pending.key][1] < RESUME_TRIES:
                log.warning("run %s interrupted at round %d (%s: %s); resuming it from its checkpoint",
                            pending.key, at, type(error).__name__, error)
                await asyncio.sleep(RESUME_AFTER_S)
                continue
            log.exception("run %s failed", pending.key)
            try:
                await journal.fail(f"{type(error).__name__}: {error}")
            except (LeaseLost, nats.errors.Error) as failed:    # leading goes on: the run is tried again
                log.warning("run %s: its failure was not recorded: %s", pending.key, failed)


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    cluster = load_cluster(args.cluster)
    await bus.ensure_stream(subjects.RUN_LOG_STREAM, subjects.RUN_LOG_SUBJECTS,
                            duplicate_window=subjects.RUN_LOG_DEDUP_S)
    runs = await bus.kv(subjects.RUNS_BUCKET, RunCheckpoint)
    holder = f"{socket.gethostname()}-{os.getpid()}"
    leadership = await Leadership.open(bus, subjects.LEASE_BUCKET, subjects.LEADER_KEY, holder, args.lease_ttl)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(leadership.campaign(stop)),
             loop.create_task(lead(bus, leadership, runs, cluster, args.cluster, stop))]

    async def step_down() -> None:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await leadership.release()

    bus.on_close(step_down)

    async def status(_: Ack) -> Lease:
        return Lease(await leadership.leader())

    service = new_service(bus, subjects.POLICY_SERVICE, f"the scheduling round on {cluster.name}", {"holder": holder})
    await bus.add_endpoint(service, "status", subjects.POLICY_STATUS, Ack, status)
    return service

