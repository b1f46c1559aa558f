"""Real jobs end to end on this machine: NATS, the six services and node agents, CPU slots
standing in for GPUs.

`goodput up --executors real --nodes 2 --once` submits the three example jobs together to two
node agents; the real profiler measures each on one slot through an agent, the scheduler allocates
and re-allocates slots as jobs arrive and finish on both nodes, every job re-tunes its batch as it
trains and reaches its target. A rigid job of two slots spans both nodes. Then the bad inputs: a
script that breaks, a job too big for a slot, a job naming no code there is, a submission with an
unknown field — each ends failed with its reason, the others unaffected. And the executor killed -9 mid-training: its successor takes the jobs back from KV,
the workers it left on the node checkpoint and stop (their checkpoints in JetStream's object store,
as on a cluster without a shared folder), and every job still reaches its target.
"""

import asyncio
import contextlib
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from launcher.nats import embedded_nats, free_loopback_port
from launcher.stack import (
    create_run,
    local_node_arguments,
    local_service_arguments,
    records_once_ended,
    running_services,
)
from shared import credentials, storage, subjects
from shared.schema.api import CancelAnswer, JobRequest
from shared.schema.base import Ack
from shared.schema.jobs import JobSpec
from shared.schema.nodes import NodeInfo
from shared.schema.records import JobRecords
from shared.schema.runs import RunRequest
from tests.jobs.profile_stalls import STALLING
from tests.jobs.profile_stalls import marker as stalling_marker
from tests.test_multinode import until

pytestmark = pytest.mark.e2e  # every test here starts NATS, the services and node agents as processes

TARGETS = {"mlp-blobs": 0.95, "cnn-shapes": 0.95, "tiny-lm": 0.75}  # each job's own metric at its end


def test_three_example_jobs_share_the_slots_adapt_and_reach_their_targets(tmp_path):
    out = tmp_path / "up.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "up",
            "--executors",
            "real",
            "--nodes",
            "2",
            "--slots",
            "1",
            "--once",
            "--round",
            "3",
            "--port",
            str(free_loopback_port()),
            "--data",
            str(tmp_path),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    jobs = {job["name"]: job for job in json.loads(out.read_text())["jobs"]}
    assert set(jobs) == set(TARGETS)
    for name, job in jobs.items():
        assert job["failure"] is None and job["finish_s"] is not None, job
        assert job["metric"] >= TARGETS[name], job
    # Each re-tuned its batch as it trained. Whether a job moved or spread depends on how long each
    # took on this machine: test_multinode moves and spreads one at will, and below a rigid 2-slot
    # job must span both nodes.
    assert all(len(job["batches"]) > 1 for job in jobs.values()), jobs
    assert "finished" in run.stdout and " x CPU slot" in run.stdout  # the changes were shown as they came, by type
    assert {node for job in jobs.values() for placed in job["placements"] for node, _ in placed["nodes"]} == {
        "cpu-0",
        "cpu-1",
    }


@contextlib.asynccontextmanager
async def _live_stack(folder, cluster="local", **options):
    """NATS, the six services and the node agents of the cluster's nodes (by default the local
    one's slots; real jobs), a live run of sia every 2 s; a bus to submit on."""
    agents = local_node_arguments(cluster, folder / "work", options.get("jobs_package"))
    with embedded_nats(folder) as nats:
        with running_services(
            nats, local_service_arguments(cluster, folder / "work", 1.0, **options), folder, agents=agents
        ) as stack:
            bus = await nats.connect("test")
            try:
                await stack.wait_ready(bus)
                await create_run(bus, RunRequest("live", "sia", {"round_s": 2.0}, "none", (), 2.0, live=True))
                yield bus, stack, nats
            finally:
                await bus.close()


async def _submit(bus, jobs: dict[str, str]) -> None:
    for job_id, application in jobs.items():
        await bus.js_publish(
            subjects.stored(subjects.DEFAULT_TEAM, subjects.OPERATOR), JobSpec(job_id, application), msg_id=job_id
        )


async def _bad_inputs(folder):
    async with _live_stack(folder, slot_memory_mb=64, jobs_package="tests.jobs") as (bus, stack, _):
        await _submit(bus, {"breaks": "raises", "too-big": "huge", "no-code": "nosuchjob", "good": "quick"})
        unknown_field = {"id": "typo", "application": "quick", "requested_gpu": 2}
        await bus.nc.publish(
            subjects.stored(subjects.DEFAULT_TEAM, subjects.OPERATOR), msgspec.msgpack.encode(unknown_field)
        )
        await records_once_ended(bus, ["breaks", "too-big", "no-code", "good", "typo"], timeout_s=300)
        records = {r.name: r for r in (await bus.request(subjects.RECORDS, Ack(), JobRecords)).jobs}
        alive = [name for name, process in stack.processes.items() if process.poll() is None]
        return records, alive


