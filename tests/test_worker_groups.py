"""No process of a job outlives its stop, and none holds up its node agent: a worker leads a process
group of its own, stopped whole; with a user of its own, every process of that user is ended; what
the workers print is read in bounded lines (tests/jobs/leaves.py leaves children behind)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.node.agent import NodeWorkers, _lines, box_problem
from services.node.box import JOB_UID_BASE
from services.node.processes import alive
from shared.schema.nodes import NodeInfo, ProfileRequest, StartWorkers, StopWorkers
from tests.test_box import boxed_node

ROOT = Path(__file__).resolve().parent.parent


def children(node: NodeWorkers, job_id: str, timeout_s: float = 60) -> list[int]:
    """The process ids the job wrote once it had started its children."""
    path = node.job_folder(job_id) / "children"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"job {job_id} did not start its children"
        time.sleep(0.05)
    return [int(pid) for pid in path.read_text().split()]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def order(job_id: str, folder: Path, user: int | None = None, **env: str) -> StartWorkers:
    checkpoint = folder / "checkpoints" / job_id / f"{job_id}.pt"
    return StartWorkers(job_id, "leaves", 1, (0,), 1, 1, "cpu", str(checkpoint), env, user=user)


def test_a_line_of_any_length_is_read_in_bounded_parts():
    stream = io.StringIO("a" * 100 + "\nshort\n" + "b" * 25 + "\n" + "c" * 7)
    assert list(_lines(stream, limit=10)) == ["a" * 10, "short\n", "b" * 10, "c" * 7]


def test_a_worker_that_exits_as_it_is_asked_about_is_not_reaped_before_its_group_is_killed(monkeypatch):
    # Reaped there, it would leave its group's id unusable: the children in its group would live on.
    from services.node import processes

    worker = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    while alive(worker.pid):  # exited (a zombie), not reaped
        time.sleep(0.01)
    monkeypatch.setattr(processes.os, "waitid", lambda *args: None)  # asked just before it exited
    assert processes.ended(worker) is None and worker.returncode is None
    monkeypatch.undo()
    assert processes.ended(worker) == 0  # asked again: its group killed, then reaped


@pytest.mark.e2e
def test_a_stop_ends_the_workers_group_and_holds_up_neither_the_stop_nor_the_polls(open_folder):
    """Without a user of its own: the child in the worker's group is killed with it; the one that
    left the group keeps the worker's stdout open, yet a poll waits for its reader once only and a
    stop does not wait for it."""
    node = NodeWorkers(NodeInfo("grp-0", "cpu", 1, "127.0.0.1"), open_folder / "node", "tests.jobs")
    node.start(order("exits-1", open_folder, LEAVES_EXIT="1"))
    pids = children(node, "exits-1")
    try:
        deadline = time.monotonic() + 60
        while node.poll().jobs[0].codes != (0,):
            assert time.monotonic() < deadline, "the worker did not exit"
        while alive(pids[0]):  # its group's, killed once it had exited (SIGKILL takes a moment)
            assert time.monotonic() < deadline, "the child in the worker's group outlived it"
            time.sleep(0.05)
        began = time.monotonic()
        node.poll()  # the reader held up by the child that left: waited for before, not again
        assert time.monotonic() - began < 1.0
        node.stop(StopWorkers("exits-1", grace_s=5))
        node.start(order("sleeps-1", open_folder))
        more = children(node, "sleeps-1")
        pids += more
        began = time.monotonic()
        report = node.stop(StopWorkers("sleeps-1", grace_s=5))
        assert time.monotonic() - began < 15, "the stop waited for a reader held up by a child"
        assert report.codes == (-signal.SIGTERM,)
        deadline = time.monotonic() + 30
        while alive(more[0]):  # the child in its group, signalled with it
            assert time.monotonic() < deadline, "the child in the worker's group outlived its stop"
            time.sleep(0.05)
    finally:
        kill_all(pids)


def job_users_node(folder: Path) -> NodeWorkers:
    """A node whose jobs run in boxes of their own (runc, as root), or skipped where there are none."""
    if box_problem("runc", sys.executable, "tests.jobs")[0]:
        pytest.skip(box_problem("runc", sys.executable, "tests.jobs")[0])
    return boxed_node("grp-1", folder / "node", slots=1)


def processes_of(uid: int) -> list[int]:
    """The host's running processes whose real user is `uid` (a box's pids are its own namespace's)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            status = (entry / "status").read_text() if entry.name.isdigit() else ""
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if fields and fields["Uid"].split()[0] == str(uid) and not fields["State"].strip().startswith("Z"):
                found.append(int(entry.name))
    return found


@pytest.mark.e2e
def test_in_a_box_no_process_of_the_job_outlives_its_stop(open_folder):
    node = job_users_node(open_folder)
    node.start(order("users-1", open_folder, user=41))
    children(node, "users-1")
    uid = node.jobs["users-1"].uid
    assert uid == JOB_UID_BASE + 41 and node.job_folder("users-1").stat().st_uid == uid  # the executor's number
    assert len(processes_of(uid)) >= 3  # the worker, its child in its group, the one that left (and the box's first)
    report = node.stop(StopWorkers("users-1", grace_s=5))
    assert report.codes == (128 + signal.SIGTERM,)  # the box's runtime says a signal's end so
    assert processes_of(uid) == [], "a process of the job outlived its stop"


@pytest.mark.e2e
def test_a_profiling_run_ends_though_a_child_keeps_its_stdout(open_folder):
    """The run exits, its child that left its group sleeps on with the run's stdout: the answer comes
    all the same (the old one waited for the child)."""
    users = not box_problem("runc", sys.executable, "tests.jobs")[0]
    node = (
        job_users_node(open_folder)
        if users
        else NodeWorkers(NodeInfo("grp-2", "cpu", 1, "127.0.0.1"), open_folder / "node", "tests.jobs")
    )
    answers = []
    run = threading.Thread(target=lambda: answers.append(node.profile(ProfileRequest("prof-1", "leaves", user=42))))
    run.start()
    pids = children(node, "prof-1")
    try:
        run.join(60)
        assert answers, "the profiling run's answer waited for a child of the run"
        assert "printed no profile" in answers[0].failure
        if users:  # every process of its box ended
            assert processes_of(JOB_UID_BASE + 42) == []
    finally:
        if not users:  # its own processes (a box's numbers are its namespace's)
            kill_all(pids)
        run.join()
