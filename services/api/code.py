"""The user API's code endpoints (`goodput.api.code.put`, `goodput.api.code.has`): a login's archive
comes in chunks, is checked whole (its sha256 against the digest it was sent under, then
`shared.code_archive.check`: no path out of its folder, no link, no device, the caps) and only then
stored in the code store, under the login's name and its digest (`stored_name`): a login's jobs run
only its own archives, and what it keeps there is bounded (STORED_PER_LOGIN). An archive about to
age out of the store (within REFRESH_S) is not taken as stored: uploaded again, it is stored anew.
A login never writes the store itself.

`Uploads` is the API's memory of the uploads under way (pure: a clock passed in): each a login's,
of its team, named by the digest it will have. What is shared is taken by the bytes that have come,
never by the size an upload says it will be: a team's uploads together hold at most BYTES_PER_TEAM
(a quarter of BYTES_IN_ALL, what all hold) and UPLOADS_PER_TEAM uploads, so no team fills what the
others upload into, however many logins it has or however large they say their archives are. A
login's own bound counts its uploads whole, as they were begun (UPLOADS_PER_LOGIN uploads,
BYTES_PER_LOGIN bytes): it begins no more than it could finish alone, and the sizes it says bar only
itself. A chunk refused for room is not kept, and the upload keeps what came before it (send the
chunk again later); an upload that has not moved for IDLE_S is dropped. `CodeGate` is the shell around it: the object store, and the
endpoints' handlers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import nats.errors
import nats.js.errors

from shared import subjects
from shared.bus import Bus
from shared.code_archive import LIMITS, ArchiveRefused, check, digest, stored_name
from shared.schema.code import CodeAnswer, CodeChunk, CodeRequest
from shared.storage import DAY_S, MIB, OBJECT_STORE_MAX_AGE_S, SETUP_HINT
from shared.subjects import DEFAULT_TEAM

UPLOADS_PER_LOGIN = 4
BYTES_PER_LOGIN = 2 * LIMITS.compressed  # its uploads' sizes as begun
UPLOADS_PER_TEAM = 16
BYTES_PER_TEAM = 4 * LIMITS.compressed  # the bytes its uploads hold: a quarter of all
BYTES_IN_ALL = 512 * MIB  # the bytes all uploads hold
IDLE_S = 120.0  # an upload with no chunk for this long is dropped
STORED_PER_LOGIN = 128 * MIB  # a login's archives in the store: a quarter of it
STORE_MAX_AGE_S = OBJECT_STORE_MAX_AGE_S[subjects.CODE_STORE]
REFRESH_S = 7 * DAY_S  # an archive this close to aging out is uploaded again, not taken as stored


@dataclass
class Upload:
    size: int  # what it will be, as it was begun: counted in its login's bound only
    team: str
    data: bytearray  # what has come: counted in its team's and in all
    touched: float


class Uploads:
    """The uploads under way: (login, digest) -> what has come of it."""

    def __init__(
        self,
        per_login: int = UPLOADS_PER_LOGIN,
        bytes_per_login: int = BYTES_PER_LOGIN,
        bytes_in_all: int = BYTES_IN_ALL,
        idle_s: float = IDLE_S,
        clock: Callable[[], float] = time.monotonic,
        per_team: int = UPLOADS_PER_TEAM,
        bytes_per_team: int = BYTES_PER_TEAM,
    ) -> None:
        self.per_login, self.bytes_per_login, self.bytes_in_all = per_login, bytes_per_login, bytes_in_all
        self.per_team, self.bytes_per_team = per_team, bytes_per_team
        self.idle_s, self.clock = idle_s, clock
        self.uploads: dict[tuple[str, str], Upload] = {}

    def sweep(self) -> None:
        """Drop the uploads that have not moved for idle_s."""
        now = self.clock()
        for key in [k for k, u in self.uploads.items() if now - u.touched > self.idle_s]:
            del self.uploads[key]

    def received(self, who: str, archive: str) -> int:
        """The bytes of `who`'s upload of `archive` held now (0: none under way)."""
        self.sweep()
        upload = self.uploads.get((who, archive))
        return len(upload.data) if upload else 0

    def drop(self, who: str, archive: str) -> None:
        self.uploads.pop((who, archive), None)

    def add(self, who: str, chunk: CodeChunk, team: str = DEFAULT_TEAM) -> bytes | int:
        """Take a chunk of `who`'s (of `team`): the whole archive once this chunk completes it (the
        upload is then over), else the bytes held so far. ValueError with why a chunk is refused:
        nothing of it is kept, and the upload keeps what came before it."""
        self.sweep()
        key = (who, chunk.digest)
        upload = self.uploads.get(key)
        if upload is not None and upload.size != chunk.size and chunk.offset != 0:
            raise ValueError(
                f"upload of {chunk.digest[:12]}: it was begun as {upload.size:,} bytes, not {chunk.size:,}; "
                "send it again from offset 0 with its size"
            )
        if chunk.offset != 0 and upload is None:
            raise ValueError(
                f"no upload of {chunk.digest[:12]} under way from you (none begun, or dropped after "
                f"{self.idle_s:.0f} s without a chunk): begin it at offset 0"
            )
        held = len(upload.data) if upload is not None and chunk.offset != 0 else 0
        if chunk.offset != held:
            raise ValueError(
                f"upload of {chunk.digest[:12]}: {held:,} bytes have come; send the chunk at "
                f"offset {held:,}, not {chunk.offset:,}"
            )
        # The chunk is checked whole before any room is taken for it: a refused one holds none.
        if chunk.offset + len(chunk.data) > chunk.size:
            raise ValueError(f"upload of {chunk.digest[:12]}: this chunk runs past its size of {chunk.size:,} bytes")
        if not chunk.data and chunk.offset < chunk.size:
            raise ValueError(f"upload of {chunk.digest[:12]}: an empty chunk before its end")
        begun = chunk.offset == 0  # begun again: what came before goes, once this chunk is taken
        self._room(who, team, chunk, replaced=upload if begun else None)
        if begun:
            upload = self.uploads[key] = Upload(chunk.size, team, bytearray(), self.clock())
        upload.data += chunk.data
        upload.touched = self.clock()
        if len(upload.data) < upload.size:
            return len(upload.data)
        del self.uploads[key]
        return bytes(upload.data)

    def _room(self, who: str, team: str, chunk: CodeChunk, replaced: Upload | None) -> None:
        """ValueError when `chunk` is over a bound: its login's (uploads begun, counted whole), its
        team's or all's (the bytes that have come). `replaced`: the upload it begins again, left out."""
        others = [u for u in self.uploads.values() if u is not replaced]
        mine = [u for (login, _), u in self.uploads.items() if login == who and u is not replaced]
        ours = [u for u in others if u.team == team]
        wait = f"or wait {self.idle_s:.0f} s for an abandoned one to be dropped"
        if chunk.offset == 0:
            begun = sum(u.size for u in mine)
            if len(mine) >= self.per_login:
                raise ValueError(
                    f"over your limit: at most {self.per_login} uploads of a login under way at once; "
                    f"finish one first ({wait})"
                )
            if begun + chunk.size > self.bytes_per_login:
                raise ValueError(
                    f"over your limit: a login's uploads under way may come to {amount(self.bytes_per_login)} at "
                    f"once, and yours come to {amount(begun)} with this one of {amount(chunk.size)}; finish one "
                    f"first ({wait})"
                )
            if len(ours) >= self.per_team:
                raise ValueError(
                    f"over your team's limit: team {team}'s logins have {len(ours)} uploads under way, at most "
                    f"{self.per_team} at once; begin this one when one of them is done ({wait})"
                )
        kept = f"the {amount(chunk.offset)} that came of it before are kept" if chunk.offset else "nothing is kept"
        held = sum(len(u.data) for u in ours)
        if held + len(chunk.data) > self.bytes_per_team:
            raise ValueError(
                f"over your team's limit: team {team}'s uploads under way hold {amount(held)} of the "
                f"{amount(self.bytes_per_team)} a team's may hold at once; send this chunk again when one of "
                f"them is done ({kept})"
            )
        if sum(len(u.data) for u in others) + len(chunk.data) > self.bytes_in_all:
            raise ValueError(
                f"the API holds as many uploads as it may now ({amount(self.bytes_in_all)}); send this chunk "
                f"again in a minute ({kept})"
            )


