"""A job's own code as an archive: packed by `goodput submit --code DIR`, kept in the code store
under its digest, checked by the API before it is stored and unpacked by the node agent that runs it.

An archive is a gzipped tar, made the same from the same files (`pack`: members sorted, times,
owners and modes zeroed or normalised, no `__pycache__` or `.git`), so its sha256 (`digest`) names
its content. What may be in one is narrow, and whatever else is refused with the reason
(`ArchiveRefused`), never skipped: regular files and folders only (no symbolic or hard links, no
devices or fifos), relative paths that stay inside the folder (no `/...`, no `..`), each name once,
and caps on the compressed size, the unpacked size, one file's size and the number of files. An
archive may unpack to at most `Limits.ratio` times its size (code and text pack 1.5 to 15 times;
a bomb, a file of zeros, about 1,000 times), and that is checked before the CPU is spent: against
the size gzip's trailer says the stream inflates to, before anything is inflated; against the
sizes the tar headers declare, as each is read, before its file (or an extended header's data, at
most MAX_EXTENDED) is inflated; and the stream is inflated through a counter that stops it at the
bound, whatever the headers said. `unpack` writes into a fresh folder beside the destination and
renames it into place only when every member passed: a refused archive leaves nothing behind.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import os
import re
import shutil
import stat
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

KIB, MIB = 1024, 1024**2
SKIPPED = frozenset({"__pycache__", ".git"})  # folders `pack` leaves out
SKIPPED_SUFFIXES = (".pyc",)
MAX_ENTRYPOINT = 256
MAX_ARGS = 64  # a job's arguments, each at most MAX_ARG characters
MAX_ARG = 1024
MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
DIGEST = re.compile(r"^[0-9a-f]{64}$")
COPY_CHUNK = 64 * KIB
EXTENDED = (
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
)
MAX_EXTENDED = 64 * KIB  # an extended header's data: a path is at most 4 KiB
GZIP_MAGIC, GZIP_LEAST = b"\x1f\x8b", 18  # how gzip begins; its header and trailer's bytes


@dataclass(frozen=True)
class Limits:
    """What one archive may be."""

    compressed: int = 32 * MIB  # the archive as stored
    unpacked: int = 128 * MIB  # all its files together
    files: int = 2_000  # files and folders
    file: int = 64 * MIB  # one file
    ratio: int = 100  # what it may unpack to, per byte of it (its gzip stream: files and headers)...
    small: int = 1 * MIB  # ... but any archive may unpack to this much (a few files: tar's padding is zeros)

    @property
    def stream(self) -> int:
        """The most the gzip stream may inflate to: the files, a header (and a long name's) per member, the end."""
        return self.unpacked + self.files * 3 * 512 + 20 * 512

    def inflatable(self, compressed: int) -> int:
        """The most the gzip stream of an archive of `compressed` bytes may inflate to."""
        return min(self.stream, max(self.ratio * compressed, self.small))


LIMITS = Limits()


class ArchiveRefused(ValueError):
    """An archive that is not one goodput runs; the message says why."""


def digest(data: bytes) -> str:
    """The archive's name in the code store: its sha256, in hex."""
    return hashlib.sha256(data).hexdigest()


STORED_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}\.([0-9a-f]{64})$")


def stored_name(login: str, archive: str) -> str:
    """The name in the code store of `login`'s archive whose digest is `archive`: each login's are its
    own there (counted in its share of the store, run only by its jobs)."""
    return f"{login}.{archive}"


def owned(code: tuple[str, str, tuple[str, ...], tuple[str, ...]], login: str) -> tuple:
    """A job's own code as the node agents take it (`JobSpec.own_code`), its archive named as its
    owner's in the code store; ("", "", (), ()) for a job module's."""
    archive, *rest = code
    return (stored_name(login, archive) if archive else "", *rest)


def stored_digest(name: str) -> str:
    """The digest in a code store's name (`stored_name`); ValueError when it is not one."""
    matched = STORED_NAME.match(name)
    if matched is None:
        raise ValueError(f"{name!r} names no archive in the code store (a login, a dot and a sha256 in hex)")
    return matched.group(1)


