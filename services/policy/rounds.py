"""The scheduler's round loop: the clock, a round's stages (facts → models → solve → place → apply
→ advance), and what each round cost. It is the policy leader's own; the simulator is one of its
drivers (`sim.simulator`, the stages as calls in one process), the policy service another (the
stages as requests to the services, `services.policy.wiring`).

Every round:
1. jobs whose submit time has come join the queue (a live run: the jobs the executors say arrived);
2. on a policy round, the executors' `JobFacts` and the estimator's `JobModels` make the policy's
   views, the policy decides, the placer (or the policy itself) picks physical GPUs, and the
   executors apply the placements; with teams (a team file, resolved against the round's cluster),
   the policy holds their guarantees, and the round's ledger (`policies.teams.ledger`) tells the
   executors, the trace and the metrics what each job borrows and which jobs it shrank or stopped
   to give a team back its guarantee;
3. the executors run the round and report the jobs that ended.

One job's trouble is never the round's: a job the executors cannot run yet, or the estimator has no
model of yet, is held out of the round (it waits, and is asked of again next round); a job that will
never run (rejected, refused by the policy, a view that cannot be made of it) leaves the run as
failed, with its reason, which the executors are told in the round's apply. A policy that fails to
solve, or whose decision does not fit the cluster, costs a round: every job keeps its placement.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import msgspec
from opentelemetry import trace

from policies.base import (
    Decision,
    HybridRefused,
    JobView,
    Policy,
    RoundState,
    decision_from_placements,
    job_view,
    restore_policy,
    snapshot_policy,
)
from policies.teams import ledger
from services.policy.decisions import team_waits
from services.policy.observer import DecidedJobs, RoundObserver, StageTimes
from shared.cluster import Cluster
from shared.hardware import hardware_name
from shared.schema.base import Config, Node, Spots
from shared.schema.decisions import JobDecision, RoundSummary
from shared.schema.jobs import CANCELLED
from shared.schema.rounds import (
    AdvanceReply,
    ApplyRequest,
    FactsReply,
    JobFacts,
    JobModels,
    ModelsReply,
    PlacementResult,
    Reclaim,
)
from shared.schema.runs import DecidedRound, RoundRecord, RunClock, RunStep
from shared.schema.teams import TeamFile, Teams
from shared.settings import SimSettings
from shared.teams import resolve

TRACER_NAME = "goodput.round"
log = logging.getLogger(__name__)


class Wiring(Protocol):
    """How a round's messages travel between the loop (with the policy) and the other stages."""

    async def facts(self, now: float, jobs: list[str]) -> FactsReply: ...  # executors

    async def models(self, facts: list[JobFacts]) -> ModelsReply: ...  # estimator

    async def place(
        self,
        round: int,
        allocations: dict[str, Config],
        previous: dict[str, Spots],
        groups: dict[str, int],
        nodes: tuple[Node, ...] | None = None,
    ) -> PlacementResult: ...

    async def apply(self, request: ApplyRequest) -> None: ...  # executors

    async def advance(self, now: float, step: float, jobs: list[str]) -> AdvanceReply: ...  # executors: jobs that ended


class Journal(Protocol):
    """Where a run's progress is kept (the policy leader's checkpoints and the run's log)."""

    async def decided(self, clock: RunClock) -> None: ...  # before it is carried out

    async def stepped(self, clock: RunClock, step: RunStep) -> None: ...  # a round has run

    async def idled(self, clock: RunClock) -> None: ...  # a live round had no jobs


class Recorder(Protocol):
    """Where a live run's decided rounds are recorded: the policy leader's decisions stream and round
    metrics (`services.policy.recorder.DecisionRecorder`)."""

    async def decided(self, summary: RoundSummary, decisions: Sequence[JobDecision]) -> None: ...

    # a stage outside the decision: apply, advance, checkpoint (the decided clock), log (the round's step)
    def stage(self, stage: str, seconds: float) -> None: ...


