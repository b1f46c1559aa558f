"""What the round loop (`services.policy.rounds`) reports of its rounds, beside deciding them: each
round's trace (its root span, the policy's solve, one `job.decision` span per job, each team's use),
the `RoundRecord` a run keeps of a decided round, and, for a live run's recorder, each decided
round's summary and job decisions (`services.policy.decisions`) and its stages' times. The loop
tells its observer what it knows at each point of a round; nothing the observer does changes a
decision.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context

from policies.base import Decision, JobView
from services.policy.decisions import (
    JobOutcome,
    Measuring,
    job_decisions,
    job_outcome,
    measured_goodput,
    measuring,
    round_summary,
    span_attributes,
)
from shared.cluster import Cluster
from shared.hardware import hardware_name
from shared.schema.base import Config, Spots
from shared.schema.decisions import JobDecision, RoundSummary
from shared.schema.rounds import ApplyRequest, JobFacts, JobModels, Reclaim
from shared.schema.runs import RoundRecord, RunClock
from shared.schema.teams import Teams
from shared.tracing import span_context_of

if TYPE_CHECKING:
    from services.policy.rounds import Recorder

# At most this many `job.decision` spans a round (a span costs the SDK tens of microseconds, and a
# trace of 10,000 spans is not read): beyond it, the jobs left where they were go unrecorded.
MAX_DECISION_SPANS = 2000


class StageTimes:
    """The seconds each stage of a round took, in the order they ran, from `started`; each is told to
    `tell` as it ends (the recorder's, for the stages outside the decision)."""

    def __init__(self, tell: Callable[[str, float], None] | None = None):
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.tell = tell

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - started
        if self.tell is not None:
            self.tell(name, self.seconds[name])

    def ms(self) -> dict[str, float]:
        return {stage: seconds * 1e3 for stage, seconds in self.seconds.items()}


@dataclass(frozen=True)
class DecidedJobs:
    """A round the loop has decided, as its observer reports it: what the loop knew of the jobs, and
    what the round made of each."""

    round: int
    now: float
    active: Sequence[str]  # the jobs the round was asked about
    facts: Sequence[JobFacts]  # the executors' word on them, held and failed jobs too
    models: Mapping[str, JobModels]  # the estimator's
    views: Sequence[JobView]  # the jobs the policy decided for
    held: Mapping[str, str]  # jobs that wait out the round, and why
    failed: Mapping[str, str]  # jobs that leave the run, and why
    decision: Decision
    kept: str | None  # why every job kept its placement (None: the policy decided)
    placements: Mapping[str, Spots]  # of the jobs in `views`
    evicted: Sequence[str]  # jobs the placer found no node for
    teams: Teams | None
    borrowed: Mapping[str, int]  # the ledger's: GPUs beyond each job's team's guarantee
    reclaims: Mapping[str, Reclaim]  # ... and the jobs the round shrank or stopped for a team
    cluster: Cluster
    stages: StageTimes  # the decision's: facts, models, solve, place
    events: Sequence[str]


class RoundObserver:
    """The spans (on `tracer`), records and recorded decisions of one loop's rounds under `policy`;
    `recorder`: where each decided round's summary and job decisions go (None: nowhere)."""

    def __init__(self, tracer: trace.Tracer, policy: str, recorder: Recorder | None = None):
        self.tracer = tracer
        self.policy = policy
        self.recorder = recorder
        self._recorded: tuple[RoundSummary, list[JobDecision]] | None = None  # the last decision's, to record
        # For the recorded decisions, from the rounds this loop decided (a new leader starts without):
        # each job's predicted goodput, and where its measurement over the round started.
        self._predicted: dict[str, float] = {}
        self._measuring: dict[str, Measuring] = {}

    def round(self, clock: RunClock, gpus: int, decides: bool) -> AbstractContextManager[trace.Span]:
        """The round's root span: every stage's span, in every service, descends from it (one trace a
        round)."""
        return self.tracer.start_as_current_span(
            "round",
            context=Context(),
            attributes={
                "round": clock.round,
                "now_s": clock.now_s,
                "jobs": len(clock.active),
                "gpus": gpus,
                "decides": decides,
            },
        )

    def solving(self, jobs: int) -> AbstractContextManager[trace.Span]:
        """The policy's solve's span, over `jobs` jobs (its outcome: `solved`)."""
        return self.tracer.start_as_current_span("policy.solve", attributes={"policy": self.policy, "jobs": jobs})

    @staticmethod
    def solved(span: trace.Span, jobs: int, decision: Decision, refused: int, kept: str | None) -> None:
        """What the solve decided for `jobs` jobs, `refused` of them refused; `kept`: why it kept every
        job where it was."""
        span.set_attributes(
            {
                "jobs.scheduled": jobs,
                "jobs.allocated": len(decision.allocations),
                "gpus.allocated": sum(c.gpus for c in decision.allocations.values()),
                "jobs.refused": refused,
                "placed_by_policy": decision.placements is not None,
                "allocation.kept": kept is not None,
            }
        )
        if kept is not None:
            span.set_attribute("reason", kept)
        if decision.events:  # e.g. sia's solver ran out of time
            span.set_attribute("events", list(decision.events))

    def stage_times(self) -> StageTimes:
        """Times for the stages outside the decision (apply, advance, checkpoint, log), each told to the
        recorder as it ends."""
        return StageTimes(self.recorder.stage if self.recorder is not None else None)

    @staticmethod
    def round_record(decided: DecidedJobs) -> RoundRecord:
        """The run's record of the decided round: each running job's GPUs, their type, batch and
        nodes; with teams, each team's use; what deciding cost, so far."""
        placements, cluster = decided.placements, decided.cluster
        gpus = {job: sum(g for _, g in spots) for job, spots in placements.items() if spots}
        types = {job: cluster.placement_type(placements[job]) or "mixed" for job in gpus}
        batches = {
            job: p.batch for job, p in decided.decision.predictions.items() if job in gpus and p.batch is not None
        }
        spread = {job: len(placements[job]) for job in gpus if len(placements[job]) > 1}
        configs = {job: cluster.config_of(placements[job]) for job in gpus}
        teams = decided.teams
        use = (
            team_use(decided.views, configs, teams, decided.borrowed, decided.reclaims)
            if teams is not None
            else ({}, {}, {})
        )
        stages = decided.stages
        return RoundRecord(
            decided.now,
            len(decided.active),
            len(gpus),
            stages.seconds["solve"] * 1e3,
            (time.perf_counter() - stages.started) * 1e3,
            gpus,
            types,
            batches,
            spread,
            *use,
            stages_ms=stages.ms(),
        )

    def decided(self, decided: DecidedJobs, apply: ApplyRequest, record: RoundRecord) -> None:
        """Report the decided round: a `job.decision` span per job under the round's span, and its
        summary and job decisions kept for the recorder (`record_decision`); nothing when neither
        is wanted."""
        if self.recorder is None and not trace.get_current_span().is_recording():
            return
        by_id, gone = {f.job_id: f for f in decided.facts}, set(decided.evicted)
        outcomes = [
            job_outcome(
                job,
                by_id.get(job),
                decided.held,
                decided.failed,
                decided.decision,
                decided.placements,
                gone,
                decided.kept,
                decided.cluster,
                self.policy,
                apply.waits,
            )
            for job in dict.fromkeys([*decided.active, *decided.held, *decided.failed])
        ]
        self._trace(decided, outcomes, apply, record)
        if self.recorder is not None:
            summary = round_summary(
                decided.round,
                decided.now,
                self.policy,
                outcomes,
                decided.cluster,
                apply.borrowed,
                decided.decision.objective,
                decided.stages.seconds,
                record.round_ms / 1e3,
                decided.events,
                record,
            )
            self._recorded = (summary, self._job_decisions(decided, outcomes, apply))

    async def record_decision(self) -> None:
        """The last decided round's summary and job decisions to the recorder (once the run has kept
        the decision)."""
        if self.recorder is not None and self._recorded is not None:
            await self.recorder.decided(*self._recorded)
            self._recorded = None

    def _job_decisions(
        self, decided: DecidedJobs, outcomes: Sequence[JobOutcome], apply: ApplyRequest
    ) -> list[JobDecision]:
        """The round's JobDecisions, with what this observer remembers of the round before (each job's
        prediction then, and what it did since); then it remembers this round's."""
        now, models = decided.now, decided.models
        measured = {}
        for o in outcomes:
            value = measured_goodput(o.facts, self._measuring.get(o.job), models.get(o.job), now)
            if value is not None:
                measured[o.job] = value
        decisions = job_decisions(
            decided.round, now, outcomes, decided.cluster, models, apply.reclaims, self._predicted, measured
        )
        self._predicted = {
            o.job: o.prediction.goodput for o in outcomes if o.spots and o.prediction.goodput is not None
        }
        self._measuring = {o.job: measuring(o, now) for o in outcomes if o.spots}
        return decisions

    def _trace(
        self, decided: DecidedJobs, outcomes: Sequence[JobOutcome], apply: ApplyRequest, record: RoundRecord
    ) -> None:
        """One `job.decision` span per job the round considered, a child of the round's span (and
        linked to the job's submission when its facts carry that trace): what it got and why; with
        teams, what each job borrows and whose reclaim shrank it, and each team's use on the round."""
        round_span = trace.get_current_span()
        if not round_span.is_recording():  # no one records this round: spare building the spans
            return
        by_id = {o.job: o.facts for o in outcomes}
        traced = [(span_attributes(o), o.restart) for o in outcomes]
        if decided.teams is not None:
            for attributes, _ in traced:
                attributes["borrowed"] = apply.borrowed.get(attributes["job.id"], 0)
                reclaim = apply.reclaims.get(attributes["job.id"])
                if reclaim is not None:
                    attributes["reclaimed"] = reclaim.by_team
            round_span.set_attributes(team_attributes(decided.teams, record))
        if len(traced) > MAX_DECISION_SPANS:  # a huge round: what changed first, jobs left as they were last
            traced.sort(key=lambda d: d[0]["decision"] in ("allocated", "kept") and not d[0]["placement.changed"])
        for attributes, _ in traced[:MAX_DECISION_SPANS]:
            f = by_id.get(attributes["job.id"])
            context = span_context_of(f.trace) if f is not None else None
            links = [trace.Link(context)] if context is not None else None  # its submission's trace
            self.tracer.start_span("job.decision", attributes={"round": decided.round, **attributes}, links=links).end()
        placements = decided.placements
        round_span.set_attributes(
            {
                "jobs.considered": len(outcomes),
                "jobs.held": len(decided.held),
                "jobs.failed": len(decided.failed),
                "jobs.allocated": sum(1 for spots in placements.values() if spots),
                "gpus.allocated": sum(g for spots in placements.values() for _, g in spots),
                "restarts": sum(restart for _, restart in traced),
                "evictions": len(decided.evicted),
                "allocation.kept": decided.kept is not None,
                "job.decisions.omitted": max(0, len(traced) - MAX_DECISION_SPANS),
            }
        )


def team_use(
    views: Sequence[JobView],
    configs: Mapping[str, Config],
    teams: Teams,
    borrowed: Mapping[str, int],
    reclaims: Mapping[str, Reclaim],
) -> tuple[dict[str, dict[str, int]], dict[str, int], dict[str, int]]:
    """Per team after the decision: GPUs held of each type, those borrowed, its jobs reclaimed."""
    team_of = {v.job_id: v.team for v in views}
    gpus: dict[str, dict[str, int]] = {team: {} for team in teams.teams}
    borrowing: dict[str, int] = {team: 0 for team in teams.teams}
    reclaimed: dict[str, int] = {team: 0 for team in teams.teams}
    for job, config in configs.items():
        held = gpus.setdefault(team_of[job], {})
        held[config.gpu_type] = held.get(config.gpu_type, 0) + config.gpus
        borrowing[team_of[job]] = borrowing.get(team_of[job], 0) + borrowed.get(job, 0)
    for job in reclaims:
        if job in team_of:
            reclaimed[team_of[job]] = reclaimed.get(team_of[job], 0) + 1
    return gpus, borrowing, reclaimed


def team_attributes(teams: Teams, record: RoundRecord) -> dict:
    """The round span's word on each team: GPUs held and borrowed, jobs reclaimed, and per GPU type
    what it holds of its guarantee (`team.nlp.use: ["T4 12/12", "A100 10/8"]`)."""
    attributes: dict = {}
    for team, held in record.team_gpus.items():
        quota = teams.teams[team].quota if team in teams.teams else {}
        types = sorted(set(held) | {t for t, n in quota.items() if n})
        attributes.update(
            {
                f"team.{team}.gpus": sum(held.values()),
                f"team.{team}.borrowed": record.team_borrowed.get(team, 0),
                f"team.{team}.reclaimed": record.team_reclaimed.get(team, 0),
                f"team.{team}.use": [f"{hardware_name(t)} {held.get(t, 0)}/{teams.quota(team, t)}" for t in types],
            }
        )
    return attributes
