"""Each job's box on its node: what its processes may see, use and touch, decided here and torn
down here, for training runs and profiling runs alike.

A node agent that runs as root puts every job's processes on the node (one generation of its
ranks, or one profiling run) in a container of their own, made by runc (Debian's `runc`, the OCI
runtime Kubernetes' containerd uses; crun 1.8 refuses hosts whose cgroup v2 tree holds a controller
beside v1's, as this one's does):

- **a cgroup** (v1 or v2, whichever the host has) with CPU at most the job's slots' worth (a CFS
  quota; its weight by slots; its slots' own cores when a slot has whole ones), memory at most its slots' memory (the kernel's OOM killer ends
  the job's own processes past it, and `memory_note` says so in the job's error), and a cap on its
  processes and threads: for all of the job's processes together, whatever they fork, however
  they detach;
- **a user of its own** (`Claims`), unique on the host however many stacks or agents run there,
  with no capability and no way to gain one (no_new_privileges);
- **its own PID namespace** (`/proc` shows its processes alone), IPC namespace and `/dev/shm`, a
  private `/tmp` (its folder's `tmp/`), its stdio passed through (never runc's, which a daemon
  the job left would hold open), and **its own network namespace** (loopback only) when all of
  its ranks are on this node: its rendezvous is reachable by its own ranks alone;
- **the node's files read-only**, and of them only the system's folders and what the workers run
  (the interpreter, the project, the jobs package): the stack's DATA, the agent's folder and
  other jobs' folders are not in the box at all. Its own folder is `/job` (HOME, the working
  directory, where its code is unpacked) and its checkpoint folder `/checkpoint`, both writable;
  the environment of its requirements (`environments.py`) is `/env`, read-only.

Its first process (`box_init`) holds the box open; each worker enters it (`runc exec`). A stop is
SIGTERM to every process of the box, and `close` kills what is left by its cgroup and removes it. A
box outlives no agent: its first process reads the agent's lifeline and, once it breaks, gives the
job's processes the stop's grace to checkpoint and then ends the box.

`--box off` runs jobs as the agent's own user, in no box: for code the operator trusts only (an
agent that is not root, or has no runc, refuses to start without it: `check`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from shared.runtime import STOP_TIMEOUT_S

RUNTIME = "runc"
JOB_HOME = Path("/job")  # the job's folder, as its processes see it
JOB_CHECKPOINTS = Path("/checkpoint")  # its checkpoint folder (in the folder every node shares)
JOB_ENVIRONMENT = Path("/env")  # the environment of its requirements (read-only; writable while it is built)
JOB_UID_BASE = 200_000  # above the accounts of a machine (system, people; subordinate ranges start at 100000)
JOB_UID_SPAN = 1 << 24  # jobs' users are JOB_UID_BASE + [0, JOB_UID_SPAN)
CLAIMS = Path("/run/goodput/uids")  # the host's claims on jobs' users, by every agent of every stack
SYSTEM_FOLDERS = ("bin", "etc", "lib", "lib32", "lib64", "libx32", "opt", "sbin", "usr", "var")
BOX_ROOT = "box-root"  # in the agent's folder
MOUNT_POINTS = ("/proc", "/dev", "/sys", "/run", "/tmp", str(JOB_HOME), str(JOB_CHECKPOINTS), str(JOB_ENVIRONMENT))
INIT = "services.node.box_init"  # a box's first process
MB = 1 << 20
CPU_PERIOD_US = 100_000
RUNTIME_TIMEOUT_S = 30.0  # one runc command (a kill of a box whose processes are stuck in the kernel waits)
MAX_OWNED_BYTES = 1 << 30  # the largest file the agent reads from a job's folder: the checkpoints store's size
PRIVATE = 0o700


class BoxError(Exception):
    """A box cannot be had here: why, and the fix."""


@dataclass(frozen=True)
class Rules:
    """What a node gives each job's box, per slot (GPU) it holds."""

    cpus: float  # cores
    memory_mb: float
    processes: int = 512  # processes and threads
    open_files: int = 4096
    file_mb: float | None = 64 * 1024  # the largest file it may write

    def resources(self, slots: int, cores: str = "") -> dict:
        """The cgroup's limits for `slots` (OCI `linux.resources`), on `cores` ("": any)."""
        return {
            "cpu": {
                "quota": max(1000, int(self.cpus * slots * CPU_PERIOD_US)),
                "period": CPU_PERIOD_US,
                "shares": 1024 * slots,
                **({"cpus": cores} if cores else {}),
            },
            "memory": {"limit": int(self.memory_mb * slots * MB)},
            "pids": {"limit": self.processes * slots},
            "devices": [{"allow": True, "access": "rwm"}],  # GPUs are given by CUDA_VISIBLE_DEVICES
        }

    def cores(self, slots: tuple[int, ...]) -> str:
        """The CPU cores of these slots (slot k: cores k*c to k*c + c - 1 for `cpus` c a whole
        number): a neighbour's bursts within its quota never land on them. "" when the slots'
        share is not whole cores (the quota alone holds it)."""
        if self.cpus < 1 or not float(self.cpus).is_integer():
            return ""
        per = int(self.cpus)
        cores = [slot * per + core for slot in slots for core in range(per)]
        return ",".join(map(str, cores)) if cores and max(cores) < (os.cpu_count() or 1) else ""

    def rlimits(self) -> list[dict]:
        limits = {"RLIMIT_NOFILE": self.open_files, "RLIMIT_CORE": 0}
        if self.file_mb is not None:
            limits["RLIMIT_FSIZE"] = int(self.file_mb * MB)
        return [{"type": name, "hard": value, "soft": value} for name, value in limits.items()]