class LiveFeed(Protocol):
    """A live run's jobs and pace (the policy leader's, over the bus: `services.policy.wiring.LiveFeed`)."""

    async def wait(self, now: float) -> None: ...  # until the round at `now` is due

    async def jobs(self, now: float) -> list[str]: ...  # the live jobs not finished, arrived by `now`

    # The nodes the executors serve now (real ones: their live agents), set by `jobs`; None: the
    # executors' cluster is the fixed one the loop was given.
    nodes: tuple[Node, ...] | None


class TeamSource(Protocol):
    """Where a run's teams come from: the team file in force at a round (None: no teams), or
    ValueError when the one there cannot be read (the loop then keeps the last it could use)."""

    async def team_file(self) -> TeamFile | None: ...


class FixedTeams:
    """Teams given once for the whole run (`goodput simulate --teams`, a replay's request)."""

    def __init__(self, file: TeamFile | None):
        self.file = file

    async def team_file(self) -> TeamFile | None:
        return self.file


def reclaim_event(now: float, job: str, reclaim: Reclaim) -> str:
    """A reclaim as a run's event: whose job gave back what, for whom."""
    what = "stopped" if reclaim.gpus_after == 0 else f"shrunk to {reclaim.gpus_after}"
    return (
        f"{now:.0f}s: {job} {what} (from {reclaim.gpus_before} {hardware_name(reclaim.gpu_type)} GPUs): "
        f"team {reclaim.by_team} takes back its guarantee"
    )


@dataclass(frozen=True)
class Arrival:
    """A replayed job: its id and submit time on the run's clock."""

    name: str
    time: float


def hybrid_groups(allocations: Mapping[str, Config], models: Sequence[JobModels]) -> dict[str, int]:
    """The GPUs of one model-parallel group of each allocated hybrid-parallel job, on its allocated type."""
    by_id = {m.job_id: m for m in models}
    groups = {job: by_id[job].group(config.gpu_type) for job, config in allocations.items() if job in by_id}
    return {job: group for job, group in groups.items() if group > 1}


