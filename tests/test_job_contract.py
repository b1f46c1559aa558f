"""The job contract (docs/jobs.md): exit 0 is the end, the library's stopped mark a stop to resume,
a non-zero exit a crash (the third fails the job with the end of its stderr); metrics under any
name reach the job's record; the checkpoint path comes from the environment. The page's own script
runs as a worker would, is stopped, and resumes to its end."""

import base64
import io
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch

from goodput_train.protocol import (
    CHECKPOINT_PATH_ENV,
    METRICS_PREFIX,
    OUTCOME_PREFIX,
    REPORT_ENV,
    STATS_PREFIX,
    STOPPED_MARK,
    JobStats,
    clean_metrics,
)
from launcher.nats import free_loopback_port
from services.executor.local import InProcessNodes, LocalExecutors, LocalJob, finished
from services.executor.progress import job_progress, main_metric
from services.node.agent import NodeWorkers
from services.node.processes import torchrun_env, worker_env
from shared.cluster import Cluster
from shared.schema.api import job_status
from shared.schema.base import Node
from shared.schema.nodes import NodeInfo, WorkersReport

ROOT = Path(__file__).resolve().parents[1]
SLOTS = Cluster("local-2", (Node("local-0", "cpu", 2),))


def page_script() -> str:
    """The first python block of docs/jobs.md: the complete job the page shows."""
    return re.search(r"```python\n(.*?)```", (ROOT / "docs" / "jobs.md").read_text(), re.S).group(1)


def stats_of(line: str) -> JobStats:
    return msgspec.msgpack.decode(base64.b64decode(line[len(STATS_PREFIX) :]), type=JobStats)


@pytest.mark.e2e
def test_the_pages_script_stops_on_sigterm_and_resumes_to_its_end(tmp_path):
    """Run as a worker is (its environment, no argument, no lifeline): SIGTERM after its first
    reported steps makes it save, print the stopped mark and exit 0; run again, it resumes from
    the checkpoint (its steps never go back), reports its metric and exits 0 at its target."""
    (tmp_path / "train.py").write_text(page_script())
    checkpoint = tmp_path / "checkpoints" / "doc-1.pt"
    env = worker_env(
        {**torchrun_env(0, 1, 1, free_loopback_port(), "doc-1", "cpu"), CHECKPOINT_PATH_ENV: str(checkpoint)}
    )
    env[REPORT_ENV] = "0.2"
    first = subprocess.Popen(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen = []
    for line in first.stdout:  # its first report of steps taken: it trains
        seen.append(line.strip())
        if line.startswith(STATS_PREFIX) and stats_of(line.strip()).steps > 0:
            break
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=120)
    lines = seen + out.splitlines()
    assert first.returncode == 0, err[-3000:]
    assert lines[0] == "starting at step 0 with batch 32" and STOPPED_MARK in lines, lines[-5:]
    saved = torch.load(checkpoint, weights_only=True)["steps"]
    assert saved >= max(stats_of(s).steps for s in lines if s.startswith(STATS_PREFIX)) > 0

    again = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    lines = again.stdout.splitlines()
    assert lines[0] == f"starting at step {saved} with batch 32" and STOPPED_MARK not in lines
    steps = [stats_of(line).steps for line in lines if line.startswith(STATS_PREFIX)]
    assert steps and min(steps) >= saved and steps == sorted(steps)  # never back
    last = stats_of(next(line for line in reversed(lines) if line.startswith(STATS_PREFIX)))
    assert last.target_epochs == 60 and last.epochs >= 60
    (metrics,) = [json.loads(line[len(METRICS_PREFIX) :]) for line in lines if line.startswith(METRICS_PREFIX)]
    assert set(metrics) == {"test_mse"} and metrics["test_mse"] < 0.5  # it learned (the targets' variance: ~8.6)
    assert lines[-1].startswith("done: ")


def local_executors(folder, **options) -> LocalExecutors:
    """Real workers of tests.jobs on one node of two CPU slots, its agent in this process (no bus)."""
    node = NodeWorkers(NodeInfo("local-0", "cpu", 2, "127.0.0.1"), folder, "tests.jobs")
    return LocalExecutors(InProcessNodes({"local-0": node}), folder, SLOTS, jobs_package="tests.jobs", **options)


