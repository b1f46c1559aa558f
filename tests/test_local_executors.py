"""Real jobs on CPU slots, the executor's side and one node's workers in this process: a crashed
worker restarts its job from its checkpoint, a job told not to adapt keeps its batch, only declared
jobs run, workers never see the agent's credentials; the executor's bookkeeping across restarts,
rounds asked again, cancels and the round's nodes. (A job moved between nodes and across two of
them, with agents as processes: tests/test_multinode.py.)"""

import base64
import json
import threading
import time

import msgspec
import pytest

from goodput_train.protocol import STATS_PREFIX, JobStats
from services.executor.local import InProcessNodes, LocalExecutors
from services.node.agent import NodeWorkers
from shared.bus.encoding import Refused
from shared.cluster import Cluster
from shared.runtime import job_module
from shared.schema.base import Node
from shared.schema.nodes import CANNOT_RUN, NodeInfo, NodeReport, Rendezvous, StartWorkers, WorkersReport
from shared.schema.records import NodeJob

SLOTS = Cluster("local-2", (Node("local-0", "cpu", 2),))


def local_executors(folder, jobs_package="examples.jobs", **options) -> LocalExecutors:
    """Real workers on one node of two CPU slots, its agent's part in this process (no bus)."""
    node = NodeWorkers(NodeInfo("local-0", "cpu", 2, "127.0.0.1"), folder, jobs_package) if folder else None
    return LocalExecutors(
        InProcessNodes({"local-0": node} if node else {}), folder, SLOTS, jobs_package=jobs_package, **options
    )


def wait_for(condition, executors, timeout_s=120):
    finished = []
    deadline = time.monotonic() + timeout_s
    while not condition(finished):
        assert time.monotonic() < deadline, "timed out"
        finished += executors.poll()
        time.sleep(0.1)
    return finished


class ReportingNodes:
    """Node agents that start nothing: each job's workers run and report `stats[job]`, as the
    executor's order numbered them (their generation), until `codes[job]` says they exited; a
    stop of workers never started here answers that it found none."""

    def __init__(self):
        self.orders: dict[tuple[str, str], StartWorkers] = {}
        self.stats: dict[str, JobStats] = {}
        self.codes: dict[str, int | None] = {}

    def start(self, node, order):
        self.orders[node, order.job_id] = order
        return Rendezvous("127.0.0.1", 29500)

    def _report(self, node, job_id):
        order = self.orders[node, job_id]
        stats = self.stats.get(job_id)
        line = STATS_PREFIX + base64.b64encode(msgspec.msgpack.encode(stats)).decode() if stats else ""
        codes = (self.codes.get(job_id),) * len(order.ranks)
        return WorkersReport(job_id, order.generation, order.ranks, codes, stats=line)

    def stop(self, node, request):
        if (node, request.job_id) not in self.orders:
            return WorkersReport(request.job_id, -1, (), ())
        return self._report(node, request.job_id)

    def poll(self, node):
        return NodeReport(node, tuple(self._report(n, job) for n, job in self.orders if n == node))


@pytest.mark.e2e
def test_a_crashed_worker_restarts_from_its_checkpoint(tmp_path):
    """kill -9 of one of a job's two workers: the other (waiting for it in a collective) is taken
    down too, and the job starts again from its checkpoint."""
    executors = local_executors(tmp_path, report_every_s=0.2)
    executors.add("cnn-1", "cnn_shapes")
    job = executors.jobs["cnn-1"]
    try:
        executors.apply({"cnn-1": (("local-0", 2),)})
        wait_for(lambda _: job.stats is not None and job.stats.steps > 0, executors)
        executors.nodes.workers["local-0"].jobs["cnn-1"].processes[1].kill()  # kill -9 mid-training
        wait_for(lambda finished: "cnn-1" in finished, executors)
    finally:
        executors.stop_all()
    assert job.crashes == 1 and job.failure is None and job.result["metric"] >= 0.95


def test_only_example_jobs_may_run():
    executors = local_executors(None)
    with pytest.raises(ValueError, match="no job"):
        executors.add("x", "os")
    with pytest.raises(ValueError, match="no job"):
        executors.add("y", "../../etc/passwd")


