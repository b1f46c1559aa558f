"""The placer service: `place` requests in, placements out (the core decides; this only moves messages)."""

from __future__ import annotations

import argparse

from nats import micro
from opentelemetry import trace

from services.placer.core import place
from shared import subjects
from shared.bus import Bus
from shared.cluster import Cluster, load_cluster
from shared.runner import new_service
from shared.schema.rounds import PlacementResult, PlaceRequest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="sia-hetero-64", help="cluster preset or YAML/JSON file")


def placement_attributes(request: PlaceRequest, result: PlacementResult) -> dict:
    """The `placer.place` span's attributes: what was asked, what was placed, who moved or lost out."""
    return {
        "decision.number": request.round,
        "jobs.allocated": len(request.allocations),
        "jobs.placed": sum(1 for spots in result.placements.values() if spots),
        "gpus.placed": sum(g for spots in result.placements.values() for _, g in spots),
        "restarts": len(result.restarts),
        "evictions": len(result.evicted),
        "evicted.job.ids": list(result.evicted),
    }


class Placer:
    """The placer's one handler, over the cluster it places on."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def place(self, request: PlaceRequest) -> PlacementResult:
        # A live round on real executors names its nodes (the agents serving now); else the placer's own.
        nodes = self.cluster if request.nodes is None else Cluster(self.cluster.name, request.nodes)
        result = place(nodes, request.allocations, request.previous, request.groups)
        trace.get_current_span().set_attributes(placement_attributes(request, result))
        return result


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    placer = Placer(load_cluster(args.cluster))
    service = await new_service(bus, subjects.PLACER_SERVICE, f"physical GPUs for allocations on {placer.cluster.name}")
    await bus.add_endpoint(service, "place", subjects.PLACE, PlaceRequest, placer.place, span_name="placer.place")
    return service
