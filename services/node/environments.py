"""Each job's Python packages on this node: the environment its `requirements` make, built once per
node and kept, named by a hash of what was asked over what the node has (`shared.requirements`),
shared by every job that asks the same.

An environment is built by uv (`environment_build`: wheels only, so no package's own code runs) in
a box of its own (`box.py`: its own user, cgroup on the slots of the job that asked, no capability;
the node's network, for the package index; none of any job's folders), bounded in time
(`--environment-timeout`), disk (`--environment-max-gb`, its cache and temporary files counted)
and files (MAX_FILES). Once every process of that box has ended, what it built is copied (`_copy`:
new files of ours, 0644/0755, links as links, nothing followed, nothing else) and renamed into
place; jobs' boxes show it read-only at `/env`, where their workers' interpreter is its. A job's
own code never runs in the box that builds it, and nothing the builder made or still holds is the
environment, so no team can plant code in another's.

A build the installer refuses ends the job that asked with its last lines, and is remembered for
ENVIRONMENT_FAILED_KEPT_S for that job's team: its next job asking the same fails at once with the
same lines; another team's is built again (one team's trouble is never another's).
A node keeps the KEPT environments used last, and every one a job runs in; an older one is built
again when asked.
While a build runs, `preparing` says for which jobs and for how long (the executor shows it in
the job's status); the installer's output is kept in the job's logs as its "env" rank's.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from services.node.box import JOB_UID_SPAN, BoxError, Boxes
from services.node.processes import ROOT, wait_ended
from shared.bus.encoding import Refused
from shared.requirements import environment_key
from shared.runtime import ENVIRONMENT_FAILED_KEPT_S, ENVIRONMENT_MAX_S
from shared.schema.nodes import CANNOT_RUN
from shared.subjects import DEFAULT_TEAM

FOLDER = "environments"  # in the agent's folder
KEPT = 16  # environments a node keeps, the newest used (and every one a job runs in)
MAX_FILES = 1_000_000  # files and folders a build may make
INSTALLER = "the installer's exit status"  # a failure of the packages' own (remembered), not the node's
WATCH_S = 1.0  # how often a build's size is looked at
ERROR_LINES = 20  # the installer's last lines in a failed job's reason
KEPT_LINES = 2000  # the installer's lines kept in the job's logs
GIB = 1 << 30
# What of the agent's environment reaches uv: the operator's index, certificates and proxies.
PASSED = ("UV_INDEX", "UV_DEFAULT_INDEX", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS", "UV_NATIVE_TLS")
PASSED += ("UV_SYSTEM_CERTS", "SSL_CERT_FILE", "SSL_CERT_DIR", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY")
log = logging.getLogger(__name__)


def cannot_run(reason: str) -> Refused:
    """A start or profiling run refused for good: the job's packages cannot be had."""
    return Refused(reason, None, CANNOT_RUN)