def test_only_modules_that_declare_themselves_jobs_may_run():
    """A module of the jobs package is not a job unless it says so: the example jobs' shared loop
    is refused, with the reason and the jobs there are."""
    with pytest.raises(
        ValueError,
        match=r"no job 'common' in examples.jobs: examples.jobs.common does not declare "
        r"itself a job \(`GOODPUT_JOB = True`\) \(its jobs: cnn_shapes, mlp_blobs, "
        r"tiny_lm\)",
    ):
        local_executors(None).add("c", "common")
    with pytest.raises(
        ValueError,
        match=r"its jobs: contract, deaf, environment, greedy, huge, leaves, packages, probes, profile_stalls, quick, raises, says, writes\)",
    ):
        job_module("small", "tests.jobs")  # the test jobs' helper
    with pytest.raises(ValueError, match=r"its jobs: none"):
        job_module("x", "no_such_package")
    assert job_module("mlp_blobs") == "examples.jobs.mlp_blobs"


CREDENTIALS = {
    "GOODPUT_NATS_USER": "executor",
    "GOODPUT_NATS_PASSWORD": "hunter2-secret",
    "GOODPUT_NATS_PASSWORD_FILE": "/run/secrets/executor",
    "GOODPUT_NATS_PASSWORD_PLACER": "placer-secret",
    "GOODPUT_NATS_TOKEN_FILE": "/run/secrets/token",
    "GOODPUT_NATS_TLS_KEY": "/etc/goodput/tls.key",
    "GOODPUT_NATS_URL": "nats://user:pass@nats:4222",
    "GITHUB_TOKEN": "ghp_secret",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
}


def given_environment(log) -> dict[str, str]:
    """What the environment job (tests/jobs/environment.py) wrote to its log."""
    return json.loads(next(line for line in log.read_text().splitlines() if line.startswith("{")))


@pytest.mark.e2e
def test_workers_and_profiling_runs_get_a_minimal_environment_never_the_agents_credentials(tmp_path, monkeypatch):
    """Real worker processes, started with NATS credentials and tokens in the agent's environment:
    they see none of them, only what a job needs (the device settings among it) and their place."""
    from shared.schema.nodes import ProfileRequest

    for name, value in {**CREDENTIALS, "CUDA_VISIBLE_DEVICES": "0,1", "NCCL_DEBUG": "WARN"}.items():
        monkeypatch.setenv(name, value)
    executors = local_executors(tmp_path, "tests.jobs")
    executors.add("env-1", "environment")
    try:
        executors.apply({"env-1": (("local-0", 2),)})
        wait_for(lambda finished: "env-1" in finished, executors, timeout_s=60)
    finally:
        executors.stop_all()
    answer = executors.nodes.workers["local-0"].profile(ProfileRequest("env-2", "environment", slot_memory_mb=64))
    assert answer.run is None and "printed no profile" in answer.failure
    workers = [given_environment(tmp_path / f"env-1.rank{rank}.log") for rank in (0, 1)]
    profiling = given_environment(tmp_path / "env-2.profile-cpu.log")
    for env in (*workers, profiling):
        leaked = {name for name, value in env.items() if name in CREDENTIALS or value in CREDENTIALS.values()}
        assert not leaked and not any(name.startswith("GOODPUT_NATS_") for name in env), leaked
        assert env["PATH"] and env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["NCCL_DEBUG"] == "WARN"
        assert env["OMP_NUM_THREADS"] == "1" and env["GOODPUT_JOB_ID"] in ("env-1", "env-2")
    assert [env["RANK"] for env in workers] == ["0", "1"] and workers[0]["WORLD_SIZE"] == "2"
    assert profiling["GOODPUT_PROFILE"] == "1" and profiling["GOODPUT_SLOT_MEMORY_MB"] == "64"


