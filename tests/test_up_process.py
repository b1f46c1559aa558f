"""`goodput up` as a process: the jobs it starts with (`--jobs none`, the examples only when asked),
and nothing it started outlives it, killed -9 included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.main import main
from cli.up import EXAMPLE_JOBS, prepare, start_jobs
from shared.files import PRIVATE_FOLDER
from shared.runtime import JOBS_PACKAGE

EXAMPLES = [str(p) for p in EXAMPLE_JOBS]


def test_a_fresh_start_wipes_the_jobs_folders_and_leaves_data_closed(tmp_path):
    # A job sees its own folders in its box, never DATA: nothing on the way to them is opened.
    data = tmp_path / "data"
    (data / "work" / "node").mkdir(parents=True, mode=PRIVATE_FOLDER)
    (data / "jetstream").mkdir()
    os.chmod(data, PRIVATE_FOLDER)
    prepare(data, fresh=True)
    assert not (data / "jetstream").exists() and not (data / "work").exists()
    assert oct(os.stat(data).st_mode & 0o777) == oct(PRIVATE_FOLDER)


def test_real_jobs_are_refused_before_anything_starts_where_no_box_can_be_had(monkeypatch, tmp_path, capsys):
    """No runtime to box jobs with (or no root): `goodput up --executors real` says why and the fix,
    and starts nothing; --box off, said in so many words, is the operator's choice."""
    from services.node import agent

    monkeypatch.setattr(agent, "RUNTIME", "no-such-runc")
    data = tmp_path / "data"
    code = main(["up", "--executors", "real", "--workload", "none", "--data", str(data)])
    said = capsys.readouterr().err
    assert code != 0 and "real jobs cannot run here" in said and "--box off" in said, said
    assert not data.exists()
    assert agent.box_problem("off", sys.executable, JOBS_PACKAGE)[0] == ""


def test_real_executors_start_with_the_example_jobs_only_when_asked():
    assert start_jobs(None, "builtin.csv", JOBS_PACKAGE) == EXAMPLES  # the real start-up workload
    assert start_jobs(["none"], "builtin.csv", JOBS_PACKAGE) == []
    assert start_jobs(None, "none", JOBS_PACKAGE) == []  # no workload asked for
    assert start_jobs(None, "builtin.csv", "my_jobs") == []  # the examples are no modules of it
    assert start_jobs(["a.yaml"], "none", "my_jobs") == ["a.yaml"]
    with pytest.raises(ValueError, match="--jobs none submits nothing"):
        start_jobs(["none", "a.yaml"], None, JOBS_PACKAGE)


def test_once_with_no_jobs_is_refused_before_anything_starts(tmp_path, capsys):
    from cli.main import main

    assert main(["up", "--executors", "real", "--once", "--jobs", "none", "--data", str(tmp_path / "d")]) == 2
    assert "--once waits for the jobs submitted at start, and there are none" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    return children


def _descendants(pid: int) -> set[int]:
    children, found, todo = _children(), set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"pid {pid}"


def _alive(pid: int) -> bool:
    """Running: a zombie (ended, not yet reaped by its new parent) is not."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
def test_nothing_goodput_up_started_outlives_it_killed_9(tmp_path):
    """The NATS server, the services and the node agents all end within 5 s of `goodput up`'s kill -9."""
    from launcher.nats import free_loopback_port

    command = [sys.executable, "-m", "cli.main", "up", "--executors", "real", "--nodes", "2", "--workload", "none"]
    command += ["--port", str(free_loopback_port()), "--data", str(tmp_path / "data")]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started: set[int] = set()
    try:
        seen = []
        for line in up.stdout:  # until it says it serves (a line it prints once everything answers)
            seen.append(line)
            if line.startswith("serving:"):
                break
        else:
            raise AssertionError("goodput up ended before serving:\n" + "".join(seen))
        started = _descendants(up.pid)
        names = {Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].rsplit(b"/", 1)[-1] for pid in started}
        assert b"nats-server" in names and len(started) >= 9, (names, started)  # NATS, 6 services, 2 agents
        up.send_signal(signal.SIGKILL)
        up.wait()
        deadline = time.monotonic() + 5.0
        while (left := {pid for pid in started if _alive(pid)}) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"still running 5 s after goodput up was killed -9: {[_command(pid) for pid in left]}"
    finally:
        started |= _descendants(up.pid) if up.poll() is None else set()
        up.kill()
        for pid in started:  # what a failure left: none of it outlives the test
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
