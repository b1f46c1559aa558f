"""The policy leader's record of the live run's decided rounds: the round metrics (from each round's
summary: `services.policy.decisions.record_round_metrics`, and the apply and advance stages as they
run), and the decisions stream, where each job's JobDecision goes on `job_decisions(job)` and the
round's RoundSummary on ROUND_DECISIONS, kept a bounded time (shared.storage's plan) for the API to
explain a job (goodput.api.explain) and show the last rounds (goodput.api.rounds).

A round with thousands of jobs publishes thousands of messages: they are published in the background
(a round's after the last's), their acks awaited together, so the round waits neither for them nor
for JetStream; a record that fails is logged (once a run of failures), and the rounds go on: the
record is for people, never for the schedule. Replays are not recorded: they would flood the stream and the gauges of the live cluster.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import nats.errors
import nats.js.errors

from services.policy.decisions import record_round_metrics, record_stage
from shared import subjects
from shared.bus import Bus
from shared.schema.decisions import JobDecision, RoundSummary

ACK_TIMEOUT_S = 30.0  # a round's records not acknowledged by then are taken as lost (and said so)
log = logging.getLogger(__name__)


class DecisionRecorder:
    """The live run's `services.policy.rounds.Recorder`, on the leader's bus."""

    def __init__(self, bus: Bus, ack_timeout_s: float = ACK_TIMEOUT_S) -> None:
        self.bus, self.ack_timeout_s = bus, ack_timeout_s
        self.types_seen: set[str] = set()  # the GPU types the metrics have shown
        self.teams_seen: set[tuple[str, str]] = set()  # ... and the (team, GPU type) pairs
        self.in_flight: set[asyncio.Task] = set()  # each round's publishing and acks
        self.order = asyncio.Lock()  # the rounds are stored in their order
        self.failing = False  # the last round's record failed (said once until one succeeds)

    def stage(self, stage: str, seconds: float) -> None:
        record_stage(stage, seconds)

    async def decided(self, summary: RoundSummary, decisions: Sequence[JobDecision]) -> None:
        """Record the round: its metrics now, its decisions and summary in the stream in the background
        (`publish`)."""
        record_round_metrics(summary, self.types_seen, self.teams_seen)
        task = asyncio.ensure_future(self.publish(summary, decisions))
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)

    async def publish(self, summary: RoundSummary, decisions: Sequence[JobDecision]) -> None:
        """Store each decision on its job's subject and the summary on ROUND_DECISIONS, not awaiting
        one ack before the next publish; then await them (`settled`)."""
        js, encode = self.bus.js, self.bus.encode
        acks: list[asyncio.Future] = []
        async with self.order:
            try:
                for decision in decisions:
                    acks.append(await js.publish_async(subjects.job_decisions(decision.job), encode(decision)))
                acks.append(await js.publish_async(subjects.ROUND_DECISIONS, encode(summary)))
            except (nats.errors.Error, nats.js.errors.Error, OSError) as error:
                self._failed(summary.round, f"{type(error).__name__}: {error}", len(decisions) + 1 - len(acks))
        await self.settled(summary.round, acks)

    async def settled(self, round_number: int, acks: list[asyncio.Future]) -> None:
        """Await a round's acks (at most `ack_timeout_s`: those left are cancelled, so their places
        among the client's pending publishes are freed); say what failed."""
        if not acks:
            return
        try:
            results = await asyncio.wait_for(asyncio.gather(*acks, return_exceptions=True), self.ack_timeout_s)
        except asyncio.TimeoutError:
            self._failed(round_number, f"no ack within {self.ack_timeout_s:g} s", len(acks))
            return
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._failed(round_number, f"{type(errors[0]).__name__}: {errors[0]}", len(errors))
        elif self.failing:
            self.failing = False
            log.info("round %d: its decisions are recorded again", round_number)

    def _failed(self, round_number: int, why: str, lost: int) -> None:
        if not self.failing:
            log.warning(
                "round %d: %d of its decision records were not stored in %s (%s); the rounds go on",
                round_number,
                lost,
                subjects.DECISIONS_STREAM,
                why,
            )
        self.failing = True