def run_to_end(executors: LocalExecutors, job_id: str, timeout_s: float = 60) -> None:
    """Poll until the job has finished or failed (the executor's loop does it every 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    job = executors.jobs[job_id]
    while job_id not in executors.poll() and not job.failure:
        assert time.monotonic() < deadline, f"{job_id}: neither finished nor failed: {job}"
        time.sleep(0.05)


@pytest.mark.e2e
def test_exit_0_without_an_outcome_line_is_the_end_and_its_metrics_reach_the_record(tmp_path):
    """A job that prints no outcome line and exits 0 has finished, on both its workers; the latest
    of each metric it reported is kept (a list dropped), and the record and status carry them."""
    from services.executor.real import RealExecutors
    from shared.schema.jobs import JobSpec, Profiled

    agent = RealExecutors(local_executors(tmp_path))
    agent.submitted(JobSpec("quiet-1", "contract"), 1)
    agent.profiled(Profiled("quiet-1", 8, 64, submission=1))
    agent.arrive(0.0)
    try:
        agent.apply(0.0, {"quiet-1": (("local-0", 2),)})
        run_to_end(agent.executors, "quiet-1")
    finally:
        agent.executors.stop_all()
    job = agent.executors.jobs["quiet-1"]
    assert job.result == {} and (job.crashes, job.restarts, job.failure) == (0, 0, None)
    assert job.metrics == {"test_mse": 0.125, "phase": "first", "runs": 1.0}
    agent.poll()
    (record,) = agent.records()
    assert record.metrics == job.metrics and record.metric == 0.125
    assert job_status(record).metrics == {"test_mse": 0.125, "phase": "first", "runs": 1.0}


@pytest.mark.e2e
def test_the_stopped_mark_restarts_the_job_and_unasked_counts_toward_its_crashes(tmp_path):
    """Exit 0 after the library's stopped mark is a stop: the job is started again from its
    checkpoint and its next exit 0 is its end; goodput asked no stop (a SIGTERM from outside it),
    so the stop counts toward max_crashes."""
    executors = local_executors(tmp_path)
    executors.add("stopped-1", "contract")
    try:
        executors.apply({"stopped-1": (("local-0", 1),)})
        run_to_end(executors, "stopped-1")
    finally:
        executors.stop_all()
    job = executors.jobs["stopped-1"]
    assert (job.restarts, job.crashes, job.failure, job.result) == (0, 1, None, {})
    assert job.metrics["runs"] == 2.0  # the second run found its checkpoint


@pytest.mark.e2e
def test_workers_that_keep_stopping_unasked_fail_the_job_after_max_crashes(tmp_path):
    executors = local_executors(tmp_path)
    executors.add("unasked-1", "contract")
    try:
        executors.apply({"unasked-1": (("local-0", 1),)})
        run_to_end(executors, "unasked-1")
    finally:
        executors.stop_all()
    job = executors.jobs["unasked-1"]
    assert (job.crashes, job.result, job.placement) == (3, None, ())
    assert job.failure.startswith("its workers stopped 3 times without being asked (")
    assert "SIGTERM from outside goodput?)" in job.failure


def poll_until(executors: LocalExecutors, done, timeout_s: float = 60) -> None:
    """Poll until `done()` (the executor's loop polls every 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not yet, after {timeout_s} s"
        executors.poll()
        time.sleep(0.05)


@pytest.mark.e2e
def test_an_exit_0_after_a_stop_goodput_asked_for_is_a_stop_and_the_job_ends_at_its_own_end(tmp_path):
    """A script that exits 0 on SIGTERM without the stopped mark: a rescale stops it, and it is
    started again (no crash counted); it finishes when it exits 0 by itself."""
    executors = local_executors(tmp_path)
    executors.add("sigterm-1", "contract")
    job = executors.jobs["sigterm-1"]
    try:
        executors.apply({"sigterm-1": (("local-0", 1),)})
        poll_until(executors, lambda: job.metrics.get("runs") == 1.0)  # running, its SIGTERM handler set
        executors.apply({"sigterm-1": (("local-0", 2),)})  # a rescale: SIGTERM, and it exits 0
        assert (job.result, job.restarts, job.running) == (None, 1, True)
        poll_until(executors, lambda: job.metrics.get("runs") == 2.0)
        (tmp_path / "sigterm-1" / "end").touch()
        run_to_end(executors, "sigterm-1")
    finally:
        executors.stop_all()
    assert (job.result, job.restarts, job.crashes, job.failure) == ({}, 1, 0, None)


@pytest.mark.e2e
def test_a_cancelled_job_ends_cancelled_though_its_workers_exit_0(tmp_path):
    from services.executor.real import RealExecutors
    from shared.schema.jobs import CANCELLED, Cancel, JobSpec, Profiled

    agent = RealExecutors(local_executors(tmp_path))
    agent.submitted(JobSpec("sigterm-2", "contract"), 1)
    agent.profiled(Profiled("sigterm-2", 8, 64, submission=1))
    agent.arrive(0.0)
    try:
        agent.apply(0.0, {"sigterm-2": (("local-0", 1),)})
        job = agent.executors.jobs["sigterm-2"]
        poll_until(agent.executors, lambda: job.metrics.get("runs") == 1.0)
        agent.cancelled(Cancel("sigterm-2"))  # SIGTERM: it exits 0
        agent.poll()
    finally:
        agent.executors.stop_all()
    assert (job.result, job.running, job.failure) == (None, False, CANCELLED)
    (record,) = agent.records()
    assert record.state == "cancelled"


@pytest.mark.e2e
def test_output_nested_too_deep_stops_neither_the_poll_nor_the_jobs_reports(tmp_path):
    """An outcome and a metrics line of 1000 '[': unreadable, dropped; the agent reads on (its next
    metrics line is kept) and the job finishes."""
    executors = local_executors(tmp_path)
    executors.add("deep-1", "contract")
    try:
        executors.apply({"deep-1": (("local-0", 1),)})
        run_to_end(executors, "deep-1")
    finally:
        executors.stop_all()
    job = executors.jobs["deep-1"]
    assert (job.result, job.crashes, job.failure) == ({}, 0, None)
    assert job.metrics == {"test_mse": 0.125, "phase": "first", "runs": 1.0}


@pytest.mark.e2e
def test_the_third_crash_fails_the_job_with_the_end_of_its_stderr(tmp_path):
    executors = local_executors(tmp_path)
    executors.add("crash-1", "contract")
    try:
        executors.apply({"crash-1": (("local-0", 1),)})
        run_to_end(executors, "crash-1")
    finally:
        executors.stop_all()
    job = executors.jobs["crash-1"]
    assert job.crashes == 3 and job.result is None
    head, tail = job.failure.split("\n", 1)
    assert head == "its workers crashed 3 times (exit code 3 on rank 0); the end of its stderr:"
    assert tail.splitlines() == [f"stderr line {n}" for n in range(2, 12)]  # its last 10 lines


def test_an_outcome_line_over_its_bound_is_dropped_and_a_deep_one_read_as_unreadable(caplog):
    from services.node.agent import MAX_OUTCOME_LINE, _forward

    long = OUTCOME_PREFIX + json.dumps({"metric": 1.0, "pad": "x" * MAX_OUTCOME_LINE})
    short = OUTCOME_PREFIX + json.dumps({"metric": 0.5})
    process = SimpleNamespace(stdout=io.StringIO(f"{short}\n{long}\n{long}\n"))
    workers = SimpleNamespace(stats="", outcome="", stopped=False, dropped=set(), order=SimpleNamespace(job_id="j"))
    _forward(process, workers, True)
    assert workers.outcome == short
    assert caplog.text.count(f"over {MAX_OUTCOME_LINE}") == 1  # told once
    job = LocalJob("j", "contract")
    deep = WorkersReport("j", 0, (0,), (0,), outcome=OUTCOME_PREFIX + "[" * 1000)
    LocalExecutors(InProcessNodes({}), None)._take(job, deep)
    assert job.outcome is None and "unreadable report" in caplog.text


def report(ranks, codes, stopped=False, generation=1) -> WorkersReport:
    return WorkersReport("j", generation, ranks, codes, stopped=stopped)


def test_a_job_finishes_only_when_every_worker_exits_0_and_none_was_stopped():
    parts = (("a", (0, 1)), ("b", (2,)))
    assert finished(parts, [report((0, 1), (0, 0)), report((2,), (0,))])
    assert not finished(parts, [report((0, 1), (0, 0)), report((2,), (0,), stopped=True)])  # to be resumed
    assert not finished(parts, [report((0, 1), (0, 0))])  # node b's word missing (lost)
    assert not finished(parts, [report((0, 1), (0, -15)), report((2,), (0,))])  # killed
    assert not finished(parts, [report((0, 1), (0, None)), report((2,), (0,))])  # still running
    assert not finished((), [])


def test_metrics_are_numbers_or_short_strings_and_a_bounded_few():
    kept, dropped = clean_metrics({"loss": 1, "acc": 0.5, "tag": "x" * 128, "on": True, "curve": [1], "": 2})
    assert kept == {"loss": 1.0, "acc": 0.5, "tag": "x" * 128}
    assert len(dropped) == 3 and any(why.startswith("curve: list") for why in dropped)
    kept, dropped = clean_metrics({f"m{n}": n for n in range(40)})
    assert list(kept) == [f"m{n}" for n in range(32)] and len(dropped) == 8
    assert main_metric(None, {"loss": "low", "test_mse": 0.1}) == 0.1
    assert main_metric({"metric": 0.9}, {"test_mse": 0.1}) == 0.9 and main_metric(None, {}) is None


def test_a_dropped_metric_is_warned_of_once_however_often_it_is_reported(caplog, capsys):
    from torch import nn
    from torch.utils.data import TensorDataset

    from goodput_train.trainer import AdaptiveTraining

    model = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(64, 4), torch.randint(2, (64,)))
    training = AdaptiveTraining(model, torch.optim.SGD(model.parameters(), lr=0.1), data, init_batch=8)
    for step in range(5):
        training.report(loss=1.0 / (step + 1), curve=[1, 2])
    warned = [r.getMessage() for r in caplog.records if "metric dropped" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("metric dropped: curve: list"), warned


def test_progress_is_measured_at_its_current_configuration():
    """Throughput from the step time measured at its batch and GPUs now, goodput once its noise
    is known, the expected end from its epoch rate; a job not running has no speed."""
    from goodput_train.goodput import Observation

    stats = JobStats(
        "j",
        "cpu",
        (Observation(1, 1, 32, 0, 0.5), Observation(1, 2, 32, 1, 0.4)),
        grad_sqr=1.0,
        grad_var=2.0,
        epochs=5.0,
        steps=100,
        m=32,
        s=1,
        target_epochs=20.0,
    )
    progress = job_progress(stats, 32, (("local-0", (0, 1)),), rate=0.5)
    assert (progress.steps, progress.epochs, progress.target_epochs) == (100, 5.0, 20.0)
    assert progress.throughput == 2 * 32 * 2 / 0.4  # 128 examples a step
    phi = 32 * 2.0 / 1.0
    assert progress.goodput == pytest.approx(320 * (phi + 32) / (phi + 128), abs=1e-3)
    assert progress.remaining_s == 30.0  # 15 epochs left at 0.5 a second
    idle = job_progress(stats, 32, (), rate=0.5)
    assert (idle.throughput, idle.goodput, idle.remaining_s) == (None, None, None)
    assert job_progress(None, 32) is None
    # The submission's target wins over the one its code reports, as the scheduler plans with it;
    # past it, no end is expected.
    declared = job_progress(stats, 32, (("local-0", (0, 1)),), rate=0.5, declared=10.0)
    assert (declared.target_epochs, declared.remaining_s) == (10.0, 10.0)
    past = job_progress(stats, 32, (("local-0", (0, 1)),), rate=0.5, declared=4.0)
    assert (past.target_epochs, past.remaining_s) == (4.0, None)


def test_the_library_reads_its_checkpoint_from_the_environment_and_grows_its_batch_by_default(tmp_path, monkeypatch):
    from torch import nn
    from torch.utils.data import TensorDataset

    from goodput_train.trainer import MAX_BATCH_REPLICAS, AdaptiveTraining

    monkeypatch.setenv(CHECKPOINT_PATH_ENV, str(tmp_path / "job.pt"))
    model = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(64, 4), torch.randint(2, (64,)))
    training = AdaptiveTraining(model, torch.optim.SGD(model.parameters(), lr=0.1), data, init_batch=8)
    assert training.checkpoint_path == tmp_path / "job.pt"
    assert (training.limits.max_local, training.limits.max_batch) == (8, 8 * MAX_BATCH_REPLICAS)
    training.save()
    assert (tmp_path / "job.pt").exists()
    monkeypatch.delenv(CHECKPOINT_PATH_ENV)
    assert AdaptiveTraining(model, training.optimizer, data, init_batch=8).checkpoint_path is None