def test_the_agent_takes_the_jobs_stream_in_order_and_a_successor_takes_its_jobs_back(tmp_path):
    """Submissions, then the profiler's word on each; a refused malformed submission (never read)
    is listed as refused all the same; a refusal naming a held id is listed on its own and leaves the
    job as it is. A new agent given the saved jobs answers the same, restarts only what was running,
    and nothing twice."""
    from services.executor.real import RealExecutors
    from shared.schema.jobs import JobSpec, Profiled, Rejected

    agent = RealExecutors(LocalExecutors(ReportingNodes(), tmp_path, SLOTS))
    for sequence, job_id in enumerate(("lm", "refused", "done"), start=1):
        agent.submitted(JobSpec(job_id, "tiny_lm"), sequence)
    agent.submitted(JobSpec("lm", "cnn_shapes"), 4)  # another body under a held id: not taken
    agent.profiled(Profiled("lm", 16, 256, submission=1))
    agent.profiled(Profiled("done", 16, 256, submission=3))
    agent.rejected(Rejected("goodput.jobs.submit", "too big", "refused", submission=2), 5)
    agent.rejected(Rejected("goodput.jobs.submit", "malformed: unknown field", "never-read"), 6)
    # Refusals of other submissions naming held ids leave the jobs as they are.
    agent.rejected(Rejected("goodput.jobs.submit", "job lm already exists", "lm", submission=4), 7)
    agent.rejected(Rejected("goodput.jobs.submit", "malformed submission", "done"), 8)
    assert agent.jobs["lm"].spec.application == "tiny_lm"
    assert agent.arrive(10.0) == ["done", "lm"]
    lm = agent.executors.jobs["lm"]
    lm.placement = (("local-0", 1),)  # placed: its workers start (its nodes run nothing here)
    agent.executors.jobs["done"].result = {"stopped": False, "metric": 0.9, "batches": [16, 32]}
    assert agent.advance(10.0, 3.0, ["done", "lm"]).finished == ("done",)
    assert (lm.parts, lm.running) == ((("local-0", (0,)),), True)  # its workers there, as KV keeps them
    failures = sorted((r.name, r.failure) for r in agent.records() if r.failure)
    assert failures == [
        ("done", "malformed submission"),
        ("lm", "job lm already exists"),
        ("never-read", "malformed: unknown field"),
        ("refused", "too big"),
    ]
    facts = agent.facts(12.0, ["lm"]).facts[0]
    assert (facts.submit_s, facts.age_s, facts.init_batch, facts.max_batch, facts.iterations) == (10.0, 2.0, 16, 256, 0)

    successor = RealExecutors(LocalExecutors(ReportingNodes(), tmp_path, SLOTS))
    for job in msgspec.msgpack.decode(msgspec.msgpack.encode(agent.saved()), type=list[NodeJob]):  # as KV keeps them
        successor.restore(job)
    successor.executors.stop_leftovers()  # what was running on the nodes stops; it starts again
    assert sorted((r.name, r.failure) for r in successor.records() if r.failure) == failures
    records = {r.name: r for r in successor.records() if r.state != "rejected"}
    assert (records["done"].finish_s, records["done"].restarts, records["done"].metric) == (
        agent.jobs["done"].finish_s,
        0,
        0.9,
    )  # ended: not started again
    assert records["lm"].restarts == 1 and records["lm"].gpu_seconds == 3.0  # was running: starts again
    assert successor.advance(10.0, 3.0, ["done", "lm"]).finished == ("done",)  # the same round asked again
    assert successor.jobs["lm"].gpu_seconds == 3.0
    assert successor.arrive(13.0) == ["lm"]


def test_every_refusal_is_listed_with_what_could_be_read_of_it_across_a_restart(tmp_path):
    """A body whose id could not be read is listed all the same (`"id": null`), each on its own; a
    readable refusal with its id and application, not "unreadable"; each kept under its place in the
    stream; a successor lists them the same."""
    from services.executor.real import RealExecutors
    from shared.schema.api import job_statuses
    from shared.schema.jobs import Rejected

    agent = RealExecutors(local_executors(None))
    agent.rejected(Rejected("goodput.jobs.submit", "a message is a JSON object", payload="hello"), 5)
    agent.rejected(Rejected("goodput.jobs.submit", "a message is a JSON object", payload="[1]"), 6)
    agent.rejected(Rejected("goodput.api.submit", "unknown application 'nosuchjob'", "x", application="nosuchjob"), 7)
    agent.rejected(Rejected("goodput.jobs.submit", "malformed: `$.requested_gpus`", "typo", application="tiny_lm"), 8)
    expected = [(None, "rejected", "a message is a JSON object", "unreadable")] * 2 + [
        ("x", "rejected", "unknown application 'nosuchjob'", "nosuchjob"),
        ("typo", "rejected", "malformed: `$.requested_gpus`", "tiny_lm"),
    ]
    listed = [(s.id, s.state, s.reason, s.application) for s in job_statuses(agent.records())]
    assert listed == expected

    successor = RealExecutors(local_executors(None))
    for job in msgspec.msgpack.decode(msgspec.msgpack.encode(agent.saved()), type=list[NodeJob]):  # as KV keeps them
        successor.restore(job)
    assert [(s.id, s.state, s.reason, s.application) for s in job_statuses(successor.records())] == expected
    assert sorted(job.key for job in successor.saved()) == [f"_rejected.{n}" for n in (5, 6, 7, 8)]


