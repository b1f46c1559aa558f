"""A job's own code on a node: the archive its submission names (its owner's, by digest:
`stored_name`), fetched from the code store once per node and checked against that digest, kept in
the agent's folder (the newest CACHED), and unpacked safely (`shared.code_archive.unpack`) into the
job's folder, `code/`, where its workers run it; by a process of the job's user when it has one, so
that the unpacking can do no more there than the job itself. It is unpacked again only when the job
names another archive: a job's restarts and rescales on the node run what is there.
`store_fetcher` reads the store from the agent's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import nats.js.errors

from services.node.box import Box
from shared import subjects
from shared.bus import Bus
from shared.code_archive import (
    KIB,
    MISSING,
    REFUSED,
    digest,
    entrypoint_missing,
    remove,
    stored_digest,
    unpack,
)

CACHED = 32  # archives a node keeps (each at most 32 MiB)
FETCH_TIMEOUT_S = 300.0
UNPACK_TIMEOUT_S = 120.0
ROOT = Path(__file__).resolve().parents[2]  # the project, where the job's user finds `shared`
CODE_FOLDER = "code"  # in the job's folder


class JobCode:
    """The code store's archives on this node: `fetch(digest)` reads one (None: not stored), `folder`
    (the agent's own) keeps them."""

    def __init__(self, folder: Path, fetch: Callable[[str], bytes | None]) -> None:
        self.folder, self.fetch = folder, fetch

    def archive(self, archive: str) -> bytes:
        """The archive's bytes (by its name in the store, `stored_name`), fetched unless kept;
        ValueError when it is not stored or not what its digest says."""
        expected = stored_digest(archive)  # also what makes it a plain file name here
        kept = self.folder / archive
        try:
            os.utime(kept)  # the newest are kept
            return kept.read_bytes()
        except FileNotFoundError:
            pass
        data = self.fetch(archive)
        if data is None:
            raise ValueError(f"no archive {archive} in the code store (it ages out after 30 days): submit it again")
        if digest(data) != expected:
            raise ValueError(f"the code store's archive {archive} has the sha256 {digest(data)}: refused")
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        # A name of its own: starts of other jobs fetch and evict at the same time, in other threads.
        with tempfile.NamedTemporaryFile(
            dir=self.folder, prefix=f".{archive}.", suffix=".fetched", delete=False
        ) as file:
            file.write(data)
        os.replace(file.name, kept)
        self._evict()
        return data

    def _evict(self) -> None:
        """All but the newest CACHED archives removed; one another thread renamed or removed meanwhile is passed over."""
        kept = []
        for path in self.folder.iterdir():
            if path.name.startswith("."):  # being fetched
                continue
            with contextlib.suppress(FileNotFoundError):
                kept.append((path.stat().st_mtime, path))
        for _, old in sorted(kept, reverse=True)[CACHED:]:
            old.unlink(missing_ok=True)

    def prepare(self, job_folder: Path, archive: str, entrypoint: str, marker: Path, box: Box | None = None) -> Path:
        """The job's code, unpacked into `job_folder`/code (again when `marker`, the agent's note of
        what is there, names another archive); ValueError when it cannot be, or its entrypoint is not
        in it. In a box, unpacked and looked into by a process of the job's, in its box: never by us
        as root in a folder the job may change (no `box`, or `--box off`'s: by us)."""
        code = job_folder / CODE_FOLDER
        unpacked = marker.is_file() and marker.read_text() == archive and code.is_dir() and not code.is_symlink()
        data = None if unpacked else self.archive(archive)
        if data is not None:
            marker.unlink(missing_ok=True)
        if box is None or box.uid is None:
            if data is not None:
                remove(code)
                unpack(data, code)
                marker.write_text(archive)
            missing = entrypoint_missing(code, entrypoint)
        else:
            status, missing = _in_box(box, code, entrypoint, data)
            if data is not None and status in (0, MISSING):
                marker.write_text(archive)
        if missing is not None:
            raise ValueError(missing)
        return code


def _in_box(box: Box, code: Path, entrypoint: str, data: bytes | None) -> tuple[int, str | None]:
    """`shared.code_archive`'s `main` run in the job's box: the archive `data` unpacked into `code`
    (None: what is there kept), and `entrypoint` looked for. Its exit status, and why it failed (None: it did not)."""
    command = [box.boxes.python, "-P", "-s", "-m", "shared.code_archive", "find" if data is None else "unpack"]
    with tempfile.TemporaryFile() as errors:  # on disk: what it says is not held in our memory
        process = box.spawn(
            [*command, str(box.inside(code)), entrypoint],
            {"PYTHONPATH": str(ROOT), "PATH": os.defpath},  # nothing else of ours
            box.folder,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=errors,
        )
        try:
            process.communicate(data or b"", timeout=UNPACK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            box.signal(signal.SIGKILL)
            process.wait()
            return -1, f"unpacking the job's code in its box took over {UNPACK_TIMEOUT_S:.0f} s"
        if process.returncode == 0:
            return 0, None
        errors.seek(max(0, os.fstat(errors.fileno()).st_size - 4 * KIB))
        said = errors.read().decode(errors="replace").strip().splitlines()
    reason = said[-1] if said else f"exit status {process.returncode}"
    if process.returncode in (REFUSED, MISSING):
        return process.returncode, reason
    return process.returncode, f"unpacking the job's code in its box (uid {box.uid}) failed: {reason}"


def store_fetcher(bus: Bus, loop: asyncio.AbstractEventLoop) -> Callable[[str], bytes | None]:
    """Read an archive from the code store from a thread of the agent's (None: not stored)."""
    opened = []

    async def fetch(name: str) -> bytes | None:
        if not opened:
            opened.append(await bus.js.object_store(subjects.CODE_STORE))
        try:
            return (await opened[0].get(name)).data
        except nats.js.errors.ObjectNotFoundError:
            return None

    return lambda name: asyncio.run_coroutine_threadsafe(fetch(name), loop).result(FETCH_TIMEOUT_S)
