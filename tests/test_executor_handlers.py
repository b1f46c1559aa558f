"""The executors' handlers called as methods, with no NATS server: each service object is built over
in-memory stand-ins for the KV buckets and the node agents, which record what they are asked and
decide nothing. A round's placements (`ApplyRequest`) change the jobs, and reach KV before the
handler answers."""

from dataclasses import dataclass, field
from types import SimpleNamespace

import msgspec
import pytest

from services.estimator.core import Estimator
from services.executor.local import LocalExecutors
from services.executor.real import RealExecutors, RealExecutorService
from services.simulated.service import SimulatedExecutorService
from services.simulated.truth import job_sources
from services.simulated.world import SimulatedExecutors, SubmittedJob
from shared import subjects
from shared.cluster import Cluster, load_cluster
from shared.lifecycle import TRANSITIONS, IllegalTransition, JobState
from shared.schema.base import Ack, Node
from shared.schema.estimates import StoredAll
from shared.schema.jobs import CANCELLED, Cancel, JobSpec, Profiled, Rejected
from shared.schema.nodes import NodeInfo, Rendezvous, StartWorkers, StopWorkers, WorkersReport
from shared.schema.rounds import AdvanceRequest, ApplyRequest
from shared.settings import simulation_settings


@dataclass
class Entry:
    value: object


@dataclass
class RecordingKV:
    """A KV bucket in memory: what was put, in order, and the latest value of each key."""

    puts: list[tuple[str, object]] = field(default_factory=list)
    held: dict[str, object] = field(default_factory=dict)

    async def put(self, key: str, value) -> int:
        self.puts.append((key, value))
        self.held[key] = value
        return len(self.puts)

    async def get(self, key: str) -> Entry | None:
        return Entry(self.held[key]) if key in self.held else None

    async def keys(self) -> list[str]:
        return list(self.held)

    async def values(self) -> dict[str, object]:
        return dict(self.held)

    async def delete(self, key: str, revision: int | None = None) -> None:
        self.held.pop(key, None)


class NoBus:
    """The apply handlers send nothing on the bus: any use of it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the handler used the bus: {name}")


# ---- the simulated executors ------------------------------------------------------------------------


SOURCES = job_sources(use_zoo=True)


class CopyingKV(RecordingKV):
    """A KV bucket in memory that keeps a copy of each value as it was put (as a real one does)."""

    async def put(self, key: str, value) -> int:
        return await super().put(key, msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=type(value)))


async def simulated_service(kv: RecordingKV | None = None) -> SimulatedExecutorService:
    cluster = load_cluster("sia-hetero-64")
    executors = SimulatedExecutors(cluster, simulation_settings(None, "sia-hetero-64"), 1)
    service = SimulatedExecutorService(NoBus(), executors, SOURCES, RecordingKV() if kv is None else kv)
    await service.load()
    return service


async def submit_and_profile(service: SimulatedExecutorService, *names: str) -> None:
    """Each job's submission, then the profiler's acceptance, taken as `on_event` takes them."""
    for sequence, name in enumerate(names, start=1):
        assert service.on_submitted(JobSpec(name, "cifar10", requested_gpus=2, submit_s=0.0), sequence, "", "") == name
        await service.save([name])
        assert service.submitted[name].state == JobState.PROFILING
        assert service.on_profiled(Profiled(name, submission=sequence), 0, "", "") == name
        await service.save([name])


def models_for(service: SimulatedExecutorService, names) -> dict:
    """The estimator's models of the jobs, from their profiles and the facts the service reports."""
    estimator = Estimator()
    for name in names:
        truth = SOURCES.truths["cifar10"]
        estimator.add(
            name, {t: SOURCES.profile("cifar10", t) for t in truth.types if t in service.executors.cluster.gpu_types}
        )
    facts = service.facts(0.0, tuple(names)).facts
    return {models.job_id: models for models in estimator.models(list(facts))}


