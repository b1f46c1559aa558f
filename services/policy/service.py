"""The policy service: the round leader, one replica at a time, and its standbys.

Replicas campaign for a KV lease (services.policy.lease); the one holding it runs the rounds. On a
simulated cluster a run is a whole replay on the virtual clock — the next round starts as soon as
the executors have applied and advanced the last — each stage a request to its service
(`services.policy.wiring`), each decision by the named policy, through the scheduler's round loop
(`services.policy.rounds`). A live run has no end: its jobs are those submitted live, its rounds
paced by the wall clock. The run's checkpoint (its request and clock,
`RunCheckpoint`) lives in KV and is rewritten after every decision and every round; each round run
is appended to the run's log, which the driver follows. A standby that takes the lease resumes
every unfinished run from its checkpoint: a decided round is carried out as decided (every stage
may be asked twice), so the schedule is the one the old leader would have made. Checkpoints are
written compare-and-set, so a deposed leader that wakes up is refused at its next step.

A round that fails as a whole (NATS away, a service gone) is retried from the checkpoint, sooner at
first and then every RESUME_MAX_S; a replay that fails RESUME_TRIES times in a row at one round
fails with the reason, a live run never does: meanwhile its checkpoint says why it cannot go on
(`problem`), which `goodput status` and the readiness probe show.

A replay's teams come with its request; a live run's are the operator's team file in the teams' KV
bucket, read at every decision (`services.policy.wiring.KvTeams`): a change is in force the next
round, and one that cannot be used leaves the last that could.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import time

import msgspec
import nats.errors
from nats import micro

from policies.base import check_honours_teams, make_policy
from services.policy.lease import Leadership, LeaseLost
from services.policy.recorder import DecisionRecorder
from services.policy.rounds import Arrival, FixedTeams, RoundLoop, TeamSource
from services.policy.wiring import RETRY_S, BusWiring, KvTeams, LiveFeed
from shared import storage, subjects
from shared.bus import Bus
from shared.bus.kv import RevisionConflict, TypedKV
from shared.cluster import Cluster, load_cluster
from shared.runner import new_service
from shared.schema.base import Ack
from shared.schema.runs import PolicyStatus, RunCheckpoint, RunClock, RunStatus, RunStep
from shared.settings import simulation_settings
from shared.teams import resolve

# With no run to lead, the runs are looked at again when the runs bucket changes, or after IDLE_POLL_S.
IDLE_POLL_S = 5.0
RESUME_AFTER_S = 0.5
RESUME_MAX_S = 30.0
# A replay that fails is resumed from its checkpoint (the NATS server restarting fails a round's
# requests and writes); only when it fails this often in a row at the same round does it fail.
RESUME_TRIES = 3
LIVE_RETRIES = 3  # a live run's stage is asked this many request timeouts before the round fails
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The lease's time to live is the operator's: the lease bucket's (shared.storage, launcher.setup --lease-ttl).
    parser.add_argument("--cluster", default="sia-hetero-64", help="cluster preset or YAML/JSON file")


class RunJournal:
    """A run's progress, written as the leader makes it: the checkpoint (compare-and-set on our own
    last revision, and only while we lead) and the run's log."""

    def __init__(
        self, bus: Bus, runs: TypedKV[RunCheckpoint], checkpoint: RunCheckpoint, revision: int, leadership: Leadership
    ):
        self.bus = bus
        self.runs = runs
        self.request = checkpoint.request
        self.revision = revision
        self.leadership = leadership
        self.clock = checkpoint.clock  # as last checkpointed

    async def decided(self, clock: RunClock) -> None:
        await self._save(clock)

    async def idled(self, clock: RunClock) -> None:
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
        step = RunStep(
            clock.round, clock.now_s, None, (), (), clock.done, len(self.request.jobs), over=True, failure=reason
        )
        self.leadership.check()
        run_id = self.request.run_id
        await self.bus.js_publish(subjects.run_log(run_id), step, msg_id=f"{run_id}.{step.round}")
        await self._save(clock, over=True, problem=reason)

    async def stalled(self, reason: str, since: float) -> None:
        """Say in the checkpoint why the run cannot go on (best effort: NATS may be what is away)."""
        try:
            await self._save(self.clock, problem=reason, since=since)
        except (LeaseLost, nats.errors.Error, OSError) as error:
            log.info("run %s: its problem was not recorded: %s", self.request.run_id, error)

    async def _save(self, clock: RunClock, over: bool = False, problem: str = "", since: float | None = None) -> None:
        self.leadership.check()
        try:
            checkpoint = RunCheckpoint(self.request, clock, over, problem, since)
            self.revision = await self.runs.update(self.request.run_id, checkpoint, self.revision)
            self.clock = clock
        except RevisionConflict:
            raise LeaseLost(f"run {self.request.run_id} was checkpointed by another leader") from None


