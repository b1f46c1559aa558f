"""shared.code_archive: a job's code packed the same way every time, and every hostile archive
refused with its reason, nothing of it left on disk."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from shared import code_archive
from shared.code_archive import (
    LIMITS,
    ArchiveRefused,
    Limits,
    _open_folder,
    check,
    digest,
    entrypoint_problem,
    pack,
    unpack,
)


def code_folder(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('hello')\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "model.py").write_text("WIDTH = 3\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return root


def archive(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    """A gzipped tar of hand-made members, hostile ones included."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb") as zipped, tarfile.open(fileobj=zipped, mode="w") as tar:
        for info, content in members:
            if content is not None:
                info.size = len(content)
            tar.addfile(info, io.BytesIO(content) if content is not None else None)
    return buffer.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, content: bytes | None = b"x", link: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info, content if kind == tarfile.REGTYPE else None


def test_a_folder_round_trips_without_caches_and_keeps_its_executable_bit(tmp_path: Path) -> None:
    data = pack(code_folder(tmp_path / "code"))
    assert check(data) == 5  # train.py, run.sh, pkg/ and its two files
    out = unpack(data, tmp_path / "job" / "code")
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert files == ["pkg", "pkg/__init__.py", "pkg/model.py", "run.sh", "train.py"]
    assert (out / "train.py").read_text() == "print('hello')\n"
    assert os.access(out / "run.sh", os.X_OK) and not os.access(out / "train.py", os.X_OK)
    assert [p.name for p in (tmp_path / "job").iterdir()] == ["code"]  # no staging folder left


def test_the_digest_is_the_same_for_the_same_files_and_changes_with_them(tmp_path: Path) -> None:
    first = pack(code_folder(tmp_path / "a"))
    os.utime(tmp_path / "a" / "train.py", (1, 1))  # times are not content
    second = pack(code_folder(tmp_path / "b"))
    assert digest(first) == digest(pack(tmp_path / "a")) == digest(second)
    assert len(digest(first)) == 64
    (tmp_path / "b" / "train.py").write_text("print('changed')\n")
    assert digest(pack(tmp_path / "b")) != digest(first)


def test_pack_refuses_a_link_in_the_folder(tmp_path: Path) -> None:
    root = code_folder(tmp_path / "code")
    (root / "secrets").symlink_to("/etc/passwd")
    with pytest.raises(ArchiveRefused, match="symbolic link"):
        pack(root)


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        ((member("/etc/cron.d/job"),), "an absolute path"),
        ((member("../outside.py"),), "'..'"),
        ((member("code/../../outside.py"),), "'..'"),
        ((member("evil", tarfile.SYMTYPE, link="/etc/passwd"),), "is a link"),
        ((member("inside", tarfile.SYMTYPE, link="train.py"),), "is a link"),
        ((member("train.py"), member("hard", tarfile.LNKTYPE, link="train.py")), "is a link"),
        ((member("disk", tarfile.BLKTYPE),), "device, fifo"),
        ((member("tty", tarfile.CHRTYPE),), "device, fifo"),
        ((member("pipe", tarfile.FIFOTYPE),), "device, fifo"),
        ((member("train.py"), member("train.py")), "twice"),
        ((member("a"), member("a/b.py")), "a file and a folder"),
    ],
)
def test_a_hostile_archive_is_refused_with_its_reason_and_leaves_nothing(
    tmp_path: Path, members: tuple, reason: str
) -> None:
    data = archive(member("ok.py"), *members)
    with pytest.raises(ArchiveRefused, match=reason):
        check(data)
    with pytest.raises(ArchiveRefused, match=reason):
        unpack(data, tmp_path / "job" / "code")
    assert list((tmp_path / "job").iterdir()) == []  # not even the good member before it
    assert not (tmp_path / "outside.py").exists()


def test_the_caps_are_enforced(tmp_path: Path) -> None:
    small = Limits(compressed=64 * 1024, unpacked=10_000, files=3, file=4_000)
    with pytest.raises(ArchiveRefused, match="at most 3 files"):
        check(archive(*(member(f"f{i}") for i in range(4))), small)
    with pytest.raises(ArchiveRefused, match="one file is at most"):
        check(archive(member("big", content=b"0" * 5_000)), small)
    with pytest.raises(ArchiveRefused, match="unpacks to more than"):
        check(archive(*(member(f"f{i}", content=b"0" * 3_900) for i in range(3))), small)
    with pytest.raises(ArchiveRefused, match="an archive is at most"):
        check(os.urandom(70 * 1024), small)
    # A small archive that inflates to a large one is refused while it is read, not after.
    header = tarfile.TarInfo("pax")
    header.type, header.size = tarfile.XHDTYPE, 8 * small.stream  # a header tarfile would read whole
    bomb = gzip.compress(header.tobuf(tarfile.USTAR_FORMAT) + b"\0" * header.size)
    assert len(bomb) < 64 * 1024
    with pytest.raises(ArchiveRefused, match="unpacks to more than"):
        check(bomb, small)
    with pytest.raises(ArchiveRefused, match="not a gzipped tar"):
        check(b"plain text, not an archive")