async def test_the_simulated_apply_handler_places_the_jobs_and_keeps_them_before_it_answers():
    service = await simulated_service()
    await submit_and_profile(service, "a", "b", "c")
    assert {name: entry.state for name, entry in service.submitted.items()} == dict.fromkeys("abc", JobState.QUEUED)
    kv = service.states

    request = ApplyRequest(
        0.0,
        {"a": (("aws-0", 2),), "b": (("aws-1", 2),)},
        models_for(service, ["a", "b", "c"]),
        adaptive=True,
        failed={"c": "the round gave up on it"},
    )
    assert await service.on_apply(request) == Ack()

    jobs = service.executors.jobs
    assert jobs["a"].placement == (("aws-0", 2),) and jobs["b"].placement == (("aws-1", 2),)
    assert jobs["a"].m > 0 and jobs["a"].config.gpu_type == "aws"  # re-tuned for its GPUs
    records = {record.name: record for record in service.records()}
    assert {name: record.state for name, record in records.items()} == {
        "a": JobState.RUNNING,
        "b": JobState.RUNNING,
        "c": JobState.FAILED,
    }
    assert records["c"].failure == "the round gave up on it" and records["a"].gpu_type == "aws"
    # Every job the round named is in KV, as the handler left it.
    assert sorted(key for key, _ in kv.puts[-3:]) == ["a", "b", "c"]
    kept = kv.held["a"]
    assert isinstance(kept, SubmittedJob) and kept.job.placement == (("aws-0", 2),)
    assert kv.held["c"].job.failure == "the round gave up on it"

    # Taken off its GPUs by the next round, which sends the models of the placed jobs only and names
    # the others it decided on: queued again; a cancel ends it.
    await service.on_apply(
        ApplyRequest(1.0, {"b": (("aws-1", 2),)}, models_for(service, ["b"]), adaptive=True, jobs=("a", "b"))
    )
    assert service.submitted["a"].state == JobState.QUEUED and kv.held["a"].job.placement == ()
    assert jobs["b"].placement == (("aws-1", 2),) and jobs["b"].m > 0
    assert service.on_cancel(Cancel("a"), 0, "", "") == "a"
    assert service.submitted["a"].state == JobState.CANCELLED and jobs["a"].failure == CANCELLED


async def test_a_round_writes_only_the_jobs_it_changed_and_a_restart_takes_back_the_same():
    service = await simulated_service()
    await submit_and_profile(service, "a", "b", "c")
    kv = service.states
    models = models_for(service, ["a", "b", "c"])
    before = len(kv.puts)
    await service.on_apply(ApplyRequest(0.0, {"a": (("aws-0", 2),)}, models, adaptive=True))
    assert [key for key, _ in kv.puts[before:]] == ["a"]  # b and c stay queued, as KV holds them
    before = len(kv.puts)
    await service.on_apply(ApplyRequest(0.0, {"a": (("aws-0", 2),)}, models, adaptive=True))  # asked again
    assert len(kv.puts) == before and not service.dirty
    executors = SimulatedExecutors(service.executors.cluster, service.executors.settings, 1)
    restarted = SimulatedExecutorService(NoBus(), executors, SOURCES, kv)
    await restarted.load()
    assert list(restarted.records()) == list(service.records())
    await restarted.on_apply(ApplyRequest(0.0, {"a": (("aws-0", 2),)}, models, adaptive=True))
    assert len(kv.puts) == before  # what it read back is what KV holds: nothing to write


class EstimatorBus(NoBus):
    """The estimator as the executors report to it: each observation stored; nothing else on the bus."""

    async def request(self, subject, message, answer_type, timeout=None):
        assert subject == subjects.OBSERVE and answer_type is StoredAll
        return StoredAll((1,) * len(message.observed))