def test_a_running_jobs_batch_is_its_current_runs_own(tmp_path):
    """The batch a job trains at: null until its workers of this run report, then their per-GPU
    batch and accumulation times this run's replicas; once it grows, null again until the new
    run reports, never the last run's batch with the new GPUs."""
    from services.executor.real import RealExecutors
    from shared.schema.jobs import JobSpec, Profiled

    nodes = ReportingNodes()
    agent = RealExecutors(LocalExecutors(nodes, tmp_path, Cluster("local-4", (Node("local-0", "cpu", 4),))))
    agent.submitted(JobSpec("lm", "tiny_lm"), 1)
    agent.profiled(Profiled("lm", 16, 256, submission=1))
    agent.arrive(0.0)

    def batch():
        agent.poll()
        return next(r.batch for r in agent.records() if r.name == "lm")

    agent.apply(0.0, {"lm": (("local-0", 1),)})
    assert batch() is None  # not reported yet
    nodes.stats["lm"] = JobStats("lm", "cpu", (), None, None, 0.1, 10, m=32, s=1)
    assert batch() == 32 * 2 * 1
    agent.apply(3.0, {"lm": (("local-0", 4),)})  # it grows: its workers restart on 4
    assert batch() is None  # the report it has is the 1-GPU run's
    nodes.stats["lm"] = JobStats("lm", "cpu", (), None, None, 0.2, 20, m=24, s=0)
    assert batch() == 24 * 1 * 4


def test_a_job_moved_to_another_gpu_type_reports_its_configurations_there_again(tmp_path):
    """The estimator fits each GPU type on that type's own times: a configuration told on one type
    is told again when the job runs it on another (and not twice on one)."""
    from goodput_train.goodput import Observation
    from services.executor.real import RealExecutors
    from shared.schema.jobs import JobSpec, Profiled

    nodes = ReportingNodes()
    agent = RealExecutors(LocalExecutors(nodes, tmp_path, Cluster("local-4", (Node("local-0", "cpu", 4),))))
    agent.submitted(JobSpec("lm", "tiny_lm"), 1)
    agent.profiled(Profiled("lm", 16, 256, submission=1))
    agent.arrive(0.0)
    agent.apply(0.0, {"lm": (("local-0", 2),)})
    ran = (Observation(1, 2, 32, 0, 0.1),)
    nodes.stats["lm"] = JobStats("lm", "cpu", ran, None, None, 0.1, 10, m=32, s=0)
    agent.poll()
    told = agent.observations()
    assert [(o.gpu_type, o.observation[:5]) for o in told] == [("cpu", ran[0][:5])]  # t_grad: NaN
    for message in told:
        agent.reported(message, 2)
    agent.poll()
    assert agent.observations() == []  # told: not again on this type
    nodes.stats["lm"] = JobStats("lm", "fast", ran, None, None, 0.2, 20, m=32, s=0)  # the same, elsewhere
    agent.poll()
    assert [(o.gpu_type, o.observation[:5]) for o in agent.observations()] == [("fast", ran[0][:5])]


