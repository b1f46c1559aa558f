"""The placer as a real process over NATS: ping, a placement equal to the core's, refusals, SIGTERM."""

import asyncio
import json
import signal
import subprocess
import sys

import pytest
from nats.errors import NoRespondersError
from nats.micro.request import ServiceError

from services.placer.core import place
from shared import subjects
from shared.cluster import load_cluster
from shared.schema.base import Config
from shared.schema.rounds import PlacementResult, PlaceRequest

CLUSTER = load_cluster("sia-hetero-64")


@pytest.fixture
async def placer(nats_server):
    process = subprocess.Popen(
        [sys.executable, "-m", "services.placer", "--server", nats_server, "--cluster", "sia-hetero-64"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    yield process
    if process.poll() is None:
        process.kill()
        process.wait()


async def wait_for_ping(bus, process, timeout_s=15.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        assert process.poll() is None, process.stdout.read().decode()
        try:
            reply = await bus.nc.request(f"$SRV.PING.{subjects.PLACER_SERVICE}", b"", timeout=0.5)
            return json.loads(reply.data)
        except Exception:  # noqa: BLE001 - not up yet
            await asyncio.sleep(0.1)
    raise AssertionError("the placer never answered ping")


async def test_placer_serves_placements_and_refuses_bad_requests(placer, connect_bus):
    bus = await connect_bus("client")
    ping = await wait_for_ping(bus, placer)
    assert ping["name"] == subjects.PLACER_SERVICE

    allocations = {"a": Config("aws", 2, 8), "b": Config("rtx", 1, 4), "c": Config("dgx-ext", 1, 8)}
    previous = {"b": (("rtx-1", 4),)}
    for _ in range(50):  # a service answers ping a moment before its endpoints
        try:
            reply = await bus.request(
                subjects.PLACE, PlaceRequest(1, allocations, previous), PlacementResult, timeout=5
            )
            break
        except NoRespondersError:
            await asyncio.sleep(0.1)
    assert reply == place(CLUSTER, allocations, previous)
    assert reply.placements["b"] == (("rtx-1", 4),)  # unchanged allocations stay where they are

    with pytest.raises(ServiceError) as refused:  # well formed, but no such GPU type
        await bus.request(subjects.PLACE, PlaceRequest(2, {"x": Config("tpu", 1, 1)}), PlacementResult, timeout=5)
    assert refused.value.code == "400" and "tpu" in refused.value.description
    reply = await bus.nc.request(subjects.PLACE, b"\xc1 not msgpack", timeout=5)  # not even a message
    assert reply.headers["Nats-Service-Error-Code"] == "400"
    again = await bus.request(subjects.PLACE, PlaceRequest(3, allocations, previous), PlacementResult, timeout=5)
    assert again == place(CLUSTER, allocations, previous)  # the service kept going

    stats = json.loads((await bus.nc.request(f"$SRV.STATS.{subjects.PLACER_SERVICE}", b"", timeout=2)).data)
    assert stats["endpoints"][0]["num_requests"] == 4

    placer.send_signal(signal.SIGTERM)
    assert placer.wait(timeout=10) == 0