def test_bad_inputs_end_as_failed_jobs_with_their_reason_and_nothing_else_is_affected(tmp_path):
    records, alive = asyncio.run(_bad_inputs(tmp_path))
    assert set(records) == {"breaks", "too-big", "no-code", "good", "typo"}, records
    breaks, too_big, good, typo = (records[name] for name in ("breaks", "too-big", "good", "typo"))
    assert breaks.finish_s is None and "crashed 3 times" in breaks.failure, breaks  # restarted twice
    assert "RuntimeError: the data loader broke at step 3" in breaks.failure
    assert "does not fit in the 64 MB memory of one cpu GPU at any batch size" in too_big.failure, too_big
    assert math.isnan(too_big.submit_s) and too_big.gpu_seconds == 0  # it never ran
    assert "unknown field `requested_gpu`" in typo.failure, typo
    assert "no job 'nosuchjob' in tests.jobs" in records["no-code"].failure, records["no-code"]
    assert good.failure is None and good.finish_s is not None and good.metric >= 0.9, good
    assert len(alive) == 7, f"a service died: only {alive} still run"  # six services and one node agent


async def _user_refusals(folder):
    """A user's nats-py client on the live local stack: an unknown application, then bodies refused
    on the durable subject; the answers, and the refusals as goodput.api.jobs lists them."""
    import nats

    async with _live_stack(folder, jobs_package="tests.jobs") as (bus, _, server):
        reader = await server.connect("test-members", role="api")  # the membership, as the API reads it
        members = await storage.open_kv(reader, subjects.NODES_BUCKET, NodeInfo)
        await until(lambda: _all_say(members), "every node agent to say which jobs it runs")
        await reader.close()
        nc = await nats.connect(server.url, **server.options("user"))
        try:
            asked = time.monotonic()
            reply = await nc.request(
                subjects.API_SUBMIT, json.dumps({"id": "x", "application": "nosuchjob"}).encode(), timeout=30
            )
            answered_s = time.monotonic() - asked
            unknown = (json.loads(reply.data), dict(reply.headers or {}), answered_s)
            await nc.publish(subjects.submit("user"), b"hello there")  # fire-and-forget: no JSON object
            await nc.flush()
        finally:
            await nc.close()
        status = await until(lambda: _listed(bus, "x"), "the refusal to be listed")
        unnamed = await until(lambda: _unnamed(bus), "the unreadable body to be listed")
        return unknown, status, unnamed


async def _unnamed(bus):
    """The refusals goodput.api.jobs lists with `"id": null`."""
    reply = await bus.nc.request(subjects.API_JOBS, b'{"state": "rejected"}', timeout=30)
    return [job for job in json.loads(reply.data)["jobs"] if job["id"] is None]


async def _listed(bus, job_id):
    """goodput.api.job's answer on `job_id`, as a user's client reads it; None while no job has the id."""
    reply = await bus.nc.request(subjects.API_JOB, json.dumps({"id": job_id}).encode(), timeout=30)
    return None if (reply.headers or {}).get("Nats-Service-Error-Code") == "404" else json.loads(reply.data)


async def _all_say(members):
    nodes = (await members.values()).values()
    return bool(nodes) and all(node.applications for node in nodes)


def test_a_user_is_refused_an_unknown_application_at_once_and_every_refusal_is_listed(tmp_path):
    """`{"id": "x", "application": "nosuchjob"}` on goodput.api.submit: error 400 with the known
    jobs, not `accepted: true, state: profiling` and a refusal by its profiling run later; listed
    with its application. A body that is no JSON object on goodput.jobs.submit.user: listed too."""
    (answer, headers, answered_s), status, unnamed = asyncio.run(_user_refusals(tmp_path))
    assert answer["accepted"] is False and answer["state"] == "rejected", answer
    assert answer["reason"].startswith("unknown application 'nosuchjob'"), answer
    assert "(known: " in answer["reason"] and "quick" in answer["reason"], answer  # tests.jobs's
    assert headers.get("Nats-Service-Error-Code") == "400", headers
    assert answered_s < 10, answered_s
    assert status["state"] == "rejected" and status["reason"] == answer["reason"], status
    assert status["application"] == "nosuchjob", status  # what could be read, not "unreadable"
    # A body that is no JSON object, on the durable subject: listed, `"id": null`, saying why.
    [listed] = unnamed
    assert listed["reason"].startswith("malformed submission: a message is a JSON object"), listed


