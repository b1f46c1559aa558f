"""KV buckets of typed values (`TypedKV`): compare-and-set by revision, and a value larger than one
message kept in part keys beside its key."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from shared.bus.encoding import ChunkLost, T, split_body
from shared.bus.jetstream import _STREAM_EXISTS_WITH_OTHER_CONFIG

if TYPE_CHECKING:
    from shared.bus import Bus


# A KV create on an existing key, or an update/delete with a stale revision: someone else won.
RevisionConflict = nats.js.errors.KeyWrongLastSequenceError
_WRONG_LAST_SEQUENCE = (10071, 10164)


class KeyValues:
    """A bus's KV buckets."""

    async def kv(self, bucket: str, value_type: type[T], **config: Any) -> TypedKV[T]:
        """The KV bucket `bucket`, created on first use, whose values are `value_type`.
        `config` is nats-py's KeyValueConfig fields (`history`, `ttl` in seconds …); an existing
        bucket with another configuration is used as it is."""
        config.setdefault("replicas", self.replicas)
        try:
            store = await self.js.create_key_value(bucket=bucket, **config)
        except nats.js.errors.BadRequestError as error:
            if error.err_code != _STREAM_EXISTS_WITH_OTHER_CONFIG:
                raise
            store = await self.js.key_value(bucket)
        return TypedKV(self, bucket, store, value_type)

    async def open_kv(self, bucket: str, value_type: type[T]) -> TypedKV[T]:
        """The existing KV bucket `bucket` (nats-py's BucketNotFoundError if there is none)."""
        return TypedKV(self, bucket, await self.js.key_value(bucket), value_type)


@dataclass(frozen=True)
class KVEntry(Generic[T]):
    key: str
    value: T
    revision: int


# A KV value larger than one message is kept in part keys `_parts.<id>.<i>.<key>`, and its key holds
# SPILLED + the msgpack of a _Spilled: 0xc1 never begins msgpack, so no value is taken for one. The
# key's last token(s) come last so that `_parts.*.*.<key>` matches this key's parts and no other's.
SPILLED = b"\xc1"
PARTS = "_parts"
_SPILL_RETRIES = 3  # a value replaced while it was read is read again


class _Spilled(msgspec.Struct, frozen=True, array_like=True):
    id: str
    parts: int


