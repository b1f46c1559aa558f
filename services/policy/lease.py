"""Leadership through a JetStream KV lease.

The lease is one key in a bucket whose TTL ends any value not rewritten in time. A replica leads
from the moment it creates the key (creation fails while someone else holds it) and renews it by
compare-and-set on the revision it last wrote, several times per TTL; a renewal that fails (the key
expired and another replica took it, or the bus was unreachable past the TTL) ends its leadership.
Standbys keep trying to create the key, so one takes over within a TTL of the leader's death.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats.errors

from shared import storage
from shared.bus import Bus
from shared.bus.kv import RevisionConflict, TypedKV
from shared.schema.runs import Lease

RENEWALS_PER_TTL = 4
log = logging.getLogger(__name__)


class LeaseLost(Exception):
    """This replica no longer leads: whatever it was doing as leader must stop."""


class Leadership:
    def __init__(self, kv: TypedKV[Lease], key: str, holder: str, ttl_s: float):
        self.kv = kv
        self.key = key
        self.holder = holder
        self.ttl_s = ttl_s
        self.revision: int | None = None  # of our last write while we lead
        self.gained = asyncio.Event()  # set when this replica takes the lease

    @classmethod
    async def open(cls, bus: Bus, bucket: str, key: str, holder: str) -> Leadership:
        """Campaign for `key` of `bucket` (the operator's, its TTL the lease's: shared.storage)."""
        return cls(await storage.open_kv(bus, bucket, Lease), key, holder, await storage.bucket_ttl(bus, bucket))

    @property
    def held(self) -> bool:
        return self.revision is not None

    def check(self) -> None:
        if not self.held:
            raise LeaseLost(f"{self.holder} lost the lease")

    async def leader(self) -> str:
        """Who holds the lease now ("" when no one does)."""
        entry = await self.kv.get(self.key)
        return entry.value.holder if entry else ""

    async def try_acquire(self) -> bool:
        with contextlib.suppress(RevisionConflict, nats.errors.TimeoutError):
            self.revision = await self.kv.create(self.key, Lease(self.holder))
            log.info("%s leads", self.holder)
            self.gained.set()
        return self.held

    async def renew(self) -> bool:
        if self.revision is None:
            return False
        try:
            self.revision = await self.kv.update(self.key, Lease(self.holder), self.revision)
        except (RevisionConflict, nats.errors.Error) as error:
            log.warning("%s lost the lease: %s", self.holder, error)
            self.revision = None
            self.gained.clear()
        return self.held

    async def release(self) -> None:
        """Step down now (a clean stop): a standby need not wait for the TTL."""
        revision, self.revision = self.revision, None
        self.gained.clear()
        if revision is not None:
            with contextlib.suppress(RevisionConflict, nats.errors.Error):
                await self.kv.delete(self.key, revision)

    async def campaign(self, stop: asyncio.Event) -> None:
        """Until `stop`: acquire the lease whenever it is free, and renew it while held."""
        period = self.ttl_s / RENEWALS_PER_TTL
        while not stop.is_set():
            await (self.renew() if self.held else self.try_acquire())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), period)
