"""A job that tries what a job must not do, as a job author could, and tells what it got: one JSON
object on stderr (its log), each probe's name to "denied: ..." or "ALLOWED: ...". It uses the
standard library only (the isolation test may run it on another interpreter than the agent's).

What it is given, in its environment (the test's order): PROBE_READ, files and folders of the stack
and of another job to read or list; PROBE_PLANT, a folder of the agent's to write in; PROBE_PIDS,
processes outside its box (the agent, another job's) to read and signal; PROBE_CONNECT, another
job's rendezvous (HOST:PORT) to reach; PROBE_PROCESSES and PROBE_FILE_MB, amounts over its limits.
It also writes in its own folder and its checkpoint's, which it must be able to."""

import json
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path

GOODPUT_JOB = True


def attempt(action) -> str:
    try:
        return f"ALLOWED: {action()}"
    except (OSError, MemoryError, ValueError) as error:
        return f"denied: {type(error).__name__}: {error}"


def read(path: str) -> str:
    return f"{len(os.listdir(path))} entries" if os.path.isdir(path) else f"{len(Path(path).read_bytes())} bytes"


def processes(count: int) -> str:
    """Start `count` processes (each waits to be killed); how many started, or the error."""
    children = []
    try:
        for _ in range(count):
            pid = os.fork()
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            children.append(pid)
        return f"{len(children)} processes"
    except OSError as error:
        raise OSError(error.errno, f"after {len(children)} processes: {error.strerror}") from None
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def connect(address: str) -> str:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as peer:
        return f"connected to {peer.getpeername()}"


def others() -> str:
    """The processes /proc shows that are not of its box (its own user's, or its box's first)."""
    mine = {str(os.getpid()), "1", "self", "thread-self"}
    seen = [entry for entry in os.listdir("/proc") if entry.isdigit() and entry not in mine]
    foreign = [pid for pid in seen if Path(f"/proc/{pid}/status").read_text().count(f"\t{os.getuid()}\t") == 0]
    if foreign:
        return f"{len(foreign)} processes of other users"
    raise PermissionError(f"only its own: {len(seen) + 2} processes")


def write(path: Path, megabytes: float) -> str:
    with open(path, "wb") as file:
        file.write(b"\0" * int(megabytes * (1 << 20)))
    return f"{megabytes:g} MB in {path}"


def allocate(megabytes: float) -> str:
    block = bytearray(int(megabytes * (1 << 20)))
    return f"{len(block) >> 20} MB"


if __name__ == "__main__":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file over the limit: an error, not death
    env = os.environ
    home = Path(env["HOME"])
    checkpoint = Path(env.get("GOODPUT_CHECKPOINT") or sys.argv[sys.argv.index("--checkpoint") + 1])
    got = {f"read {path}": attempt(lambda path=path: read(path)) for path in env["PROBE_READ"].split(os.pathsep)}
    got |= {
        **{
            f"read process {pid}'s environment": attempt(lambda pid=pid: read(f"/proc/{pid}/environ"))
            for pid in env["PROBE_PIDS"].split()
        },
        **{f"signal process {pid}": attempt(lambda pid=pid: os.kill(int(pid), 0)) for pid in env["PROBE_PIDS"].split()},
        "see other processes": attempt(others),
        "reach another job's rendezvous": attempt(lambda: connect(env["PROBE_CONNECT"])),
        "write in the agent's folder": attempt(lambda: write(Path(env["PROBE_PLANT"]) / "planted", 0)),
        "write in the node's files": attempt(lambda: write(Path(sys.executable).parent / "planted", 0)),
        "start processes": attempt(lambda: processes(int(env["PROBE_PROCESSES"]))),
        "write a large file": attempt(lambda: write(home / "large", float(env["PROBE_FILE_MB"]))),
        "raise its open files limit": attempt(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 20, 1 << 20))),
        # what it may do: its own folder, its temporary files, its checkpoint's folder, some memory
        "own: write in its folder": attempt(lambda: write(home / "notes", 1)),
        "own: write a temporary file": attempt(lambda: write(Path(env["TMPDIR"]) / "scratch", 1)),
        "own: write its checkpoint": attempt(lambda: write(checkpoint, 1)),
        "own: allocate some memory": attempt(lambda: allocate(16)),
        "own: its user": f"ALLOWED: uid {os.getuid()} gid {os.getgid()} groups {os.getgroups()}",
        "own: its limits": f"ALLOWED: core {resource.getrlimit(resource.RLIMIT_CORE)}",
    }
    print(json.dumps(got), file=sys.stderr, flush=True)
