"""The estimator service: bootstrap profiles and observations in, each job's models out.

Replicas share the work through the service's queue group: the KV bucket holds every job's record
(profiles and observations) and is the truth; each replica keeps fitted estimates as a cache over
it. A write is a compare-and-set on the revision the replica's cache was built from (a replica that
missed another's write reloads and tries again), and its acknowledgement carries the new revision;
the executors hand that revision back in each job's facts, so whichever replica answers a round
reads the job again if its copy is older. A restarted replica starts empty and loads jobs as asked.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from nats import micro
from opentelemetry import trace

from services.estimator.core import Estimator
from shared import storage, subjects
from shared.bus import Bus
from shared.bus.kv import RevisionConflict, TypedKV
from shared.runner import new_service
from shared.schema.base import Ack, Count, Stored
from shared.schema.estimates import EstimateRecord, JobProfiles, Observed, ObservedAll, ProfilesAll, StoredAll
from shared.schema.rounds import ModelsReply, ModelsRequest
from shared.settings import OBSERVED_AT_ONCE, PROFILES_IN_FLIGHT, REPORTS_AT_ONCE, settings_for

CONFLICT_RETRIES = 20
MAX_TRACED_IDS = 256  # job ids listed on one `estimator.goodput` span (the count is always there)
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="sia-hetero-64")
    parser.add_argument("--calibration", help="simulated clusters: the calibration's per-model batch caps")


class SharedEstimates:
    """An `Estimator` as a read-through cache of the KV records, and its compare-and-set writes: the
    estimator service's handlers (`add`, `observe`, `models`, `count`)."""

    def __init__(self, estimator: Estimator, records: TypedKV[EstimateRecord], bus: Bus | None = None):
        self.estimator = estimator
        self.records = records
        self.bus = bus
        self.revisions: dict[str, int] = {}  # the revision each cached estimate was built from

    async def load(self, job_id: str, at_least: int = 0) -> bool:
        """Make the cached estimate at least as new as `at_least`; False if the job has no record."""
        if job_id in self.revisions and self.revisions[job_id] >= at_least:
            return True
        entry = await self.records.get(job_id)
        if entry is None:
            return False
        self.estimator.restore(entry.value)
        self.revisions[job_id] = entry.revision
        return True

    async def add(self, message: JobProfiles) -> Stored:
        # Not cached here: a new job, most likely, stored without reading first (one that is stored
        # already is refused, and read).
        if message.job_id not in self.revisions:
            self.estimator.add(message.job_id, {p.gpu_type: p for p in message.profiles})
            try:
                self.revisions[message.job_id] = await self.records.create(
                    message.job_id, self.estimator.record(message.job_id)
                )
            except RevisionConflict:  # stored before (by another replica, or before a restart): that stands
                await self.load(message.job_id)
        return Stored(self.revisions[message.job_id])

    async def add_all(self, message: ProfilesAll) -> StoredAll:
        """Store the profiles of jobs judged at once (`add`), side by side (each job's record is its
        own key). One that cannot be stored is its job's trouble only."""
        refused: dict[str, str] = {}

        async def one(profiles: JobProfiles) -> int:
            try:
                return (await self.add(profiles)).revision
            except Exception as error:  # noqa: BLE001 - one job's profiles that cannot be stored are that job's
                log.warning("job %s: profiles not stored: %s: %s", profiles.job_id, type(error).__name__, error)
                refused[profiles.job_id] = f"{type(error).__name__}: {error}"
                return 0

        revisions = await asyncio.gather(*(one(profiles) for profiles in message.jobs))
        span = trace.get_current_span()
        if span.is_recording():
            ids = [profiles.job_id for profiles in message.jobs]
            span.set_attributes(
                {"jobs": len(ids), "job.ids": ids[:MAX_TRACED_IDS], "job.ids.truncated": len(ids) > MAX_TRACED_IDS}
            )
        return StoredAll(tuple(revisions), refused)

    async def observe(self, message: ObservedAll) -> StoredAll:
        """Learn what jobs ran: each job's observations in order, OBSERVED_AT_ONCE jobs side by side
        (each job's record is its own key). One that cannot be stored is its job's trouble only."""
        observed = message.observed
        revisions = [0] * len(observed)
        refused: dict[str, str] = {}
        learned = 0
        by_job: dict[str, list[int]] = {}
        for i, one in enumerate(observed):
            by_job.setdefault(one.job_id, []).append(i)
        gate = asyncio.Semaphore(OBSERVED_AT_ONCE)

        async def learn_all(job_id: str, indices: list[int]) -> None:
            nonlocal learned
            async with gate:
                for i in indices:
                    try:
                        revisions[i], new = await self.learn(observed[i])
                    except Exception as error:  # noqa: BLE001 - one job's observation that cannot be stored is that job's
                        log.warning("job %s: observation not stored: %s: %s", job_id, type(error).__name__, error)
                        refused[job_id] = f"{type(error).__name__}: {error}"
                        return
                    learned += new

        await asyncio.gather(*(learn_all(job_id, indices) for job_id, indices in by_job.items()))
        span = trace.get_current_span()
        if span.is_recording():
            ids = list(by_job)
            span.set_attributes(
                {
                    "observations": len(observed),
                    "learned": learned,
                    "jobs": len(ids),
                    "job.ids": ids[:MAX_TRACED_IDS],
                    "job.ids.truncated": len(ids) > MAX_TRACED_IDS,
                }
            )
        return StoredAll(tuple(revisions), refused)

    async def learn(self, message: Observed) -> tuple[int, bool]:
        """(the revision of the job's record that holds this observation, whether it was new)."""
        for _ in range(CONFLICT_RETRIES):
            if not await self.load(message.job_id):
                raise ValueError(f"no profile for job {message.job_id!r} yet")
            revision = self.revisions[message.job_id]
            if not self.estimator.observe(message.job_id, message.gpu_type, message.observation):
                return revision, False  # seen already: nothing to write
            try:
                self.revisions[message.job_id] = await self.records.update(
                    message.job_id, self.estimator.record(message.job_id), revision
                )
                return self.revisions[message.job_id], True
            except RevisionConflict:  # another replica wrote first: reload, learn again
                await self.load(message.job_id, revision + 1)
        raise RuntimeError(f"job {message.job_id}: the record kept changing under {CONFLICT_RETRIES} writes")

    async def models(self, request: ModelsRequest) -> ModelsReply:
        """The models of the jobs it has profiles of; the others are held, not an error of the round."""
        models, held = [], {}
        for facts in request.facts:
            try:
                if not await self.load(facts.job_id, facts.estimate_revision):
                    held[facts.job_id] = "the estimator has no profile of it yet"
                    continue
                models.extend(self.estimator.models([facts]))
            except Exception as error:  # noqa: BLE001 - one job's model that cannot be made holds that job only
                log.warning("job %s: no model this round: %s: %s", facts.job_id, type(error).__name__, error)
                held[facts.job_id] = f"the estimator could not model it: {type(error).__name__}: {error}"
        span = trace.get_current_span()
        if span.is_recording():
            ids = [f.job_id for f in request.facts]
            span.set_attributes(
                {
                    "jobs": len(ids),
                    "jobs.modelled": len(models),
                    "jobs.held": len(held),
                    "job.ids": ids[:MAX_TRACED_IDS],
                    "job.ids.truncated": len(ids) > MAX_TRACED_IDS,
                }
            )
            if held:
                span.set_attribute("held.job.ids", sorted(held)[:MAX_TRACED_IDS])
        return ModelsReply(tuple(models), held)

    async def count(self, _: Ack) -> Count:
        # The bucket's keys, as the server counts them, in one request however many jobs: it keeps one
        # value per key (history 1) and none is deleted, so each stored message is a key.
        info = await self.bus.js.stream_info(storage.BUCKETS[subjects.ESTIMATES_BUCKET].stream)
        return Count(info.state.messages)


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    records = await storage.open_kv(bus, subjects.ESTIMATES_BUCKET, EstimateRecord)
    shared = SharedEstimates(Estimator(settings_for(args.calibration, args.cluster).max_local), records, bus)

    service = await new_service(bus, subjects.ESTIMATOR_SERVICE, "throughput models and goodput per job and GPU type")
    # A burst of submissions: the profiler judges many at once, and sends their profiles together
    # (`ProfilesAll`), a few requests in flight; each job's record is its own key.
    await bus.add_endpoint(
        service,
        "profiles",
        subjects.PROFILES,
        ProfilesAll,
        shared.add_all,
        span_name="estimator.profiles",
        concurrency=PROFILES_IN_FLIGHT,
    )
    # A round's end: an observation from each job that trained, in requests of many (`report_all`),
    # a few at once.
    await bus.add_endpoint(
        service,
        "observe",
        subjects.OBSERVE,
        ObservedAll,
        shared.observe,
        span_name="estimator.observe",
        concurrency=REPORTS_AT_ONCE,
    )
    await bus.add_endpoint(
        service, "models", subjects.MODELS, ModelsRequest, shared.models, span_name="estimator.goodput"
    )
    await bus.add_endpoint(service, "status", subjects.ESTIMATOR_STATUS, Ack, shared.count, parts=False)
    return service
