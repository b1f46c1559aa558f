"""A job's code kept away from the stack and from other jobs: the user each job's workers run as,
their limits, the files the agent reads and writes in a job's folder; and a job that tries what a
job must not (tests/jobs/probes.py), run by a real node agent's workers as root, denied each time."""

from __future__ import annotations

import json
import os
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launcher.nats import AUTH_CONF, Access, server_config, write_accounts
from services.node.agent import NodeWorkers
from services.node.box import (
    JOB_UID_BASE,
    JOB_UID_SPAN,
    LIMITS_ENV,
    Limits,
    closed_to_others,
    job_uid,
    make_own,
    read_owned,
    render_limits,
    write_owned,
)
from shared import credentials
from shared.files import make_passable, make_private
from shared.schema import NodeInfo, StartWorkers, StopWorkers

ROOT = Path(__file__).resolve().parent.parent


def test_each_job_gets_a_user_of_its_own_from_its_submission_not_its_id():
    # the executor's number for it (its submission's), the same on every node; its id plays no part
    assert job_uid(7) == JOB_UID_BASE + 7 == job_uid(7, job_id="a") == job_uid(7, job_id="b")
    assert job_uid(JOB_UID_SPAN + 7) == JOB_UID_BASE + 7 and job_uid(7, base=5_000_000) == 5_000_007
    assert len({job_uid(n) for n in range(100)}) == 100
    # another job of the node has its number (JOB_UID_SPAN submissions before): the next one
    assert job_uid(7, taken={JOB_UID_BASE + 7}) == JOB_UID_BASE + 8
    # an older executor's order, without one: a hash of the id, in the range
    uid = job_uid(None, job_id="train-1")
    assert uid == job_uid(None, job_id="train-1") and JOB_UID_BASE <= uid < JOB_UID_BASE + JOB_UID_SPAN


def test_a_workers_limits():
    limits = Limits(processes=64, open_files=256, memory_mb=512, file_mb=8)
    assert limits.rlimits(own_user=True) == {
        "NPROC": 64,
        "NOFILE": 256,
        "CORE": 0,
        "DATA": 512 << 20,
        "FSIZE": 8 << 20,
    }
    # without a user of its own, a process limit would count the agent's and every service's
    assert "NPROC" not in limits.rlimits(own_user=False)
    assert Limits(memory_mb=None, file_mb=None).rlimits(own_user=False) == {"NOFILE": 4096, "CORE": 0}


