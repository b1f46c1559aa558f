"""The policy service: the round leader. On a simulated cluster it runs a whole replay on the
virtual clock — the next round starts as soon as the executors have applied and advanced the last —
each stage a request to its service (sim.bus_wiring), each decision by the named policy."""

from __future__ import annotations

import argparse

from nats import micro

from services.policy.base import make_policy
from services.runner import VERSION
from shared import subjects
from shared.bus import Bus
from shared.cluster import load_cluster
from shared.reference import WorkloadJob
from shared.schema import RunReport, RunRequest
from sim.bus_wiring import BusWiring
from sim.run import simulation_settings
from sim.simulator import Simulator


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="sia-hetero-64", help="cluster preset or YAML/JSON file")


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    cluster = load_cluster(args.cluster)

    async def on_run(request: RunRequest) -> RunReport:
        policy = make_policy(request.policy, **request.policy_options)
        settings = simulation_settings(request.calibration, args.cluster, round_s=request.round_s,
                                       horizon_s=request.horizon_s)
        # The clock needs each job's name and submit time only; the executors hold the rest.
        workload = [WorkloadJob(name, submit_s, "", 1, 1) for name, submit_s in request.jobs]
        sim = Simulator(workload, cluster, policy, settings, wiring=BusWiring(bus, request.request_timeout_s))
        await sim.run_async()
        return RunReport(tuple(sim.rounds), tuple(sim.events))

    service = await micro.add_service(bus.nc, name=subjects.POLICY_SERVICE, version=VERSION,
                                      description=f"the scheduling round on {cluster.name}",
                                      queue_group=subjects.POLICY_SERVICE)
    await bus.add_endpoint(service, "run", subjects.RUN, RunRequest, on_run, span_name="policy.run")
    return service