def test_status_shows_progress_speed_the_expected_end_and_metrics_readably():
    from cli.job_view import job_lines, job_row, progress_note

    job = {
        "state": "running",
        "batch": 64,
        "restarts": 1,
        "reason": "",
        "metrics": {"test_mse": 0.072134, "phase": "warm", "seen": 12345.0},
        "progress": {
            "steps": 1234,
            "epochs": 12.34,
            "target_epochs": 60.0,
            "throughput": 851.2,
            "goodput": 610.3,
            "remaining_s": 4000.0,
        },
    }
    assert progress_note(job) == "epoch 12.3 of 60 (21%), ends in ~67 min"
    assert job_lines(job) == [
        "progress: step 1,234, epoch 12.3 of 60 (21%)",
        "speed: 851.2 examples/s, goodput 610.3 (at its statistical efficiency), batch 64",
        "expected end: in ~67 min, at its rate since it last started",
        "metrics: test_mse 0.07213, phase warm, seen 12,345",
        "restarts: 1",
    ]
    crashed = {"state": "failed", "reason": "its workers crashed 3 times; the end of its stderr:\nboom\nValueError: x"}
    assert progress_note(crashed) == "" and job_lines(crashed) == ["boom", "ValueError: x"]
    # Its row in the list says the error itself.
    row = job_row({**crashed, "id": "c-1", "application": "train.py", "batch": None})
    assert row.endswith("failed     its workers crashed 3 times; the end of its stderr: ValueError: x"), row
    done = {"state": "finished", "reason": "", "jct_s": 18720.0, "gpu_seconds": 302400.0, "restarts": 1}
    assert job_lines(done) == ["finished 5 h 12 min after its submission, 84 GPU-hours", "restarts: 1"]
    taken = {**done, "restarts": 0, "refusals": ["job x already exists: another submission holds this id"]}
    assert job_lines(taken)[1:] == ["another body sent under its id was refused: job x already exists: another "
                                    "submission holds this id"]  # fmt: skip