async def _executor_killed(folder):
    async with _live_stack(folder, checkpoints="jetstream:") as (bus, stack, _):  # no folder shared
        await _submit(bus, {"tiny-lm": "tiny_lm", "cnn-shapes": "cnn_shapes"})
        for _ in range(240):  # both training
            records = (await bus.request(subjects.RECORDS, Ack(), JobRecords)).jobs
            if len(records) == 2 and all(r.placement for r in records):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(3)
        # Those still training when it dies (a fast one may have finished meanwhile, on a fast machine).
        training = {r.name for r in (await bus.request(subjects.RECORDS, Ack(), JobRecords)).jobs if r.finish_s is None}
        stack.kill("executor")  # kill -9: its workers are left behind on the node
        await asyncio.sleep(1)
        stack.start("executor")
        records = await records_once_ended(bus, ["tiny-lm", "cnn-shapes"], timeout_s=300)
        return records, training, stack.log("executor")


def test_the_executor_killed_mid_training_its_successor_finishes_the_jobs(tmp_path):
    records, training, log = asyncio.run(_executor_killed(tmp_path))
    assert log.count("ready on") == 2  # it really started again
    for name, record in records.items():
        assert record.failure is None and record.metric >= TARGETS[name], record
    # One still training when it died started again from its checkpoint (a job that reached its target
    # in the moment between may end as it was: its node agent lives on).
    assert any(records[name].restarts >= 1 for name in training), (training, records)
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "work")], capture_output=True, text=True).stdout
    assert leftover == "", f"workers left running: {leftover}"


async def _cancelled_mid_training(folder):
    async with _live_stack(folder) as (bus, stack, nats):
        await _submit(bus, {"tiny-lm": "tiny_lm", "mlp-blobs": "mlp_blobs"})
        for _ in range(240):  # tiny-lm training: its workers have reported steps
            records = {r.name: r for r in (await bus.request(subjects.RECORDS, Ack(), JobRecords)).jobs}
            if "tiny-lm" in records and records["tiny-lm"].batch is not None:
                break
            await asyncio.sleep(0.5)
        answer = await bus.request(subjects.API_CANCEL, JobRequest("tiny-lm"), CancelAnswer, timeout=60)
        workers = subprocess.run(
            ["pgrep", "-f", f"{folder / 'work'}.*tiny-lm.pt"], capture_output=True, text=True
        ).stdout
        ended = await records_once_ended(bus, ["mlp-blobs"], timeout_s=300)
        records = {r.name: r for r in (await bus.request(subjects.RECORDS, Ack(), JobRecords)).jobs}
        # The operator drains the node, then uses it again; a user may not.
        operator = {**{k: v for k, v in os.environ.items() if not k.startswith("GOODPUT_NATS")}, **nats.env("operator")}
        user = {**operator, **nats.env("user")}
        drains = [
            await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "cli.main", "drain", *args, "--server", nats.url],
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
            )
            for args, env in ((["cpu-0"], operator), (["cpu-0", "--undo"], operator), (["cpu-0"], user))
        ]
        return answer, workers, records, ended, drains


def test_a_real_job_cancelled_mid_training_checkpoints_stops_and_the_others_go_on(tmp_path):
    answer, workers, records, ended, (drained, undone, refused) = asyncio.run(_cancelled_mid_training(tmp_path))
    assert answer.cancelled and answer.state == "cancelled", answer
    assert workers == "", f"its workers still run after the cancel was answered: {workers}"
    cancelled = records["tiny-lm"]
    assert cancelled.state == "cancelled" and cancelled.placement == () and cancelled.finish_s is None, cancelled
    assert list((tmp_path / "work").rglob("tiny-lm.pt")), "it stopped without a checkpoint"
    assert ended["mlp-blobs"].failure is None and ended["mlp-blobs"].metric >= TARGETS["mlp-blobs"], ended
    assert drained.returncode == 0 and "node cpu-0: drained, nothing new is placed there" in drained.stdout, drained
    assert undone.returncode == 0 and "node cpu-0: used again" in undone.stdout, undone
    assert refused.returncode != 0 and "operator" in refused.stderr, refused