def zeros(*sizes: int, pax: int = 0) -> bytes:
    """A gzipped tar of files of zeros (a pax header of `pax` zeros first): a bomb, gzip's most."""
    body = b""
    if pax:
        header = tarfile.TarInfo("pax")
        header.type, header.size = tarfile.XHDTYPE, pax
        body += header.tobuf(tarfile.USTAR_FORMAT) + bytes(pax)
    for n, size in enumerate(sizes):
        info = tarfile.TarInfo(f"zeros{n}.bin")
        info.size = size
        body += info.tobuf(tarfile.USTAR_FORMAT) + bytes(-(-size // 512) * 512)
    return gzip.compress(body + bytes(1024), compresslevel=9)


def lying(data: bytes) -> bytes:
    """The archive with gzip's trailer saying the stream inflates to 1 KiB."""
    return data[:-4] + (1024).to_bytes(4, "little")


@pytest.mark.parametrize(
    ("bomb", "reason", "inflated"),
    [  # (the archive, why it is refused, the most inflated before)
        (zeros(3 << 20, 3 << 20), "unpacks to at least 1,0[0-9][0-9] times its size", 0),  # its trailer says so
        (lying(zeros(3 << 20, 3 << 20)), r"unpacks to at least \d+ times its size", 64 * 1024),  # its header
        (lying(zeros(pax=3 << 20)), "an extended header .* at most 64 KiB", 64 * 1024),
        (lying(zeros(pax=60 * 1024)), "unpacks to more than 100 times its size", 128 * 1024),  # inflating
    ],
    ids=["trailer", "header", "pax", "inflating"],
)
def test_an_archive_that_unpacks_to_over_a_hundred_times_its_size_is_refused_before_it_is_inflated(
    monkeypatch, bomb: bytes, reason: str, inflated: int
) -> None:
    counted: list[int] = [0]

    class Counted(code_archive._Inflated):
        def readinto(self, buffer) -> int:
            read = super().readinto(buffer)
            counted[0] = self.count
            return read

    monkeypatch.setattr(code_archive, "_Inflated", Counted)
    limits = Limits(small=16 * 1024)  # the ratio is the API's (100); a bomb need not be large here
    with pytest.raises(ArchiveRefused, match=reason) as refused:
        check(bomb, limits)
    assert counted[0] <= inflated, f"{counted[0]:,} bytes inflated before: {refused.value}"
    assert "leave such a file out and make it when the job starts" in str(refused.value) or "extended" in reason


def test_code_and_a_small_archive_unpack_as_they_are_and_a_folder_that_packs_too_small_is_refused(
    tmp_path: Path,
) -> None:
    assert check(zeros(200 * 1024)) == 1  # 1,000 times its size, but under a MiB: any archive may
    data = code_folder(tmp_path / "data")
    (data / "data.csv").write_text("".join(f"{i},{i * i},{i % 7}\n" for i in range(50_000)))  # about 5 times
    assert check(pack(data)) == 6
    root = code_folder(tmp_path / "code")
    (root / "weights.bin").write_bytes(bytes(4 << 20))
    with pytest.raises(ArchiveRefused, match="at most 100 times its size .* leave such a file out"):
        pack(root)  # `goodput submit --code` says so before anything is sent
    assert LIMITS.ratio == 100


def test_every_member_counts_and_the_folder_itself_comes_once_as_a_folder(tmp_path: Path) -> None:
    small = Limits(files=3)
    with pytest.raises(ArchiveRefused, match="at most 3 files"):  # the folder itself counts too
        check(archive(member(".", tarfile.DIRTYPE), *(member(f"f{i}") for i in range(3))), small)
    with pytest.raises(ArchiveRefused, match="twice or as a file"):
        check(archive(member("./", tarfile.DIRTYPE), member(".", tarfile.DIRTYPE)))
    with pytest.raises(ArchiveRefused, match="twice or as a file"):
        check(archive(member(".")))
    assert check(archive(member("./", tarfile.DIRTYPE), member("./a.py"))) == 1  # as `tar -C DIR .` makes it
    unpack(archive(member("./", tarfile.DIRTYPE), member("./a.py")), tmp_path / "code")
    assert (tmp_path / "code" / "a.py").read_bytes() == b"x"


def test_a_folder_is_made_and_entered_through_no_link(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "pkg").symlink_to(tmp_path / "elsewhere")  # what a job could swap in while it is unpacked
    root = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(ArchiveRefused, match="'pkg' is not a folder where one must be"):
            _open_folder(root, ("pkg", "sub"))
        inner = _open_folder(root, ("a", "b"))
        os.close(inner)
    finally:
        os.close(root)
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert (staging / "a" / "b").is_dir() and (staging / "a" / "b").stat().st_mode & 0o777 == 0o755


def test_unpack_never_writes_over_a_folder(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    with pytest.raises(FileExistsError):
        unpack(archive(member("ok.py")), tmp_path / "code")


@pytest.mark.parametrize("entrypoint", ["train.py", "src/train.py", "./train.py", "trainer", "trainer.main"])
def test_an_entrypoint_is_a_script_inside_or_a_module(entrypoint: str) -> None:
    assert entrypoint_problem(entrypoint) is None


@pytest.mark.parametrize("entrypoint", ["/abs/train.py", "../train.py", "a/../../b.py", "rm -rf /", "", "x" * 300])
def test_an_entrypoint_outside_the_code_is_refused(entrypoint: str) -> None:
    assert entrypoint_problem(entrypoint) is not None
