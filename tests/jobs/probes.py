"""A job that tries what a job must not do, as a job author could, and tells what it got: one JSON
object on stderr (its log), each probe's name to "denied: ..." or "ALLOWED: ...". It uses the
standard library only (the isolation test may run it on another interpreter than the agent's).

What it is given, in its environment (the test's order): PROBE_READ, files and folders of the stack
and of another job to read or list; PROBE_PLANT, a folder of the agent's to write in;
PROBE_PROCESSES, PROBE_MEMORY_MB and PROBE_FILE_MB, amounts over its limits. It also writes in its
own folder and its checkpoint's, which it must be able to."""

import json
import os
import resource
import signal
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
        "read the agent's environment": attempt(lambda: read(f"/proc/{os.getppid()}/environ")),
        "signal the agent": attempt(lambda: os.kill(os.getppid(), 0)),
        "signal init": attempt(lambda: os.kill(1, 0)),
        "write in the agent's folder": attempt(lambda: write(Path(env["PROBE_PLANT"]) / "planted", 0)),
        "start processes": attempt(lambda: processes(int(env["PROBE_PROCESSES"]))),
        "allocate memory": attempt(lambda: allocate(float(env["PROBE_MEMORY_MB"]))),
        "write a large file": attempt(lambda: write(home / "large", float(env["PROBE_FILE_MB"]))),
        "raise its process limit": attempt(
            lambda: resource.setrlimit(resource.RLIMIT_NPROC, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        ),
        # what it may do: its own folder, its temporary files, its checkpoint's folder, some memory
        "own: write in its folder": attempt(lambda: write(home / "notes", 1)),
        "own: write a temporary file": attempt(lambda: write(Path(env["TMPDIR"]) / "scratch", 1)),
        "own: write its checkpoint": attempt(lambda: write(checkpoint, 1)),
        "own: allocate some memory": attempt(lambda: allocate(16)),
        "own: its user": f"ALLOWED: uid {os.getuid()} gid {os.getgid()} groups {os.getgroups()}",
        "own: its limits": f"ALLOWED: core {resource.getrlimit(resource.RLIMIT_CORE)}",
    }
    print(json.dumps(got), file=sys.stderr, flush=True)
