"""Jobs across node agents: each agent its own process tree on this machine, its own node of one CPU
slot and its own work folder, the checkpoints in one folder they all read; real gloo between them,
the executor's side (`LocalExecutors` over `BusNodes`) in the test, on a real NATS server.

One job's life: trained on one node, moved to another (it resumes where it stopped), spread over
two at once, one of them lost (its agent killed -9: the job stops everywhere, no worker is left),
then finished on the remaining node and one that joined meanwhile. A worker hung in a collective:
its job is restarted in bounded time, not left hanging. And checkpoints without a shared folder,
through JetStream's object store.
"""

import asyncio
import io
import subprocess
import sys
import time

import pytest
import torch

from services.executor.local import BusNodes, LocalExecutors
from services.executor.real import RealExecutors, live_members
from shared import storage, subjects
from shared.schema.nodes import DrainRequest, NodeInfo

TINY_LM_TARGET = 0.75


class Agents:
    """Node agents as processes (`python -m services.executor --node NAME`), by node name."""

    def __init__(self, server: str, folder, prefix: str):
        self.server, self.folder, self.prefix = server, folder, prefix
        self.processes: dict[str, subprocess.Popen] = {}

    def name(self, node: str) -> str:
        return f"{self.prefix}-{node}"  # node names unique to the test: the session's server is shared

    def start(self, node: str) -> None:
        log = open(self.folder / f"agent-{node}.log", "ab")
        self.processes[node] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.node",
                "--server",
                self.server,
                "--node",
                self.name(node),
                "--gpus",
                "1",
                "--gpu-type",
                "cpu",
                "--workdir",
                str(self.folder / node),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def kill(self, node: str) -> None:
        self.processes[node].kill()
        self.processes[node].wait()

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                process.kill()


async def until(condition, what: str, timeout_s: float = 180.0, every_s: float = 0.2):
    """Wait for `condition()` (awaited when it is a coroutine) to be truthy; its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        value = await value if asyncio.iscoroutine(value) else value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every_s)


def workers_of(checkpoint) -> str:
    """The processes whose command line names the job's checkpoint: its workers, anywhere on this machine."""
    return subprocess.run(["pgrep", "-f", f"--checkpoint {checkpoint}"], capture_output=True, text=True).stdout


@pytest.fixture
async def cluster(nats_server, connect_bus, tmp_path, name_prefix):
    bus = await connect_bus("executor")
    await storage.provision(bus)
    members = await storage.open_kv(bus, subjects.NODES_BUCKET, NodeInfo)
    drained = await storage.open_kv(bus, subjects.DRAINED_BUCKET, DrainRequest)
    agents = Agents(nats_server, tmp_path, name_prefix)
    executors = LocalExecutors(
        BusNodes(bus, asyncio.get_running_loop()),
        tmp_path / "checkpoints",
        report_every_s=0.2,
        collective_timeout_s=5.0,
    )
    real = RealExecutors(executors)

    async def nodes() -> set[str]:
        """The test's live nodes (by short name), the round's cluster set from them."""
        infos, gone = await live_members(members, drained)
        mine = {name: info for name, info in infos.items() if name.startswith(name_prefix)}
        await asyncio.to_thread(real.serve_nodes, mine, gone)
        return {name.removeprefix(f"{name_prefix}-") for name in mine}

    async def step(*_):
        """What the executor service's watch does: look at the workers; the jobs finished."""
        return await asyncio.to_thread(executors.poll)

    try:
        yield agents, executors, nodes, step
    finally:
        await asyncio.to_thread(executors.stop_all)
        agents.stop()


async def test_a_job_moves_spans_two_nodes_survives_a_lost_one_and_finishes_where_one_joined(cluster, tmp_path):
    agents, executors, nodes, poll = cluster
    a, b, c = (agents.name(n) for n in "abc")
    checkpoint = tmp_path / "checkpoints" / "lm" / "lm.pt"  # a job's checkpoints: a folder of its own
    agents.start("a")
    agents.start("b")
    await until(lambda: _has(nodes, {"a", "b"}), "agents a and b registered")
    executors.add("lm", "tiny_lm", user=1)
    job = executors.jobs["lm"]

    async def trained_on(gpus: int, steps: int = 1) -> bool:
        await poll()
        return job.heard and any(o.gpus == gpus for o in job.stats.observations) and job.stats.steps >= steps

    # On node a; then moved to node b: it checkpoints on a and resumes there on b, where it stopped.
    await asyncio.to_thread(executors.apply, {"lm": ((a, 1),)})
    await until(lambda: trained_on(1, steps=10), "training on node a")
    await asyncio.to_thread(executors.apply, {})
    stopped, epochs = torch.load(checkpoint, weights_only=True), job.stats.epochs
    assert stopped["steps"] == job.stats.steps and workers_of(checkpoint) == ""  # saved at its last step, gone
    await asyncio.to_thread(executors.apply, {"lm": ((b, 1),)})
    await until(lambda: _stepped_past(poll, job, stopped["steps"]), "training again on node b")
    assert job.stats.epochs > epochs and job.restarts == 1 and job.parts == ((b, (0,)),)

    # Across both nodes at once: rank 0 on a, rank 1 on b, gloo between the two agents' workers.
    await asyncio.to_thread(executors.apply, {"lm": ((a, 1), (b, 1))})
    await until(lambda: trained_on(2), "training on nodes a and b together")
    assert job.parts == ((a, (0,)), (b, (1,))) and job.stats.observations[-1].nodes == 2

    # Node b lost (its agent killed -9): its worker stops on its lifeline, the one on a with it; the
    # node lapses from the members, and the job waits for a placement with no worker left anywhere.
    agents.kill("b")
    await until(lambda: _lacks(nodes, "b"), "node b lapsed from the members", timeout_s=60)
    assert job.placement == () and not job.running and job.failure is None
    await until(lambda: workers_of(checkpoint) == "", "no worker of the job left", timeout_s=60)

    # Node c joins; the job finishes on a and c from its last checkpoint.
    agents.start("c")
    assert await until(lambda: _has(nodes, {"a", "c"}), "agent c registered") and not _has_now(executors, b)
    await asyncio.to_thread(executors.apply, {"lm": ((a, 1), (c, 1))})
    await until(lambda: _finished(poll, "lm"), "the job finished", timeout_s=300)
    assert job.result["metric"] >= TINY_LM_TARGET and job.result["world"] == 2 and job.crashes == 0
    assert {(o.nodes, o.gpus) for o in job.stats.observations} == {(1, 1), (2, 2)}  # both, in one model's data
    assert workers_of(checkpoint) == ""