async def run(bus: Bus, cluster: Cluster, cluster_arg: str, journal: RunJournal, clock: RunClock) -> None:
    """Run (or resume) one replay to its end. Its teams: a replay's, from its request (checked
    against the cluster and the policy first); a live run's, the operator's team file in KV."""
    request = journal.request
    teams: TeamSource | None = None
    try:
        policy = make_policy(request.policy, **request.policy_options)
        settings = simulation_settings(
            request.calibration, cluster_arg, round_s=request.round_s, horizon_s=request.horizon_s
        )
        if request.live:
            teams = KvTeams(bus)
        elif request.teams is not None:
            check_honours_teams(policy, resolve(request.teams, cluster))
            teams = FixedTeams(request.teams)
    except ValueError as error:
        await journal.fail(str(error))
        return
    # The clock needs each job's name and submit time only; the executors hold the rest.
    # A live run that cannot go on says so within a few request timeouts (and is retried); a replay
    # waits longer for a restarted service before its round counts as failed.
    wiring = BusWiring(
        bus, request.request_timeout_s, LIVE_RETRIES * request.request_timeout_s if request.live else RETRY_S
    )
    loop = RoundLoop(
        [Arrival(name, submit_s) for name, submit_s in request.jobs],
        cluster,
        policy,
        settings,
        wiring,
        teams=teams,
        recorder=DecisionRecorder(bus) if request.live else None,  # a replay's rounds are not the cluster's
    )
    live = LiveFeed(wiring, clock.now_s, request.speed) if request.live else None
    log.info(
        "run %s: %s from round %d (%d jobs done)",
        request.run_id,
        "resumed" if clock.round else "started",
        clock.round,
        clock.done,
    )
    await loop.run(clock=clock, journal=journal, live=live)
    log.info("run %s: over", request.run_id)


async def _next_run(runs: TypedKV[RunCheckpoint], unreadable: set[str]):
    """The first run not over, replays before a live run (which never ends); an unreadable
    checkpoint is skipped (warned of once), not fatal."""
    keys = await runs.keys()
    for key in sorted(keys, key=lambda k: k == subjects.LIVE_RUN):
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