def test_a_status_row_joins_where_a_job_is_and_its_progress_with_nothing_dangling():
    from cli.job_view import job_row

    finished = {"id": "mine-1", "application": "train.py", "state": "finished", "reason": "", "batch": None}
    finished["progress"] = {"steps": 12848, "epochs": 60.0, "target_epochs": 60.0}
    assert job_row(finished).split("finished", 1)[1].strip() == "epoch 60.0 of 60 (100%)"
    past = {**finished, "progress": {"steps": 20000, "epochs": 87.2, "target_epochs": 30.0}}
    assert job_row(past).split("finished", 1)[1].strip() == "epoch 87.2 of 30 (100%)"
    running = {**finished, "state": "running", "gpus": 2, "gpu_type": "CPU slot", "nodes": ["cpu-0"], "batch": 128}
    running["progress"] = {"steps": 10, "epochs": 28.3, "target_epochs": 60.0, "remaining_s": 13.0}
    assert job_row(running).endswith(
        "running    2 CPU slots on cpu-0, batch 128; epoch 28.3 of 60 (47%), ends in ~13 s"
    )
    failed = {**finished, "state": "failed", "reason": "its workers crashed 3 times; the end of its stderr:\nboom"}
    failed.pop("progress")
    assert job_row(failed).endswith("failed     its workers crashed 3 times; the end of its stderr: boom")
