"""What keeps a job's code away from the stack and from other jobs on its node.

A node agent that runs as root starts each job's workers as a user and group of the job's own
(`job_uid`: a number derived from the job's id, no account needed), with no other group, in a
folder of the job's own (`JobFolder`: its HOME, its TMPDIR, its working directory, 0700 and
owned by that user), and under limits (`Limits`, set by `job_main` before the job's code runs, soft
and hard alike, so the job cannot raise them). Another job's user cannot read that folder or signal
its processes, and what the stack keeps private (its secrets, the agent's environment, other jobs'
checkpoints) is its owner's, root's, alone. An agent that is not root cannot switch users: its
workers run as it does, and keeping jobs apart is then the deployment's (one agent per container).

The agent still reads and writes in a job's folder (it copies checkpoints in and out), always
without following a link the job may have put there (`read_owned`, `write_owned`).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import resource
import stat
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

JOB_UID_BASE = 200_000  # above the accounts of a machine (system, people; subordinate ranges start at 100000)
JOB_UID_SPAN = 1 << 24  # jobs' users are JOB_UID_BASE + [0, JOB_UID_SPAN)
LIMITS_ENV = "GOODPUT_WORKER_LIMITS"  # the limits `job_main` sets, NAME=VALUE,... (resource.RLIMIT_NAME)
PRIVATE = 0o700
MB = 1 << 20


def job_uid(job_id: str, base: int = JOB_UID_BASE, taken: Collection[int] = ()) -> int:
    """The user (and group) a job's workers run as: `base` plus a hash of its id, the next hash
    where another job of the node has that one (`taken`), so two jobs never share one."""
    for salt in itertools.count():
        digest = hashlib.sha256(f"{job_id}\0{salt}".encode()).digest()
        uid = base + int.from_bytes(digest[:8], "big") % JOB_UID_SPAN
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
    """`folder` (made, 0700) and all in it given to `uid` (None: left to us). Links are changed,
    never followed. The folder above must be ours: the job cannot move this one away."""
    folder.mkdir(mode=PRIVATE, parents=True, exist_ok=True)
    if uid is not None:
        for root, folders, files in os.walk(folder):
            for name in (*folders, *files):
                os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)
        os.chown(folder, uid, uid)
    os.chmod(folder, PRIVATE)
    return folder


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


def read_owned(path: Path, uid: int | None) -> bytes:
    """A file the job wrote in its folder, read without following a link; with `uid`, only a
    regular file of the job's user (not a hard link it made to a file of ours). OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or (uid is not None and info.st_uid != uid):
            raise PermissionError(f"{path} is not a file of the job's (uid {uid})")
        return file.read()


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