def default_rules(slots: int, cpus: float | None = None, memory_mb: float | None = None, processes: int = 512) -> Rules:
    """A node's rules: each slot the machine's cores and memory shared evenly by its slots, unless set."""
    slots = max(1, slots)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / MB
    return Rules(cpus or (os.cpu_count() or 1) / slots, memory_mb or memory / slots, processes)


# ---- the host's claims on jobs' users -------------------------------------------------------------


class Claims:
    """This process's claims on jobs' users. A claim is a file of CLAIMS named by the uid, holding
    the claimant's key (its stack and job), under a shared lock for as long as a box of the job runs:
    another agent of the same stack (the job's ranks on another node of this host) joins it; any
    other key takes the next uid. The kernel drops a dead agent's locks: no claim outlives it."""

    def __init__(self, folder: Path = CLAIMS):
        self.folder = folder
        self.held: dict[int, tuple[int, str, int]] = {}  # uid -> (its file, key, boxes holding it)
        self.lock = threading.Lock()

    def claim(self, key: str, slot: int, base: int = JOB_UID_BASE) -> int:
        """The uid for `key`: `base` plus its `slot` (its submission's number: the same on every
        node of the job), or the next one free of any other key on this host."""
        with self.lock:
            self.folder.mkdir(mode=PRIVATE, parents=True, exist_ok=True)
            with open(self.folder.parent / "uids.lock", "a") as mutex:  # one claimant of the host at a time
                fcntl.flock(mutex, fcntl.LOCK_EX)
                for step in range(JOB_UID_SPAN):
                    uid = base + (slot + step) % JOB_UID_SPAN
                    if self._take(uid, key):
                        return uid
        raise BoxError(f"every one of the {JOB_UID_SPAN} jobs' users from {base} is claimed on this host")

    def _take(self, uid: int, key: str) -> bool:
        held = self.held.get(uid)
        if held is not None:  # ours: this agent's other box of the job (its profiling, its next run)
            if held[1] != key:
                return False
            self.held[uid] = (held[0], key, held[2] + 1)
            return True
        fd = os.open(self.folder / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: by another agent of this job's stack, or by another job
            if os.pread(fd, 4096, 0).decode(errors="replace") != key:
                os.close(fd)
                return False
            fcntl.flock(fd, fcntl.LOCK_SH)
        else:  # free (under the host's mutex: no one else takes it between these steps)
            os.ftruncate(fd, 0)
            os.pwrite(fd, key.encode(), 0)
            fcntl.flock(fd, fcntl.LOCK_SH)
        self.held[uid] = (fd, key, 1)
        return True

    def release(self, uid: int) -> None:
        with self.lock:
            fd, key, count = self.held[uid]
            if count > 1:
                self.held[uid] = (fd, key, count - 1)
            else:
                del self.held[uid]
                os.close(fd)  # its lock goes with it


CLAIMED = Claims()


# ---- the folders a job's processes see -------------------------------------------------------------


def reachable(path: Path, binds: Collection[Path]) -> Path | None:
    """The first folder on the way to `path` inside a box that a job's user cannot enter, or None:
    a folder of the box's own root (made by runc for a mount point, 0755) is open; one of a host
    folder bound whole is the host's, with its mode."""
    path = Path(os.path.realpath(path))
    for step in (*reversed(path.parents), path):
        if not any(step == bound or bound in step.parents for bound in binds):
            continue
        try:
            if not stat.S_IMODE(step.stat().st_mode) & stat.S_IXOTH:
                return step
        except OSError:
            return step
    return None


def shown_folders(python: str, paths: Iterable[str]) -> list[Path]:
    """The host folders a box shows (read-only): the system's, and what the workers run that is
    outside them (`paths`: the project, the jobs package, the interpreter's prefixes and import
    path), each the outermost of those nested."""
    wanted = {
        Path("/", name) for name in SYSTEM_FOLDERS if Path("/", name).is_dir() and not Path("/", name).is_symlink()
    }
    prefix = Path(os.path.realpath(python)).parent.parent
    for path in (prefix, Path(python).parent.parent, *map(Path, paths)):
        path = Path(os.path.realpath(path))
        if path.exists() and path != Path("/"):
            wanted.add(path if path.is_dir() else path.parent)
    kept: list[Path] = []
    for path in sorted(wanted, key=lambda p: len(p.parts)):
        if not any(path == k or k in path.parents for k in kept):
            kept.append(path)
    return [part for path in kept for part in _open_parts(path)]


def _open_parts(path: Path) -> list[Path]:
    """`path` when a job's user may enter it; else the folders in it, each shown on its own (a
    clone in a folder of mode 0700, as `mktemp -d` makes: its folders are open, itself not)."""
    if stat.S_IMODE(path.stat().st_mode) & stat.S_IXOTH:
        return [path]
    return [child for child in sorted(path.iterdir()) if child.is_dir() and not child.is_symlink()]


def interpreter_paths(python: str, pythonpath: str) -> list[str]:
    """What the workers' interpreter imports from (its sys.path, with the workers' PYTHONPATH)."""
    found = subprocess.run(
        [python, "-P", "-s", "-c", "import sys, json; print(json.dumps(sys.path))"],
        env={"PYTHONPATH": pythonpath, "PATH": os.defpath},
        capture_output=True,
        text=True,
        timeout=RUNTIME_TIMEOUT_S,
        check=True,
    )
    return [path for path in json.loads(found.stdout) if path]


# ---- a node's boxes ------------------------------------------------------------------------------


@dataclass
class Boxes:
    """A node's boxes: runc's state and the boxes' root under the agent's folder `workdir`
    (`runtime` None: `--box off`, every job as the agent, in no box)."""

    workdir: Path
    rules: Rules
    python: str = sys.executable
    runtime: str | None = RUNTIME
    shown: list[Path] = field(default_factory=list)  # host folders every box shows, read-only
    stack: str = ""  # this stack's name on the host (its claims' keys)
    uid_base: int = JOB_UID_BASE
    claims: Claims = CLAIMED

    def __post_init__(self) -> None:
        self.workdir = Path(os.path.abspath(self.workdir))  # runc takes a relative path as its bundle's

    @property
    def contained(self) -> bool:
        return self.runtime is not None

    @property
    def agent(self) -> str:
        """This agent's name on the host, the same across its restarts: its boxes' cgroups are
        under `/goodput/<agent>/` (a restarted agent's boxes take the same folder, not a new one)."""
        return hashlib.sha256(str(self.workdir.resolve()).encode()).hexdigest()[:12]

    @property
    def state(self) -> Path:
        return self.workdir / "runc"

    @property
    def root(self) -> Path:
        """The boxes' `/`: open to every job's user (the agent's folder above it is not in a box)."""
        return self.workdir / BOX_ROOT

    def prepare(self) -> None:
        """The boxes' root: an empty folder, the system's links (/bin -> usr/bin) as they are."""
        if not self.contained:
            return
        self.state.mkdir(mode=PRIVATE, parents=True, exist_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)
        for name in SYSTEM_FOLDERS:
            if Path("/", name).is_symlink():
                self.root.mkdir(parents=True, exist_ok=True)
                (self.root / name).symlink_to(os.readlink(Path("/", name)))
        # Every folder on the way to a mount point one the jobs' users may enter, not list, whatever
        # our umask (a private one, as `goodput up` gives its agents, would close the box's own
        # `/work` to them; a listable `/root` would show the way to the project).
        for point in (*self.shown, *MOUNT_POINTS):
            way = self.root
            for part in Path(point).parts[1:]:
                way = way / part
                way.mkdir(exist_ok=True)
                os.chmod(way, 0o711)
        for point in self.shown:  # a folder shown in parts is listed as the host's would be (an import path)
            if point.parent not in self.shown and point.parent != Path("/") and point.parent.is_dir():
                if not stat.S_IMODE(point.parent.stat().st_mode) & stat.S_IXOTH:
                    os.chmod(self.root / point.parent.relative_to("/"), 0o755)
        self.root.mkdir(exist_ok=True)
        os.chmod(self.root, 0o755)

    def open(
        self,
        job_id: str,
        name: str,
        folder: Path,
        user: int | None,
        slots: tuple[int, ...],
        private_network: bool,
        checkpoints: Path | None = None,
        environment: Path | None = None,
        building: bool = False,
    ) -> Box:
        """A box on the node's `slots` (their indices) for job `job_id` (its runc name `name`, unique on this agent) whose
        folder is `folder` (made the job's user's before) and checkpoint folder `checkpoints` (None:
        none of the shared one's); its user from `user`, the job's submission number. `environment`:
        the folder of its requirements' environment, shown read-only (`building`: its user's and
        writable, for the box that builds it)."""
        if checkpoints is not None and checkpoints.name != job_id:
            raise BoxError(
                f"job {job_id}: its checkpoint must be in a folder of its own, named {job_id}, not {checkpoints}"
            )
        if not self.contained:
            box = Box(self, job_id, name, folder, None, checkpoints, environment)
        elif user is None:
            raise BoxError(f"job {job_id}: its order names no user (the executor gives every job one)")
        else:
            box = Box(
                self,
                job_id,
                name,
                folder,
                self.claims.claim(f"{self.stack}/{job_id}", user, self.uid_base),
                checkpoints,
                environment,
            )
        try:
            # Its folders its user's, all in them (an earlier run of the job may have had another user).
            for own in (folder, folder / "tmp", *((checkpoints,) if checkpoints is not None else ())):
                make_own(own, box.uid)
            if building and environment is not None:
                make_own(environment, box.uid)
            if self.contained:
                box.start(slots, private_network, writable_environment=building)
        except BaseException:
            box.close()
            raise
        return box

    def leftovers(self, grace_s: float = STOP_TIMEOUT_S) -> list[str]:
        """The boxes an agent before this one left (it was killed): their processes, whose lifeline
        broke with it, given `grace_s` to checkpoint and stop (SIGTERM too), then each box ended."""
        if not self.contained or not self.state.is_dir():
            return []
        running = self._listed()
        for name in running:
            _runc(self, "kill", "--all", name, "TERM", check=False)
        deadline = time.monotonic() + grace_s
        while any(self._listed().get(name) == "running" for name in running) and time.monotonic() < deadline:
            time.sleep(0.2)
        for name in running:
            _runc(self, "delete", "--force", name, check=False)
        return sorted(running)

    def _listed(self) -> dict[str, str]:
        """This agent's boxes that runc knows, and their status."""
        listed = _runc(self, "list", "--format", "json", check=False).stdout.strip() or "[]"
        return {entry["id"]: entry["status"] for entry in json.loads(listed) or ()}


class Box:
    """One job's box on this node: its processes, user and cgroup."""

    def __init__(
        self,
        boxes: Boxes,
        job_id: str,
        name: str,
        folder: Path,
        uid: int | None,
        checkpoints: Path | None,
        environment: Path | None = None,
    ):
        self.boxes, self.job_id, self.name, self.uid = boxes, job_id, name, uid
        # Absolute: runc takes a relative path as its bundle's (`goodput up`'s DATA is out/stack).
        self.folder = Path(os.path.abspath(folder))
        self.checkpoints = None if checkpoints is None else Path(os.path.abspath(checkpoints))
        self.environment = None if environment is None else Path(os.path.abspath(environment))
        self.processes: list[subprocess.Popen] = []
        self.lifeline: int | None = None  # our end of its first process's stdin
        self.cgroup = f"/goodput/{boxes.agent}/{name}"
        self.closed = False

    @property
    def bundle(self) -> Path:
        return self.boxes.state / "bundles" / self.name

    def inside(self, path: Path) -> Path:
        """A host path of the job's folder or checkpoint folder as the job's processes see it."""
        if not self.boxes.contained:
            return path
        path = Path(os.path.abspath(path))
        for host, seen in (
            (self.folder, JOB_HOME),
            (self.checkpoints, JOB_CHECKPOINTS),
            (self.environment, JOB_ENVIRONMENT),
        ):
            if host is not None and (path == host or host in path.parents):
                return seen / path.relative_to(host)
        raise ValueError(f"{path} is not in job {self.job_id}'s box")

    def env(self) -> dict[str, str]:
        """HOME and TMPDIR: its folder and its own /tmp (in its folder); with an environment, that
        environment's VIRTUAL_ENV and PATH (its scripts first)."""
        if not self.boxes.contained:
            env = {"HOME": str(self.folder), "TMPDIR": str(self.folder / "tmp")}
        else:
            env = {"HOME": str(JOB_HOME), "TMPDIR": "/tmp"}
        if self.environment is not None:
            seen = self.inside(self.environment)
            env |= {"VIRTUAL_ENV": str(seen), "PATH": f"{seen / 'bin'}:{os.environ.get('PATH', os.defpath)}"}
        return env

    @property
    def python(self) -> str:
        """The interpreter its processes run: its environment's, else the node's."""
        return self.boxes.python if self.environment is None else str(self.inside(self.environment) / "bin" / "python")

    def start(self, slots: tuple[int, ...], private_network: bool, writable_environment: bool = False) -> None:
        """The box, its first process holding it open with our lifeline as its stdin."""
        boxes = self.boxes
        shutil.rmtree(self.bundle, ignore_errors=True)
        self.bundle.mkdir(mode=PRIVATE, parents=True)
        _runc(boxes, "delete", "--force", self.name, check=False)  # an older generation's, left by a failed stop
        # Its /tmp first: what it shows of the node (the project in a clone under /tmp) goes over it,
        # on folders made here that others may enter, not list (runc's would be open to all).
        for path in boxes.shown:
            if Path("/tmp") in path.parents:
                _enterable(self.folder / "tmp", path.relative_to("/tmp"))
                if path.parent not in boxes.shown and path.parent != Path("/tmp"):  # shown in parts: listed
                    os.chmod(self.folder / "tmp" / path.parent.relative_to("/tmp"), 0o755)
        mounts = [_bind(self.folder / "tmp", Path("/tmp"))]
        mounts += [_bind(path, path, read_only=True) for path in boxes.shown]
        mounts += [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "bind", "source": "/dev", "options": ["rbind", "nosuid"]},
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": [
                    "nosuid",
                    "nodev",
                    "noexec",
                    "mode=1777",
                    f"size={int(boxes.rules.memory_mb * len(slots))}m",
                ],
            },
            {
                "destination": "/sys",
                "type": "bind",
                "source": "/sys",
                "options": ["rbind", "ro", "nosuid", "nodev", "noexec"],
            },
            {
                "destination": "/run",
                "type": "tmpfs",
                "source": "run",
                "options": ["nosuid", "nodev", "mode=755", "size=16m"],
            },
            _bind(self.folder, JOB_HOME),
        ]
        if self.checkpoints is not None:
            mounts.append(_bind(self.checkpoints, JOB_CHECKPOINTS))
        if self.environment is not None:
            mounts.append(_bind(self.environment, JOB_ENVIRONMENT, read_only=not writable_environment))
        namespaces = [{"type": kind} for kind in ("pid", "ipc", "mount", *(("network",) if private_network else ()))]
        config = {
            "ociVersion": "1.0.2",
            "process": {
                **_process(
                    self.uid,
                    [boxes.python, "-P", "-s", "-m", INIT],
                    {"PATH": os.defpath, "PYTHONPATH": str(_project())},
                    "/",
                    boxes.rules,
                ),
            },
            "root": {"path": str(boxes.root), "readonly": True},
            "mounts": mounts,
            "linux": {
                "namespaces": namespaces,
                "cgroupsPath": self.cgroup,
                "resources": boxes.rules.resources(len(slots), boxes.rules.cores(slots)),
                "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
                "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"],
            },
        }
        (self.bundle / "config.json").write_text(json.dumps(config))
        read, self.lifeline = os.pipe()
        # Its first process keeps runc's stdio: a file for what runc says, never a pipe we wait to close.
        with tempfile.TemporaryFile() as said:
            try:
                done = subprocess.run(
                    [
                        boxes.runtime,
                        "--root",
                        str(boxes.state),
                        "run",
                        "--detach",
                        "--bundle",
                        str(self.bundle),
                        self.name,
                    ],
                    stdin=read,
                    stdout=subprocess.DEVNULL,
                    stderr=said,
                    timeout=RUNTIME_TIMEOUT_S,
                    umask=0o022,  # what runc makes in the box's root is open to its user
                )
            finally:
                os.close(read)
            said.seek(0)
            error = said.read(4096).decode(errors="replace").strip()
        if done.returncode != 0:
            raise BoxError(f"job {self.job_id}: runc could not make its box: {error}")

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: Path,
        stdin: IO | int | None = subprocess.DEVNULL,
        stdout: IO | int | None = subprocess.DEVNULL,
        stderr: IO | int | None = subprocess.DEVNULL,
        text: bool = False,
        errors: str | None = None,
    ) -> subprocess.Popen:
        """One process of the job in its box (its user, limits and view), its stdio as Popen's
        (PIPE: ours, as its `stdin`, `stdout`, `stderr`); it leads a session of its own outside a box."""
        if not self.boxes.contained:
            process = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                start_new_session=True,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                text=text,
                errors=errors,
            )
        else:
            process = self._exec(argv, env, cwd, (stdin, stdout, stderr), text, errors)
        self.processes.append(process)
        return process

    def _exec(self, argv: list[str], env: dict[str, str], cwd: Path, stdio: tuple, text: bool, errors: str | None):
        """`runc exec` of `argv`, its stdio ours, passed through as its fds 3-5 and made its 0-2 as it
        starts: runc's own would copy the process's output until every holder closes it, and a daemon
        the job leaves behind would hold up its end for ever."""
        passed, ours = [], []
        for index, spec in enumerate(stdio):
            if spec == subprocess.PIPE:
                read, write = os.pipe()
                passed.append(read if index == 0 else write)
                ours.append(write if index == 0 else read)
            else:
                fd = spec if isinstance(spec, int) and spec >= 0 else getattr(spec, "fileno", lambda: None)()
                passed.append(os.open(os.devnull, os.O_RDWR) if fd is None else os.dup(fd))
                ours.append(None)
        inner = ["/bin/sh", "-c", 'exec 0<&3 1>&4 2>&5 3<&- 4>&- 5>&-; exec "$@"', "sh", *argv]
        spec = self.bundle / f"process-{len(self.processes)}.json"
        spec.write_text(json.dumps(_process(self.uid, inner, env, str(self.inside(cwd)), self.boxes.rules)))
        runc = [self.boxes.runtime, "--root", str(self.boxes.state), "exec", "--preserve-fds", "3"]
        command = [  # bash: dash takes no file descriptor past 9
            "bash",
            "-c",
            'exec 3<&"$1" 4>&"$2" 5>&"$3"; shift 3; exec "$@"',
            "sh",
            *map(str, passed),
            *runc,
            "--process",
            str(spec),
            self.name,
        ]
        try:
            process = subprocess.Popen(
                command,
                env={"PATH": os.defpath},
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=passed,
            )
        finally:
            for fd in passed:
                os.close(fd)
        modes = ("wb", "rb", "rb")
        for index, (name, fd) in enumerate(zip(("stdin", "stdout", "stderr"), ours)):
            if fd is not None:
                mode = modes[index].replace("b", "") if text else modes[index]
                stream = os.fdopen(
                    fd,
                    mode,
                    **({"errors": errors} if text else {}),
                    **({"buffering": 1} if text and index == 0 else {}),
                )
                setattr(process, name, stream)
        return process

    def signal(self, sig: int) -> None:
        """`sig` to every process of the job's here: in a box, all its cgroup's (but its first, which
        holds it open); else each worker with its session's group."""
        if self.closed:
            return
        if self.boxes.contained:
            _runc(self.boxes, "kill", "--all", self.name, str(int(sig)), check=False)
        else:
            for process in self.processes:
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, sig)

    def memory_note(self) -> str:
        """ "out of memory: N MiB, its limit M MiB" once the kernel killed a process of the box for
        its memory; "" otherwise (or outside a box)."""
        if not self.boxes.contained or self.closed:
            return ""
        return memory_note(self.cgroup)

    def close(self) -> str:
        """The box ended: every process left in it killed, its cgroup removed, its user released.
        Its memory note, read before."""
        if self.closed:
            return ""
        note = self.memory_note()
        self.closed = True
        if self.boxes.contained:
            _runc(self.boxes, "delete", "--force", self.name, check=False)
            shutil.rmtree(self.bundle, ignore_errors=True)
            if self.lifeline is not None:
                os.close(self.lifeline)
                self.lifeline = None
            if self.uid is not None:
                self.boxes.claims.release(self.uid)
        else:
            for process in self.processes:
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
        return note