async def test_a_round_run_writes_only_the_jobs_on_gpus_and_a_restart_takes_the_round_back():
    service = await simulated_service(CopyingKV())
    service.bus = EstimatorBus()
    await submit_and_profile(service, "a", "b", "c")
    kv, jobs = service.states, ("a", "b", "c")
    for now in (0.0, 60.0):
        await service.on_apply(ApplyRequest(now, {"a": (("aws-0", 2),)}, models_for(service, jobs), adaptive=True))
        before = len(kv.puts)
        await service.on_advance(AdvanceRequest(now, 60.0, jobs))
        assert {key for key, _ in kv.puts[before:]} == {"a"}  # b and c wait: only their round run moved
    assert service.executors.jobs["b"].advanced_to == 120.0 and kv.held["b"].job.advanced_to is None
    restarted = SimulatedExecutorService(
        NoBus(), SimulatedExecutors(service.executors.cluster, service.executors.settings, 1), SOURCES, kv
    )
    await restarted.load()
    assert {name: job.advanced_to for name, job in restarted.executors.jobs.items()} == dict.fromkeys(jobs, 120.0)
    # As before the restart: an apply of a round run already (a deposed leader's, late) moves no job.
    stale = ApplyRequest(60.0, {"b": (("aws-1", 2),)}, models_for(service, jobs), adaptive=True)
    for executors in (service, restarted):
        await executors.on_apply(stale)
        assert executors.executors.jobs["b"].placement == ()

    # A round in which no job runs: one job is written all the same, and carries the round run.
    idle = await simulated_service(CopyingKV())
    await submit_and_profile(idle, "x", "y")
    before = len(idle.states.puts)
    await idle.on_advance(AdvanceRequest(0.0, 60.0, ("x", "y")))
    assert [key for key, _ in idle.states.puts[before:]] == ["x"]
    again = SimulatedExecutorService(
        NoBus(), SimulatedExecutors(idle.executors.cluster, idle.executors.settings, 1), SOURCES, idle.states
    )
    await again.load()
    assert {name: job.advanced_to for name, job in again.executors.jobs.items()} == {"x": 60.0, "y": 60.0}


class DecodingBus(NoBus):
    """The events' bodies decoded as the bus decodes them; anything else on the bus fails the test."""

    def decode(self, data, kind):
        return msgspec.msgpack.decode(data, type=kind)


async def test_a_batch_of_job_events_is_written_once_after_the_batch():
    service = await simulated_service()
    service.bus = DecodingBus()
    submitted = SimpleNamespace(subject=subjects.stored("default", "user"), stream_sequence=1, traceparent="")
    profiled = SimpleNamespace(subject=subjects.PROFILED, stream_sequence=2, traceparent="")
    await service.on_event(msgspec.Raw(msgspec.msgpack.encode(JobSpec("a", "cifar10"))), submitted)
    await service.on_event(msgspec.Raw(msgspec.msgpack.encode(Profiled("a", submission=1))), profiled)
    assert service.states.puts == [] and service.state_of(service.submitted["a"]) == JobState.QUEUED  # not yet kept
    await service.save_events()  # then the batch is acknowledged
    assert [(key, value.state) for key, value in service.states.puts] == [("a", JobState.QUEUED)]


async def test_a_refusal_is_listed_for_its_logins_team_in_both_executors():
    # The API's record of a refusal says whose on its subject (refused.<team>.<login>); the
    # profiler's on the subject of the submission judged (stored.<team>.<login>).
    api_refusal = Rejected(subjects.API_SUBMIT, "ids beginning vision. are team vision's", "nlp.vision.x")
    judged = Rejected(subjects.stored("nlp", "ann"), "no GPU type it runs on", "nlp.y", application="cifar10")
    service = await simulated_service()
    service.on_rejected(api_refusal, 1, "", "ann", "nlp")
    service.on_rejected(judged, 2, "", "")
    real = RealExecutors(LocalExecutors(RecordingNodes(), None, SLOTS))
    real.rejected(api_refusal, 1, "", "ann", "nlp")
    real.rejected(judged, 2, "", "")
    for records in (service.records(), real.records()):
        assert {(r.name, r.team, r.owner, r.state) for r in records} == {
            ("nlp.vision.x", "nlp", "ann", JobState.REJECTED),
            ("nlp.y", "nlp", "ann", JobState.REJECTED),
        }