def entrypoint_problem(entrypoint: str) -> str | None:
    """Why `entrypoint` cannot name what a job runs: a `.py` script by its path inside the archive
    (relative, no `..`), or a module by its dotted name (`python -m`); None when it can."""
    if not entrypoint or len(entrypoint) > MAX_ENTRYPOINT:
        return f"an entrypoint is 1 to {MAX_ENTRYPOINT} characters"
    if entrypoint.endswith(".py"):
        problem = path_problem(entrypoint)
        return None if problem is None else f"entrypoint {entrypoint!r}: {problem}"
    if MODULE.match(entrypoint):
        return None
    return (
        f"entrypoint {entrypoint!r} is neither a script (a relative path inside the code ending in .py, "
        "e.g. train.py) nor a module's dotted name (e.g. trainer.main)"
    )


def path_problem(name: str) -> str | None:
    """Why a member's path cannot be unpacked inside the folder; None when it can."""
    if "\0" in name or "\\" in name:
        return "its path holds a NUL or a backslash"
    if name.startswith("/"):
        return "an absolute path"
    if ".." in PurePosixPath(name).parts:
        return "a path with '..' (it would reach outside its folder)"
    return None


def pack(directory: str | Path, limits: Limits = LIMITS) -> bytes:
    """The archive of `directory`'s files (not `__pycache__`, `.git`, `.pyc`), the same bytes for the
    same files. ArchiveRefused for a link or a special file in it (name it, or copy the file in its
    place), or when it is over the caps."""
    root = Path(directory)
    if not root.is_dir():
        raise ArchiveRefused(f"{root} is not a folder")
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as zipped,
        tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for path in _walk(root):
            relative = path.relative_to(root).as_posix()
            info = tarfile.TarInfo(relative)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            mode = path.lstat().st_mode
            if stat.S_ISDIR(mode):
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = path.stat().st_size, 0o755 if mode & stat.S_IXUSR else 0o644
                with path.open("rb") as file:
                    tar.addfile(info, file)
    data = buffer.getvalue()
    check(data, limits)
    return data


def _walk(root: Path):
    """The files and folders under `root`, sorted, skipping SKIPPED; a link or special file refused."""
    for path in sorted(root.iterdir(), key=lambda p: p.name):
        mode = path.lstat().st_mode
        if path.name in SKIPPED or path.name.endswith(SKIPPED_SUFFIXES):
            continue
        if stat.S_ISLNK(mode):
            raise ArchiveRefused(
                f"{path} is a symbolic link: a job's code holds files only (copy the file in its place)"
            )
        if stat.S_ISDIR(mode):
            yield path
            yield from _walk(path)
        elif stat.S_ISREG(mode):
            yield path
        else:
            raise ArchiveRefused(f"{path} is not a regular file (a device, fifo or socket)")


def _too_large(limits: Limits, compressed: int, unpacked: int | None = None) -> str:
    """Why an archive of `compressed` bytes that unpacks to `unpacked` (None: more than it may) is refused."""
    bound = limits.inflatable(compressed)
    if bound == limits.stream:
        return f"it unpacks to more than {limits.unpacked // MIB} MiB"
    said = f"at least {unpacked / compressed:,.0f}" if unpacked is not None else f"more than {limits.ratio}"
    return (
        f"it unpacks to {said} times its size, and an archive may unpack to at most {limits.ratio} times its "
        f"size (this one of {compressed / KIB:,.1f} KiB: {bound / MIB:.1f} MiB); code and text pack 1.5 to 15 times, "
        "a file of repeated bytes (zeros, padding) far more: leave such a file out and make it when the job starts"
    )


def _declared(data: bytes) -> int:
    """What gzip's trailer says the stream inflates to (its last member's size, modulo 2**32): were it
    a lie, it could only be smaller than the stream."""
    return int.from_bytes(data[-4:], "little")


class _Header(tarfile.TarInfo):
    """A member's header, as tarfile reads it; an extended header (a long name, pax records), whose
    data tarfile reads whole before the member it extends, refused past MAX_EXTENDED before that."""

    @classmethod
    def frombuf(cls, buf, encoding, errors):
        header = super().frombuf(buf, encoding, errors)
        if header.type in EXTENDED and header.size > MAX_EXTENDED:
            raise ArchiveRefused(
                f"an extended header (a long name or pax records) of {header.size:,} bytes: "
                f"at most {MAX_EXTENDED // KIB} KiB"
            )
        return header