def test_a_profiling_jobs_status_says_where_it_is_profiled_and_it_has_no_failure():
    """While it is profiled, a job's reason says what it waits for and where its run is; its failure
    stays None (it has not failed) until its refusal, which is its failure."""
    from services.executor.real import RealExecutors
    from shared.schema.api import job_status
    from shared.schema.jobs import JobSpec, Rejected

    agent = RealExecutors(local_executors(None))
    agent.submitted(JobSpec("lm", "tiny_lm"), 1)

    def seen():
        [record] = agent.records()
        return record.state, record.failure, record.reason, job_status(record).reason

    assert seen() == (
        "profiling",
        None,
        "waiting for its profiling run (its script on one GPU of each type it may use)",
        "waiting for its profiling run (its script on one GPU of each type it may use)",
    )
    agent.profile_asked("lm", "cpu-1")
    assert seen() == ("profiling", None, "profiling on node cpu-1", "profiling on node cpu-1")
    agent.lost.add("cpu-1")
    assert seen()[:2] == ("profiling", None) and seen()[3].startswith("profiling: node cpu-1 was lost during its run")
    agent.rejected(Rejected("goodput.jobs.submit", "job lm cannot run: it raised", "lm", submission=1))
    assert seen() == ("rejected", "job lm cannot run: it raised", None, "job lm cannot run: it raised")


def test_a_queued_jobs_status_says_it_waits_for_gpus_behind_those_submitted_before_it():
    from services.executor.real import RealExecutors
    from shared.schema.jobs import JobSpec, Profiled

    agent = RealExecutors(local_executors(None))
    for sequence, job_id in enumerate(("a", "b", "c", "d"), start=1):
        agent.submitted(JobSpec(job_id, "tiny_lm"), sequence)
        if job_id != "c":  # c is still being profiled
            agent.profiled(Profiled(job_id, 16, 256, submission=sequence))
    agent.arrive(0.0)
    reasons = {r.name: (r.state, r.reason) for r in agent.records()}
    assert reasons == {
        "a": ("queued", "waiting for GPUs: the last round gave it none"),
        "b": ("queued", "waiting for GPUs: the last round gave it none; 1 queued job submitted before it"),
        "c": ("profiling", "waiting for its profiling run (its script on one GPU of each type it may use)"),
        "d": ("queued", "waiting for GPUs: the last round gave it none; 2 queued jobs submitted before it"),
    }, reasons


def test_a_job_the_live_nodes_cannot_take_is_unschedulable_until_they_change():
    """A rigid job of 2 slots on two nodes of one: queued, with why it waits while another job holds
    a node; unschedulable once a node is drained (the reason says which drain), queued again when
    the drain is lifted. Every move is one the lifecycle allows."""
    from services.executor.real import RealExecutors
    from shared.schema.jobs import JobSpec, Profiled

    agent = RealExecutors(local_executors(None))
    agent.submitted(JobSpec("rigid", "tiny_lm", requested_gpus=2, rigid=True), 1)
    agent.submitted(JobSpec("small", "tiny_lm"), 2)
    members = {name: NodeInfo(name, "cpu", 1, "127.0.0.1") for name in ("cpu-0", "cpu-1")}
    agent.serve_nodes(members, set())
    agent.profiled(Profiled("rigid", 16, 256, submission=1))
    agent.profiled(Profiled("small", 16, 256, submission=2))
    agent.arrive(0.0)
    small = agent.executors.jobs["small"]  # as if a round placed it on cpu-1 (no processes here)
    small.placement = small.started_on = (("cpu-1", 1),)
    small.parts, small.running = (("cpu-1", (0,)),), True

    def seen():
        return next((r.state, r.reason) for r in agent.records() if r.name == "rigid")

    assert seen() == ("queued", "needs 2 cpu GPUs on 2 whole nodes, and 1 is wholly free")
    agent.serve_nodes(members, {"cpu-1"})  # its workers stop; the job waits with the other
    state, reason = seen()
    assert state == "unschedulable" and reason.startswith("needs 2 GPUs of one type; "), reason
    assert reason.endswith("it would fit without the drains of cpu-1"), reason
    assert agent.facts(1.0, ["rigid"]).facts  # the rounds still see it: it starts when nodes return
    agent.serve_nodes(members, set())
    assert seen() == ("queued", "waiting for the next round: 2 GPUs of its types are free and fit it")


