"""A job's own code on a node: the archive its submission names (by digest), fetched from the code
store once per node and checked against that digest, kept in the agent's folder (the newest
CACHED), and unpacked safely (`shared.code_archive.unpack`) into the job's folder, `code/`, where its
workers run it. It is unpacked again only when the job names another archive: a job's restarts and
rescales on the node run what is there. `store_fetcher` reads the store from the agent's threads.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import nats.js.errors

from shared import subjects
from shared.bus import Bus
from shared.code_archive import digest, unpack

CACHED = 32  # archives a node keeps (each at most 32 MiB)
FETCH_TIMEOUT_S = 300.0
CODE_FOLDER = "code"  # in the job's folder


class JobCode:
    """The code store's archives on this node: `fetch(digest)` reads one (None: not stored), `folder`
    (the agent's own) keeps them."""

    def __init__(self, folder: Path, fetch: Callable[[str], bytes | None]) -> None:
        self.folder, self.fetch = folder, fetch

    def archive(self, archive: str) -> bytes:
        """The archive's bytes, fetched unless kept; ValueError when it is not stored or not what its
        digest says."""
        kept = self.folder / archive
        if kept.is_file():
            os.utime(kept)  # the newest are kept
            return kept.read_bytes()
        data = self.fetch(archive)
        if data is None:
            raise ValueError(f"no archive {archive} in the code store (it ages out after 30 days): submit it again")
        if digest(data) != archive:
            raise ValueError(f"the code store's archive {archive} has the sha256 {digest(data)}: refused")
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = kept.with_name(f".{archive}.fetched")
        partial.write_bytes(data)
        os.replace(partial, kept)
        for old in sorted(self.folder.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)[CACHED:]:
            old.unlink(missing_ok=True)
        return data

    def prepare(self, job_folder: Path, archive: str, entrypoint: str, marker: Path) -> Path:
        """The job's code, unpacked into `job_folder`/code (again when `marker`, the agent's note of
        what is there, names another archive); ValueError when it cannot be, or its entrypoint is not in it."""
        code = job_folder / CODE_FOLDER
        if not (marker.is_file() and marker.read_text() == archive and code.is_dir() and not code.is_symlink()):
            data = self.archive(archive)
            if code.is_symlink() or code.is_file():
                code.unlink()
            elif code.exists():
                shutil.rmtree(code)
            marker.unlink(missing_ok=True)
            unpack(data, code)
            marker.write_text(archive)
        missing = entrypoint_missing(code, entrypoint)
        if missing is not None:
            raise ValueError(missing)
        return code


def entrypoint_missing(code: Path, entrypoint: str) -> str | None:
    """Why `entrypoint` names nothing in the unpacked `code`; None when it names a script or module there."""
    if entrypoint.endswith(".py"):
        candidates = [PurePosixPath(entrypoint)]
    else:
        parts = entrypoint.split(".")
        candidates = [
            PurePosixPath(*parts[:-1], f"{parts[-1]}.py"),
            PurePosixPath(*parts, "__main__.py"),
        ]
    if any(code.joinpath(*c.parts).is_file() for c in candidates):
        return None
    found = sorted(p.relative_to(code).as_posix() for p in code.rglob("*.py"))[:10]
    return (
        f"entrypoint {entrypoint!r} is not in the job's code (looked for {' or '.join(map(str, candidates))}; "
        f"its Python files: {', '.join(found) or 'none'})"
    )


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