class _Inflated(io.RawIOBase):
    """The gzip stream of an archive, inflated as it is read, refused past what `limits` let it inflate to."""

    def __init__(self, data: bytes, limits: Limits) -> None:
        self.source, self.limits, self.count = gzip.GzipFile(fileobj=io.BytesIO(data)), limits, 0
        self.compressed, self.limit = len(data), limits.inflatable(len(data))

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            chunk = self.source.read(len(buffer))
        except (OSError, EOFError, gzip.BadGzipFile) as error:
            raise ArchiveRefused(f"not a gzipped tar archive ({error})") from None
        self.count += len(chunk)
        if self.count > self.limit:
            raise ArchiveRefused(_too_large(self.limits, self.compressed))
        buffer[: len(chunk)] = chunk
        return len(chunk)


def _members(data: bytes, limits: Limits):
    """Each member of the archive, with the tar it is read from, once it passed every rule."""
    if len(data) > limits.compressed:
        raise ArchiveRefused(
            f"an archive is at most {limits.compressed // MIB} MiB; this one is {len(data) / MIB:.1f} MiB"
        )
    if not data.startswith(GZIP_MAGIC) or len(data) < GZIP_LEAST:
        raise ArchiveRefused("not a gzipped tar archive (it does not begin as gzip does)")
    bound = limits.inflatable(len(data))
    if _declared(data) > bound:  # before anything is inflated
        raise ArchiveRefused(_too_large(limits, len(data), _declared(data)))
    try:
        tar = tarfile.open(fileobj=io.BufferedReader(_Inflated(data, limits)), mode="r|", tarinfo=_Header)
    except tarfile.TarError as error:
        raise ArchiveRefused(f"not a gzipped tar archive ({error})") from None
    seen: set[str] = set()
    files: set[str] = set()  # a path that is a file may not also be a folder
    total = count = 0
    with tar:
        try:
            for member in tar:
                name = member.name
                count += 1  # every member, the folder itself too: each costs the reading
                if count > limits.files:
                    raise ArchiveRefused(f"an archive holds at most {limits.files:,} files and folders")
                problem = path_problem(name)
                if problem is not None:
                    raise ArchiveRefused(f"member {name!r}: {problem}")
                if member.issym() or member.islnk():
                    raise ArchiveRefused(f"member {name!r} is a link (to {member.linkname!r}): links are refused")
                if not (member.isfile() or member.isdir()):
                    raise ArchiveRefused(f"member {name!r} is a device, fifo or other special file: refused")
                parts = PurePosixPath(name).parts
                if not parts:  # the folder itself ("." or "./"): once, as a folder
                    if "." in seen or not member.isdir():
                        raise ArchiveRefused(
                            f"member {name!r} (the folder itself) is in the archive twice or as a file"
                        )
                    seen.add(".")
                    continue
                key = "/".join(parts)
                if key in seen:
                    raise ArchiveRefused(f"member {name!r} is in the archive twice")
                seen.add(key)
                if any("/".join(parts[:i]) in files for i in range(1, len(parts))):
                    raise ArchiveRefused(f"member {name!r} is a file and a folder")
                if member.isfile():
                    files.add(key)
                if member.size > limits.file:
                    raise ArchiveRefused(
                        f"member {name!r} is {member.size / MIB:.1f} MiB; one file is at most {limits.file // MIB} MiB"
                    )
                total += member.size  # as its header says, before its file is inflated
                if total > limits.unpacked:
                    raise ArchiveRefused(f"it unpacks to more than {limits.unpacked // MIB} MiB")
                if total > bound:
                    raise ArchiveRefused(_too_large(limits, len(data), total))
                yield tar, member, PurePosixPath(*parts)
        except tarfile.TarError as error:
            raise ArchiveRefused(f"a broken tar archive ({error})") from None


