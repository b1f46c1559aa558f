"""The round loop over NATS: each stage of a round is a request to its service.

A request that finds no responder, or times out, is sent again until `retry_s` has passed: every
stage may safely run twice (facts, models and place are pure; apply gives the same placement the
same way; the executors never run a round twice), so a service that was restarted (kill -9, a
rolling update) picks the round up where it was.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import msgspec
import nats.errors

from shared import storage, subjects
from shared.bus import Bus
from shared.bus.kv import TypedKV
from shared.schema.base import Ack, Config, Node, Spots
from shared.schema.rounds import (
    AdvanceReply,
    AdvanceRequest,
    ApplyRequest,
    FactsReply,
    FactsRequest,
    JobFacts,
    JobModels,
    LiveJobs,
    LiveJobsRequest,
    ModelsReply,
    ModelsRequest,
    PlacementResult,
    PlaceRequest,
)
from shared.schema.teams import TeamFile

REQUEST_TIMEOUT_S = 10.0
RETRY_S = 120.0
log = logging.getLogger(__name__)


class StageUnanswered(RuntimeError):
    """A stage of the round found no service to answer it in time."""


class KeptModels:
    """The estimator's models of each job of the last round, with the facts they were made of. A
    job whose facts are as they were then but for its age (which no model depends on: the
    estimator's `job_models`) keeps its models, so a round asks the estimator of the others only:
    of 10,000 queued jobs, those that ran or learned something. A job that learned carries a new
    `estimate_revision` in its facts, so it is asked again."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[JobFacts, JobModels]] = {}

    def split(self, facts: Sequence[JobFacts]) -> tuple[list[JobModels], list[JobFacts]]:
        """(the models kept, the facts of the jobs to ask the estimator of)."""
        kept, ask = [], []
        for f in facts:
            last = self.last.get(f.job_id)
            if last is not None and msgspec.structs.replace(f, age_s=last[0].age_s) == last[0]:
                kept.append(last[1])
            else:
                ask.append(f)
        return kept, ask

    def keep(self, facts: Sequence[JobFacts], models: Sequence[JobModels]) -> None:
        """This round's models, each with its job's facts (only this round's jobs are kept)."""
        of = {f.job_id: f for f in facts}
        self.last = {m.job_id: (of[m.job_id], m) for m in models if m.job_id in of}


class BusWiring:
    def __init__(self, bus: Bus, timeout_s: float = REQUEST_TIMEOUT_S, retry_s: float = RETRY_S):
        self.bus = bus
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.kept_models = KeptModels()

    async def _request(self, subject: str, message, reply_type):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_s
        while True:
            try:
                return await self.bus.request(subject, message, reply_type, self.timeout_s)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as error:
                if loop.time() > deadline:
                    what = "no service answered" if isinstance(error, nats.errors.NoRespondersError) else "no answer"
                    raise StageUnanswered(f"{subject}: {what} for {self.retry_s:g} s") from error
                log.warning("%s: %s; asking again", subject, type(error).__name__)
                await asyncio.sleep(0.2)

    async def facts(self, now: float, jobs: list[str]) -> FactsReply:
        return await self._request(subjects.FACTS, FactsRequest(now, tuple(jobs)), FactsReply)

    async def models(self, facts: list[JobFacts]) -> ModelsReply:
        kept, ask = self.kept_models.split(facts)
        made = await self._request(subjects.MODELS, ModelsRequest(tuple(ask)), ModelsReply) if ask else ModelsReply(())
        models = (*kept, *made.models)
        self.kept_models.keep(facts, models)
        return ModelsReply(models, made.held)

    async def place(
        self,
        round: int,
        allocations: dict[str, Config],
        previous: dict[str, Spots],
        groups: dict[str, int],
        nodes: tuple[Node, ...] | None = None,
    ) -> PlacementResult:
        return await self._request(
            subjects.PLACE, PlaceRequest(round, allocations, previous, groups, nodes), PlacementResult
        )

    async def apply(self, request: ApplyRequest) -> None:
        await self._request(subjects.APPLY, request, Ack)

    async def advance(self, now: float, step: float, jobs: list[str]) -> AdvanceReply:
        return await self._request(subjects.ADVANCE, AdvanceRequest(now, step, tuple(jobs)), AdvanceReply)

    async def live_jobs(self, now: float) -> LiveJobs:
        """The live jobs not finished (those submitted since the last round arrive now), and the nodes."""
        return await self._request(subjects.LIVE_JOBS, LiveJobsRequest(now), LiveJobs)


class LiveFeed:
    """A live run over the bus: its jobs are those submitted live (the executors hold them), and the
    round at virtual time `now` runs when the wall clock gets there, at `speed` virtual seconds per
    second. After a pause (a new leader resuming) the clock goes on from where it was."""

    def __init__(self, wiring: BusWiring, now: float, speed: float = 1.0):
        self.wiring = wiring
        self.speed = speed
        self.origin = (time.monotonic(), now)
        self.nodes: tuple[Node, ...] | None = None

    async def wait(self, now: float) -> None:
        wall, virtual = self.origin
        await asyncio.sleep(max(0.0, wall + (now - virtual) / self.speed - time.monotonic()))

    async def jobs(self, now: float) -> list[str]:
        live = await self.wiring.live_jobs(now)
        self.nodes = live.nodes
        return list(live.jobs)


class KvTeams:
    """A live run's teams: the operator's team file (`goodput teams apply`), read from the teams'
    KV bucket at every decision, so a change is in force the round after it. No key: no teams; a
    value that cannot be read, or no bucket, is a ValueError (the round loop says it once and keeps
    the last team file it could use)."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.kv: TypedKV[TeamFile] | None = None

    async def team_file(self) -> TeamFile | None:
        where = f"KV {subjects.TEAMS_BUCKET}/{subjects.TEAMS_KEY}"
        if self.kv is None:
            try:
                self.kv = await storage.open_kv(self.bus, subjects.TEAMS_BUCKET, TeamFile)
            except storage.StorageMismatch as error:
                raise ValueError(f"the teams cannot be read: {error}") from None
        try:
            entry = await self.kv.get(subjects.TEAMS_KEY)
        except msgspec.DecodeError as error:
            raise ValueError(f"the team file in {where} cannot be read: {error}") from None
        return None if entry is None else entry.value
