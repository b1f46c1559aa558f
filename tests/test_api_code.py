"""The user API's code endpoints with no NATS server: an archive uploaded in chunks is checked whole
and only then stored; a hostile one, a wrong digest or a chunk out of place is refused with the
reason; what one login holds in flight is bounded, and an abandoned upload is dropped."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path
from types import SimpleNamespace

import msgspec
import nats.js.errors
import pytest
from test_api_handlers import gate

from services.api.code import CodeGate, Uploads
from shared.code_archive import digest, pack
from shared.schema import CodeChunk, CodeRequest, JobSpec


class Store:
    """An object store in memory: get_info and put as CodeGate uses them."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    async def get_info(self, name: str) -> SimpleNamespace:
        if name not in self.objects:
            raise nats.js.errors.ObjectNotFoundError
        return SimpleNamespace(deleted=False)  # of nats-py's ObjectInfo, only `deleted` is read

    async def put(self, name: str, data: bytes) -> None:
        self.objects[name] = data


def code_gate(uploads: Uploads | None = None) -> tuple[CodeGate, Store]:
    store = Store()
    code = CodeGate(None, uploads)  # type: ignore[arg-type] - the bus is never reached: the store is set
    code._store = store
    return code, store


def chunks(data: bytes, size: int) -> list[CodeChunk]:
    return [CodeChunk(digest(data), len(data), at, data[at : at + size]) for at in range(0, len(data), size)]


def archive_of(tmp_path: Path, files: int = 40) -> bytes:
    folder = tmp_path / "code"
    folder.mkdir()
    for i in range(files):  # random-ish content: the archive is several chunks
        (folder / f"m{i}.py").write_bytes(repr([i * 7919 + j for j in range(400)]).encode())
    return pack(folder)


def hostile(name: str) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb") as zipped, tarfile.open(fileobj=zipped, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    return buffer.getvalue()


async def test_an_archive_sent_in_chunks_is_stored_whole_and_not_uploaded_twice(tmp_path: Path) -> None:
    code, store = code_gate()
    data = archive_of(tmp_path)
    parts = chunks(data, 4096)
    assert len(parts) > 2
    first = await code.put(parts[0], "alice")
    assert (first.stored, first.received) == (False, 4096)
    assert (await code.has(CodeRequest(digest(data)), "alice")).received == 4096  # where to go on
    assert (await code.has(CodeRequest(digest(data)), "bob")).received == 0  # bob's uploads are his
    for part in parts[1:-1]:
        assert not (await code.put(part, "alice")).stored
    assert store.objects == {}  # nothing is stored before the whole archive has come and passed
    last = await code.put(parts[-1], "alice")
    assert last.stored and store.objects == {digest(data): data}
    assert (await code.has(CodeRequest(digest(data)), "bob")).stored
    again = await code.put(parts[0], "bob")  # stored before: the first chunk's answer says so
    assert again.stored and "not uploaded again" in again.reason
    assert code.uploads.uploads == {}


@pytest.mark.parametrize(("name", "reason"), [("../escape.py", "'..'"), ("/etc/cron.d/x", "an absolute path")])
async def test_a_hostile_archive_is_refused_at_upload_with_the_reason(name: str, reason: str) -> None:
    code, store = code_gate()
    data = hostile(name)
    with pytest.raises(ValueError, match=reason) as refused:
        await code.put(CodeChunk(digest(data), len(data), 0, data), "alice")
    assert "refused" in str(refused.value) and "nothing is stored" in str(refused.value)
    assert store.objects == {} and code.uploads.uploads == {}


async def test_an_archive_that_is_not_what_its_digest_says_is_refused(tmp_path: Path) -> None:
    code, store = code_gate()
    data = archive_of(tmp_path, files=2)
    with pytest.raises(ValueError, match="changed on the way"):
        await code.put(CodeChunk("0" * 64, len(data), 0, data), "alice")
    assert store.objects == {}


