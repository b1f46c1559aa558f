"""The real profiler's watch on the node a run is on (services/profiler/measure.NodeTurns)."""

import asyncio
from types import SimpleNamespace

from services.profiler import measure
from shared.schema.nodes import NodeInfo

NODE = NodeInfo("cpu-0", "cpu", 1, "127.0.0.1", agent="a-1")


class SwallowingMembers:
    """The membership as nats-py reads it under Python 3.11: a read cancelled just as its answer
    came back returns the answer and drops the cancel (asyncio.wait_for's known race)."""

    def __init__(self):
        self.reading = asyncio.Event()
        self.reads = 0

    async def get(self, name):
        self.reads += 1
        self.reading.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # swallowed, as wait_for may
        return SimpleNamespace(value=NODE)


async def test_a_watch_cancelled_while_it_reads_the_membership_ends_even_if_the_read_drops_the_cancel(monkeypatch):
    """The run's answer came, so the watch is cancelled; had the cancel been lost in the read, the
    watch would go on for ever and the run (which waits for it to end) with it: a job stuck in
    `profiling` on a node long idle."""
    monkeypatch.setattr(measure.subjects, "NODE_HEARTBEAT_S", 0.01)
    members = SwallowingMembers()
    watch = asyncio.ensure_future(measure.NodeTurns(members).lost(NODE))
    await members.reading.wait()
    watch.cancel()
    await asyncio.wait({watch}, timeout=60)
    assert watch.cancelled() and members.reads == 1, (watch, members.reads)


class Members:
    """The membership KV, its values only."""

    def __init__(self, *nodes: NodeInfo):
        self.nodes = {node.name: node for node in nodes}

    async def values(self):
        return dict(self.nodes)


async def test_a_profiling_run_takes_a_node_that_trains_no_job_and_any_when_that_is_not_known():
    import nats.errors

    members = Members(*(NodeInfo(f"cpu-{i}", "cpu", 1, "127.0.0.1") for i in range(4)))

    async def training():
        return {"cpu-0", "cpu-1", "cpu-3"}

    for _ in range(20):  # at random among the idle ones: cpu-2 is the only one
        turns = measure.NodeTurns(members, training)
        assert (await turns.take("cpu")).name == "cpu-2"

    async def all_train():
        return {"cpu-0", "cpu-1", "cpu-2", "cpu-3"}

    async def away():
        raise nats.errors.NoRespondersError

    for busy in (all_train, away):  # every node trains, or the executor does not answer: any will do
        turns = measure.NodeTurns(members, busy)
        taken = {(await turns.take("cpu")).name for _ in range(4)}
        assert taken == {"cpu-0", "cpu-1", "cpu-2", "cpu-3"}  # each lent once


async def test_runs_waiting_for_a_node_take_it_in_turn_by_team_not_in_the_order_they_came():
    """One node, held by one of team a's runs; a's four more wait, then b's one: b's goes next (its
    team's last turn is the oldest), then a's in the order they came."""
    turns = measure.NodeTurns(Members(NodeInfo("cpu-0", "cpu", 1, "127.0.0.1")))
    first = await turns.take("cpu", whose="a")
    order: list[str] = []

    async def run(name: str, whose: str) -> None:
        node = await turns.take("cpu", whose=whose)
        order.append(name)
        await turns.give_back(node.name)

    waiting = [asyncio.ensure_future(run(f"a{i}", "a")) for i in range(1, 5)]
    while len(turns._waiting["cpu"]) < 4:
        await asyncio.sleep(0)
    waiting.append(asyncio.ensure_future(run("b1", "b")))
    while len(turns._waiting["cpu"]) < 5:
        await asyncio.sleep(0)
    await turns.give_back(first.name)
    await asyncio.wait_for(asyncio.gather(*waiting), 30)
    assert order == ["b1", "a1", "a2", "a3", "a4"]