def amount(size: int) -> str:
    """`32.0 MiB`, `900 bytes`: a size as a refusal says it."""
    return f"{size / MIB:.1f} MiB" if size >= MIB // 10 else f"{size:,} bytes"


class CodeGate:
    """The code store, as the API reaches it: what is there, and uploads checked before they go in."""

    def __init__(
        self,
        bus: Bus,
        uploads: Uploads | None = None,
        stored_per_login: int = STORED_PER_LOGIN,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bus, self.uploads = bus, uploads or Uploads()
        self.stored_per_login, self.clock = stored_per_login, clock
        self.storing = asyncio.Lock()
        self._store = None

    async def store(self):
        if self._store is None:
            try:
                self._store = await self.bus.js.object_store(subjects.CODE_STORE)
            except nats.js.errors.NotFoundError:
                raise ValueError(f"the code store {subjects.CODE_STORE} does not exist: {SETUP_HINT}") from None
        return self._store

    async def stored(self, who: str, archive: str) -> bool:
        """Whether `who`'s archive is in the code store, and not about to age out (within REFRESH_S):
        one that is must be uploaded again, which stores it anew."""
        try:
            info = await (await self.store()).get_info(stored_name(who, archive))
        except nats.js.errors.ObjectNotFoundError:
            return False
        return not info.deleted and self.clock() - put_at(info) < STORE_MAX_AGE_S - REFRESH_S

    async def has(self, request: CodeRequest, who: str) -> CodeAnswer:
        if await self.stored(who, request.digest):
            return CodeAnswer(request.digest, True)
        return CodeAnswer(request.digest, False, self.uploads.received(who, request.digest))

    async def put(self, chunk: CodeChunk, who: str, team: str = DEFAULT_TEAM) -> CodeAnswer:
        """A chunk of `who`'s (of `team`); the archive stored once it is whole and passed every check,
        under the login's name (`stored_name`) and within its share of the store. One already stored
        is not taken again: the answer to its first chunk says it is stored."""
        if chunk.offset == 0:
            if await self.stored(who, chunk.digest):
                self.uploads.drop(who, chunk.digest)
                return CodeAnswer(chunk.digest, True, reason="stored before: not uploaded again")
            await self.room(who, chunk.digest, chunk.size)  # refused before it is sent
        whole = self.uploads.add(who, chunk, team)
        if isinstance(whole, int):
            return CodeAnswer(chunk.digest, False, whole)
        refusal = await asyncio.to_thread(problem, whole, chunk.digest)
        if refusal is not None:
            raise ValueError(refusal)
        async with self.storing:  # one login's archives cannot pass its share together
            await self.room(who, chunk.digest, len(whole))
            try:
                await (await self.store()).put(stored_name(who, chunk.digest), whole)
            except (nats.js.errors.Error, nats.errors.Error) as error:
                raise ValueError(
                    f"the code store did not take archive {chunk.digest[:12]} ({type(error).__name__}: {error}); "
                    "it may be full: ask the operator"
                ) from None
        return CodeAnswer(chunk.digest, True, len(whole))

    async def room(self, who: str, archive: str, size: int) -> None:
        """ValueError when `who`'s archives in the store, with this one (in place of any it replaces),
        would be more than its share."""
        try:
            infos = await (await self.store()).list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:  # an empty store
            infos = []
        name, prefix = stored_name(who, archive), stored_name(who, "")
        held = sum(i.size or 0 for i in infos if i.name.startswith(prefix) and i.name != name and not i.deleted)
        if held + size > self.stored_per_login:
            raise ValueError(
                f"over your share of the code store: your archives there hold {held / MIB:.1f} MiB, and this "
                f"one of {size / MIB:.1f} MiB would pass the {self.stored_per_login / MIB:.0f} MiB a login may "
                f"keep; each ages out {STORE_MAX_AGE_S / DAY_S:.0f} days after it was stored, or ask the operator"
            )


def put_at(info) -> float:
    """When an object of the store was put (its meta's time), as time.time(); 0.0 when it says not."""
    try:
        return datetime.fromisoformat(info.mtime).timestamp()
    except (TypeError, ValueError):
        return 0.0


def problem(data: bytes, expected: str) -> str | None:
    """Why a whole upload may not be stored under `expected`, or None."""
    actual = digest(data)
    if actual != expected:
        return (
            f"the archive's sha256 is {actual}, not {expected} as it was sent under: it changed on the way, or "
            "its digest was computed over other bytes; nothing is stored"
        )
    try:
        check(data)
    except ArchiveRefused as refused:
        return f"archive {expected[:12]} refused: {refused}; nothing is stored"
    return None
