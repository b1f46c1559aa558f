"""What keeps a job's code away from the stack and from other jobs on its node.

A node agent that runs as root starts each job's workers as a user and group of the job's own
(`job_uid`: a number from the job's submission, which the executor and the profiler give every
node of the job alike, no account needed), with no other group, in a
folder of the job's own (`JobFolder`: its HOME, its TMPDIR, its working directory, 0700 and
owned by that user), and under limits (`Limits`, set by `job_main` before the job's code runs, soft
and hard alike, so the job cannot raise them). Another job's user cannot read that folder or signal
its processes, and what the stack keeps private (its secrets, the agent's environment, other jobs'
checkpoints) is its owner's, root's, alone. An agent that is not root cannot switch users: its
workers run as it does, and keeping jobs apart is then the deployment's (one agent per container).

The agent still reads and writes in a job's folder (it copies checkpoints in and out), always
without following a link the job may have put there (`read_owned`, `write_owned`), and gives it
to the job's user only once no process of that user is left to change it meanwhile (`end_user`,
then `make_own`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import resource
import signal
import stat
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

JOB_UID_BASE = 200_000  # above the accounts of a machine (system, people; subordinate ranges start at 100000)
JOB_UID_SPAN = 1 << 24  # jobs' users are JOB_UID_BASE + [0, JOB_UID_SPAN)
LIMITS_ENV = "GOODPUT_WORKER_LIMITS"  # the limits `job_main` sets, NAME=VALUE,... (resource.RLIMIT_NAME)
PRIVATE = 0o700
MB = 1 << 20
MAX_OWNED_BYTES = 1 << 30  # the largest file the agent reads from a job's folder: the checkpoints store's size
PR_SET_CHILD_SUBREAPER = 36  # prctl(2)
KILL_TRIES = 3  # `end_user`'s sweeps: a process that forks while one runs is caught by the next
KILL_WAIT_S = 5.0  # ... and how long each waits for the killed to be gone (one in the kernel ends its call first)


def job_uid(slot: int | None, base: int = JOB_UID_BASE, taken: Collection[int] = (), job_id: str = "") -> int:
    """The user (and group) a job's workers run as: `base` plus its `slot` (its submission's number,
    which the executor gives: the same on every node of the job, and no submitter picks another
    job's), the next one where another job of the node has that (`taken`, after JOB_UID_SPAN
    submissions). Without a slot (an order of an older executor): a hash of its id."""
    if slot is None:
        slot = int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big")
    for step in itertools.count():
        uid = base + (slot + step) % JOB_UID_SPAN
        if uid not in taken:
            return uid
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Limits:
    """A worker's limits. `processes` counts every process and thread of the job's user
    (RLIMIT_NPROC is per user): set only when the job has a user of its own. `memory_mb` caps its
    data (RLIMIT_DATA: heap and private mappings, not the address space, which CUDA reserves by
    the terabyte and RLIMIT_AS would refuse); `file_mb` caps each file it writes; no core dumps."""

    processes: int | None = 512
    open_files: int = 4096
    memory_mb: float | None = None
    file_mb: float | None = 64 * 1024

    def rlimits(self, own_user: bool) -> dict[str, int]:
        """The limits by resource name (RLIMIT_NAME), as `job_main` sets them."""
        limits = {"NOFILE": self.open_files, "CORE": 0}
        if own_user and self.processes is not None:
            limits["NPROC"] = self.processes
        if self.memory_mb is not None:
            limits["DATA"] = int(self.memory_mb * MB)
        if self.file_mb is not None:
            limits["FSIZE"] = int(self.file_mb * MB)
        return limits


def default_memory_mb(slots: int) -> float:
    """A worker's memory by default: the machine's, shared evenly by its slots."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / MB / max(1, slots)


def render_limits(limits: dict[str, int]) -> str:
    return ",".join(f"{name}={value}" for name, value in sorted(limits.items()))


def apply_limits(text: str) -> None:
    """Set each limit of `text` (render_limits'), soft and hard: the job cannot raise it again. A
    limit above the hard one we have (a non-root agent's own) stays at that."""
    for item in filter(None, text.split(",")):
        name, value = item.split("=")
        which = getattr(resource, f"RLIMIT_{name}")
        _, hard = resource.getrlimit(which)
        wanted = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
        resource.setrlimit(which, (wanted, wanted))


@dataclass(frozen=True)
class Sandbox:
    """Where and as whom one job's workers run: its folder (HOME, TMPDIR under it, the working
    directory), its user and group (None: the agent's), their limits and interpreter."""

    folder: Path
    uid: int | None
    limits: dict[str, int]
    python: str = sys.executable

    @property
    def tmp(self) -> Path:
        return self.folder / "tmp"

    def env(self) -> dict[str, str]:
        return {"HOME": str(self.folder), "TMPDIR": str(self.tmp), LIMITS_ENV: render_limits(self.limits)}

    def user(self) -> dict:
        """Popen's arguments that switch to the job's user, with no group of the agent's."""
        return {} if self.uid is None else {"user": self.uid, "group": self.uid, "extra_groups": []}