async def _node_lost_while_profiling(folder):
    two = folder / "two-nodes.yaml"
    two.write_text("name: two\nnodes:\n  - {gpu_type: cpu, count: 2, gpus_per_node: 1}\n")
    stalls = f"stalls-{uuid.uuid4().hex[:8]}"  # its first profiling run stalls (tests/jobs)
    async with _live_stack(folder, str(two), jobs_package="tests.jobs") as (bus, stack, _):

        async def record(name):
            return {r.name: r for r in (await bus.request(subjects.RECORDS, Ack(), JobRecords)).jobs}.get(name)

        def stalled_on():
            return next(
                (
                    log.parent.name.removeprefix("node-")
                    for log in (folder / "work").glob(f"*/{stalls}.profile-*")
                    if STALLING in log.read_text()
                ),
                None,
            )

        stalling_marker(stalls).touch()
        await _submit(bus, {stalls: "profile_stalls"})
        node = await until(stalled_on, "its first profiling run to stall")
        stalling_marker(stalls).unlink()  # its next run does not stall
        waiting = await until(lambda: _reason_if(record(stalls), "profiling on node"), "its status to say where")
        # Another job is profiled on the other node meanwhile, not behind it. A third, submitted
        # while both nodes are busy, is cancelled as it waits: its run never starts.
        await _submit(bus, {"quick-1": "quick"})
        await until(lambda: _reason_if(record("quick-1"), "profiling on node"), "the other job's run to start")
        await _submit(bus, {"doomed": "quick"})
        await until(lambda: _state_if(record("doomed"), ("profiling",)), "the third job to be known")
        cancel = await bus.request(subjects.API_CANCEL, JobRequest("doomed"), CancelAnswer, timeout=60)
        await until(
            lambda: _state_if(record("quick-1"), ("queued", "running", "finished")),
            "the other job's verdict while the first one's run stalls",
            timeout_s=150,
        )
        await until(
            lambda: (
                "job doomed was cancelled before its profiling run"
                in (stack.logs / "profiler.log").read_text(errors="replace")
            ),
            "the cancelled job's turn on a node",
        )
        assert (await record(stalls)).state == "profiling"
        killed = time.monotonic()
        stack.kill(f"node-{node}")  # kill -9 of the agent running it
        await until(
            lambda: _state_if(record(stalls), ("queued", "running", "finished")),
            "its profile, measured again on the other node",
            timeout_s=150,
        )
        taken_s = time.monotonic() - killed
        again = sorted(log.parent.name for log in (folder / "work").glob(f"*/{stalls}.profile-*"))
        ended = await records_once_ended(bus, [stalls, "quick-1", "doomed"], timeout_s=300)
        doomed_runs = list((folder / "work").glob("*/doomed.profile-*"))
    with contextlib.suppress(FileNotFoundError):
        stalling_marker(stalls).unlink()
    return node, waiting, taken_s, again, ended, (cancel, doomed_runs)


async def _reason_if(record, begins: str):
    """The record's reason, once it begins so; a job being profiled has no failure."""
    record = await record
    if record is None or not (record.reason or "").startswith(begins):
        return None
    assert record.failure is None, record
    return record.reason


async def _state_if(record, states):
    record = await record
    return record is not None and record.state in states


def test_a_node_lost_under_a_profiling_run_is_noticed_and_the_run_moves_without_holding_up_others(tmp_path):
    """kill -9 of the node agent a profiling run is on: the profiler notices within the membership's
    time to live (not the run's 300 s timeout) and runs it on the other node; a job submitted while
    the run stalled was profiled meanwhile; the status said where the run was. A job cancelled while
    it waited for a node is never run there."""
    node, waiting, taken_s, again, ended, (cancel, doomed_runs) = asyncio.run(_node_lost_while_profiling(tmp_path))
    assert waiting == f"profiling on node {node}"
    assert taken_s < 3 * subjects.NODE_TTL_S, f"the lost node was noticed after {taken_s:.0f} s"
    assert again == sorted(f"node-cpu-{i}" for i in range(2)), again  # the second run on the other node
    doomed = ended.pop("doomed")
    assert cancel.cancelled and doomed.state == "cancelled" and doomed_runs == [], (cancel, doomed, doomed_runs)
    for name, record in ended.items():
        assert record.failure is None and record.finish_s is not None, record


