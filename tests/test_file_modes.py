"""What goodput writes at run time is its owner's only: files 0600, folders 0700, even under a
umask that lets others read (LOOSE, the usual 022). `goodput up`'s data folder: the services' logs,
the NATS server's log and store, the secrets, and what an earlier version left there readable. A
node agent (a process, as on a node): its work folder with an earlier agent's log in it, its job's
log, and what the job writes: its checkpoint (and the folder the checkpoint makes) and the files of
its own code."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import nats.errors
import pytest

from launcher.nats import free_loopback_port
from services.node.box import BOX_ROOT
from shared import storage, subjects
from shared.schema.base import Ack
from shared.schema.nodes import NodeReport, Rendezvous, StartWorkers, StopWorkers, WorkersReport
from tests.test_multinode import until

pytestmark = pytest.mark.e2e  # every test here starts `goodput up` or a node agent as a process

ROOT = Path(__file__).resolve().parent.parent
LOOSE = 0o022
SERVICE_LOGS = ("profiler.log", "estimator.log", "policy.log", "placer.log", "executor.log")


@pytest.fixture
def loose_umask():
    previous = os.umask(LOOSE)
    try:
        yield
    finally:
        os.umask(previous)


def readable_by_others(*folders: Path) -> str:
    """The folders and what is under them that the group or others may read or write, or run (links
    aside), a line each with its mode; "" when none. A folder they may only enter, not list (0711),
    is on the way to a job's own folder, for the job's user. The boxes' root is open: its folders are
    where a box mounts what it shows (a file there is reported)."""
    return "\n".join(
        f"{oct(stat.S_IMODE(mode))} {path}"
        for folder in folders
        for path in (folder, *folder.rglob("*"))
        if not stat.S_ISLNK(mode := path.lstat().st_mode)
        and stat.S_IMODE(mode) & (0o066 if stat.S_ISDIR(mode) else 0o077)
        and not (BOX_ROOT in path.relative_to(folder).parts and stat.S_ISDIR(mode))
        and not (stat.S_ISDIR(mode) and "tmp" in path.relative_to(folder).parts[2:3])  # a job's own: mount points
    )


def command_env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("GOODPUT_NATS_")}, "PYTHONPATH": str(ROOT)}


def test_goodput_up_keeps_its_data_folder_private_and_closes_what_an_earlier_version_left_open(tmp_path, loose_umask):
    data = tmp_path / "out" / "stack"
    earlier = data / "work" / "node-cpu-0"  # as an earlier version left it: 0755 folders, 0644 files
    earlier.mkdir(parents=True)
    (earlier / "old-1.rank0.log").write_text("an earlier job's log\n")
    (data / "work" / "checkpoints").mkdir()
    (data / "nats-server.log").write_text("an earlier server's log\n")
    assert readable_by_others(data)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "up",
            "--once",
            "--workload",
            "none",
            "--port",
            str(free_loopback_port()),
            "--data",
            str(data),
        ],
        cwd=tmp_path,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0 and "goodput is up" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    made = ("nats-server.log", "jetstream", "secrets", "user.env", *SERVICE_LOGS)
    assert all((data / name).exists() for name in made), sorted(p.name for p in data.iterdir())
    assert not (loose := readable_by_others(data)), loose
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755  # the folder above is not goodput's


async def test_a_node_agents_work_folder_job_logs_and_checkpoints_are_private(
    nats_server, connect_bus, tmp_path, name_prefix, loose_umask
):
    bus = await connect_bus("executor")
    await storage.provision(bus)
    work, checkpoints = tmp_path / "work", tmp_path / "checkpoints"  # the job makes the checkpoints folder
    work.mkdir()
    (work / "old-1.rank0.log").write_text("an earlier agent's job log\n")
    node = f"{name_prefix}-a"
    with open(tmp_path / "agent.log", "ab") as log:
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.node",
                "--server",
                nats_server,
                "--node",
                node,
                "--gpus",
                "1",
                "--gpu-type",
                "cpu",
                "--workdir",
                str(work),
                "--jobs-package",
                "tests.jobs",
            ],
            cwd=ROOT,
            env=command_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        order = StartWorkers("w-1", "writes", 1, (0,), 1, 1, "cpu", str(checkpoints / "w-1" / "w-1.pt"), user=1)
        await until(lambda: _started(bus, node, order), "the agent started the job", timeout_s=60)
        report = await until(lambda: _ended(bus, node), "the job ended", timeout_s=120)
        assert report.codes == (0,) and report.outcome, report
        await bus.request(subjects.node_subject(node, "stop"), StopWorkers("w-1"), WorkersReport, timeout=30)
    finally:
        agent.terminate()
        agent.wait(timeout=60)
    assert {"old-1.rank0.log", "w-1.rank0.log"} <= {p.name for p in work.iterdir()}
    assert (checkpoints / "w-1" / "w-1.pt").is_file() and (checkpoints / "w-1" / "w-1.notes" / "notes.txt").is_file()
    assert not (loose := readable_by_others(work, checkpoints)), loose


async def _started(bus, node: str, order: StartWorkers) -> bool:
    """Start the job's workers once the agent answers (it registers a moment after it starts)."""
    try:
        await bus.request(subjects.node_subject(node, "start"), order, Rendezvous, timeout=30)
        return True
    except nats.errors.NoRespondersError:
        return False


async def _ended(bus, node: str):
    """The job's report on the node once its workers have all exited; None before."""
    jobs = (await bus.request(subjects.node_subject(node, "poll"), Ack(), NodeReport, timeout=30)).jobs
    return next((job for job in jobs if job.codes and None not in job.codes), None)
