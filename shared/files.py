"""What goodput writes at run time is its owner's only: files 0600, folders 0700.

Logs (the services', the NATS server's, each job's), node work folders, jobs' output and checkpoints
may hold data and code of the jobs, so no other account of the machine may read them. Each of
goodput's processes (every service and node agent, and `goodput up` while it runs: `private_files`)
sets the umask PRIVATE_UMASK: all it creates from then on, and all the processes it starts create
(the NATS server, the jobs' workers, whatever a job's own code writes), is private without each call
saying so. A umask does not reach what exists already (made by an earlier version, or under another
umask): `make_private` tightens a folder and everything in it. A job sees its own folders in its
box (services/node/box.py), never through the folders above them.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Collection, Iterator
from pathlib import Path

PRIVATE_UMASK = 0o077  # no bit for the group or others: files 0600, folders 0700
PRIVATE_FOLDER = 0o700


def private_umask() -> int:
    """From now on, this process and every process it starts create private files and folders;
    the umask before."""
    return os.umask(PRIVATE_UMASK)


@contextlib.contextmanager
def private_files() -> Iterator[None]:
    """`private_umask` until the block ends (the umask is the process's: one caller in a process
    that does more, a test's, gets its own back)."""
    previous = private_umask()
    try:
        yield
    finally:
        os.umask(previous)


def make_private(folder: Path, skip: Collection[str] = ()) -> Path:
    """`folder` (made if missing, as the umask makes the folders above it) and everything in it
    readable by its owner only: each folder 0700, each file without its group and other bits; the
    folders of it named in `skip` left as they are, with all in them. Nothing is followed: not a
    symbolic link, not a folder swapped for one meanwhile (each is entered by its handle), and a
    file is changed through its own (not one with more names: a hard link to someone else's). What
    vanishes meanwhile (a running server's file) is passed by."""
    folder.mkdir(mode=PRIVATE_FOLDER, parents=True, exist_ok=True)
    top = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for root, folders, files, at in os.fwalk(".", dir_fd=top, follow_symlinks=False):
            if root == ".":
                folders[:] = [name for name in folders if name not in skip]
            os.fchmod(at, PRIVATE_FOLDER)
            for name in files:
                _tighten(name, at)
    finally:
        os.close(top)
    return folder


def _tighten(name: str, folder: int) -> None:
    """A regular file of `folder` (a handle) without its group and other bits, opened without
    following a link or waiting (a FIFO)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    except OSError:  # a link, a socket, gone, or not readable even by its owner
        return
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and stat.S_IMODE(info.st_mode) & PRIVATE_UMASK:
            os.fchmod(fd, stat.S_IMODE(info.st_mode) & ~PRIVATE_UMASK)
    finally:
        os.close(fd)