def test_a_profiling_run_takes_a_gpu_from_the_round_on_a_node_that_trains_nothing():
    """Two nodes of one slot, one profiling a job: the round places on the other only (a job that
    needs both waits, queued, not unschedulable); once the profiler's verdict is in, on both. A
    node training a job is left whole: its placements stand."""
    from services.executor.real import RealExecutors, lent_to_profiling
    from shared.schema.jobs import JobSpec, Profiled

    agent = RealExecutors(local_executors(None))
    members = {name: NodeInfo(name, "cpu", 1, "127.0.0.1") for name in ("cpu-0", "cpu-1")}
    agent.submitted(JobSpec("rigid", "tiny_lm", requested_gpus=2, rigid=True), 1)
    agent.profiled(Profiled("rigid", 16, 256, submission=1))
    agent.submitted(JobSpec("new", "tiny_lm"), 2)
    agent.profile_asked("new", "cpu-1")
    assert [n.name for n in agent.serve_nodes(members, set())] == ["cpu-0"]
    agent.arrive(0.0)
    assert next(r.state for r in agent.records() if r.name == "rigid") == "queued"
    agent.profiled(Profiled("new", 16, 256, submission=2))
    assert [n.name for n in agent.serve_nodes(members, set())] == ["cpu-0", "cpu-1"]
    four = [NodeInfo("a", "cpu", 4, "127.0.0.1"), NodeInfo("b", "cpu", 4, "127.0.0.1")]
    assert [(i.name, i.gpus) for i in lent_to_profiling(four, ["a", "b"], {"b"})] == [("a", 3), ("b", 4)]


def test_a_job_is_timed_from_its_submission_and_a_cancel_ends_it_wherever_it_is(tmp_path):
    """A real job's time counts its profiling and wait (the run's clock is the wall clock's); a
    cancelled job, queued or still being profiled, never starts and leaves the rounds."""
    import time

    from services.executor.real import RealExecutors
    from shared.schema.jobs import CANCELLED, Cancel, JobSpec, Profiled

    agent = RealExecutors(local_executors(tmp_path))
    for sequence, job_id in enumerate(("lm", "queued", "profiling"), start=1):
        agent.submitted(JobSpec(job_id, "tiny_lm"), sequence)
    agent.jobs["lm"].submitted_at = time.time() - 40.0  # submitted 40 s ago, profiled since
    agent.profiled(Profiled("lm", 16, 256, submission=1))
    agent.profiled(Profiled("queued", 16, 256, submission=2))
    assert agent.arrive(100.0) == ["lm", "queued"]
    records = {r.name: r for r in agent.records()}
    assert 59.0 < records["lm"].submit_s <= 60.0 and agent.facts(100.0, ["lm"]).facts[0].submit_s == 100.0
    agent.cancelled(Cancel("queued"))
    agent.cancelled(Cancel("profiling"))
    agent.cancelled(Cancel("queued"))  # twice: harmless
    agent.profiled(Profiled("profiling", 16, 256, submission=3))  # its verdict came after: it never starts
    assert agent.facts(101.0, ["lm", "queued"]).failed == {"queued": CANCELLED}
    assert agent.advance(101.0, 3.0, ["lm", "queued"]).failed == {"queued": CANCELLED}
    assert agent.arrive(104.0) == ["lm"]
    states = {r.name: r.state for r in agent.records()}
    assert states == {"lm": "queued", "queued": "cancelled", "profiling": "cancelled"}, states


def test_a_round_asked_again_gets_the_same_answer_and_counts_nothing_twice(tmp_path):
    """The clock asks a round again when its reply was lost: the job that finished in it is
    reported again (else the run would never learn of it), its slot-seconds are counted once."""
    from services.executor.real import RealExecutors
    from shared.schema.jobs import JobSpec, Profiled

    nodes = ReportingNodes()
    agent = RealExecutors(LocalExecutors(nodes, tmp_path, SLOTS))
    agent.submitted(JobSpec("lm", "tiny_lm"), 1)
    agent.profiled(Profiled("lm", 16, 256, submission=1))
    agent.arrive(0.0)
    agent.apply(0.0, {"lm": (("local-0", 2),)})
    assert agent.advance(0.0, 3.0, ["lm"]).finished == ()  # a round on two slots: 6 slot-seconds
    nodes.codes["lm"] = 0  # and then it finished
    first = agent.advance(3.0, 3.0, ["lm"])
    again = agent.advance(3.0, 3.0, ["lm"])
    assert first == again and first.finished == ("lm",)
    assert agent.jobs["lm"].gpu_seconds == 6.0
    assert agent.advance(6.0, 3.0, ["lm"]).finished == ()  # reported in its round only