def _project() -> Path:
    return Path(__file__).resolve().parents[2]


def _enterable(folder: Path, way: Path) -> None:
    """`folder`/`way`, each folder of it made 0711, entered by its handle: through no link a job left."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in way.parts:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o711, dir_fd=fd)
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
            os.fchmod(fd, 0o711)
    finally:
        os.close(fd)


def _bind(source: Path, destination: Path, read_only: bool = False) -> dict:
    options = ["rbind", "nosuid", "nodev", *(("ro",) if read_only else ("rw",))]
    return {"destination": str(destination), "type": "bind", "source": str(source), "options": options}


def _process(uid: int | None, argv: list[str], env: dict[str, str], cwd: str, rules: Rules) -> dict:
    """An OCI process: `argv` as the job's user, no capability, no way to gain one, the rules' limits."""
    return {
        "terminal": False,
        "user": {"uid": uid, "gid": uid, "additionalGids": []},
        "args": argv,
        "env": [f"{name}={value}" for name, value in env.items()],
        "cwd": cwd,
        "noNewPrivileges": True,
        "capabilities": {},
        "rlimits": rules.rlimits(),
    }


def _runc(boxes: Boxes, *arguments: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [boxes.runtime or RUNTIME, "--root", str(boxes.state), *arguments],
        capture_output=True,
        text=True,
        timeout=RUNTIME_TIMEOUT_S,
    )
    if check and done.returncode != 0:
        raise BoxError(f"runc {arguments[0]}: {done.stderr.strip()[-500:]}")
    return done


# ---- cgroups: what the kernel counted of a box ------------------------------------------------------


def cgroup_folder(controller: str, path: str) -> Path | None:
    """Where `path`'s cgroup of `controller` (memory, cpuacct) is on this host: its v1 hierarchy
    of that controller where there is one, else the v2 tree; None without either."""
    v2 = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mount, kind = fields[4], fields[fields.index("-") + 1]
        options = fields[-1].split(",")
        if kind == "cgroup" and controller in options:
            return Path(mount) / path.lstrip("/")
        if kind == "cgroup2":
            v2 = Path(mount) / path.lstrip("/")
    return v2


def _read(path: Path | None) -> str:
    try:
        return path.read_text() if path is not None else ""
    except OSError:
        return ""


def _field(text: str, name: str) -> int:
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return 0


def memory_note(cgroup: str) -> str:
    """The memory note of a cgroup (`Box.memory_note`)."""
    folder = cgroup_folder("memory", cgroup)
    if folder is None:
        return ""
    if (folder / "memory.oom_control").exists():  # v1
        killed = _field(_read(folder / "memory.oom_control"), "oom_kill")
        peak, limit = _read(folder / "memory.max_usage_in_bytes"), _read(folder / "memory.limit_in_bytes")
    else:
        killed = _field(_read(folder / "memory.events"), "oom_kill")
        peak, limit = _read(folder / "memory.peak"), _read(folder / "memory.max")
    if not killed:
        return ""
    mib = lambda text: f"{int(text) / MB:.0f}" if text.strip().isdigit() else "?"  # noqa: E731
    return f"out of memory: {mib(peak)} MiB, its limit {mib(limit)} MiB (the kernel ended {killed} of its processes)"


def cpu_seconds(cgroup: str) -> float:
    """The CPU time the cgroup's processes have used (seconds)."""
    folder = cgroup_folder("cpuacct", cgroup)
    if folder is not None and (folder / "cpuacct.usage").exists():
        return int(_read(folder / "cpuacct.usage") or 0) / 1e9
    return _field(_read(folder / "cpu.stat" if folder else None), "usage_usec") / 1e6