class Up:
    """`goodput up --executors real` as a user runs it, its printed lines read as they come."""

    def __init__(self, folder, *options):
        self.folder, self.lines = folder, queue.Queue()
        self.port = free_loopback_port()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli.main",
                "up",
                "--executors",
                "real",
                "--round",
                "2",
                "--port",
                str(self.port),
                "--data",
                str(folder),
                *options,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.seen: list[str] = []
        # The one reader of its output, to its end (`stop` waits for it, then takes what is left).
        self.reader = threading.Thread(
            target=lambda: [self.lines.put(line) for line in self.process.stdout], daemon=True
        )
        self.reader.start()

    def line(self, pattern: str, timeout_s: float = 180.0) -> re.Match:
        """The next printed line that matches `pattern` (re.search)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no line matching {pattern!r} in {timeout_s:.0f} s; printed: {self.seen}"
                ) from None
            self.seen.append(line)
            found = re.search(pattern, line)
            if found:
                return found

    def command(self, *arguments, role: str = "user") -> subprocess.CompletedProcess:
        """A goodput command on this stack, logged in from the data folder's user.env (the user's; or
        the operator's, beside it)."""
        return subprocess.run(
            [sys.executable, "-m", "cli.main", *arguments],
            capture_output=True,
            text=True,
            timeout=120,
            env=credentials.user_environment({}, data=self.folder, role=role) | dict(os.environ),
        )

    def stop(self) -> str:
        """Stop it (Ctrl-C): everything it printed."""
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=120)
        self.reader.join(timeout=30)
        rest = []
        while not self.lines.empty():
            rest.append(self.lines.get_nowait())
        return "".join(self.seen + rest)


@contextlib.contextmanager
def two_node_stack(prefix: str):
    """`goodput up --executors real --nodes 2 --slots 2 --workload none`, serving: (its folder, the
    stack), stopped after. Not pytest's own temporary folder (0700): a job's user must pass through
    to its folder."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    base.chmod(0o711)
    up = Up(base / "data", "--nodes", "2", "--slots", "2", "--workload", "none")
    up.server = f"nats://127.0.0.1:{up.port}"
    try:
        up.line(r"serving:")
        yield base, up
    finally:
        up.stop()


def test_a_dead_node_agent_is_restarted_a_rigid_job_spans_both_nodes_they_are_listed_and_a_restart_reprints_nothing(
    tmp_path,
):
    job = tmp_path / "quick.yaml"
    job.write_text("id: quick-1\napplication: quick\nrigid: true\nrequested_gpus: 2\n")  # one slot per node
    options = ("--nodes", "2", "--slots", "1", "--jobs", str(job), "--jobs-package", "tests.jobs")
    up = Up(tmp_path, *options)
    try:
        pid = int(up.line(r"node-cpu-1 +pid (\d+)").group(1))
        up.line(r"submitted quick-1 \(quick\)")
        os.kill(pid, signal.SIGKILL)
        restarted = up.line(rf"node-cpu-1 \(pid {pid}\) exited: killed by SIGKILL; .*restarted \(pid (\d+)\)")
        assert restarted
        up.line(r"quick-1 2 x CPU slot on 2 nodes", timeout_s=300)  # once both agents are back
        up.line(r"finished: quick-1", timeout_s=300)
        listed = up.command("nodes", "--json", "--server", f"nats://127.0.0.1:{up.port}", role="operator")
        assert listed.returncode == 0, listed.stderr
        nodes = {n["name"]: n for n in json.loads(listed.stdout)["nodes"]}
        assert {name: (n["gpu_type"], n["gpus"], n["state"]) for name, n in nodes.items()} == {
            "cpu-0": ("cpu", 1, "alive"),
            "cpu-1": ("cpu", 1, "alive"),
        }, nodes
        table = up.command("nodes", "--server", f"nats://127.0.0.1:{up.port}", role="operator")
        assert table.returncode == 0 and "2 nodes: 2 alive" in table.stdout, table
    finally:
        first = up.stop()
    assert first.count("submitted quick-1") == 1, first
    again = Up(tmp_path, *options)  # the same --data: the job is known, and finished
    try:
        again.line(r"quick-1 \(quick\): submitted before, finished")
    finally:
        second = again.stop()
    assert "submitted quick-1" not in second, second
    logs = "".join(log.read_text(errors="replace") for log in (tmp_path / "work").rglob("*.log"))
    assert "BrokenPipeError" not in logs, logs[-3000:]