def test_job_main_sets_the_limits_before_the_jobs_code_and_the_job_cannot_raise_them(tmp_path):
    """A worker's limits hold, soft and hard, when its module's first line runs."""
    (tmp_path / "reads_limits.py").write_text(
        "import json, resource\n"
        "names = ('NOFILE', 'CORE', 'DATA', 'FSIZE')\n"
        "print(json.dumps({n: resource.getrlimit(getattr(resource, 'RLIMIT_' + n)) for n in names}))\n"
        "try:\n"
        "    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))\n"
        "except ValueError:\n"
        "    print('raise refused')\n"
    )
    limits = Limits(open_files=128, memory_mb=1024, file_mb=16).rlimits(own_user=False)
    env = {**os.environ, LIMITS_ENV: render_limits(limits), "PYTHONPATH": os.pathsep.join((str(ROOT), str(tmp_path)))}
    run = subprocess.run(
        [sys.executable, "-m", "services.node.job_main", "reads_limits"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = run.stdout.splitlines()
    assert json.loads(lines[0]) == {name: [value, value] for name, value in limits.items()}
    assert lines[1] == "raise refused" or os.geteuid() == 0  # root may raise its hard limits; a job's user may not


def test_the_way_to_a_folder_is_open_or_the_first_closed_step_is_named(open_folder):
    way = open_folder / "a" / "b"
    way.mkdir(parents=True)
    os.chmod(open_folder / "a", 0o700)
    make_passable(way)
    assert closed_to_others(way) == open_folder / "a"
    make_passable(open_folder / "a")
    assert closed_to_others(way) is None or closed_to_others(way) in open_folder.parents  # above it: the machine's


def test_the_agent_follows_no_link_a_job_left_in_its_folder(tmp_path):
    """A job that leaves a link where the agent writes or reads its checkpoint gets neither a file of
    the agent's overwritten nor one read and copied out."""
    secret = tmp_path / "secret"
    secret.write_text("the agent's")
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / ".job.pt.fetched").symlink_to(secret)  # where the agent's copy is first written
    (folder / "link.pt").symlink_to(secret)
    write_owned(folder / "job.pt", b"checkpoint", None)
    assert secret.read_text() == "the agent's" and (folder / "job.pt").read_bytes() == b"checkpoint"
    with pytest.raises(OSError):
        read_owned(folder / "link.pt", None)
    if os.geteuid() == 0:  # a file of another user (a hard link the job made to it): not the job's
        with pytest.raises(PermissionError, match="not a file of the job's"):
            read_owned(folder / "job.pt", job_uid(1))
        write_owned(folder / "job.pt", b"resumed", job_uid(1))
        assert (folder / "job.pt").stat().st_uid == job_uid(1)


def test_the_agent_neither_waits_on_a_fifo_nor_reads_a_file_past_its_limit(tmp_path):
    """A FIFO where the job's checkpoint should be would block the read for ever: refused at once."""
    os.mkfifo(tmp_path / "job.pt")
    with pytest.raises(PermissionError, match="not a file of the job's"):
        read_owned(tmp_path / "job.pt", None)  # the old read blocked here, with no writer
    (tmp_path / "big.pt").write_bytes(b"x" * 11)
    with pytest.raises(PermissionError, match="11 bytes, over the 10"):
        read_owned(tmp_path / "big.pt", None, limit=10)
    assert read_owned(tmp_path / "big.pt", None, limit=11) == b"x" * 11


@pytest.mark.skipif(os.geteuid() != 0, reason="only root gives files to another user")
def test_giving_a_job_its_folder_follows_no_link_and_takes_no_file_of_ours(tmp_path):
    """What a job left in its folder (a link where its tmp/ goes, links in it, a hard link to a file
    of ours) does not make the agent give a file of its own to the job's user."""
    ours = tmp_path / "etc"
    ours.mkdir()
    (ours / "shadow").write_text("root's")
    folder = tmp_path / "job"
    (folder / "sub").mkdir(parents=True)
    (folder / "tmp").symlink_to(ours)  # where the agent makes the job's TMPDIR
    (folder / "sub" / "link").symlink_to(ours / "shadow")
    os.link(ours / "shadow", folder / "sub" / "hard")  # as fs.protected_hardlinks=0 would let the job
    (folder / "mine").write_text("the job's")
    uid = job_uid(3)
    make_own(folder, uid)
    make_own(folder / "tmp", uid)
    assert (ours / "shadow").stat().st_uid == 0 and ours.stat().st_uid == 0
    assert (folder / "tmp").is_dir() and not (folder / "tmp").is_symlink() and (folder / "tmp").stat().st_uid == uid
    assert (folder / "sub" / "link").lstat().st_uid == uid and (folder / "mine").stat().st_uid == uid
    assert (folder / "sub").stat().st_uid == uid and folder.stat().st_uid == uid


def test_making_a_folder_private_follows_no_link_and_leaves_what_it_is_told_to(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    (outside / "file").write_text("another's")
    os.chmod(outside / "file", 0o644)
    folder = tmp_path / "work"
    (folder / "jobs" / "a").mkdir(parents=True)
    (folder / "jobs" / "a" / "notes").write_text("a job's")
    os.chmod(folder / "jobs" / "a" / "notes", 0o644)
    (folder / "log").write_text("ours")
    os.chmod(folder / "log", 0o644)
    (folder / "linked").symlink_to(outside)
    (folder / "file-link").symlink_to(outside / "file")
    os.link(outside / "file", folder / "hard")
    os.mkfifo(folder / "fifo")  # opened without waiting for a writer
    make_private(folder, skip=("jobs",))
    assert stat.S_IMODE((folder / "log").stat().st_mode) == 0o600
    assert stat.S_IMODE((outside / "file").stat().st_mode) == 0o644 and stat.S_IMODE(outside.stat().st_mode) == 0o755
    assert stat.S_IMODE((folder / "jobs" / "a" / "notes").stat().st_mode) == 0o644


# ---- a job that tries, as root's workers run it ------------------------------------------------


def reachable_python() -> str | None:
    """An interpreter a job's user can run (this one, or the system's 3.11+ when this one lies in a
    folder closed to others, as a pyenv under /root does)."""
    for python in (sys.executable, shutil.which("python3.11"), "/usr/bin/python3"):
        if python and Path(python).exists() and closed_to_others(Path(python)) is None:
            return python
    return None


def wait_until_ended(node: NodeWorkers, job_id: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not (codes := next((r.codes for r in node.poll().jobs if r.job_id == job_id), ())) or None in codes:
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.1)


@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0, reason="workers change user only when their agent is root; this test is not")
def test_a_job_cannot_read_the_stacks_secrets_or_another_jobs_files_nor_pass_its_limits(monkeypatch, open_folder):
    python = reachable_python()
    if python is None:
        pytest.skip("no interpreter that another user may run (all lie in folders closed to others)")
    if closed_to_others(ROOT):
        pytest.skip(f"the project ({ROOT}) lies in a folder closed to other users")
    monkeypatch.setenv("GOODPUT_NATS_PASSWORD", "the-agents-password")  # in /proc/<agent>/environ
    # DATA as `goodput up` lays it out (as root): secrets, user.env, nats.conf, the nodes' work
    data = open_folder / "data"
    make_private(data)
    make_passable(data, data / "work")
    access = Access.kept_in(data / "secrets")
    user_env = credentials.write_user_env(data, "nats://127.0.0.1:4222", access.password_file("user"))
    write_accounts(data, access)  # every role's password
    (data / "nats.conf").touch(mode=0o600)  # as the launcher writes it
    (data / "nats.conf").write_text(server_config(access))
    checkpoints = data / "work" / "checkpoints"
    node = NodeWorkers(
        NodeInfo("iso-0", "cpu", 2, "127.0.0.1"),
        data / "work" / "node-iso-0",
        "tests.jobs",
        uid_base=JOB_UID_BASE,
        limits=Limits(processes=32, memory_mb=512, file_mb=8),
        python=python,
    )
    make_private(node.workdir)  # as the agent makes it when it starts
    # another job: its folder on the node, its checkpoint in the shared folder
    other = node.sandbox("other-1")
    (other.folder / "notes").write_text("the other job's")
    node._checkpoint_folder("other-1", checkpoints / "other-1", other.uid)
    (checkpoints / "other-1" / "other-1.pt").write_bytes(b"the other job's checkpoint")
    readable = [
        access.password_file("policy"),
        access.password_file("operator"),
        data / "secrets",
        user_env,
        data / "nats.conf",
        data / AUTH_CONF,
        data,
        data / "work",
        other.folder,
        other.folder / "notes",
        checkpoints / "other-1",
        checkpoints / "other-1" / "other-1.pt",
    ]
    env = {
        "PROBE_READ": os.pathsep.join(map(str, readable)),
        "PROBE_PLANT": str(node.workdir),
        "PROBE_PROCESSES": "64",
        "PROBE_MEMORY_MB": "1024",
        "PROBE_FILE_MB": "16",
    }
    checkpoint = checkpoints / "probe-1" / "probe-1.pt"
    node.start(StartWorkers("probe-1", "probes", 1, (0,), 1, 1, "cpu", str(checkpoint), env))
    try:
        wait_until_ended(node, "probe-1")
    finally:
        report = node.stop(StopWorkers("probe-1"))
    log = node.log_path("probe-1", 0).read_text()
    assert report.codes == (0,), log
    got = json.loads(next(line for line in log.splitlines() if line.startswith("{")))
    print(json.dumps(got, indent=1))  # shown by pytest -s, or with a failure
    allowed = {probe: result for probe, result in got.items() if not probe.startswith("own:")}
    assert all(result.startswith("denied") for result in allowed.values()), json.dumps(allowed, indent=1)
    assert all(result.startswith("ALLOWED") for probe, result in got.items() if probe.startswith("own:")), got
    uid = job_uid(None, job_id="probe-1")  # an order without the executor's number: the id's hash
    assert got["own: its user"] == f"ALLOWED: uid {uid} gid {uid} groups []"
    assert "after" in got["start processes"] and "Errno 11" in got["start processes"]
    assert got["own: its limits"] == "ALLOWED: core (0, 0)"
    assert not (node.workdir / "planted").exists()
    assert checkpoint.read_bytes() and checkpoint.parent.stat().st_uid == uid
    assert (checkpoint.parent.stat().st_mode & 0o777) == 0o700
    assert node.job_folder("probe-1").stat().st_uid == uid


def test_the_workers_memory_by_default_is_the_machines_shared_by_its_slots():
    machine_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 20)
    node = NodeWorkers(NodeInfo("n", "cpu", 4, "127.0.0.1"), Path(tempfile.gettempdir()), "tests.jobs")
    assert node.limits.memory_mb == pytest.approx(machine_mb / 4)
    assert resource.RLIM_INFINITY  # (the limits are set in the worker, never in the agent)