def find_uv() -> str | None:
    """The uv of the node's interpreter (the `uv` package), or one on PATH."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


class Environments:
    """This node's environments, in `boxes.workdir`/environments: `<key>/` each, built and sealed;
    `<key>.failed` a failed build's lines."""

    def __init__(
        self,
        boxes: Boxes,
        node: str,
        timeout_s: float = 900.0,
        max_bytes: int = 20 * GIB,
        uv: str | None = None,
        in_use: Callable[[], set[Path]] = set,
    ) -> None:
        self.boxes, self.node, self.in_use = boxes, node, in_use  # in_use: the environments jobs run in here
        self.timeout_s, self.max_bytes = min(timeout_s, ENVIRONMENT_MAX_S), max_bytes
        self.uv = uv or find_uv()
        self.folder = boxes.workdir / FOLDER
        self._base: tuple[str, list[str]] | None = None  # what the node's interpreter is, and its site-packages
        self._lock = threading.Lock()
        self._builds: dict[str, threading.Lock] = {}  # key -> held while it is built
        self._waiting: dict[str, float] = {}  # job id -> when it began waiting for its environment (monotonic)

    def preparing(self) -> dict[str, float]:
        """The jobs waiting here for their environment: since how many seconds."""
        now = time.monotonic()
        with self._lock:
            return {job: now - since for job, since in self._waiting.items()}

    def base(self) -> tuple[str, list[str]]:
        """The node's interpreter and packages, in words (part of every environment's name), and its
        site-packages folders."""
        if self._base is None:
            found = subprocess.run(
                [self.boxes.python, "-P", "-s", "-c", _DESCRIBE],
                env={"PATH": os.defpath},
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            described = json.loads(found.stdout)
            self._base = json.dumps([described["version"], described["packages"]]), described["sites"]
        return self._base

    def get(
        self,
        job_id: str,
        requirements: tuple[str, ...],
        slots: tuple[int, ...],
        keep: Callable[[str], None] | None = None,
        team: str = DEFAULT_TEAM,
    ) -> Path:
        """The folder of the environment of `requirements`, built first unless it is here (in a box
        on `slots`, the installer's lines to `keep`); `cannot_run` when it cannot be built (the
        installer's refusal is remembered for the asking job's `team`)."""
        if self.uv is None:
            raise cannot_run(
                f"job {job_id} asks for Python packages, and node {self.node} has no uv to install them: "
                "pip install uv into the node agents' environment"
            )
        key = environment_key(requirements, self.base()[0])
        with self._lock:
            self._waiting[job_id] = time.monotonic()
            build = self._builds.setdefault(key, threading.Lock())
        try:
            with build:  # one build of a key at a time; the others wait for it, then take it
                return self._ready(key, team) or self._build(job_id, key, requirements, slots, team, keep)
        finally:
            with self._lock:
                self._waiting.pop(job_id, None)

    def _ready(self, key: str, team: str) -> Path | None:
        built = self.folder / key
        if built.is_dir():
            os.utime(built)  # the newest used are the ones kept
            return built
        failed = self.folder / f"{key}.{team}.failed"  # a team's failure answers that team's asks only
        try:
            if time.time() - failed.stat().st_mtime < ENVIRONMENT_FAILED_KEPT_S:
                raise cannot_run(failed.read_text())
            failed.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        return None

    def _build(
        self,
        job_id: str,
        key: str,
        requirements: tuple[str, ...],
        slots: tuple[int, ...],
        team: str,
        keep: Callable[[str], None] | None,
    ) -> Path:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        staging, home = self.folder / f".{key}.building", self.folder / f".{key}.home"
        sealing = self.folder / f".{key}.sealing"
        for leftover in (staging, home, sealing):
            _remove(leftover)
        started = time.monotonic()
        name = f"env-{key}"
        try:
            box = self.boxes.open(
                name,
                name,
                home,
                int(key[:6], 16) % JOB_UID_SPAN,  # a user of its own: no job's
                slots,
                private_network=False,  # the package index
                environment=staging,
                building=True,
            )
        except BoxError as error:  # the node's trouble, not the job's: its start fails and is tried again
            raise ValueError(f"job {job_id}: its environment's box could not be made on node {self.node}: {error}")
        with tempfile.TemporaryFile() as output:  # ours: the box never sees it
            try:
                (home / "requirements.txt").write_text("\n".join(requirements) + "\n")
                if box.uid is not None:
                    os.chown(home / "requirements.txt", box.uid, box.uid)
                env = {**box.env(), "PATH": os.defpath, "PYTHONPATH": str(ROOT)}
                env |= {name: os.environ[name] for name in PASSED if name in os.environ}
                env |= {"UV_CACHE_DIR": str(box.inside(home / "cache")), "UV_PYTHON_DOWNLOADS": "never"}
                process = box.spawn(
                    [
                        self.boxes.python,
                        *("-P", "-s", "-m", "services.node.environment_build"),
                        self.uv,
                        os.path.realpath(self.boxes.python),
                        str(box.inside(home / "requirements.txt")),
                        str(box.inside(staging)),
                        *self.base()[1],
                    ],
                    env,
                    home,
                    stdout=output,
                    stderr=output,
                )
                problem = self._watch(process, (staging, home))
                box.signal(9)
                wait_ended(process, 10.0)
            finally:
                box.close()  # every process of it ended before its files are copied
            output.seek(0)
            lines = output.read().decode(errors="replace").splitlines()
        built = self.folder / key
        try:
            if problem is None:  # a copy: new files of ours, nothing the builder could still hold or change
                problem = _copy(staging, sealing, self.max_bytes)
                if problem is None:
                    os.rename(sealing, built)
        except (OSError, RecursionError) as error:
            problem = f"its files could not be taken: {type(error).__name__}"
        finally:
            for leftover in (staging, home, sealing):
                _remove(leftover)
        took = time.monotonic() - started
        if keep is not None:
            for line in [
                *lines[-KEPT_LINES:],
                f"environment {key}: {'built' if problem is None else 'failed'} in {took:.1f} s",
            ]:
                keep(line)
        if problem is not None:
            said = [line for line in lines if not line.startswith("Using Python")]  # uv's word on where
            tail = "\n".join(said[-ERROR_LINES:])
            reason = f"its requirements could not be installed on node {self.node} ({problem}):\n{tail}"
            if problem.startswith(INSTALLER):  # the packages' own trouble, not the node's: remembered
                (self.folder / f"{key}.{team}.failed").write_text(reason)
            raise cannot_run(reason)
        log.info("job %s: environment %s built in %.1f s", job_id, key, took)
        self._evict(keep=built)
        return built

    def _evict(self, keep: Path) -> None:
        """All but the KEPT environments used last removed, but `keep` and those jobs run in."""
        held = {keep, *self.in_use()}
        found = []
        for path in self.folder.iterdir():
            if path.is_dir() and not path.name.startswith(".") and path not in held:
                found.append((path.stat().st_mtime, path))
        for _, old in sorted(found, reverse=True)[KEPT - 1 :]:
            _remove(old)
            log.info("environment %s removed: %d newer are kept", old.name, KEPT)

    def _watch(self, process: subprocess.Popen, folders: tuple[Path, ...]) -> str | None:
        """Wait for the build; why it failed (None: it did not)."""
        deadline = time.monotonic() + self.timeout_s
        while (code := wait_ended(process, WATCH_S)) is None:
            if time.monotonic() > deadline:
                return f"it took over {self.timeout_s:.0f} s, the node's --environment-timeout"
            if problem := self._too_big(folders):
                return problem
        if code != 0:
            return f"{INSTALLER} {code}"
        return self._too_big(folders)

    def _too_big(self, folders: tuple[Path, ...]) -> str | None:
        size, files = map(sum, zip(*(_usage(folder) for folder in folders)))
        if size > self.max_bytes:
            return f"it took over {size / GIB:.1f} GiB, past the node's --environment-max-gb {self.max_bytes / GIB:g}"
        if files > MAX_FILES:
            return f"it made over {MAX_FILES:,} files"
        return None


def _usage(folder: Path) -> tuple[int, int]:
    """The disk a folder's files take (bytes, by their blocks) and how many there are; not followed."""
    size = count = 0
    try:
        for _, folders, files, at in os.fwalk(folder, follow_symlinks=False):
            for name in (*folders, *files):
                count += 1
                try:
                    size += os.stat(name, dir_fd=at, follow_symlinks=False).st_blocks * 512
                except FileNotFoundError:
                    pass
    except RecursionError:
        return size, MAX_FILES + 1  # deeper than we walk: too much
    return size, count


def _remove(folder: Path) -> None:
    """A folder a builder made removed, however deep, following no link."""
    subprocess.run(["rm", "-rf", "--one-file-system", "--", str(folder)], check=False)


def _copy(source: Path, destination: Path, max_bytes: int) -> str | None:
    """The environment a builder made copied into `destination`, a new folder of ours: folders
    0755, files 0644 or 0755, links as links; nothing else (no FIFO, no setuid bit), nothing
    followed (each entry opened by its folder's handle, O_NOFOLLOW), nothing shared with what the
    builder made (a handle it left open, a folder it may still change, are not the copy's). Why it
    cannot be taken, or None."""
    os.mkdir(destination, 0o700)
    copied = 0
    for relative, folders, files, at in os.fwalk(source, follow_symlinks=False):
        target = destination / os.path.relpath(relative, source)
        for name in folders:
            (target / name).mkdir()
            os.chmod(target / name, 0o755)  # whatever our umask
        for name in files:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=at)
            except OSError as error:
                if error.errno == errno.ELOOP:  # a link: as a link
                    (target / name).symlink_to(os.readlink(name, dir_fd=at))
                continue  # gone, or nothing a file could be opened as: left out
            with os.fdopen(fd, "rb") as file:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    continue
                with open(target / name, "xb") as out:
                    while chunk := file.read(1 << 20):
                        copied += len(chunk)
                        if copied > max_bytes:
                            return f"it takes over {max_bytes / GIB:g} GiB, the node's --environment-max-gb"
                        out.write(chunk)
                os.chmod(target / name, 0o755 if info.st_mode & 0o111 else 0o644)
    os.chmod(destination, 0o755)
    return None


# What the node's interpreter is: its version, its packages, its site-packages.
_DESCRIBE = """
import importlib.metadata as m, json, site, sys
print(json.dumps({
    "version": sys.version,
    "packages": sorted(f"{d.metadata['Name']}=={d.version}" for d in m.distributions()),
    "sites": [p for p in site.getsitepackages() if __import__("os").path.isdir(p)],
}))
"""
