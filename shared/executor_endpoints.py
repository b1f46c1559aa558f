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
from shared.schema.base import Ack, Count
from shared.schema.estimates import Observed, ObservedAll, StoredAll
from shared.schema.nodes import NodeStatuses
from shared.schema.records import JobRecord, JobsQuery, select
from shared.schema.rounds import (
    AdvanceReply,
    AdvanceRequest,
    ApplyRequest,
    FactsReply,
    FactsRequest,
    LiveJobs,
    LiveJobsRequest,
)
from shared.settings import OBSERVED_IN_ONE_REPORT, REPORTS_AT_ONCE
from shared.subjects import DEFAULT_TEAM

log = logging.getLogger(__name__)

REPORT_TIMEOUT_S = 10.0  # a request of observations, each maybe a fit the estimator makes


async def report(bus: Bus, message: ObservedAll) -> StoredAll:
    """Configurations jobs ran, to the estimator, until it has them: observing twice changes nothing,
    so a restarted estimator is simply asked again. The revisions it stored (the jobs' facts carry
    them)."""
    while True:
        try:
            return await bus.request(subjects.OBSERVE, message, StoredAll, timeout=REPORT_TIMEOUT_S)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            log.warning("estimator unavailable; reporting %d observations again", len(message.observed))
            await asyncio.sleep(0.2)


def refused_whose(subject: str, owner: str, team: str) -> tuple[str, str]:
    """The login and team a refusal is listed for: the API's record says whose on its own subject
    (`owner`, `team`, as the jobs stream's subject gave them); else the subject of the submission
    judged (`subject`) does."""
    _, came_team, came_login = subjects.owner_of(subject)
    return owner or came_login, team or came_team or DEFAULT_TEAM


async def report_all(
    bus: Bus, messages: Iterable[Observed], reported: Callable[[Observed, int], Awaitable[None]]
) -> None:
    """The messages to the estimator (`report`), about OBSERVED_IN_ONE_REPORT a request and
    REPORTS_AT_ONCE requests in flight, each job's together and in the order given (its fits learn
    them in that order). `reported(message, revision)` for each one stored; one refused is logged,
    and reported again the next time its job runs it."""
    by_job: dict[str, list[Observed]] = {}
    for message in messages:
        by_job.setdefault(message.job_id, []).append(message)
    requests: list[list[Observed]] = [[]]
    for queue in by_job.values():
        if len(requests[-1]) >= OBSERVED_IN_ONE_REPORT:
            requests.append([])
        requests[-1].extend(queue)
    gate = asyncio.Semaphore(REPORTS_AT_ONCE)

    async def send(observed: list[Observed]) -> None:
        async with gate:
            stored = await report(bus, ObservedAll(tuple(observed)))
        for job_id, reason in stored.refused.items():
            log.warning("the estimator did not store what job %s ran: %s", job_id, reason)
        for message, revision in zip(observed, stored.revisions):
            if revision:
                await reported(message, revision)

    await asyncio.gather(*(send(observed) for observed in requests if observed))


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
    nodes: Callable[[Ack], Awaitable[NodeStatuses]],
) -> micro.Service:
    """Register the round's executor endpoints (facts, apply, advance, live) and the status ones:
    the jobs' records, how many of those whose id begins with a prefix have the profiler's verdict
    (`count(prefix)`), and the nodes with the jobs on each."""
    service = await new_service(bus, subjects.EXECUTOR_SERVICE, description)
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
    await bus.add_endpoint(service, "nodes", subjects.EXECUTOR_NODES, Ack, nodes, parts=False)
    return service