@pytest.mark.parametrize("order", [(0, 1, 2), (1, 0, 2), (1, 2, 0), (2, 0, 1)])
async def test_refusals_naming_an_id_are_each_listed_and_leave_its_job_whatever_order_they_come_in(order):
    """The intake judges bodies at once, so the API's refusals of bodies under an id (a malformed
    one, another body) may reach the stream before or after the valid submission that holds it."""
    events = (
        ("submitted", JobSpec("mine", "mlp_blobs")),
        ("rejected", Rejected(subjects.refused("default", "ann"), "unknown field `command`", "mine")),
        ("rejected", Rejected(subjects.refused("default", "ann"), "job mine already exists", "mine")),
    )
    service = await simulated_service()
    real = RealExecutors(LocalExecutors(RecordingNodes(), None, SLOTS))
    for sequence, index in enumerate(order, start=1):
        kind, message = events[index]
        if kind == "submitted":
            service.on_submitted(message, sequence, "", "ann")
            real.submitted(message, sequence, "", "ann")
        else:
            service.on_rejected(message, sequence, "", "ann", "default")
            real.rejected(message, sequence, "", "ann", "default")
    held = order.index(0) + 1
    verdict = Rejected(subjects.stored("default", "ann"), "no GPU type it runs on", "mine", submission=held)
    for _ in range(2):  # the profiler's verdict on the held submission, read again after a restart
        service.on_rejected(verdict, 9, "", "")
        real.rejected(verdict, 9, "", "")
    for records in (service.records(), real.records()):
        assert sorted((r.name, r.state, r.failure) for r in records) == [
            ("mine", JobState.REJECTED, "job mine already exists"),
            ("mine", JobState.REJECTED, "no GPU type it runs on"),
            ("mine", JobState.REJECTED, "unknown field `command`"),
        ]
    # Only the refusal of the submission that held the id is the job's own: its run's output is too.
    assert sorted((r.failure, r.held) for r in real.records())[0] == ("job mine already exists", False)
    assert [r.failure for r in real.records() if r.held] == ["no GPU type it runs on"]


async def test_the_simulated_apply_handler_checks_each_move_against_the_lifecycle(monkeypatch):
    """With queued -> running taken out of the table, placing a queued job raises where it happens."""
    service = await simulated_service()
    await submit_and_profile(service, "a")
    monkeypatch.setitem(TRANSITIONS, JobState.QUEUED, frozenset())
    request = ApplyRequest(0.0, {"a": (("aws-0", 2),)}, models_for(service, ["a"]), adaptive=True)
    with pytest.raises(IllegalTransition, match="job a: queued -> running"):
        await service.on_apply(request)


# ---- the real executors -----------------------------------------------------------------------------


@dataclass
class RecordingNodes:
    """The node agents: the orders they are sent. A start is answered with the address rank 0's
    workers listen on, a stop with a report of no workers (what an agent says of a job it holds none of)."""

    started: list[tuple[str, StartWorkers]] = field(default_factory=list)
    stopped: list[tuple[str, StopWorkers]] = field(default_factory=list)

    def start(self, node: str, order: StartWorkers) -> Rendezvous:
        self.started.append((node, order))
        return Rendezvous("127.0.0.1", 29500)

    def stop(self, node: str, request: StopWorkers) -> WorkersReport:
        self.stopped.append((node, request))
        return WorkersReport(request.job_id, 0, (), ())

    def poll(self, node: str):
        raise AssertionError("the apply handler does not poll the workers")


SLOTS = Cluster("local-4", (Node("local-0", "cpu", 4),))


async def real_service() -> RealExecutorService:
    agent = RealExecutors(LocalExecutors(RecordingNodes(), None, SLOTS))
    service = RealExecutorService(NoBus(), agent, RecordingKV(), RecordingKV(), RecordingKV())
    for sequence, name in enumerate(("lm", "mlp", "late"), start=1):
        agent.submitted(JobSpec(name, "mlp_blobs"), sequence)
    for sequence, name in enumerate(("lm", "mlp"), start=1):
        agent.profiled(Profiled(name, 16, 256, submission=sequence))
    assert agent.arrive(0.0) == ["lm", "mlp"]
    return service


