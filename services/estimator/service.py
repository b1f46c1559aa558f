"""The estimator service: bootstrap profiles and observations in, each job's models out."""

from __future__ import annotations

import argparse

from nats import micro

from services.estimator.core import Estimator
from services.runner import VERSION
from shared import subjects
from shared.bus import Bus
from shared.schema import Ack, Count, JobProfiles, ModelsReply, ModelsRequest, Observed
from sim.settings import settings_for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="sia-hetero-64")
    parser.add_argument("--calibration", help="simulated clusters: the calibration's per-model batch caps")


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    # One replica for now: the estimates live in this process (KV-backed state is the next step).
    estimator = Estimator(settings_for(args.calibration, args.cluster).max_local)

    def on_profiles(message: JobProfiles) -> Ack:
        estimator.add(message.job_id, {p.gpu_type: p for p in message.profiles})
        return Ack()

    def on_observed(message: Observed) -> Ack:
        estimator.observe(message.job_id, message.gpu_type, message.observation)
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
