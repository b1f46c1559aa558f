"""No job's stop holds up a round: each changed job's transition (its workers' stop with the grace,
then its start on its new GPUs) goes on beside the others', the executor's calls and handlers return
at once, a start waits only for the stops that hold its GPUs, a later round's placement for a job
still stopping comes after that stop, and KV follows the transitions as they answer. Node agents
whose stops hang until the test lets them go (as a job that ignores SIGTERM holds its stop for the
whole grace), and once real workers that ignore SIGTERM (tests/jobs/deaf.py)."""

import asyncio
import functools
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
from test_executor_handlers import NoBus, RecordingKV

from services.executor.local import InProcessNodes, LocalExecutors
from services.executor.real import RealExecutors, RealExecutorService
from services.node.agent import NodeWorkers
from shared import subjects
from shared.cluster import Cluster
from shared.lifecycle import JobState
from shared.schema.base import Node
from shared.schema.jobs import CANCELLED, Cancel, JobSpec, Profiled
from shared.schema.nodes import NodeInfo, NodeReport, Rendezvous, WorkersReport
from shared.schema.records import NodeJob
from shared.schema.rounds import ApplyRequest

HANG_S = 60  # a guard only: a call that waited for a hanging stop would never return before it


class GatedNodes:
    """Node agents whose stops wait until the test opens the job's gate; starts answer at once; a
    poll lists the workers started and not being stopped (an agent forgets a job as its stop
    begins). What they were asked, in order: ("start", node, job, GPUs), ("stop", node, job) as a
    stop begins, ("stopped", node, job) as it answers."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls: list[tuple] = []
        self.orders = {}  # (node, job) -> its StartWorkers
        self.gates: dict[str, threading.Event] = {}

    def gate(self, job_id: str) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(job_id, threading.Event())

    def start(self, node, order):
        with self.lock:
            self.orders[node, order.job_id] = order
            self.calls.append(("start", node, order.job_id, len(order.ranks)))
        return Rendezvous("127.0.0.1", 29500)

    def stop(self, node, request):
        with self.lock:
            order = self.orders.pop((node, request.job_id), None)
            self.calls.append(("stop", node, request.job_id))
        self.gate(request.job_id).wait(HANG_S)
        with self.lock:
            self.calls.append(("stopped", node, request.job_id))
        if order is None:
            return WorkersReport(request.job_id, -1, (), ())
        return WorkersReport(request.job_id, order.generation, order.ranks, (-9,) * len(order.ranks), stopped=True)

    def poll(self, node):
        with self.lock:
            orders = [order for (n, _), order in self.orders.items() if n == node]
        return NodeReport(
            node, tuple(WorkersReport(o.job_id, o.generation, o.ranks, (None,) * len(o.ranks)) for o in orders)
        )

    def index(self, call: tuple) -> int:
        with self.lock:
            return self.calls.index(call)

    def starts(self, job_id: str) -> list[tuple]:
        with self.lock:
            return [call for call in self.calls if call[0] == "start" and call[2] == job_id]


def until(executors: LocalExecutors, done, timeout_s: float = HANG_S) -> None:
    """Poll (as the executor service's watch does) until `done()`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "not yet"
        executors.poll()
        time.sleep(0.01)


def test_stops_go_on_beside_each_other_and_a_start_waits_only_for_the_stops_holding_its_gpus():
    nodes = GatedNodes()
    cluster = Cluster("two", (Node("n0", "cpu", 4), Node("n1", "cpu", 2)))
    executors = LocalExecutors(nodes, None, cluster, blocking=False)
    for name in "abcd":
        executors.add(name, "mlp_blobs")
    a, b, c, d = (executors.jobs[name] for name in "abcd")
    executors.apply({"a": (("n0", 2),), "b": (("n0", 2),)})
    until(executors, lambda: not a.busy and not b.busy)

    # Round 1: a shrinks, b is cancelled (their stops hang), c gets the free node: it starts at once.
    executors.apply({"a": (("n0", 1),), "b": (("n0", 2),), "c": (("n1", 2),)})
    executors.cancel("b")
    assert a.stopping is not None and b.stopping is not None  # both returned with the stops under way
    until(executors, lambda: nodes.starts("c") == [("start", "n1", "c", 2)])
    assert executors.transition("a").startswith(
        "stopping its workers on n0 (it was placed anew): they checkpoint (SIGTERM)"
    )
    assert executors.transition("a").endswith("; then it starts on n0:1")
    # Round 2: d gets b's GPUs; a is to have 2 again, its stop still under way.
    executors.apply({"a": (("n0", 2),), "c": (("n1", 2),), "d": (("n0", 2),)})
    for _ in range(3):  # polls find neither a's nor b's workers on n0: no crash, no restart
        executors.poll()
    assert (
        d.waits == ("a", "b") and not d.running and "once the workers stopping there free" in executors.transition("d")
    )
    assert (a.crashes, a.restarts, b.crashes, b.restarts) == (0, 1, 0, 0)

    nodes.gate("b").set()  # b's workers are killed: its GPUs go to d, a still stops
    until(executors, lambda: nodes.starts("d") == [("start", "n0", "d", 2)] and not d.busy)
    assert a.stopping is not None and nodes.starts("a") == [("start", "n0", "a", 2)]
    assert (b.running, b.failure, b.result, b.placement) == (False, CANCELLED, None, ())
    nodes.gate("a").set()
    until(executors, lambda: len(nodes.starts("a")) == 2 and not a.busy)
    # a started again on the newest placement only (never on 1 GPU), once its own stop was over.
    assert [call[0::3] for call in nodes.calls if call[2] == "a"] == [
        ("start", 2),
        ("stop",),
        ("stopped",),
        ("start", 2),
    ]
    assert a.parts == (("n0", (0, 1)),)
    assert nodes.index(("stopped", "n0", "b")) < nodes.index(("start", "n0", "d", 2))
    assert nodes.index(("start", "n1", "c", 2)) < nodes.index(("stopped", "n0", "b"))
    assert (a.restarts, a.crashes, a.generation, c.running, d.running) == (1, 0, 2, True, True)
    executors.grace_s = 0.0
    for name in "acd":
        nodes.gate(name).set()
    executors.stop_all()


async def test_the_round_handlers_answer_while_stops_go_on_and_kv_follows_them():
    """A round that shrinks a job and a cancel of another (both stops hang) are answered at once;
    their records say what their workers are doing, the cancelled job reads as cancelled once its
    workers are gone; a job placed on its GPUs starts then, and KV holds each job's workers as they are."""
    nodes = GatedNodes()
    agent = RealExecutors(LocalExecutors(nodes, None, Cluster("local-4", (Node("local-0", "cpu", 4),)), blocking=False))
    service = RealExecutorService(EventsBus(), agent, RecordingKV(), RecordingKV(), RecordingKV())
    agent.executors.wake = functools.partial(service.wake, asyncio.get_running_loop())
    for sequence, name in enumerate(("lm", "mlp", "other"), start=1):
        agent.submitted(JobSpec(name, "mlp_blobs"), sequence)
        agent.profiled(Profiled(name, 16, 256, submission=sequence))
    agent.arrive(0.0)
    kv = service.states
    service.watching = asyncio.get_running_loop().create_task(service.watch())
    try:
        await service.on_apply(ApplyRequest(0.0, {"lm": (("local-0", 2),), "mlp": (("local-0", 2),)}, {}, True))
        await held(kv, lambda: kv.held["lm"].parts and kv.held["mlp"].generation == 1)

        async with asyncio.timeout(HANG_S):  # a guard: waiting for a stop, they would never answer
            await service.on_apply(ApplyRequest(60.0, {"lm": (("local-0", 1),), "mlp": (("local-0", 2),)}, {}, True))
            await service.on_event(msgspec.msgpack.encode(Cancel("mlp")), delivery(subjects.CANCEL))
        records = {r.name: r for r in agent.records()}
        assert records["lm"].state == JobState.RUNNING and records["lm"].reason.startswith("stopping its workers")
        assert records["mlp"].state == JobState.RUNNING and records["mlp"].failure is None
        assert records["mlp"].reason.startswith("stopping its workers on local-0 (it was cancelled): they checkpoint")
        assert {f.job_id: f.mid_restart for f in agent.facts(61.0, ["lm", "other"]).facts} == {
            "lm": True,
            "other": False,
        }
        assert agent.facts(61.0, ["mlp"]).failed == {"mlp": CANCELLED}  # the round frees its GPUs

        async with asyncio.timeout(HANG_S):
            await service.on_apply(ApplyRequest(120.0, {"lm": (("local-0", 1),), "other": (("local-0", 2),)}, {}, True))
        other = next(r for r in agent.records() if r.name == "other")
        assert other.state == JobState.RUNNING and other.reason.startswith("starting on local-0:2 once the workers")
        assert nodes.starts("other") == []
        nodes.gate("mlp").set()
        await held(kv, lambda: kv.held["other"].parts == (("local-0", (0, 1)),) and kv.held["mlp"].parts == ())
        assert agent.state_of(agent.jobs["mlp"]) == JobState.CANCELLED and kv.held["mlp"].cancelled
        assert kv.held["lm"].parts == (("local-0", (0, 1)),)  # still stopping
        nodes.gate("lm").set()
        await held(kv, lambda: kv.held["lm"].parts == (("local-0", (0,)),) and kv.held["lm"].generation == 2)
        assert [p.spots for p in kv.held["lm"].placements] == [(("local-0", 2),), (("local-0", 1),)]
        assert {r.name: r.reason for r in agent.records() if r.state == JobState.RUNNING} == {"lm": None, "other": None}
    finally:
        service.watching.cancel()
        for name in ("lm", "other"):
            nodes.gate(name).set()
        await service.stop_workers()


class EventsBus(NoBus):
    def decode(self, data, kind):
        return msgspec.msgpack.decode(data, type=kind)


def delivery(subject: str) -> SimpleNamespace:
    return SimpleNamespace(raw=SimpleNamespace(subject=subject), stream_sequence=9, traceparent="")


async def held(kv: RecordingKV, done, timeout_s: float = HANG_S) -> None:
    """Wait until KV holds what `done()` asks (the service's watch writes it as answers come in)."""
    deadline = time.monotonic() + timeout_s
    while not (all(k in kv.held for k in ("lm", "mlp", "other")) and done()):
        assert time.monotonic() < deadline, "KV never held it"
        await asyncio.sleep(0.01)


class LoggingNodes(InProcessNodes):
    """In-process node agents, and when each call began and answered: (event, job, monotonic time,
    the answer's exit codes)."""

    def __init__(self, workers):
        super().__init__(workers)
        self.log: list[tuple] = []

    def start(self, node, order):
        self.log.append(("start", order.job_id, time.monotonic(), ()))
        return super().start(node, order)

    def stop(self, node, request):
        report = super().stop(node, request)
        self.log.append(("stopped", request.job_id, time.monotonic(), report.codes))
        return report

    def first(self, event: str, job_id: str) -> tuple:
        return next(entry for entry in self.log if entry[:2] == (event, job_id))


def asleep(folder, job_id: str, rank: int) -> bool:
    """Whether the deaf job's worker of that rank ignores SIGTERM by now (its log says so)."""
    log = folder / f"{job_id}.rank{rank}.log"
    return log.exists() and "asleep" in log.read_text()


@pytest.mark.e2e
def test_workers_that_ignore_sigterm_hold_up_no_one_but_the_job_placed_on_their_gpus(tmp_path):
    """Two jobs whose workers ignore SIGTERM, one shrunk and one cancelled: the calls return as
    their stops begin; a job placed on free slots starts before either is over; one placed on the
    cancelled job's slots starts once that job's workers were killed at the end of the grace."""
    node = NodeWorkers(NodeInfo("local-0", "cpu", 6, "127.0.0.1"), tmp_path, "tests.jobs")
    nodes = LoggingNodes({"local-0": node})
    executors = LocalExecutors(
        nodes, tmp_path, Cluster("local-6", (Node("local-0", "cpu", 6),)), jobs_package="tests.jobs", grace_s=3.0
    )
    executors.add("a", "deaf")
    executors.add("b", "deaf")
    executors.add("c", "deaf", args=("--hears",))
    executors.add("d", "deaf", args=("--hears",))
    a, b, c, d = (executors.jobs[name] for name in "abcd")
    try:
        executors.apply({"a": (("local-0", 2),), "b": (("local-0", 2),)})  # blocking: started
        until(
            executors,
            lambda: all(asleep(tmp_path, job, rank) for job, rank in (("a", 0), ("a", 1), ("b", 0), ("b", 1))),
        )
        executors.blocking = False  # as the executor service runs it
        executors.apply({"a": (("local-0", 1),), "c": (("local-0", 2),)})
        executors.cancel("b")
        assert a.stopping is not None and b.stopping is not None  # answered with both stops under way
        executors.apply({"a": (("local-0", 1),), "c": (("local-0", 2),), "d": (("local-0", 2),)})
        until(executors, lambda: a.generation == 2 and d.running and not (a.busy or b.busy or d.busy))
    finally:
        executors.grace_s = 0.5
        executors.stop_all()
    stopped_a, stopped_b = nodes.first("stopped", "a"), nodes.first("stopped", "b")
    assert stopped_a[3] == stopped_b[3] == (-9, -9)  # they ignored SIGTERM: killed after the grace
    assert nodes.first("start", "c")[2] < min(stopped_a[2], stopped_b[2])  # on free slots: at once
    assert stopped_b[2] <= nodes.first("start", "d")[2]  # on b's slots: once b's workers were gone
    assert (a.restarts, a.crashes, b.failure, b.result, c.crashes, d.crashes) == (1, 0, CANCELLED, None, 0, 0)


def test_a_successor_ends_the_workers_of_a_job_cancelled_while_they_stopped():
    """The executor dies while a cancelled job's workers stop (KV holds the cancel and where they
    run): its successor stops what is left, counts no restart, and the job reads as cancelled."""
    nodes = GatedNodes()
    slots = Cluster("local-4", (Node("local-0", "cpu", 4),))
    agent = RealExecutors(LocalExecutors(nodes, None, slots, blocking=False))
    agent.submitted(JobSpec("lm", "mlp_blobs"), 1)
    agent.profiled(Profiled("lm", 16, 256, submission=1))
    agent.arrive(0.0)
    agent.apply(0.0, {"lm": (("local-0", 2),)})
    until(agent.executors, lambda: not agent.executors.jobs["lm"].busy)
    agent.cancelled(Cancel("lm"))  # its stop hangs, and the executor dies
    assert agent.state_of(agent.jobs["lm"]) == JobState.RUNNING
    kept = msgspec.msgpack.decode(msgspec.msgpack.encode(agent.saved()), type=list[NodeJob])  # as KV keeps them
    nodes.gate("lm").set()

    after = GatedNodes()
    after.gate("lm").set()
    successor = RealExecutors(LocalExecutors(after, None, slots))
    for job in kept:
        successor.restore(job)
    successor.executors.stop_leftovers()
    assert after.calls == [("stop", "local-0", "lm"), ("stopped", "local-0", "lm")]
    local = successor.executors.jobs["lm"]
    assert (local.running, local.restarts, local.failure) == (False, 0, CANCELLED)
    assert successor.state_of(successor.jobs["lm"]) == JobState.CANCELLED