@pytest.mark.e2e
def test_a_job_told_not_to_adapt_keeps_its_batch(tmp_path):
    """Under a policy that does not adapt batches (or for a rigid job) the workers keep theirs."""
    executors = local_executors(tmp_path, report_every_s=0.2)
    executors.add("cnn-1", "cnn_shapes")
    job = executors.jobs["cnn-1"]
    job.adaptive = False
    try:
        executors.apply({"cnn-1": (("local-0", 1),)})
        wait_for(lambda finished: "cnn-1" in finished, executors)
    finally:
        executors.stop_all()
    assert job.result["batches"] == [32] and job.result["metric"] >= 0.95


def test_the_rounds_nodes_are_the_live_ones_less_the_drained_and_a_gone_nodes_jobs_stop(tmp_path):
    """Each round's cluster is the agents alive now: a node of 6 GPUs is split as a cluster file's
    are (4 + 2), a node not in the given cluster is not used, a drained one is left out, and a job
    whose workers ran on a node that is gone stops and waits for the round's placement."""
    from services.executor.real import RealExecutors
    from shared.cluster import build_cluster

    spec = build_cluster(
        "two",
        [{"gpu_type": "cpu", "count": 2, "gpus_per_node": 2}, {"gpu_type": "big", "count": 1, "gpus_per_node": 6}],
    )
    real = RealExecutors(local_executors(tmp_path), spec)
    members = {
        "cpu-0": NodeInfo("cpu-0", "cpu", 2, "10.0.0.1"),
        "cpu-1": NodeInfo("cpu-1", "cpu", 2, "10.0.0.2"),
        "big-0": NodeInfo("big-0", "big", 6, "10.0.0.3"),
        "stray": NodeInfo("stray", "cpu", 8, "10.0.0.4"),
        "cpu-9": NodeInfo("cpu-9", "cpu", 4, "10.0.0.5"),
    }  # named in no cluster, or not as it says
    nodes = real.serve_nodes(members, set())
    assert [(n.name, n.gpu_type, n.gpus) for n in nodes] == [
        ("big-0-v0", "big", 4),
        ("big-0-v1", "big", 2),
        ("cpu-0", "cpu", 2),
        ("cpu-1", "cpu", 2),
    ]
    assert real.executors.real["big-0-v1"] == "big-0"
    real.executors.add("lm", "tiny_lm")
    lm = real.executors.jobs["lm"]  # as if its workers ran on cpu-1 (no processes here)
    lm.placement = lm.started_on = (("cpu-1", 2),)
    lm.parts, lm.running = (("cpu-1", (0, 1)),), True
    assert real.jobs_on("cpu-1") == ["lm"]
    nodes = real.serve_nodes(members, {"cpu-1"})  # drained (or lost: the same to its jobs)
    assert "cpu-1" not in {n.name for n in nodes}
    assert (lm.placement, lm.running, lm.restarts, lm.failure) == ((), False, 1, None)
    assert {n.name for n in real.serve_nodes(members, set())} >= {"cpu-0", "cpu-1"}  # drained no more


@pytest.mark.e2e
def test_a_worker_whose_agent_is_gone_exits_quietly(tmp_path):
    """Its agent killed (kill -9): the pipes it read and held close; the worker stops on its
    lifeline, checkpointed, and exits without a BrokenPipeError traceback in its log for the line
    it could not print."""
    from goodput_train.protocol import REPORT_ENV, STATS_PREFIX
    from services.node.box import Boxes, default_rules
    from services.node.processes import torchrun_env, worker

    checkpoint = tmp_path / "quick-1.pt"
    (tmp_path / "quick-1").mkdir()
    box = Boxes(tmp_path, default_rules(1), runtime=None).open(
        "quick-1", "quick-1", tmp_path / "quick-1", None, 1, False
    )
    with open(tmp_path / "quick-1.rank0.log", "w") as log:
        process = worker(
            box,
            job_module("quick", "tests.jobs"),
            ["--checkpoint", str(checkpoint)],
            {**torchrun_env(0, 1, 1, 0, "quick-1", "cpu"), REPORT_ENV: "0.2"},
            log,
            lifeline=True,
        )
    assert process.stdout.readline().startswith(STATS_PREFIX)  # it trains
    process.stdout.close()
    process.stdin.close()
    process.wait(timeout=120)
    assert checkpoint.exists()
    written = (tmp_path / "quick-1.rank0.log").read_text()
    assert "BrokenPipeError" not in written and "Traceback" not in written, written


