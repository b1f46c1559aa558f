"""The executors' side of the round as endpoints, the same whoever plays the jobs: the simulated
executors (`services.simulated`) or the executor over real ones (`services.executor.real`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Iterable

import msgspec
import nats.errors
from nats import micro

from shared import storage, subjects
from shared.bus import Bus
from shared.runner import new_service
from shared.schema import (
    Ack,
    AdvanceReply,
    AdvanceRequest,
    ApplyRequest,
    Count,
    FactsReply,
    FactsRequest,
    JobRecord,
    JobsQuery,
    LiveJobs,
    LiveJobsRequest,
    Observed,
    Stored,
    select,
)
from shared.settings import OBSERVED_AT_ONCE

log = logging.getLogger(__name__)


async def report(bus: Bus, message: Observed) -> int:
    """A configuration a job ran, to the estimator, until it has it: observing twice changes nothing,
    so a restarted estimator is simply asked again. The revision it stored (the job's facts carry it)."""
    while True:
        try:
            return (await bus.request(subjects.OBSERVE, message, Stored, timeout=5)).revision
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            log.warning("estimator unavailable; reporting %s again", message.job_id)
            await asyncio.sleep(0.2)


async def report_all(
    bus: Bus, messages: Iterable[Observed], reported: Callable[[Observed, int], Awaitable[None]]
) -> None:
    """Each message to the estimator (`report`), OBSERVED_AT_ONCE in flight: one job's in the order
    given (its fits learn them in that order), different jobs' side by side. `reported(message,
    revision)` as each is stored."""
    by_job: dict[str, list[Observed]] = {}
    for message in messages:
        by_job.setdefault(message.job_id, []).append(message)
    gate = asyncio.Semaphore(OBSERVED_AT_ONCE)

    async def one_job(queue: list[Observed]) -> None:
        for message in queue:
            async with gate:
                revision = await report(bus, message)
            await reported(message, revision)

    await asyncio.gather(*(one_job(queue) for queue in by_job.values()))


async def consume_job_events(
    bus: Bus, consumer: str, on_event: Callable[[msgspec.Raw, Any], Awaitable[None]]
) -> asyncio.Task:
    """Read the jobs stream in order through the executors' durable `consumer` (its dead letters
    kept), each event to `on_event(raw, delivery)`; the task reading it."""
    await storage.open_stream(bus, subjects.DEAD_LETTER_STREAM)
    events = await storage.open_consumer(
        bus, consumer, msgspec.Raw, span_name="executor.job-event", dead_letters=subjects.dead_letters(consumer)
    )
    return asyncio.get_running_loop().create_task(events.consume(on_event, with_delivery=True))


async def serve_round(
    bus: Bus,
    description: str,
    *,
    facts: Callable[[float, tuple[str, ...]], FactsReply],
    apply: Callable[[ApplyRequest], Awaitable[Ack]],
    advance: Callable[[AdvanceRequest], Awaitable[AdvanceReply]],
    live: Callable[[LiveJobsRequest], Awaitable[LiveJobs]],
    records: Callable[[], Iterable[JobRecord]],
    count: Callable[[str], int],
) -> micro.Service:
    """Register the round's executor endpoints (facts, apply, advance, live) and the status ones:
    the jobs' records, and how many of those whose id begins with a prefix have the profiler's
    verdict (`count(prefix)`)."""
    service = new_service(bus, subjects.EXECUTOR_SERVICE, description)
    await bus.add_endpoint(
        service,
        "facts",
        subjects.FACTS,
        FactsRequest,
        lambda request: facts(request.now_s, request.jobs),
        span_name="executor.facts",
    )
    await bus.add_endpoint(service, "apply", subjects.APPLY, ApplyRequest, apply, span_name="executor.apply")
    await bus.add_endpoint(service, "advance", subjects.ADVANCE, AdvanceRequest, advance, span_name="executor.advance")
    await bus.add_endpoint(service, "live", subjects.LIVE_JOBS, LiveJobsRequest, live)
    await bus.add_endpoint(
        service, "records", subjects.RECORDS, JobsQuery, lambda query: select(records(), query), parts=False
    )
    await bus.add_endpoint(
        service, "status", subjects.EXECUTOR_STATUS, JobsQuery, lambda query: Count(count(query.prefix)), parts=False
    )
    return service
