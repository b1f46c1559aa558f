"""The simulator's clock over NATS: each stage of a round is a request to its service."""

from __future__ import annotations

from shared import subjects
from shared.bus import Bus
from shared.cluster import Config, Spots
from shared.schema import (
    Ack,
    AdvanceReply,
    AdvanceRequest,
    ApplyRequest,
    FactsReply,
    FactsRequest,
    JobFacts,
    JobModels,
    ModelsReply,
    ModelsRequest,
    PlacementResult,
    PlaceRequest,
)

REQUEST_TIMEOUT_S = 60.0


class BusWiring:
    def __init__(self, bus: Bus, timeout_s: float = REQUEST_TIMEOUT_S):
        self.bus = bus
        self.timeout_s = timeout_s
        self.round = 0

    async def facts(self, now: float, jobs: list[str]) -> list[JobFacts]:
        reply = await self.bus.request(subjects.FACTS, FactsRequest(now, tuple(jobs)), FactsReply, self.timeout_s)
        return list(reply.facts)

    async def models(self, facts: list[JobFacts]) -> list[JobModels]:
        reply = await self.bus.request(subjects.MODELS, ModelsRequest(tuple(facts)), ModelsReply, self.timeout_s)
        return list(reply.models)

    async def place(self, allocations: dict[str, Config], previous: dict[str, Spots]) -> PlacementResult:
        self.round += 1
        return await self.bus.request(subjects.PLACE, PlaceRequest(self.round, allocations, previous),
                                      PlacementResult, self.timeout_s)

    async def apply(self, now: float, placements: dict[str, Spots], models: dict[str, JobModels],
                    adaptive: bool) -> None:
        await self.bus.request(subjects.APPLY, ApplyRequest(now, placements, models, adaptive), Ack, self.timeout_s)

    async def advance(self, now: float, step: float) -> list[str]:
        reply = await self.bus.request(subjects.ADVANCE, AdvanceRequest(now, step), AdvanceReply, self.timeout_s)
        return list(reply.finished)