async def test_the_real_apply_handler_starts_the_workers_and_keeps_the_jobs_before_it_answers():
    service = await real_service()
    agent, nodes, kv = service.agent, service.agent.executors.nodes, service.states
    assert {r.name: r.state for r in agent.records()} == {
        "lm": JobState.QUEUED,
        "mlp": JobState.QUEUED,
        "late": JobState.PROFILING,
    }

    request = ApplyRequest(0.0, {"lm": (("local-0", 2),)}, {}, adaptive=False, failed={"mlp": "no GPUs fit it"})
    assert await service.on_apply(request) == Ack()

    assert [(node, order.job_id, order.ranks, order.world) for node, order in nodes.started] == [
        ("local-0", "lm", (0, 1), 2)
    ]
    assert agent.executors.jobs["lm"].adaptive is False  # the round's policy adapts no batch
    states = {r.name: r.state for r in agent.records()}
    assert states == {"lm": JobState.RUNNING, "mlp": JobState.FAILED, "late": JobState.PROFILING}
    # Every job is in KV as the handler left it: the placement and when it began.
    assert kv.held["lm"].placement == (("local-0", 2),) and [p.at_s for p in kv.held["lm"].placements] == [0.0]
    assert kv.held["mlp"].failure == "no GPUs fit it" and kv.held["mlp"].ended_in == 0.0
    written = len(kv.puts)

    # The same round asked again changes nothing and writes nothing; a later one moves the job.
    await service.on_apply(request)
    assert len(nodes.started) == 1 and len(kv.puts) == written
    await service.on_apply(ApplyRequest(1.0, {}, {}, adaptive=False))
    assert [(node, stop.job_id) for node, stop in nodes.stopped] == [("local-0", "lm")]
    assert agent.state_of(agent.jobs["lm"]) == JobState.QUEUED and kv.held["lm"].placement == ()


async def test_a_round_that_leaves_a_real_job_waiting_on_its_team_says_so_in_its_record():
    service = await real_service()
    agent = service.agent
    await service.on_apply(ApplyRequest(0.0, {}, {}, adaptive=True, waits={"lm": "its team's limits"}))
    reasons = {r.name: r.reason for r in agent.records()}
    assert reasons["lm"] == "its team's limits" and reasons["mlp"] != "its team's limits"
    await service.on_apply(ApplyRequest(60.0, {}, {}, adaptive=True))  # the next round says otherwise
    assert {r.name: r.reason for r in agent.records()}["lm"].startswith("waiting for")


async def test_the_real_apply_handler_checks_each_move_against_the_lifecycle(monkeypatch):
    service = await real_service()
    monkeypatch.setitem(TRANSITIONS, JobState.QUEUED, frozenset({JobState.RUNNING}))
    with pytest.raises(IllegalTransition, match="job mlp: queued -> failed"):
        await service.on_apply(ApplyRequest(0.0, {}, {}, adaptive=True, failed={"mlp": "no GPUs fit it"}))


async def test_a_job_that_ended_holds_no_gpus_in_a_waiting_jobs_reason():
    service = await real_service()
    agent = service.agent
    agent.serve_nodes({"local-0": NodeInfo("local-0", "cpu", 4, "127.0.0.1")}, set())
    await service.on_apply(ApplyRequest(0.0, {"lm": (("local-0", 4),)}, {}, adaptive=True))
    assert {r.name: r.reason for r in agent.records()}["mlp"].startswith("the cluster is full")
    lm = agent.executors.jobs["lm"]
    lm.running, lm.result = False, {}  # it finished: its placement stays as it ended
    agent.poll()
    reasons = {r.name: r.reason for r in agent.records()}
    assert agent.state_of(agent.jobs["lm"]) == JobState.FINISHED
    assert not reasons["mlp"].startswith("the cluster is full"), reasons["mlp"]


async def test_a_job_cancelled_while_profiled_has_its_run_stopped_on_its_node():
    service = await real_service()  # "late" is still being profiled
    agent, nodes = service.agent, service.agent.executors.nodes
    agent.profile_asked("late", "local-0")
    agent.cancelled(Cancel("late"))
    assert [(node, stop.job_id, stop.kill) for node, stop in nodes.stopped] == [("local-0", "late", True)]
    assert agent.state_of(agent.jobs["late"]) == JobState.CANCELLED
    agent.cancelled(Cancel("lm"))  # profiled, not running: no node to tell
    assert len(nodes.stopped) == 1
