"""The user API's code endpoints, with no NATS server but the last test: an archive uploaded in chunks is checked whole
and only then stored; a hostile one, a wrong digest or a chunk out of place is refused with the
reason; what one login begins and what a team's uploads hold in flight are bounded (by the bytes that
have come, so no team refuses another's by the sizes it says), and an abandoned upload is dropped."""

from __future__ import annotations

import base64
import gzip
import io
import json
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import msgspec
import nats.js.errors
import pytest
from test_api_handlers import gate
from test_team_logins import PASSWORDS, two_teams  # noqa: F401 - two_teams: a fixture
from test_team_logins import login as team_login

from services.api import service as api
from services.api.code import UPLOADS_PER_TEAM, CodeGate, Uploads
from services.api.who import Who
from shared import permissions, storage, subjects
from shared.bus import Bus
from shared.code_archive import LIMITS, digest, pack
from shared.schema.code import CodeChunk, CodeRequest
from shared.schema.jobs import JobOwner, JobSpec


class Store:
    """An object store in memory: get_info, list and put as CodeGate uses them."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.put_at: dict[str, float] = {}

    def info(self, name: str) -> SimpleNamespace:  # what CodeGate reads of nats-py's ObjectInfo
        when = datetime.fromtimestamp(self.put_at[name], timezone.utc).isoformat()
        return SimpleNamespace(name=name, size=len(self.objects[name]), mtime=when, deleted=False)

    async def get_info(self, name: str) -> SimpleNamespace:
        if name not in self.objects:
            raise nats.js.errors.ObjectNotFoundError
        return self.info(name)

    async def list(self, ignore_deletes: bool = False) -> list[SimpleNamespace]:
        if not self.objects:
            raise nats.js.errors.NotFoundError
        return [self.info(name) for name in self.objects]

    async def put(self, name: str, data: bytes) -> None:
        self.objects[name], self.put_at[name] = data, time.time()


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
    assert last.stored and store.objects == {f"alice.{digest(data)}": data}  # alice's own
    assert (await code.has(CodeRequest(digest(data)), "alice")).stored
    assert not (await code.has(CodeRequest(digest(data)), "bob")).stored  # not bob's: his jobs may not run it
    again = await code.put(parts[0], "alice")  # stored before: the first chunk's answer says so
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


async def test_what_a_login_begins_is_bounded_by_its_sizes_and_an_abandoned_upload_is_dropped() -> None:
    now = [0.0]
    uploads = Uploads(per_login=2, bytes_per_login=1000, idle_s=60, clock=lambda: now[0])
    code, _ = code_gate(uploads)

    def begin(n: int, size: int) -> CodeChunk:
        return CodeChunk(f"{n:064x}", size, 0, b"x")

    await code.put(begin(1, 400), "alice")
    await code.put(begin(2, 400), "alice")
    with pytest.raises(ValueError, match="at most 2 uploads of a login under way"):
        await code.put(begin(3, 10), "alice")
    await code.put(begin(4, 600), "bob")
    with pytest.raises(
        ValueError, match="may come to 1,000 bytes at once, and yours come to 600 bytes with this one of 700 bytes"
    ):  # 600 + 700 > 1000 begun
        await code.put(begin(5, 700), "bob")
    now[0] = 61.0  # alice's two went quiet: dropped
    await code.put(begin(6, 900), "alice")
    assert {login for login, _ in uploads.uploads} == {"alice"}  # and bob's
    with pytest.raises(ValueError, match="dropped after 60 s"):
        await code.put(CodeChunk(f"{1:064x}", 400, 1, b"y"), "alice")


async def test_one_team_cannot_refuse_anothers_upload_by_the_sizes_its_logins_declare(tmp_path: Path) -> None:
    """What an attacker showed: 8 logins of a team, 2 uploads each of 1 byte that say they are of 32
    MiB, held the whole pool when it was reserved by the sizes said; another team's upload was refused."""
    code, store = code_gate()  # the API's own bounds
    for login in range(8):
        for n in range(2):
            chunk = CodeChunk(f"{login:032x}{n:032x}", LIMITS.compressed, 0, b"x")
            assert (await code.put(chunk, f"a{login}", "a")).received == 1
    data = archive_of(tmp_path)
    for part in chunks(data, 4096):
        answer = await code.put(part, "b0", "b")
    assert answer.stored and f"b0.{digest(data)}" in store.objects
    with pytest.raises(ValueError, match=f"over your team's limit: team a's logins have {UPLOADS_PER_TEAM} uploads"):
        await code.put(CodeChunk("f" * 64, 1, 0, b"x"), "a-late", "a")  # a's 17th: its own team's bound


async def test_a_team_holds_at_most_its_share_of_what_has_come_and_a_refused_chunk_loses_nothing() -> None:
    uploads = Uploads(bytes_per_login=10_000, bytes_per_team=1000, bytes_in_all=2500)
    code, _ = code_gate(uploads)

    def chunk(n: int, offset: int, size: int = 4000) -> CodeChunk:
        return CodeChunk(f"{n:064x}", size, offset, b"x" * 500)

    await code.put(chunk(1, 0), "alice", "a")
    await code.put(chunk(2, 0), "anna", "a")  # team a holds 1000 bytes that came
    with pytest.raises(
        ValueError, match="team a's uploads under way hold 1,000 bytes of the 1,000 bytes a team's may hold at once"
    ):
        await code.put(chunk(1, 500), "alice", "a")
    assert uploads.received("alice", f"{1:064x}") == 500  # what came before is kept, to go on from
    await code.put(chunk(3, 0), "bob", "b")  # another team is not held by a's
    await code.put(chunk(3, 500), "bob", "b")
    await code.put(chunk(4, 0), "carl", "c")  # 2500 bytes in all
    with pytest.raises(
        ValueError,
        match=r"the API holds as many uploads as it may now \(2,500 bytes\); send this chunk again in a minute \(the 500 bytes that came of it before are kept\)",
    ):
        await code.put(chunk(4, 500), "carl", "c")
    assert uploads.received("carl", f"{4:064x}") == 500
    uploads.drop("bob", f"{3:064x}")  # done (or dropped): its room is free again
    assert (await code.put(chunk(4, 500), "carl", "c")).received == 1000  # the refused chunk, sent again


