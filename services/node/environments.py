"""Each job's Python packages on this node: the environment its `requirements` make, built once per
node and kept, named by a hash of what was asked over what the node has (`shared.requirements`),
shared by every job that asks the same.

An environment is built by uv (`environment_build`) in a box of its own (`box.py`: its own user,
cgroup on the slots of the job that asked, no capability; the node's network, for the package
index; none of any job's folders), bounded in time (`--environment-timeout`) and size
(`--environment-max-gb`). What it built is then sealed: every process of its box ended, its files
made root's and read-only, and renamed into place; jobs' boxes show it read-only at `/env`, where
their workers' interpreter is its. A job's own code never runs in the box that builds it, and no
job's user can write to it after, so no team can plant code in another's environment.

A build that fails ends the job that asked with the installer's last lines, and is remembered for
ENVIRONMENT_FAILED_KEPT_S: another job asking the same on this node fails at once with the same lines.
A node keeps the KEPT environments used last, and every one a job runs in; an older one is built
again when asked.
While a build runs, `preparing` says for which jobs and for how long (the executor shows it in
the job's status); the installer's output is kept in the job's logs as its "env" rank's.
"""

from __future__ import annotations

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

FOLDER = "environments"  # in the agent's folder
KEPT = 16  # environments a node keeps, the newest used (and every one a job runs in)
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
    ) -> Path:
        """The folder of the environment of `requirements`, built first unless it is here (in a box
        on `slots`, the installer's lines to `keep`); `cannot_run` when it cannot be built."""
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
                return self._ready(key) or self._build(job_id, key, requirements, slots, keep)
        finally:
            with self._lock:
                self._waiting.pop(job_id, None)

    def _ready(self, key: str) -> Path | None:
        built = self.folder / key
        if built.is_dir():
            os.utime(built)  # the newest used are the ones kept
            return built
        failed = self.folder / f"{key}.failed"
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
        keep: Callable[[str], None] | None,
    ) -> Path:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        staging, home = self.folder / f".{key}.building", self.folder / f".{key}.home"
        for leftover in (staging, home):
            shutil.rmtree(leftover, ignore_errors=True)
        started = time.monotonic()
        name = f"env-{key[:12]}"
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
        except BoxError as error:
            raise cannot_run(f"job {job_id}: its environment's box could not be made on node {self.node}: {error}")
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
                problem = self._watch(process, staging)
                box.signal(9)
                wait_ended(process, 10.0)
            finally:
                box.close()  # every process of it ended before its files are sealed
            output.seek(0)
            lines = output.read().decode(errors="replace").splitlines()
        took = time.monotonic() - started
        if keep is not None:
            for line in [
                *lines[-KEPT_LINES:],
                f"environment {key}: {'built' if problem is None else 'failed'} in {took:.1f} s",
            ]:
                keep(line)
        shutil.rmtree(home, ignore_errors=True)
        if problem is not None:
            shutil.rmtree(staging, ignore_errors=True)
            said = [line for line in lines if not line.startswith("Using Python")]  # uv's word on where
            tail = "\n".join(said[-ERROR_LINES:])
            reason = f"its requirements could not be installed on node {self.node} ({problem}):\n{tail}"
            (self.folder / f"{key}.failed").write_text(reason)
            raise cannot_run(reason)
        _seal(staging, contained=self.boxes.contained)
        built = self.folder / key
        os.rename(staging, built)
        log.info("job %s: environment %s built in %.1f s", job_id, key, took)
        self._evict(keep=built)
        return built

    def _evict(self, keep: Path) -> None:
        """All but the KEPT environments used last removed, but `keep` and those jobs run in."""
        held = {keep, *self.in_use()}
        with self._lock:
            building = set(self._builds)
        found = []
        for path in self.folder.iterdir():
            if path.is_dir() and not path.name.startswith(".") and path not in held and path.name not in building:
                found.append((path.stat().st_mtime, path))
        for _, old in sorted(found, reverse=True)[KEPT - 1 :]:
            shutil.rmtree(old, ignore_errors=True)
            log.info("environment %s removed: %d newer are kept", old.name, KEPT)

    def _watch(self, process: subprocess.Popen, staging: Path) -> str | None:
        """Wait for the build; why it failed (None: it did not)."""
        deadline = time.monotonic() + self.timeout_s
        while (code := wait_ended(process, WATCH_S)) is None:
            if time.monotonic() > deadline:
                return f"it took over {self.timeout_s:.0f} s, the node's --environment-timeout"
            if (size := _size(staging)) > self.max_bytes:
                return (
                    f"it took over {size / GIB:.1f} GiB, past the node's --environment-max-gb {self.max_bytes / GIB:g}"
                )
        if code != 0:
            return f"the installer's exit status {code}"
        if (size := _size(staging)) > self.max_bytes:
            return f"it takes {size / GIB:.1f} GiB, over the node's --environment-max-gb {self.max_bytes / GIB:g}"
        return None


def _size(folder: Path) -> int:
    total = 0
    for _, _, files, at in os.fwalk(folder, follow_symlinks=False):
        for name in files:
            try:
                total += os.stat(name, dir_fd=at, follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
    return total


def _seal(folder: Path, contained: bool) -> None:
    """A built environment made ours and read-only for everyone else (what is neither a file, a
    folder nor a link removed), entered by handles: nothing is followed. No process of its builder
    is left (its box has ended), so nothing changes under us."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for _, folders, files, at in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
            for name in (*folders, *files):
                info = os.stat(name, dir_fd=at, follow_symlinks=False)
                if stat.S_ISLNK(info.st_mode):
                    if contained:
                        os.chown(name, 0, 0, dir_fd=at, follow_symlinks=False)
                elif stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode):
                    if contained:
                        os.chown(name, 0, 0, dir_fd=at, follow_symlinks=False)
                    mode = 0o755 if stat.S_ISDIR(info.st_mode) or info.st_mode & 0o111 else 0o644
                    os.chmod(name, mode, dir_fd=at)
                else:
                    os.unlink(name, dir_fd=at)
        if contained:
            os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o755)
    finally:
        os.close(fd)


# What the node's interpreter is: its version, its packages, its site-packages.
_DESCRIBE = """
import importlib.metadata as m, json, site, sys
print(json.dumps({
    "version": sys.version,
    "packages": sorted(f"{d.metadata['Name']}=={d.version}" for d in m.distributions()),
    "sites": [p for p in site.getsitepackages() if __import__("os").path.isdir(p)],
}))
"""
