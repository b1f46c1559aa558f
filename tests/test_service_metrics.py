"""What the services record in the metrics catalog (shared/metrics.py), read back from the process's
Prometheus text as a scrape sees it. Each handler is called in-process, over the in-memory stand-ins
of the handler tests; the provider is installed once for the process, and other tests in it may
record too, so each test reads what its own calls moved (after less before)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_api_handlers import MemoryKV, gate
from test_executor_handlers import models_for, real_service, simulated_service, submit_and_profile

from services.api.submissions import REFUSAL_CAUSES
from services.api.who import Who
from services.executor.real import RealExecutors
from services.node.agent import NodeWorkers, Workers
from services.node.box import Box
from services.profiler.service import Profiler
from shared import subjects
from shared.cluster import load_cluster
from shared.lifecycle import JobState
from shared.metrics import (
    CHECKPOINT_DURATION,
    CHECKPOINT_SIZE,
    JOB_RESTARTS,
    JOBS,
    NODES,
    REFUSALS,
    SUBMISSIONS,
    VERDICTS,
    WORKERS,
    scrape,
    setup_metrics,
)
from shared.schema.estimates import StoredAll
from shared.schema.jobs import JobSpec
from shared.schema.nodes import NodeInfo, Rendezvous, StartWorkers, StopWorkers
from shared.schema.rounds import AdvanceRequest, ApplyRequest
from shared.storage import MAX_SUBMISSION_BYTES
from shared.subjects import DEFAULT_TEAM
from sim.profiles import profile_source


@pytest.fixture(scope="module", autouse=True)
def provider() -> None:
    setup_metrics("goodput-test")  # once per process: a later call returns the provider installed


def values() -> dict[tuple[str, frozenset], float]:
    """Every sample of a scrape now: (series name, its labels but the exporter's otel_scope_*) -> value."""
    return {
        (sample.name, frozenset((k, v) for k, v in sample.labels.items() if not k.startswith("otel_scope_"))): (
            sample.value
        )
        for family in text_string_to_metric_families(scrape())
        for sample in family.samples
    }


def read(now: dict, name: str, **labels: str) -> float:
    """One series' value in a scrape (0 when it is not there yet: nothing recorded)."""
    return now.get((name, frozenset(labels.items())), 0.0)


@contextmanager
def moved() -> Iterator[SimpleNamespace]:
    """What the block moved: `.by(name, **labels)`, the series' change across it."""
    before = values()
    change = SimpleNamespace()
    yield change
    after = values()
    change.by = lambda name, **labels: read(after, name, **labels) - read(before, name, **labels)
    change.now = lambda name, **labels: read(after, name, **labels)


def jobs(state: JobState) -> dict[str, str]:
    return {"state": state.value}


# ---- the API ------------------------------------------------------------------------------------


async def test_each_submission_is_counted_by_outcome_and_each_refusal_by_its_cause() -> None:
    judge, _, _ = gate(lambda spec: "unknown application" if spec.application == "nosuchjob" else None)
    alice = Who("alice")
    body = msgspec.json.encode(JobSpec("lm-1", "cifar10"))
    submissions, refusals = SUBMISSIONS.prometheus, REFUSALS.prometheus
    with moved() as accepted:
        assert (await judge.submit(body, alice)).accepted
    assert accepted.by(submissions, outcome="accepted") == 1 and accepted.by(submissions, outcome="refused") == 0

    with moved() as again:
        await judge.submit(body, alice)  # the same body: a repeat, not stored again
    assert again.by(submissions, outcome="duplicate") == 1 and again.by(submissions, outcome="accepted") == 0

    cases = [
        (b'{"id": "typo", "application": "cifar10", "requestd_gpus": 2}', "malformed"),
        (msgspec.json.encode(JobSpec("lm-2", "nosuchjob")), "unschedulable"),
        (msgspec.json.encode(JobSpec("lm-3", "cifar10", team="other")), "team"),
        (msgspec.json.encode(JobSpec("lm-1", "cifar10", requested_gpus=2)), "id_taken"),  # another body, same id
        (b" " * (MAX_SUBMISSION_BYTES + 1), "too_large"),
    ]
    for data, cause in cases:
        with moved() as refused:
            answer = await judge.submit(data, alice)
        assert not answer.accepted, (cause, answer)
        assert refused.by(submissions, outcome="refused") == 1, cause
        assert refused.by(refusals, reason=cause) == 1, (cause, answer.reason)
        assert cause in REFUSAL_CAUSES


async def test_a_logins_submission_on_the_intake_stream_is_counted_as_the_apis() -> None:
    judge, _, _ = gate()
    subject = subjects.intake(DEFAULT_TEAM, "bob")
    with moved() as change:
        await judge.judge(
            msgspec.Raw(msgspec.json.encode(JobSpec("in-1", "cifar10"))), SimpleNamespace(subject=subject)
        )
        await judge.unjudgeable(subject, b"\xff not a body", ValueError("unreadable"))
    submissions = SUBMISSIONS.prometheus
    assert change.by(submissions, outcome="accepted") == 1 and change.by(submissions, outcome="refused") == 1
    assert change.by(REFUSALS.prometheus, reason="malformed") == 1


# ---- the profiler -------------------------------------------------------------------------------


class ProfilerBus:
    """What the profiler asks of the bus: its verdicts published, the estimator's acknowledgement."""

    def __init__(self) -> None:
        self.published: list[tuple[str, object]] = []

    async def js_publish(self, subject: str, message, **_) -> None:
        self.published.append((subject, message))

    async def request(self, subject: str, message, answer_type, **_):
        assert subject == subjects.PROFILES and answer_type is StoredAll
        return StoredAll((1,) * len(message.jobs))


async def test_the_profilers_verdicts_are_counted_accepted_and_rejected() -> None:
    bus = ProfilerBus()
    profiler = Profiler(bus, load_cluster("sia-hetero-64"), MemoryKV(), source=profile_source(use_zoo=True))
    stored = subjects.stored(DEFAULT_TEAM, "alice")
    verdicts = VERDICTS.prometheus
    with moved() as change:
        await profiler.on_submission(JobSpec("ok-1", "cifar10"), SimpleNamespace(stream_sequence=1, subject=stored))
        await profiler.on_submission(JobSpec("no-1", "nosuchjob"), SimpleNamespace(stream_sequence=2, subject=stored))
        await profiler.on_malformed(stored, b"{", ValueError("unreadable"))
    assert [subject for subject, _ in bus.published] == [subjects.PROFILED, subjects.REJECTED, subjects.REJECTED]
    assert change.by(verdicts, verdict="accepted") == 1 and change.by(verdicts, verdict="rejected") == 2


# ---- the simulated executors --------------------------------------------------------------------


class EstimatorBus:
    """The estimator, as the simulated executors report what their jobs ran to it."""

    async def request(self, subject: str, message, answer_type, **_):
        assert subject == subjects.OBSERVE and answer_type is StoredAll
        return StoredAll((1,) * len(message.observed))


async def test_the_simulated_executors_count_their_jobs_by_state_and_their_restarts() -> None:
    service = await simulated_service()
    service.bus = EstimatorBus()
    with moved() as submitted:
        await submit_and_profile(service, "a", "b")
    assert submitted.now(JOBS.prometheus, **jobs(JobState.QUEUED)) == 2  # this service's jobs, set whole
    for state in JobState:  # every state, zeros included
        assert (JOBS.prometheus, frozenset(jobs(state).items())) in values(), state

    with moved() as placed:
        await service.on_apply(
            ApplyRequest(0.0, {"a": (("aws-0", 2),)}, models_for(service, ["a", "b"]), adaptive=True)
        )
    assert placed.now(JOBS.prometheus, **jobs(JobState.RUNNING)) == 1
    assert placed.now(JOBS.prometheus, **jobs(JobState.QUEUED)) == 1
    assert placed.by(JOB_RESTARTS.prometheus) == 0  # a first start is no restart

    with moved() as moved_job:
        await service.on_apply(
            ApplyRequest(1.0, {"a": (("aws-1", 2),)}, models_for(service, ["a", "b"]), adaptive=True)
        )
    assert moved_job.by(JOB_RESTARTS.prometheus) == 1

    with moved() as ended:  # a round long enough for the job to train to its end
        reply = await service.on_advance(AdvanceRequest(1.0, 1e9, ("a", "b")))
    assert reply.finished == ("a",)
    assert ended.now(JOBS.prometheus, **jobs(JobState.FINISHED)) == 1
    assert ended.now(JOBS.prometheus, **jobs(JobState.RUNNING)) == 0  # emptied: it reads 0


# ---- the real executors -------------------------------------------------------------------------


async def test_the_real_executors_count_their_jobs_by_state_their_restarts_and_their_nodes() -> None:
    service = await real_service()
    running, queued = jobs(JobState.RUNNING), jobs(JobState.QUEUED)
    with moved() as placed:
        await service.on_apply(ApplyRequest(0.0, {"lm": (("local-0", 2),)}, {}, adaptive=False))
    assert placed.now(JOBS.prometheus, **running) == 1 and placed.now(JOBS.prometheus, **queued) == 1
    assert placed.now(JOBS.prometheus, **jobs(JobState.PROFILING)) == 1
    assert placed.now(JOBS.prometheus, **jobs(JobState.FINISHED)) == 0

    with moved() as stopped:  # taken off its slots: its workers checkpoint and stop, to start again
        await service.on_apply(ApplyRequest(1.0, {}, {}, adaptive=False))
    assert stopped.by(JOB_RESTARTS.prometheus) == 1
    assert stopped.now(JOBS.prometheus, **running) == 0 and stopped.now(JOBS.prometheus, **queued) == 2

    agent: RealExecutors = service.agent
    members = {name: NodeInfo(name, "cpu", 2, "127.0.0.1") for name in ("n-0", "n-1", "n-2")}
    with moved() as served:
        agent.serve_nodes(members, {"n-2"})
    assert [served.now(NODES.prometheus, state=s) for s in ("alive", "drained", "lost")] == [2, 1, 0]
    with moved() as lost:
        agent.serve_nodes({name: members[name] for name in ("n-0", "n-2")}, {"n-2"})
    assert [lost.now(NODES.prometheus, state=s) for s in ("alive", "drained", "lost")] == [1, 1, 1]


# ---- a node agent -------------------------------------------------------------------------------

# A worker that checkpoints on SIGTERM, as the library does: rank 0 writes CHECKPOINT_BYTES (renamed
# into place), then it exits 0. It says when it is ready for the signal.
CHECKPOINT_BYTES = 4096
WORKER = f"""
import os, signal, sys
path = sys.argv[1]
def stop(*_):
    if path:
        with open(path + ".tmp", "wb") as file:
            file.write(b"x" * {CHECKPOINT_BYTES})
        os.replace(path + ".tmp", path)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    signal.pause()
"""


def started_worker(checkpoint: str) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", WORKER, checkpoint], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert process.stdout.readline().strip() == "ready"  # its handler is in place
    return process


def test_a_node_agent_counts_its_running_workers_and_times_a_jobs_checkpoint(tmp_path: Path) -> None:
    node = NodeWorkers(NodeInfo("n-0", "cpu", 2, "127.0.0.1"), tmp_path)
    checkpoint = tmp_path / "lm" / "lm.pt"
    checkpoint.parent.mkdir()
    order = StartWorkers("lm", "mlp_blobs", 1, (0, 1), 2, 1, "cpu", str(checkpoint))
    processes = [started_worker(str(checkpoint)), started_worker("")]  # rank 0 writes the checkpoint
    try:
        box = Box(node.boxes, "lm", "lm.1", node.job_folder("lm"), None, None)  # --box off: as the agent
        box.processes += processes
        node.jobs["lm"] = Workers(order, Rendezvous("127.0.0.1", 1), (), checkpoint, box, processes=processes)
        with moved() as polled:
            node.poll()
        assert polled.now(WORKERS.prometheus) == 2

        duration, size = CHECKPOINT_DURATION.prometheus, CHECKPOINT_SIZE.prometheus
        with moved() as stop:
            report = node.stop(StopWorkers("lm", grace_s=60))
        assert report.codes == (0, 0) and report.stopped  # asked to stop while they ran: a checkpoint
        assert stop.now(WORKERS.prometheus) == 0
        assert stop.by(f"{duration}_count") == 1 and stop.by(f"{duration}_sum") > 0
        assert stop.by(f"{size}_count") == 1 and stop.by(f"{size}_sum") == CHECKPOINT_BYTES
    finally:
        for process in processes:
            process.kill()
            process.wait()
            process.stdout.close()