def check(data: bytes, limits: Limits = LIMITS) -> int:
    """Whether the archive may be unpacked (ArchiveRefused with the reason when not), without writing
    anything; the number of its files and folders."""
    return sum(1 for _ in _members(data, limits))


def unpack(data: bytes, destination: str | Path, limits: Limits = LIMITS) -> Path:
    """Unpack the archive into `destination` (a folder that must not exist yet): all of it, or, refused
    with the reason (ArchiveRefused), nothing. Files are readable by all and executable as they were
    packed; nothing else of the archive's modes or owners is taken."""
    destination = Path(destination)
    if os.path.lexists(destination):
        raise FileExistsError(f"{destination} exists")
    destination.parent.mkdir(parents=True, exist_ok=True)
    # Everything is made through folders' descriptors, never by a path: whoever else may write
    # beside the destination cannot turn a step of the way into a link to elsewhere.
    parent = os.open(destination.parent, _FOLDER)
    try:
        staging = os.path.basename(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
        try:
            root = os.open(staging, _FOLDER, dir_fd=parent)
            try:
                for tar, member, relative in _members(data, limits):
                    folder = _open_folder(root, relative.parts if member.isdir() else relative.parts[:-1])
                    try:
                        if member.isfile():
                            _write(tar, member, relative.name, folder)
                    finally:
                        os.close(folder)
                os.fchmod(root, 0o755)
            finally:
                os.close(root)
            os.rename(staging, destination.name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            shutil.rmtree(staging, dir_fd=parent, ignore_errors=True)
            raise
    finally:
        os.close(parent)
    return destination


_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def _open_folder(root: int, parts: tuple[str, ...]) -> int:
    """The folder `parts` below the folder `root` (made when missing), opened through no link; the
    caller closes it. A member that is a file where a folder must be is refused."""
    current = os.dup(root)
    try:
        for depth, part in enumerate(parts, 1):
            try:
                os.mkdir(part, 0o755, dir_fd=current)
                made = True
            except FileExistsError:
                made = False
            try:
                step = os.open(part, _FOLDER, dir_fd=current)
            except OSError as error:
                if error.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                raise ArchiveRefused(
                    f"member {'/'.join(parts[:depth])!r} is not a folder where one must be ({error.strerror})"
                ) from None
            os.close(current)
            current = step
            if made:
                os.fchmod(current, 0o755)  # whatever the umask
        return current
    except BaseException:
        os.close(current)
        raise


def _write(tar: tarfile.TarFile, member: tarfile.TarInfo, name: str, folder: int) -> None:
    """A file member into the folder `folder`, a new file (never through a link)."""
    mode = 0o755 if member.mode & stat.S_IXUSR else 0o644
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=folder)
    with os.fdopen(fd, "wb") as out:
        shutil.copyfileobj(tar.extractfile(member), out, COPY_CHUNK)
        os.fchmod(fd, mode)  # whatever the umask


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


def remove(path: Path) -> None:
    """Whatever is at `path` (a folder with all in it, a file, a link: not what it points to) removed."""
    if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


REFUSED, MISSING = 2, 3  # `main`'s exit codes: the archive refused (nothing unpacked); no such entrypoint in it


def main(argv: list[str] | None = None) -> int:
    """`python -P -s -m shared.code_archive unpack FOLDER ENTRYPOINT`: the archive on stdin unpacked
    into FOLDER (what was there removed first), then ENTRYPOINT looked for in it; `find FOLDER
    ENTRYPOINT`: only looked for. A node agent that runs as root runs this as the job's user, so that
    it does no more in the job's folder than the job itself could. The reason of a refusal on stderr."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] not in ("unpack", "find"):
        print("usage: python -m shared.code_archive unpack|find FOLDER ENTRYPOINT", file=sys.stderr)
        return 64
    command, folder, entrypoint = args[0], Path(args[1]), args[2]
    if command == "unpack":
        try:
            data = sys.stdin.buffer.read(LIMITS.compressed + 1)
            remove(folder)
            unpack(data, folder)
        except (ArchiveRefused, OSError) as error:
            print(error, file=sys.stderr)
            return REFUSED
    missing = entrypoint_missing(folder, entrypoint)
    if missing is not None:
        print(missing, file=sys.stderr)
        return MISSING
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
