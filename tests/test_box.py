"""Each job in a box of its own (services/node/box.py): the host's claims on jobs' users, the
folders a box shows, the files the agent reads and writes in a job's folder; and jobs that try what a
job must not (tests/jobs/probes.py, tests/jobs/greedy.py), run in real boxes (runc) by a node agent's
workers as root: denied, contained, or ended with the reason."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.nats import AUTH_CONF, Access, server_config, write_accounts
from services.node.agent import NodeWorkers, box_problem
from services.node.box import (
    BOX_ROOT,
    JOB_UID_BASE,
    Boxes,
    Claims,
    Rules,
    check,
    cpu_seconds,
    interpreter_paths,
    make_own,
    reachable,
    read_owned,
    shown_folders,
    write_owned,
)
from services.node.processes import import_path
from shared import credentials
from shared.files import make_private
from shared.schema.nodes import NodeInfo, StartWorkers, StopWorkers

ROOT = Path(__file__).resolve().parent.parent
BOXED = pytest.mark.skipif(
    box_problem("runc", sys.executable, "tests.jobs")[0] != "",
    reason=box_problem("runc", sys.executable, "tests.jobs")[0] or "boxes here",
)


def test_a_jobs_user_is_claimed_on_the_host_shared_by_its_stack_and_never_by_another(tmp_path):
    """Two agents of one stack (the job's ranks on two nodes of one host) share its user; another
    stack's job of the same number takes the next; a claim dies with its holder."""
    a, b, other = Claims(tmp_path / "uids"), Claims(tmp_path / "uids"), Claims(tmp_path / "uids")
    uid = a.claim("stack-1/train-7", 7)
    assert uid == JOB_UID_BASE + 7 and b.claim("stack-1/train-7", 7) == uid
    assert other.claim("stack-2/train-7", 7) == JOB_UID_BASE + 8  # its submission has the same number
    assert a.claim("stack-1/train-7", 7) == uid  # this agent's second box of the job (its next run)
    for claims in (a, a, b):
        claims.release(uid)
    assert other.claim("stack-3/eval-7", 7) == uid  # every holder gone: free again
    # a holder that dies (its file closed by the kernel) holds nothing
    dying = Claims(tmp_path / "uids")
    taken = dying.claim("stack-4/x-100", 100)
    os.close(dying.held[taken][0])
    assert Claims(tmp_path / "uids").claim("stack-5/y-100", 100) == taken


def test_a_boxs_limits_are_its_slots_and_whole_cores_its_own():
    rules = Rules(cpus=0.5, memory_mb=1024, processes=64, open_files=256, file_mb=8)
    assert rules.cores((0, 1)) == ""  # half a core a slot: the quota alone holds it
    whole = Rules(cpus=1, memory_mb=1024)
    assert whole.cores((1,)) == "1" and whole.resources(1, whole.cores((1,)))["cpu"]["cpus"] == "1"
    assert whole.cores((os.cpu_count() or 1,)) == ""  # past the machine's cores: none pinned
    two = rules.resources(2)
    assert two["cpu"]["quota"] == 100_000 and two["cpu"]["period"] == 100_000 and two["cpu"]["shares"] == 2048
    assert two["memory"]["limit"] == 2048 << 20 and two["pids"]["limit"] == 128
    assert {limit["type"]: limit["hard"] for limit in rules.rlimits()} == {
        "RLIMIT_NOFILE": 256,
        "RLIMIT_CORE": 0,
        "RLIMIT_FSIZE": 8 << 20,
    }


def test_a_box_shows_the_system_and_what_workers_run_and_reaches_it_through_its_own_folders(tmp_path):
    closed = tmp_path / "closed"
    (closed / "clone" / "venv").mkdir(parents=True)
    os.chmod(closed, 0o700)  # as /root is
    shown = shown_folders(sys.executable, [str(closed / "clone"), str(closed / "clone" / "venv")])
    assert closed / "clone" in shown and closed / "clone" / "venv" not in shown  # the outermost
    assert Path("/usr") in shown and not any(path in (Path("/"), Path("/root"), Path("/tmp")) for path in shown)
    # the folders above a shown one are the box's own (open): /root's mode does not matter inside
    assert reachable(closed / "clone" / "venv", shown) is None
    # a closed folder inside a shown one is the host's, with its mode
    os.chmod(closed / "clone", 0o700)
    assert reachable(closed / "clone" / "venv", shown) == closed / "clone"


def test_an_agent_that_cannot_box_jobs_refuses_with_the_fix(tmp_path):
    assert check(None, sys.executable, []) == ""  # --box off: said in so many words
    assert "install it" in check("no-such-runtime", sys.executable, [ROOT]) or os.geteuid() != 0
    closed = tmp_path / "clone"
    closed.mkdir()
    os.chmod(closed, 0o700)
    fake_python = closed / "python"
    fake_python.touch()
    if os.geteuid() == 0:
        problem = check("runc", str(fake_python), [closed])
        assert f"cannot enter {closed}" in problem and "--box off" in problem
    else:
        assert "not root" in box_problem("runc", sys.executable, "tests.jobs")[0]


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
            read_owned(folder / "job.pt", JOB_UID_BASE + 1)
        write_owned(folder / "job.pt", b"resumed", JOB_UID_BASE + 1)
        assert (folder / "job.pt").stat().st_uid == JOB_UID_BASE + 1


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
    uid = JOB_UID_BASE + 3
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


# ---- jobs that try, in real boxes --------------------------------------------------------------


def boxed_node(name: str, workdir: Path, slots: int = 2, rules: Rules | None = None) -> NodeWorkers:
    """A node agent's workers as `python -m services.node` makes them, as root, with runc boxes."""
    shown = shown_folders(sys.executable, interpreter_paths(sys.executable, import_path("tests.jobs")))
    boxes = Boxes(
        workdir,
        rules or Rules(cpus=1.0, memory_mb=512, processes=32, file_mb=8),
        sys.executable,
        "runc",
        shown,
        f"test-{os.getpid()}",
    )
    boxes.prepare()
    return NodeWorkers(NodeInfo(name, "cpu", slots, "127.0.0.1"), workdir, "tests.jobs", boxes=boxes)


def box_pid(box) -> int:
    """A box's first process, as the host numbers it."""
    state = subprocess.run(["runc", "--root", str(box.boxes.state), "state", box.name], capture_output=True, check=True)
    return json.loads(state.stdout)["pid"]


def wait_until_ended(node: NodeWorkers, job_id: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not (codes := next((r.codes for r in node.poll().jobs if r.job_id == job_id), ())) or None in codes:
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.1)


@pytest.mark.e2e
@BOXED
def test_a_job_in_its_box_cannot_read_signal_see_or_reach_what_is_not_its_own(monkeypatch, tmp_path):
    """DATA under a folder only root may enter (pytest's, as /root is): jobs still run as users of
    their own, and what a job tries is denied."""
    monkeypatch.setenv("GOODPUT_NATS_PASSWORD", "the-agents-password")  # in /proc/<agent>/environ
    data = (
        tmp_path / "data"
    )  # DATA as `goodput up` lays it out (as root): secrets, user.env, nats.conf, the nodes' work
    make_private(data)
    access = Access.kept_in(data / "secrets")
    user_env = credentials.write_user_env(data, "nats://127.0.0.1:4222", access.password_file("user"))
    write_accounts(data, access)
    (data / "nats.conf").touch(mode=0o600)
    (data / "nats.conf").write_text(server_config(access))
    checkpoints = data / "work" / "checkpoints"
    node = boxed_node("box-0", data / "work" / "node-box-0")
    make_private(node.workdir, skip=("jobs", BOX_ROOT))  # as the agent makes it when it starts
    # another job: its folder on the node and its checkpoint in the shared folder, and its rendezvous
    # listening on the host's loopback
    other = node.boxes.open("other-1", "other-1.1", node.job_folder("other-1"), 2, (1,), True, checkpoints / "other-1")
    (other.folder / "notes").write_text("the other job's")
    (checkpoints / "other-1" / "other-1.pt").write_bytes(b"the other job's checkpoint")
    rendezvous = socket.create_server(("127.0.0.1", 0))
    readable = [access.password_file("policy"), data / "secrets", user_env, data / "nats.conf", data / AUTH_CONF, data]
    readable += [other.folder, other.folder / "notes", checkpoints / "other-1" / "other-1.pt", Path("/root")]
    env = {
        "PROBE_READ": os.pathsep.join(map(str, readable)),
        "PROBE_PLANT": str(node.workdir),
        "PROBE_PIDS": f"{os.getpid()} {box_pid(other)}",  # the agent, the other job's box
        "PROBE_CONNECT": "127.0.0.1:%d" % rendezvous.getsockname()[1],
        "PROBE_PROCESSES": "64",
        "PROBE_FILE_MB": "16",
    }
    checkpoint = checkpoints / "probe-1" / "probe-1.pt"
    try:
        node.start(StartWorkers("probe-1", "probes", 1, (0,), 1, 1, "cpu", str(checkpoint), env, user=1))
        try:
            wait_until_ended(node, "probe-1")
        finally:
            report = node.stop(StopWorkers("probe-1"))
    finally:
        other.close()
        rendezvous.close()
    log = node.log_path("probe-1", 0).read_text()
    assert report.codes == (0,), log
    got = json.loads(next(line for line in log.splitlines() if line.startswith("{")))
    print(json.dumps(got, indent=1))  # shown by pytest -s, or with a failure
    allowed = {probe: result for probe, result in got.items() if not probe.startswith("own:")}
    assert all(result.startswith("denied") for result in allowed.values()), json.dumps(allowed, indent=1)
    assert all(result.startswith("ALLOWED") for probe, result in got.items() if probe.startswith("own:")), got
    uid = JOB_UID_BASE + 1
    assert got["own: its user"] == f"ALLOWED: uid {uid} gid {uid} groups []"
    assert "after" in got["start processes"] and "Errno 11" in got["start processes"]  # its pids cgroup
    assert "only its own" in got["see other processes"]
    assert got["own: its limits"] == "ALLOWED: core (0, 0)"
    assert not (node.workdir / "planted").exists()
    assert checkpoint.read_bytes() and checkpoint.parent.stat().st_uid == uid
    assert (checkpoint.parent.stat().st_mode & 0o777) == 0o700
    assert node.job_folder("probe-1").stat().st_uid == uid


@pytest.mark.e2e
@BOXED
def test_a_jobs_detached_children_use_its_cpu_and_its_memory_past_its_limit_ends_it_with_the_reason(tmp_path):
    node = boxed_node("box-1", tmp_path / "node", slots=1, rules=Rules(cpus=0.25, memory_mb=192, processes=64))
    env = {"GREEDY_CHILDREN": "4", "GREEDY_SECONDS": "3"}
    node.start(
        StartWorkers(
            "greedy-1", "greedy", 1, (0,), 1, 1, "cpu", str(tmp_path / "ck" / "greedy-1" / "x.pt"), env, user=2
        )
    )
    cgroup = node.jobs["greedy-1"].box.cgroup
    began, used = time.monotonic(), cpu_seconds(cgroup)
    wait_until_ended(node, "greedy-1")
    wall, used = time.monotonic() - began, cpu_seconds(cgroup) - used
    node.stop(StopWorkers("greedy-1"))
    # five busy processes, in sessions of their own, held to a quarter of a core all together
    assert used <= 0.25 * wall * 1.25 + 0.1, f"{used:.2f} s of CPU in {wall:.2f} s"
    # memory: past its 192 MB the kernel ends its own processes, and its error says why
    env = {"GREEDY_MB": "400"}
    node.start(
        StartWorkers(
            "greedy-2", "greedy", 1, (0,), 1, 1, "cpu", str(tmp_path / "ck" / "greedy-2" / "x.pt"), env, user=3
        )
    )
    wait_until_ended(node, "greedy-2")
    report = next(r for r in node.poll().jobs if r.job_id == "greedy-2")
    node.stop(StopWorkers("greedy-2", kill=True))
    assert report.codes[0] not in (0, None)
    assert "out of memory:" in report.error and "its limit 192 MiB" in report.error, report.error


@pytest.mark.e2e
@BOXED
def test_a_killed_agents_boxes_end_when_the_next_one_starts(tmp_path):
    node = boxed_node("box-2", tmp_path / "node", slots=1)
    env = {"GREEDY_CHILDREN": "1", "GREEDY_SECONDS": "600"}
    node.start(
        StartWorkers("left-1", "greedy", 1, (0,), 1, 1, "cpu", str(tmp_path / "ck" / "left-1" / "x.pt"), env, user=4)
    )
    box = node.jobs["left-1"].box
    assert node.boxes._listed() == {box.name: "running"}
    # the agent is gone (its table forgotten); the next one on its folder ends what it left
    later = boxed_node("box-2", tmp_path / "node", slots=1)
    assert later.boxes.leftovers(grace_s=1) == [box.name]
    assert later.boxes._listed() == {}
    assert cpu_seconds(box.cgroup) == 0.0  # its cgroup is gone


@pytest.mark.e2e
@BOXED
def test_an_agent_whose_folders_are_relative_boxes_its_jobs(tmp_path, monkeypatch):
    """`goodput up`'s DATA is out/stack, relative: runc would read the box's paths as its bundle's."""
    monkeypatch.chdir(tmp_path)
    node = boxed_node("box-3", Path("data") / "node", slots=1)
    checkpoint = Path("data") / "checkpoints" / "rel-1" / "rel-1.pt"
    node.start(StartWorkers("rel-1", "greedy", 1, (0,), 1, 1, "cpu", str(checkpoint), {}, user=5))
    wait_until_ended(node, "rel-1")
    report = node.stop(StopWorkers("rel-1"))
    assert report.codes == (0,), report