class PolicyService:
    """One policy replica: it campaigns for the lease and, while it leads, runs each unfinished run
    in turn (`lead`); it answers `status` whether it leads or not, and steps down when the bus closes.
    A run's life: pending (in the runs bucket, not over) -> led (`run`, resumed from its checkpoint
    after a failure, sooner at first) -> over, or failed with its reason (`journal.fail`)."""

    def __init__(
        self, bus: Bus, leadership: Leadership, runs: TypedKV[RunCheckpoint], cluster: Cluster, cluster_arg: str
    ) -> None:
        self.bus, self.leadership, self.runs = bus, leadership, runs
        self.cluster, self.cluster_arg = cluster, cluster_arg
        self.stop = asyncio.Event()
        self.unreadable: set[str] = set()  # checkpoints warned of once
        # run -> (round it last failed at, failures there in a row, since)
        self.failures: dict[str, tuple[int, int, float]] = {}
        self.changed = asyncio.Event()  # the runs bucket changed: a new run may be there
        self.tasks: list[asyncio.Task] = []

    def begin(self) -> None:
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self.leadership.campaign(self.stop)), loop.create_task(self.lead())]

    async def step_down(self) -> None:
        self.stop.set()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.leadership.release()

    async def status(self, _: Ack) -> PolicyStatus:
        entry = await self.runs.get(subjects.LIVE_RUN)
        return PolicyStatus(await self.leadership.leader(), None if entry is None else run_status(entry.value))

    async def watch(self) -> None:
        while True:
            try:
                async for _ in self.runs.changes():
                    self.changed.set()
            except Exception as error:  # noqa: BLE001 - NATS away: the idle poll stands in until it is back
                log.info("watching the runs stopped (%s); watching again", error)
            await asyncio.sleep(1.0)

    async def lead(self) -> None:
        """While we lead: run each unfinished run in turn."""
        watching = asyncio.get_running_loop().create_task(self.watch())
        try:
            while not self.stop.is_set():
                await self.lead_once()
        finally:
            watching.cancel()

    async def lead_once(self) -> None:
        """Run the next unfinished run, or wait until one may be there."""
        pending = None
        self.changed.clear()
        if self.leadership.held:
            try:
                pending = await _next_run(self.runs, self.unreadable)
            except Exception as error:  # noqa: BLE001 - a failed read must not end the leading; try again
                log.warning("reading the runs failed: %s: %s", type(error).__name__, error)
        if pending is None:  # idle: until a run is written, we lead, or the poll is due
            events = (
                (self.stop, self.changed) if self.leadership.held else (self.stop, self.changed, self.leadership.gained)
            )
            waits = [asyncio.ensure_future(e.wait()) for e in events]
            await asyncio.wait(waits, timeout=IDLE_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
            return
        journal = RunJournal(self.bus, self.runs, pending.value, pending.revision, self.leadership)
        try:
            await run(self.bus, self.cluster, self.cluster_arg, journal, pending.value.clock)
        except LeaseLost as error:
            log.warning("stepping down: %s", error)
        except Exception as error:  # noqa: BLE001 - resumed, or failed with its reason; the service goes on
            if not self.stop.is_set():
                await self.interrupted(pending, journal, f"{type(error).__name__}: {error}")

    async def interrupted(self, pending, journal: RunJournal, reason: str) -> None:
        """A run's round failed: resume it from its checkpoint after a wait, or fail it with the reason."""
        at = journal.clock.round
        last, count, since = self.failures.get(pending.key, (-1, 0, time.time()))
        count, since = (count + 1, since) if last == at else (1, time.time())
        self.failures[pending.key] = (at, count, since)
        if pending.value.request.live or count < RESUME_TRIES:
            wait_s = min(RESUME_AFTER_S * 2 ** (count - 1), RESUME_MAX_S)
            log.warning(
                "run %s interrupted at round %d (%s); resuming it from its checkpoint in %.1f s",
                pending.key,
                at,
                reason,
                wait_s,
            )
            await journal.stalled(f"round {at} failed {count} time{'s' * (count > 1)} in a row: {reason}", since)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), wait_s)
            return
        log.error("run %s failed at round %d: %s", pending.key, at, reason)
        try:
            await journal.fail(reason)
        except (LeaseLost, nats.errors.Error) as failed:  # leading goes on: the run is tried again
            log.warning("run %s: its failure was not recorded: %s", pending.key, failed)


def run_status(checkpoint: RunCheckpoint) -> RunStatus:
    clock = checkpoint.clock
    state = (
        ("failed" if checkpoint.problem else "over")
        if checkpoint.over
        else "stalled"
        if checkpoint.problem
        else "running"
    )
    reason = checkpoint.problem
    if state == "stalled" and checkpoint.problem_since is not None:
        reason += f" (since {time.time() - checkpoint.problem_since:.0f} s ago; retrying)"
    return RunStatus(checkpoint.request.run_id, state, reason, clock.round, clock.now_s, len(clock.active))


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    cluster = load_cluster(args.cluster)
    await storage.open_stream(bus, subjects.RUN_LOG_STREAM)
    await storage.open_stream(bus, subjects.DECISIONS_STREAM)  # the live run's decisions, for goodput explain
    runs = await storage.open_kv(bus, subjects.RUNS_BUCKET, RunCheckpoint)
    holder = f"{socket.gethostname()}-{os.getpid()}"
    leadership = await Leadership.open(bus, subjects.LEASE_BUCKET, subjects.LEADER_KEY, holder)
    policy = PolicyService(bus, leadership, runs, cluster, args.cluster)
    policy.begin()
    bus.on_close(policy.step_down)
    service = await new_service(
        bus, subjects.POLICY_SERVICE, f"the scheduling round on {cluster.name}", {"holder": holder}
    )
    await bus.add_endpoint(service, "status", subjects.POLICY_STATUS, Ack, policy.status, parts=False)
    return service