async def test_chunks_out_of_place_are_refused_with_the_offset_to_send(tmp_path: Path) -> None:
    code, _ = code_gate()
    data = archive_of(tmp_path)
    parts = chunks(data, 4096)
    with pytest.raises(ValueError, match="begin it at offset 0"):
        await code.put(parts[1], "alice")
    await code.put(parts[0], "alice")
    with pytest.raises(ValueError, match="send the chunk at offset 4,096, not 8,192"):
        await code.put(parts[2], "alice")
    with pytest.raises(ValueError, match=f"begun as {len(data):,} bytes"):
        await code.put(CodeChunk(parts[1].digest, len(data) + 1, 4096, parts[1].data), "alice")
    assert (await code.put(parts[1], "alice")).received == 8192  # the right one is taken


async def test_what_a_login_holds_in_flight_is_bounded_and_an_abandoned_upload_is_dropped() -> None:
    now = [0.0]
    uploads = Uploads(per_login=2, bytes_per_login=1000, bytes_in_all=1500, idle_s=60, clock=lambda: now[0])
    code, _ = code_gate(uploads)

    def begin(n: int, size: int) -> CodeChunk:
        return CodeChunk(f"{n:064x}", size, 0, b"x")

    await code.put(begin(1, 400), "alice")
    await code.put(begin(2, 400), "alice")
    with pytest.raises(ValueError, match="at most 2 uploads under way"):
        await code.put(begin(3, 10), "alice")
    await code.put(begin(4, 600), "bob")
    with pytest.raises(ValueError, match="may hold 1,000 bytes"):  # 400 + 700 > 1000 bytes
        await code.put(begin(5, 700), "bob")
    with pytest.raises(ValueError, match="try again in a minute"):  # 1400 + 200 > 1500 in all
        await code.put(begin(6, 200), "carol")
    now[0] = 61.0  # alice's two went quiet: dropped
    await code.put(begin(6, 200), "carol")
    assert {login for login, _ in uploads.uploads} == {"carol"}
    with pytest.raises(ValueError, match="dropped after 60 s"):
        await code.put(CodeChunk(f"{1:064x}", 400, 1, b"y"), "alice")


async def test_a_job_naming_an_archive_is_refused_unless_it_is_stored(tmp_path: Path) -> None:
    judge, bus, _ = gate()
    judge.code, store = code_gate()
    data = archive_of(tmp_path, files=2)
    spec = JobSpec("mine-1", code=digest(data), entrypoint="m0.py", args=("--epochs", "2"))
    answer = await judge.submit(msgspec.json.encode(spec), "alice")
    assert not answer.accepted and f"no archive {digest(data)} in the code store" in answer.reason, answer
    assert bus.stored() == []
    store.objects[digest(data)] = data
    answer = await judge.submit(msgspec.json.encode(JobSpec("mine-2", code=digest(data), entrypoint="m0.py")), "alice")
    assert answer.accepted, answer
    assert bus.stored()[0][1].code == digest(data)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"id": "x"}', "names its application, or carries its code"),
        (b'{"id": "x", "code": "' + b"a" * 64 + b'"}', "names both the archive"),
        (b'{"id": "x", "code": "' + b"a" * 64 + b'", "entrypoint": "../up.py"}', "'..'"),
        (b'{"id": "x", "code": "' + b"a" * 64 + b'", "entrypoint": "/abs.py"}', "absolute"),
        (b'{"id": "x", "code": "nothex", "entrypoint": "t.py"}', "`$.code`"),
        (b'{"id": "x", "application": "cifar10", "args": ["-v"]}', "args are for a job that carries its code"),
    ],
)
async def test_a_code_submission_that_is_malformed_is_refused_with_the_reason(body: bytes, reason: str) -> None:
    judge, bus, _ = gate()
    answer = await judge.submit(body, "alice")
    assert not answer.accepted and reason in answer.reason, answer
    assert bus.stored() == []
