"""The estimator service: bootstrap profiles and observations in, each job's models out."""

from __future__ import annotations

import argparse

from nats import micro

from services.estimator.core import Estimator
from services.runner import VERSION
from shared import subjects
from shared.bus import Bus
from shared.schema import Ack, Count, EstimateRecord, JobProfiles, ModelsReply, ModelsRequest, Observed
from sim.settings import settings_for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="sia-hetero-64")
    parser.add_argument("--calibration", help="simulated clusters: the calibration's per-model batch caps")


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    # Every change is written to KV before it is acknowledged, so a restarted estimator rebuilds
    # each job's models from its record (same data, same fits). One replica for now: replicas
    # would also need each other's updates.
    estimator = Estimator(settings_for(args.calibration, args.cluster).max_local)
    records = await bus.kv(subjects.ESTIMATES_BUCKET, EstimateRecord)
    for key in await records.keys():
        entry = await records.get(key)
        if entry is not None:
            estimator.restore(entry.value)

    async def on_profiles(message: JobProfiles) -> Ack:
        if message.job_id not in estimator.estimates:
            estimator.add(message.job_id, {p.gpu_type: p for p in message.profiles})
            await records.put(message.job_id, estimator.record(message.job_id))
        return Ack()

    async def on_observed(message: Observed) -> Ack:
        if estimator.observe(message.job_id, message.gpu_type, message.observation):
            await records.put(message.job_id, estimator.record(message.job_id))
        return Ack()

    service = await micro.add_service(bus.nc, name=subjects.ESTIMATOR_SERVICE, version=VERSION,
                                      description="throughput models and goodput per job and GPU type",
                                      queue_group=subjects.ESTIMATOR_SERVICE)
    await bus.add_endpoint(service, "profiles", subjects.PROFILES, JobProfiles, on_profiles)
    await bus.add_endpoint(service, "observe", subjects.OBSERVE, Observed, on_observed,
                           span_name="estimator.observe")
    await bus.add_endpoint(service, "models", subjects.MODELS, ModelsRequest,
                           lambda request: ModelsReply(tuple(estimator.models(request.facts))),
                           span_name="estimator.goodput")
    await bus.add_endpoint(service, "status", subjects.ESTIMATOR_STATUS, Ack,
                           lambda _: Count(len(estimator.estimates)))
    return service