class RoundLoop:
    """The clock and the policy over a wiring; `rounds` and `events` as it ran. What it reports of
    each round (spans, records, the recorder's decided rounds) is its `observer`'s."""

    def __init__(
        self,
        arrivals: Sequence[Arrival],
        cluster: Cluster,
        policy: Policy,
        settings: SimSettings,
        wiring: Wiring,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        teams: TeamSource | None = None,
        recorder: Recorder | None = None,
        policy_in_thread: bool = True,
    ):
        """`tracer_provider`: where the round's spans go (the process's global one unless given);
        `teams`: where each decision's teams come from (None: no teams), resolved against the
        round's cluster; a file that cannot be used leaves the last one that could in force;
        `recorder`: where each decided round's summary and job decisions go (None: nowhere);
        `policy_in_thread`: the policy decides in a thread, the event loop meanwhile serving (pings,
        the leader's lease); a simulation, with nothing else on its loop, spares the hand-overs."""
        self.arrivals = sorted(arrivals, key=lambda j: (j.time, j.name))
        self.cluster = cluster
        self.policy = policy
        self.settings = settings
        self.wiring = wiring
        # What the loop reports of its rounds: spans, records, and the recorder's decided rounds.
        self.observer = RoundObserver(
            trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider), policy.name, recorder
        )
        self.rounds: list[RoundRecord] = []
        self.events: list[str] = []
        self.dynamic = False  # the cluster is the executors' live nodes (the placer is told them)
        self.team_source = teams
        self.teams: Teams | None = None  # in force: the last team file that resolved
        self._resolved: tuple[TeamFile, tuple[Node, ...]] | None = None  # ... from this file on these nodes
        self._team_problem: str | None = None  # the last reason a team file could not be used (said once)
        self.policy_in_thread = policy_in_thread

    async def run(
        self,
        progress: Callable[[float, int, int], None] | None = None,
        clock: RunClock | None = None,
        journal: Journal | None = None,
        live: LiveFeed | None = None,
    ) -> RunClock:
        """Run to the end from `clock` (the start unless given: a standby resuming a run passes the
        last checkpoint). `journal` is told of each decision before it is carried out and of each
        round once it has run, so a run can be resumed from any point; returns the final clock.
        With `live`, the jobs are those `live` reports each round, rounds keep its pace, and the run
        has no end."""
        step = self.settings.round_s
        clock = clock or RunClock()
        if clock.policy_state:
            restore_policy(self.policy, clock.policy_state)
        while live or clock.admitted < len(self.arrivals) or clock.active:
            if live:
                clock = await self._live_jobs(clock, live)
                if not clock.active or not self.cluster.nodes:  # idle (or no node): the next round, on the wall clock
                    clock = msgspec.structs.replace(clock, now_s=clock.now_s + step)
                    if journal:  # kept, so a resumed run's clock is never behind its jobs
                        await journal.idled(clock)
                    continue
            elif clock.now_s > self.settings.horizon_s:
                return await self._stop_at_horizon(clock, journal)
            clock = self._admit(clock)
            if not clock.active:  # idle: jump to the round of the next arrival
                clock = msgspec.structs.replace(clock, now_s=step * -(-self.arrivals[clock.admitted].time // step))
                continue
            after = self.observer.stage_times()  # the stages after the decision (RoundRecord.stages_ms)
            decides = clock.decided is None and clock.now_s >= clock.next_decision_s - 1e-9  # on the policy's grid
            with self.observer.round(clock, self.cluster.total_gpus, decides):
                if decides:
                    clock = await self._decided(clock, journal, after)
                given_up = clock.decided.apply.failed if clock.decided is not None else {}
                if clock.decided is not None:
                    with after.stage("apply"):
                        await self.wiring.apply(clock.decided.apply)
                with after.stage("advance"):
                    ended = await self.wiring.advance(clock.now_s, step, [j for j in clock.active if j not in given_up])
            clock, stepped = self._step(clock, ended.finished, {**given_up, **ended.failed}, after, live is not None)
            if journal:
                with after.stage("log"):
                    await journal.stepped(clock, stepped)
            if progress:
                progress(clock.now_s, stepped.done, stepped.total)
        return clock

    async def _live_jobs(self, clock: RunClock, live: LiveFeed) -> RunClock:
        """The clock once the live round at its time is due, with the jobs `live` reports then, on the
        nodes the executors serve then."""
        await live.wait(clock.now_s)
        clock = msgspec.structs.replace(clock, active=tuple(await live.jobs(clock.now_s)))
        self._serve_nodes(live.nodes, clock.now_s)
        return clock

    async def _stop_at_horizon(self, clock: RunClock, journal: Journal | None) -> RunClock:
        """The run's end past its horizon, with the jobs still active."""
        now = clock.now_s
        event = f"horizon {self.settings.horizon_s:.0f} s reached with {len(clock.active)} jobs active"
        self.events.append(event)
        if journal:
            await journal.stepped(
                clock, RunStep(clock.round, now, None, (event,), (), clock.done, len(self.arrivals), over=True)
            )
        return clock

    def _admit(self, clock: RunClock) -> RunClock:
        """The clock with the jobs whose submit time has come in the queue."""
        arrived = [j.name for j in self.arrivals[clock.admitted :] if j.time <= clock.now_s]
        if not arrived:
            return clock
        return msgspec.structs.replace(
            clock, admitted=clock.admitted + len(arrived), active=clock.active + tuple(arrived)
        )

    async def _decided(self, clock: RunClock, journal: Journal | None, after: StageTimes) -> RunClock:
        """The clock with the round's decision, kept by `journal` before it is carried out (the policy's
        state with it), then recorded."""
        now = clock.now_s
        decided = await self._decide(now, list(clock.active), clock.decisions, clock.round)
        clock = msgspec.structs.replace(
            clock,
            decided=decided,
            decisions=clock.decisions + 1,
            next_decision_s=(now // self.policy.round_s + 1) * self.policy.round_s,
        )
        if journal:
            with after.stage("checkpoint"):  # kept before it is applied
                clock = msgspec.structs.replace(clock, policy_state=snapshot_policy(self.policy))
                await journal.decided(clock)
        await self.observer.record_decision()
        return clock

    def _step(
        self,
        clock: RunClock,
        finished: Sequence[str],
        failed: Mapping[str, str],
        after: StageTimes,
        live: bool,
    ) -> tuple[RunClock, RunStep]:
        """The clock at the next round once this one has run (`finished` and `failed` jobs done with),
        and the step the journal logs of it; the round's record and events kept."""
        now = clock.now_s
        ended_jobs = set(finished) | set(failed)  # a failed job is done with, too
        record, events = (clock.decided.record, clock.decided.events) if clock.decided else (None, ())
        if record is not None:
            record = msgspec.structs.replace(record, stages_ms={**record.stages_ms, **after.ms()})
            self.rounds.append(record)
        events += tuple(
            f"{now:.0f}s: {job} {'was ' if reason == CANCELLED else 'failed: '}{reason}"
            for job, reason in sorted(failed.items())
        )
        self.events.extend(events)
        clock = msgspec.structs.replace(
            clock,
            round=clock.round + 1,
            now_s=now + self.settings.round_s,
            done=clock.done + len(ended_jobs),
            decided=None,
            active=tuple(name for name in clock.active if name not in ended_jobs),
        )
        over = not live and clock.admitted == len(self.arrivals) and not clock.active
        total = clock.done + len(clock.active) if live else len(self.arrivals)
        step = RunStep(
            clock.round - 1,
            now,
            record,
            events,
            tuple(sorted(finished)),
            clock.done,
            total,
            over,
            failed=tuple(sorted(failed)),
        )
        return clock, step

    def _serve_nodes(self, nodes: tuple[Node, ...] | None, now: float) -> None:
        """A live round on the nodes the executors serve now: joined ones are used, lost ones not."""
        if nodes is None or nodes == self.cluster.nodes:
            return
        before = {n.name for n in self.cluster.nodes}
        after = {n.name for n in nodes}
        joined, gone = sorted(after - before), sorted(before - after)
        self.events.extend(
            [
                *(f"{now:.0f}s: node {name} joined" for name in joined),
                *(f"{now:.0f}s: node {name} is gone" for name in gone),
            ]
        )
        if not nodes:
            self.events.append(f"{now:.0f}s: no node is served: jobs wait for a node agent")
        self.cluster = Cluster(self.cluster.name, nodes)
        self.dynamic = True

    async def _round_teams(self, now: float) -> tuple[Teams | None, list[str]]:
        """The teams in force for this round's decision (the source's team file resolved against
        this round's cluster), and what the round's events say of them. A file that cannot be read
        or resolved (a node it counted on has gone) is said once, and the last that could be used
        stays in force; no file: no teams."""
        events: list[str] = []
        if self.team_source is None:
            return None, events
        try:
            file = await self.team_source.team_file()
            if file is None:
                self.teams, self._resolved = None, None
            elif self._resolved != (file, self.cluster.nodes):
                self.teams, self._resolved = resolve(file, self.cluster), (file, self.cluster.nodes)
                if not self.policy.honours_teams:  # a live run's policy, given teams later
                    event = (
                        f"{now:.0f}s: policy {self.policy.name} cannot hold teams' guarantees; "
                        "what each team holds is only recorded"
                    )
                    log.warning(event)
                    events.append(event)
            self._team_problem = None  # in use again: a later problem is said again
        except ValueError as error:
            if str(error) != self._team_problem:
                self._team_problem = str(error)
                kept = "the last valid one stays in force" if self.teams is not None else "no teams in force"
                log.warning("the team file cannot be used (%s); %s", error, kept)
                events.append(f"{now:.0f}s: the team file cannot be used ({error}); {kept}")
        return self.teams, events

    def _ledger(
        self, now: float, views: Sequence, placements: Mapping[str, Spots], teams: Teams | None, round_number: int
    ) -> tuple[dict[str, int], dict[str, Reclaim], tuple[str, ...]]:
        """The round's ledger with teams (`policies.teams.ledger`): each job's GPUs beyond its team's
        guarantee, the reclaims the round made, and their events; nothing without teams."""
        if teams is None:
            return {}, {}, ()
        configs = {job: self.cluster.config_of(spots) for job, spots in placements.items() if spots}
        try:
            borrowed, reclaims = ledger(RoundState(now, self.cluster, tuple(views), teams), configs, round_number)
        except Exception as error:  # noqa: BLE001 - an account that cannot be kept costs the round's ledger only
            event = f"{now:.0f}s: the teams' ledger failed ({type(error).__name__}: {error}); borrowing not recorded"
            log.warning(event)
            return {}, {}, (event,)
        events = tuple(reclaim_event(now, job, r) for job, r in sorted(reclaims.items()))
        return {job: n for job, n in borrowed.items() if n}, dict(reclaims), events

    async def _decide(self, now: float, active: list[str], decisions: int, round_number: int) -> DecidedRound:
        """The round's decision: facts, models, the policy, then the placer unless the policy placed;
        with teams, the ledger of what each job borrows and what the round reclaimed."""
        stages = StageTimes()  # the decision's (RoundRecord.stages_ms)
        teams, events = await self._round_teams(now)  # what it says of the teams opens the round's events
        with stages.stage("facts"):
            known = await self.wiring.facts(now, active)
        failed = dict(known.failed)  # jobs that will never run: they leave the run
        held = dict(known.held)  # jobs that cannot run yet: they wait out this round
        with stages.stage("models"):
            estimated = await self.wiring.models(list(known.facts))
        held.update(estimated.held)
        models = {m.job_id: m for m in estimated.models}
        facts, views = self._views(known.facts, models, held, failed)
        events.extend(f"{now:.0f}s: {job} waits: {reason}" for job, reason in sorted(held.items()))
        # A policy that cannot hold the teams' guarantees (a live run's, given a team file later)
        # decides without them; the ledger still records what each team holds.
        honoured = teams if self.policy.honours_teams else None
        with stages.stage("solve"):
            decision, kept = await self._solve(now, facts, views, failed, honoured)
        placements, evicted = decision.placements, ()
        if placements is None:
            with stages.stage("place"):
                placements, evicted = await self._place(decisions + 1, decision, facts, views)
            events.extend(f"{now:.0f}s: placer evicted {job}: no node fits its allocation" for job in evicted)
        problem = self._misfit(placements)
        if problem is not None:
            kept = f"policy {self.policy.name} {problem}; previous allocation kept"
            decision, evicted = self._keep(facts, kept), ()
            placements = decision.placements
        events.extend(f"{now:.0f}s: {e}" for e in decision.events)
        scheduled = {v.job_id for v in views}
        placements = {job: spots for job, spots in placements.items() if job in scheduled}
        borrowed, reclaims, reclaimed = self._ledger(now, views, placements, teams, round_number)
        events.extend(reclaimed)
        decided = DecidedJobs(
            round=round_number,
            now=now,
            active=active,
            facts=known.facts,
            models=models,
            views=views,
            held=held,
            failed=failed,
            decision=decision,
            kept=kept,
            placements=placements,
            evicted=evicted,
            teams=teams,
            borrowed=borrowed,
            reclaims=reclaims,
            cluster=self.cluster,
            stages=stages,
            events=events,
        )
        record = self.observer.round_record(decided)
        # Only a policy that holds the teams' limits keeps a job waiting on them.
        waits = self._team_waits(views, placements, honoured, record) if honoured is not None else {}
        apply = ApplyRequest(
            now,
            placements,
            {v.job_id: v.models for v in views if placements.get(v.job_id)},
            self.policy.adaptive_batch,
            failed,
            borrowed,
            reclaims,
            jobs=tuple(v.job_id for v in views),
            waits=waits,
        )
        self.observer.decided(decided, apply, record)
        return DecidedRound(apply, record, tuple(events))

    def _team_waits(
        self, views: Sequence[JobView], placements: Mapping[str, Spots], teams: Teams, record: RoundRecord
    ) -> dict[str, str]:
        """The jobs left without GPUs that wait on their team's limits, and why, by what each team
        holds on the round's record (`services.policy.decisions.team_waits`)."""
        team_of = {v.job_id: v.team for v in views}
        return team_waits([v.models for v in views], placements, self.cluster, teams, team_of, record.team_gpus)

    def _views(
        self,
        reported: Sequence[JobFacts],
        models: Mapping[str, JobModels],
        held: dict[str, str],
        failed: dict[str, str],
    ) -> tuple[list[JobFacts], list[JobView]]:
        """The facts and the policy's views of the jobs the round decides for: those neither held nor
        failed; a job the estimator has no model of yet is held, one that cannot be viewed fails."""
        facts, views = [], []
        for f in reported:
            if f.job_id in held or f.job_id in failed:
                continue
            if f.job_id not in models:
                held[f.job_id] = "the estimator has no model of it yet"
                continue
            try:
                views.append(job_view(f, models[f.job_id], self.cluster, self.settings.restart_estimate(f.application)))
                facts.append(f)
            except Exception as error:  # noqa: BLE001 - one job that cannot be viewed is that job's failure
                failed[f.job_id] = f"cannot be scheduled: {type(error).__name__}: {error}"
        return facts, views

    async def _place(
        self, round: int, decision: Decision, facts: Sequence[JobFacts], views: Sequence[JobView]
    ) -> tuple[dict[str, Spots], tuple[str, ...]]:
        """The placer's placements of the decision's allocations (jobs stay on their GPUs where they
        can), and the jobs it found no node for."""
        previous = {f.job_id: f.placement for f in facts if f.placement and f.job_id in decision.allocations}
        placed = await self.wiring.place(
            round,
            decision.allocations,
            previous,
            hybrid_groups(decision.allocations, [v.models for v in views]),
            self.cluster.nodes if self.dynamic else None,
        )
        return placed.placements, tuple(placed.evicted)

    async def _solve(
        self, now: float, facts: list[JobFacts], views: list, failed: dict[str, str], teams: Teams | None = None
    ) -> tuple[Decision, str | None]:
        """The policy's decision for `views`, and why every job was kept where it is instead (None
        when the policy decided). Jobs it refuses (a hybrid-parallel job under a policy that would
        split its groups) are failed with its reason and it decides for the rest; any other failure
        keeps every job where it is for this round."""
        with self.observer.solving(len(views)) as span:
            before = len(failed)
            decision, kept = await self._policy_decision(now, facts, views, failed, teams)
            self.observer.solved(span, len(views), decision, len(failed) - before, kept)
            return decision, kept

    async def _policy_decision(
        self, now: float, facts: list[JobFacts], views: list, failed: dict[str, str], teams: Teams | None = None
    ) -> tuple[Decision, str | None]:
        for _ in range(2):
            try:
                state = RoundState(now, self.cluster, tuple(views), teams)
                if not self.policy_in_thread:
                    return self.policy.allocate(state), None
                return await asyncio.to_thread(self.policy.allocate, state), None
            except HybridRefused as error:
                refused = [v for v in views if v.models.group_gpus]
                failed.update({v.job_id: str(error) for v in refused})
                views[:] = [v for v in views if not v.models.group_gpus]
                facts[:] = [f for f in facts if f.job_id not in failed]
            except Exception as error:  # noqa: BLE001 - a failed solve (LinAlgError, a solver's) costs a round
                event = f"policy {self.policy.name} failed ({type(error).__name__}: {error}); previous allocation kept"
                return self._keep(facts, event), event
        event = f"policy {self.policy.name} refused the round twice; previous allocation kept"
        return self._keep(facts, event), event

    def _keep(self, facts: list[JobFacts], event: str) -> Decision:
        """The round's decision when the policy could not make one: every job stays where it is."""
        log.warning(event)
        return decision_from_placements(self.cluster, {f.job_id: f.placement for f in facts if f.placement}, (event,))

    def _misfit(self, placements: Mapping[str, Spots]) -> str | None:
        """Why placements cannot be carried out on this cluster (None when they can)."""
        used: dict[str, int] = defaultdict(int)
        for job, spots in placements.items():
            if self.cluster.placement_type(spots) is None:
                return f"placed {job} on unknown or mixed nodes: {spots}"
            for node, gpus in spots:
                used[node] += gpus
        capacity = {n.name: n.gpus for n in self.cluster.nodes}
        over = sorted(n for n, g in used.items() if g > capacity[n])
        return f"over-filled nodes {over}" if over else None