@pytest.mark.e2e
def test_a_stop_for_a_job_being_profiled_here_ends_its_run_at_once(tmp_path):
    """A job cancelled while it is profiled: the executor's stop reaches the node, whose run of it
    (here one that would stall for as long as its agent lives) is killed, and its answer says so."""
    import threading
    import uuid

    from shared.schema.nodes import ProfileRequest, StopWorkers
    from tests.jobs.profile_stalls import STALLING, marker

    job = f"stall-{uuid.uuid4().hex[:8]}"
    node = NodeWorkers(NodeInfo("local-0", "cpu", 2, "127.0.0.1"), tmp_path, "tests.jobs")
    answers = []
    marker(job).touch()
    run = threading.Thread(target=lambda: answers.append(node.profile(ProfileRequest(job, "profile_stalls"))))
    run.start()
    try:
        deadline = time.monotonic() + 60
        log = tmp_path / f"{job}.profile-cpu.log"
        while not (log.exists() and STALLING in log.read_text()):  # the run is under way, and stalls
            assert time.monotonic() < deadline and run.is_alive(), answers
            time.sleep(0.05)
        assert node.stop(StopWorkers(job, kill=True)) == WorkersReport(job, -1, (), ())
        run.join(60)
        assert not run.is_alive() and answers[0].run is None and "exit code -9" in answers[0].failure, answers
        assert job not in node.profiling
    finally:
        marker(job).unlink(missing_ok=True)


class BuildingNodes(ReportingNodes):
    """Nodes whose starts build the job's environment until `built` is set, then start it, or refuse
    it for good when `refusal` says why."""

    def __init__(self):
        super().__init__()
        self.built, self.refusal, self.building = threading.Event(), "", set()

    def start(self, node, order):
        self.building.add(order.job_id)
        self.built.wait(60)
        self.building.discard(order.job_id)
        if self.refusal:
            raise Refused(self.refusal, None, CANNOT_RUN)
        return super().start(node, order)

    def poll(self, node):
        shown = super().poll(node)
        return NodeReport(node, shown.jobs, {job: 12.0 for job in self.building})


def test_a_job_waits_for_its_environment_in_its_status_and_one_that_cannot_be_had_fails_the_next_at_once():
    nodes = BuildingNodes()
    executors = LocalExecutors(nodes, None, SLOTS, blocking=False)
    executors.add("a", "t", code="c" * 64, entrypoint="t.py", requirements=("six",))
    executors.apply({"a": (("local-0", 1),)})
    deadline = time.monotonic() + 60
    while "preparing its environment" not in (executors.transition("a") or ""):
        assert time.monotonic() < deadline, executors.transition("a")
        executors.poll()
        time.sleep(0.05)
    assert executors.transition("a").startswith("preparing its environment (its requirements) on local-0 (12 s so far)")
    nodes.refusal = "its requirements could not be installed on node local-0: no such package"
    nodes.built.set()
    wait_for(lambda _: executors.jobs["a"].failure, executors)
    assert executors.jobs["a"].failure == nodes.refusal and executors.jobs["a"].crashes == 0
    executors.add("b", "t", code="c" * 64, entrypoint="t.py", requirements=("six",))
    executors.apply({"b": (("local-0", 1),)})
    assert executors.jobs["b"].failure == nodes.refusal  # no node asked again
    assert ("local-0", "b") not in nodes.orders
    # Another team's job asking the same is its own: tried (one team's trouble is never another's).
    nodes.refusal = ""
    executors.add("c", "t", code="c" * 64, entrypoint="t.py", requirements=("six",), team="other")
    executors.apply({"c": (("local-0", 1),)})
    wait_for(lambda _: ("local-0", "c") in nodes.orders, executors)
    assert executors.jobs["c"].failure is None