def make_own(folder: Path, uid: int | None) -> Path:
    """`folder` (made, 0700; what stands there that is not a folder, a link the job left, removed
    first) and all in it given to `uid` (None: left to us). Nothing is followed: a link is changed
    itself, each folder is entered by its handle (`os.fwalk`), not by a path a link could redirect.
    A file with more than one name (a hard link the job made to a file of ours) is left as it is.
    The folder above must be ours, and no process of the job's left (`end_user`): nothing is
    swapped while it is given."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            folder.unlink()
    folder.mkdir(mode=PRIVATE, parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if uid is not None:
            for _, folders, files, at in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
                for name in (*folders, *files):
                    with contextlib.suppress(FileNotFoundError):
                        info = os.stat(name, dir_fd=at, follow_symlinks=False)
                        if stat.S_ISDIR(info.st_mode) or info.st_nlink == 1:
                            os.chown(name, uid, uid, dir_fd=at, follow_symlinks=False)
            os.fchown(fd, uid, uid)
        os.fchmod(fd, PRIVATE)
    finally:
        os.close(fd)
    return folder


def _status(pid: int | str) -> dict[str, str]:
    """A process's /proc status fields ({} when it is gone)."""
    try:
        status = Path("/proc", str(pid), "status").read_text()
    except OSError:
        return {}
    return {name: value.strip() for name, value in (line.split(":", 1) for line in status.splitlines() if ":" in line)}


def user_processes(uid: int, ancestor: int | None = None) -> list[int]:
    """The processes of `uid` (its real, effective or saved id) still running (not zombies); with
    `ancestor`, only those that descend from it."""
    table = {int(entry.name): _status(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()}

    def descends(pid: int) -> bool:
        for _ in range(len(table)):
            pid = int(table.get(pid, {}).get("PPid", "0") or 0)
            if pid == ancestor:
                return True
            if pid <= 1:
                return False
        return False

    return [
        pid
        for pid, fields in table.items()
        if str(uid) in fields.get("Uid", "").split()[:3]
        and not fields.get("State", "").startswith("Z")
        and (ancestor is None or descends(pid))
    ]


def become_subreaper() -> None:
    """What a worker starts and leaves (a daemon in a session of its own) is re-parented to this
    process, not to init (Linux's child subreaper): `end_user` finds it among this agent's own."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def end_user(uid: int | None) -> bool:
    """Every process of the job's user that this agent's workers started, in any session (a
    subreaper's orphans are its own), killed, and those orphans reaped; whether none is left. A
    process of the user under another agent of the machine (the job's ranks of another node) is
    that agent's to end, not this one's."""
    if uid is None:
        return True
    me = os.getpid()
    for _ in range(KILL_TRIES):
        found = user_processes(uid, me)
        if not found:
            break
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        while user_processes(uid, me) and time.monotonic() < deadline:
            time.sleep(0.05)
    _reap(uid)
    return not user_processes(uid, me)


def _reap(uid: int) -> None:
    """The ended orphans of `uid` re-parented to this process. A worker's own process is never one:
    its Popen waits for it, and it has been waited for before its user is ended."""
    me = str(os.getpid())
    for entry in os.scandir("/proc"):
        fields = _status(entry.name) if entry.name.isdigit() else {}
        if fields.get("PPid") == me and fields.get("State", "").startswith("Z") and str(uid) in fields.get("Uid", ""):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(entry.name), os.WNOHANG)


def closed_to_others(path: Path) -> Path | None:
    """The first folder on the way to `path`, or `path` itself, that another user cannot enter
    (or run), links resolved (a venv's python is a link to its base's); None when the way is open."""
    path = Path(os.path.realpath(path))
    for step in (*reversed(path.parents), path):
        try:
            if not stat.S_IMODE(step.stat().st_mode) & stat.S_IXOTH:
                return step
        except OSError:
            return step
    return None


def read_owned(path: Path, uid: int | None, limit: int = MAX_OWNED_BYTES) -> bytes:
    """A file the job wrote in its folder, read without following a link, nor waiting on what is
    not a file (a FIFO would block the read for ever); with `uid`, only a regular file of the job's
    user (not a hard link it made to a file of ours); at most `limit` bytes. OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or (uid is not None and info.st_uid != uid):
            raise PermissionError(f"{path} is not a file of the job's (uid {uid})")
        if info.st_size > limit:
            raise PermissionError(f"{path} has {info.st_size} bytes, over the {limit} a job's file may have")
        data = file.read(limit + 1)
        if len(data) > limit:  # grown since
            raise PermissionError(f"{path} has over the {limit} bytes a job's file may have")
        return data


def write_owned(path: Path, data: bytes, uid: int | None) -> None:
    """`data` into `path` atomically, a file of `uid`'s (None: ours) and no one else's, through no link."""
    partial = path.with_name(f".{path.name}.fetched")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
        if uid is not None:
            os.fchown(fd, uid, uid)
    os.replace(partial, path)