async def test_a_job_naming_an_archive_is_refused_unless_it_is_stored(tmp_path: Path) -> None:
    judge, bus, _ = gate()
    judge.code, store = code_gate()
    data = archive_of(tmp_path, files=2)
    spec = JobSpec("mine-1", code=digest(data), entrypoint="m0.py", args=("--epochs", "2"))
    answer = await judge.submit(msgspec.json.encode(spec), Who("alice"))
    assert not answer.accepted and f"no archive {digest(data)} of yours in the code store" in answer.reason, answer
    assert bus.stored() == []
    await store.put(f"bob.{digest(data)}", data)  # another login's is not alice's
    answer = await judge.submit(
        msgspec.json.encode(JobSpec("mine-3", code=digest(data), entrypoint="m0.py")), Who("alice")
    )
    assert not answer.accepted and "of yours" in answer.reason, answer
    await store.put(f"alice.{digest(data)}", data)
    answer = await judge.submit(
        msgspec.json.encode(JobSpec("mine-2", code=digest(data), entrypoint="m0.py")), Who("alice")
    )
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
    answer = await judge.submit(body, Who("alice"))
    assert not answer.accepted and reason in answer.reason, answer
    assert bus.stored() == []


async def test_a_login_keeps_at_most_its_share_of_the_store_and_others_are_not_held_by_it(tmp_path: Path) -> None:
    code, store = code_gate()
    data = archive_of(tmp_path, files=2)
    code.stored_per_login = len(data) + 500
    await store.put(f"alice.{'1' * 64}", b"x" * 600)  # alice holds 600 bytes already
    await store.put(f"bob.{'2' * 64}", b"x" * len(data))
    with pytest.raises(ValueError, match="over your share of the code store: your archives there hold"):
        await code.put(CodeChunk(digest(data), len(data), 0, data), "alice")
    assert f"alice.{digest(data)}" not in store.objects and code.uploads.uploads == {}
    assert (await code.put(CodeChunk(digest(data), len(data), 0, data), "carol")).stored  # bob's are not carol's


async def test_an_archive_about_to_age_out_is_not_taken_as_stored_and_is_stored_anew(tmp_path: Path) -> None:
    code, store = code_gate()
    data = archive_of(tmp_path, files=2)
    name = f"alice.{digest(data)}"
    await store.put(name, data)
    store.put_at[name] = time.time() - 24 * 86400  # 30 days' age: it goes in 6
    assert not (await code.has(CodeRequest(digest(data)), "alice")).stored
    again = await code.put(CodeChunk(digest(data), len(data), 0, data), "alice")
    assert again.stored and again.reason == "" and time.time() - store.put_at[name] < 60


def test_a_refused_first_chunk_holds_no_room_and_an_upload_begun_again_keeps_its_bytes_if_refused() -> None:
    uploads = Uploads(per_login=1, bytes_per_login=1000, bytes_per_team=600)
    with pytest.raises(ValueError, match="runs past its size"):
        uploads.add("alice", CodeChunk("a" * 64, 2, 0, b"xyz"))
    assert uploads.uploads == {}
    assert uploads.add("alice", CodeChunk("b" * 64, 900, 0, b"x" * 500)) == 500  # the room is alice's still
    with pytest.raises(ValueError, match="over your team's limit"):  # begun again with more than the team may hold
        uploads.add("alice", CodeChunk("b" * 64, 900, 0, b"x" * 700))
    assert uploads.received("alice", "b" * 64) == 500


@pytest.mark.e2e
async def test_a_teams_bound_holds_its_logins_as_the_server_names_them(two_teams: str) -> None:
    """Through a nats-server with the teams' accounts: the API counts alice's and vision's uploads in
    team vision (the server's word, not the login's), and team nlp's login is not held by them."""
    bus = await Bus.connect(
        two_teams, "test-api", user="api", password=PASSWORDS["api"], inbox_prefix=permissions.inbox_prefix("api")
    )
    try:
        served = await api.serve(bus, await storage.open_kv(bus, subjects.JOB_OWNERS_BUCKET, JobOwner), lambda s: None)
        code = served.submissions.code
        code.uploads = Uploads(per_team=2)

        async def begin(name: str, n: int) -> dict:
            client = await team_login(two_teams, name)
            try:
                chunk = {"digest": f"{n:064x}", "size": 1000, "offset": 0, "data": base64.b64encode(b"x").decode()}
                reply = await client.request(subjects.API_CODE_PUT, json.dumps(chunk).encode(), timeout=10)
                return json.loads(reply.data)
            finally:
                await client.close()

        assert (await begin("alice", 1))["received"] == 1
        assert (await begin("vision", 2))["received"] == 1
        refused = await begin("alice", 3)
        assert "over your team's limit: team vision's logins have 2 uploads" in refused["error"], refused
        assert (await begin("nlp", 4))["received"] == 1  # another team's
        assert {(login, u.team) for (login, _), u in code.uploads.uploads.items()} == {
            ("alice", "vision"),
            ("vision", "vision"),
            ("nlp", "nlp"),
        }
    finally:
        await bus.close()