# ---- what a node can give ----------------------------------------------------------------------------


def check(runtime: str | None, python: str, shown: Collection[Path]) -> str:
    """Why this agent cannot box jobs here, with the fix ("" when it can). `runtime` None: `--box off`."""
    if runtime is None:
        return ""
    if os.geteuid() != 0:
        return (
            "the node agent is not root, so it cannot give each job a box of its own (a container with its "
            "own user, cgroup and namespaces): run the agents as root, or pass --box off to run every job's "
            "code as this user, in no box (only for code you trust)"
        )
    for needed in (runtime, "bash"):
        if shutil.which(needed, path=None if needed == runtime else os.defpath) is None:
            return f"no {needed} on this host to box jobs with: install it (Debian: apt-get install {needed}), or pass --box off"
    for controller in ("memory", "cpu", "pids"):
        if cgroup_folder(controller, "/") is None:
            return f"this host has no {controller} cgroup controller for the jobs' boxes: mount it, or pass --box off"
    closed = next(
        ((path, step) for path in (Path(python), _project()) if (step := reachable(path, shown)) is not None),
        None,
    )
    if closed is not None:
        path, step = closed
        return (
            f"a job's user cannot enter {step} (mode {oct(step.stat().st_mode & 0o777)}) on the way to {path}, "
            "which the workers run: open it (chmod o+x), or pass --box off"
        )
    return ""


# ---- the job's folder, from the agent's side ---------------------------------------------------------


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