class TypedKV(Generic[T]):
    """A KV bucket whose values are one Struct type; revisions make compare-and-set possible. A value
    too large for one message is written in parts before its key (compare-and-set on the key alone
    keeps its meaning) and the parts of values it replaced are purged after."""

    def __init__(self, bus: Bus, bucket: str, store: KeyValue, value_type: type[T]) -> None:
        self.bucket = bucket
        self._bus = bus
        self._store = store
        self._value_type = value_type
        self._stream = f"KV_{bucket}"
        self._spilled: set[str] = set()  # keys seen with parts: a later small value purges them

    def _parts_subject(self, key: str, spill_id: str = "*") -> str:
        return f"$KV.{self.bucket}.{PARTS}.{spill_id}.*.{key}"

    async def get(self, key: str) -> KVEntry[T] | None:
        """The current value and its revision; None when the key is missing or deleted."""
        for _ in range(_SPILL_RETRIES):
            try:
                entry = await self._store.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                return None
            data = entry.value or b""
            if data[:1] == SPILLED:
                self._spilled.add(key)
                try:
                    data = await self._read_parts(key, self._bus.decode(data[1:], _Spilled))
                except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                    continue  # replaced (and its parts purged) while we read it
            return KVEntry(key, self._bus.decode(data, self._value_type), entry.revision)
        raise ChunkLost(f"KV {self.bucket}/{key}: its parts went missing {_SPILL_RETRIES} times in a row")

    async def _read_parts(self, key: str, spilled: _Spilled) -> bytes:
        parts = [await self._store.get(f"{PARTS}.{spilled.id}.{i}.{key}") for i in range(spilled.parts)]
        return b"".join(part.value or b"" for part in parts)

    async def _write(self, key: str, value: T, write: Callable[[bytes], Awaitable[int]]) -> int:
        """`write` the value's bytes, or, when it is too large for one message, its parts first and
        then `write` a pointer to them; then purge what older values left."""
        data = self._bus.encode(value)
        spill_id, first = None, None
        if len(data) > self._bus.part_size:
            spill_id = self._bus.nc.new_inbox().rsplit(".", 1)[1]
            parts = split_body(data, self._bus.part_size)
            for i, part in enumerate(parts):
                seq = await self._store.put(f"{PARTS}.{spill_id}.{i}.{key}", part)
                first = first or seq
            data = SPILLED + self._bus.encode(_Spilled(spill_id, len(parts)))
        try:
            revision = await write(data)
        except BaseException:
            if spill_id is not None:  # refused (e.g. a stale revision): its parts are nobody's
                await self._purge(self._parts_subject(key, spill_id))
            raise
        if spill_id is not None or key in self._spilled:
            await self._purge(self._parts_subject(key), before=first)  # older values' parts only
            if spill_id is None:
                self._spilled.discard(key)
            else:
                self._spilled.add(key)
        return revision

    async def _purge(self, subject: str, before: int | None = None) -> None:
        with contextlib.suppress(nats.errors.Error):  # left over parts cost space, never a value
            await self._bus.js.purge_stream(self._stream, subject=subject, seq=before)

    async def put(self, key: str, value: T) -> int:
        """Write unconditionally; returns the new revision."""
        return await self._write(key, value, lambda data: self._store.put(key, data))

    async def create(self, key: str, value: T) -> int:
        """Write only if the key does not exist (or was deleted); RevisionConflict otherwise."""
        return await self._write(key, value, lambda data: self._store.create(key, data))

    async def update(self, key: str, value: T, revision: int) -> int:
        """Write only if `revision` is still the key's latest; RevisionConflict otherwise."""
        return await self._write(key, value, lambda data: self._store.update(key, data, last=revision))

    async def delete(self, key: str, revision: int | None = None) -> None:
        """Delete (a tombstone); with `revision`, only if it is still the latest."""
        try:
            await self._store.delete(key, last=revision)
        except nats.js.errors.APIError as error:
            if error.err_code in _WRONG_LAST_SEQUENCE:
                raise RevisionConflict(description=error.description) from error
            raise
        await self._purge(self._parts_subject(key))
        self._spilled.discard(key)

    async def changes(self) -> AsyncIterator[str]:
        """The key of every write or delete from now on, as it happens (a push subscription: an
        idle bucket costs nothing)."""
        watcher = await self._store.watchall(include_history=False, meta_only=True)
        try:
            async for entry in watcher:
                if entry is not None and not entry.key.startswith(f"{PARTS}."):
                    yield entry.key
        finally:
            with contextlib.suppress(nats.errors.Error):
                await watcher.stop()

    async def keys(self) -> list[str]:
        """Live keys (deleted ones excluded); [] for an empty bucket. Read from the bucket's stream:
        nats-py's watcher-based keys() can end early under load and report none, and a service
        restoring its state from KV must see every key."""
        live = []
        for key in await self._stored_keys():
            try:  # present and not deleted; its value is not decoded here
                await self._store.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                continue
            live.append(key)
        return live

    async def values(self) -> dict[str, T]:
        """Every live key's value, each read once (as `keys`, then `get`, would read it twice)."""
        values = {}
        for key in await self._stored_keys():
            entry = await self.get(key)
            if entry is not None:
                values[key] = entry.value
        return values

    async def _stored_keys(self) -> list[str]:
        """The keys the bucket's stream holds a message for (deleted ones too), in order."""
        prefix = f"$KV.{self.bucket}."
        info = await self._bus.js.stream_info(self._stream, subjects_filter=f"{prefix}>")
        keys = (subject[len(prefix) :] for subject in sorted(info.state.subjects or {}))
        return [key for key in keys if not key.startswith(f"{PARTS}.")]