async def test_a_worker_hung_in_a_collective_restarts_its_job_in_bounded_time(cluster, tmp_path):
    agents, executors, nodes, poll = cluster
    a, b = agents.name("a"), agents.name("b")
    agents.start("a")
    agents.start("b")
    await until(lambda: _has(nodes, {"a", "b"}), "agents a and b registered")
    executors.add("mlp", "mlp_blobs", user=2)
    job = executors.jobs["mlp"]
    await asyncio.to_thread(executors.apply, {"mlp": ((a, 1), (b, 1))})
    await until(lambda: _stepped_past(poll, job, 0), "training on nodes a and b")
    # Rank 1 stops dead, mid-step, every process of its box frozen: rank 0 waits in its all-reduce.
    runc = ["runc", "--root", str(tmp_path / "b" / "runc")]
    [hung] = [
        name
        for name in subprocess.run([*runc, "list", "-q"], capture_output=True, text=True).stdout.split()
        if name.startswith("mlp.")
    ]
    subprocess.run([*runc, "pause", hung], check=True)
    started = time.monotonic()
    await until(
        lambda: _poll_then(poll, lambda: job.crashes >= 1),
        "the job restarted after its collective timed out",
        timeout_s=120,
    )
    restarted_after = time.monotonic() - started
    await until(lambda: _finished(poll, "mlp"), "the job finished", timeout_s=300)
    assert job.failure is None and job.result["metric"] >= 0.95
    assert restarted_after < 60, f"restarted {restarted_after:.0f} s after the hang (timeout 5 s)"
    assert (
        hung not in subprocess.run([*runc, "list", "-q"], capture_output=True, text=True).stdout.split()
    )  # its box is gone


async def _has(nodes, names: set[str]) -> bool:
    return names <= await nodes()


async def _lacks(nodes, name: str) -> bool:
    return name not in await nodes()


def _has_now(executors, node: str) -> bool:
    return any(n.name == node for n in executors.cluster.nodes)


async def _stepped_past(poll, job, steps: int) -> bool:
    await poll()
    return job.heard and job.stats is not None and job.stats.steps > steps


async def _finished(poll, name: str) -> bool:
    return name in await poll()


async def _poll_then(poll, check) -> bool:
    await poll()
    return check()


async def test_without_a_shared_folder_a_job_resumes_on_another_node_from_jetstreams_object_store(
    cluster, tmp_path, connect_bus
):
    """`--checkpoints jetstream:`: each agent keeps its own copy; the one of rank 0's node copies
    each new checkpoint to the store, the next node copies it in before the job starts there."""
    agents, executors, nodes, poll = cluster
    a, b = agents.name("a"), agents.name("b")
    executors.checkpoints = None  # no folder the nodes share
    agents.start("a")
    agents.start("b")
    await until(lambda: _has(nodes, {"a", "b"}), "agents a and b registered")
    name = f"{a}-lm"  # a job id of this test's own: the store is the session's
    executors.add(name, "tiny_lm", user=3)
    job = executors.jobs[name]
    await asyncio.to_thread(executors.apply, {name: ((a, 1),)})
    await until(lambda: _stepped_past(poll, job, 9), "training on node a")
    await asyncio.to_thread(executors.apply, {})
    bus = await connect_bus("reader")
    stored = torch.load(
        io.BytesIO((await (await bus.js.object_store(subjects.CHECKPOINTS_STORE)).get(f"{name}.pt")).data),
        weights_only=True,
    )
    assert stored["steps"] == job.stats.steps > 9  # the checkpoint it stopped with, in the store
    epochs = job.stats.epochs
    await asyncio.to_thread(executors.apply, {name: ((b, 1),)})
    await until(lambda: _stepped_past(poll, job, stored["steps"]), "training again on node b")
    assert job.stats.epochs > epochs and (tmp_path / "b" / "jobs" / name / f"{name}.pt").exists()
    await asyncio.to_thread(executors.apply, {})
    assert not (tmp_path / "checkpoints").exists()  # nothing went through a shared folder
