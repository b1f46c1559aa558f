"""Request and reply on the wire. A request sent (in parts when it is large) takes its reply from one
wildcard inbox; a request received has its other parts asked of the requester, is put together
beside the endpoint's other requests (bounded per requester and in all), and is answered in parts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats import micro
from nats.aio.msg import Msg
from nats.js import api

from shared.bus.encoding import CHUNK_HEADER, WANT_HEADER, ChunkLost, T, _assemble, _chunk_of, split_body
from shared.bus.requesters import _requester, is_inbox

log = logging.getLogger(__package__)  # "shared.bus" in every file: one logger to configure

CHUNK_TIMEOUT_S = 5.0  # the most a part may lag the one before it
ASSEMBLY_TIMEOUT_S = 30.0  # the most a whole request in parts may take to come in
MAX_ASSEMBLIES = 2  # requests in parts one requester may have coming in at a time
MAX_ASSEMBLIES_IN_ALL = 16  # ... and all requesters together, on one connection
NO_RESPONDERS_STATUS = "503"


@dataclass
class _Pending:
    """A request of ours waiting for its reply: the request's parts (a responder may ask for them)
    and the reply's messages as they come."""

    parts: list[bytes]
    replies: asyncio.Queue


class Requests:
    """A bus's requests: `publish` and `request` out, and how a received request's body comes in and its
    answer goes out (for `Endpoints`)."""

    async def publish(self, subject: str, msg: Any, *, headers: dict[str, str] | None = None) -> None:
        await self.nc.publish(subject, self.encode(msg), headers=self._trace_headers(headers))

    async def request(
        self,
        subject: str,
        msg: Any,
        reply_type: type[T],
        timeout: float = 1.0,
        *,
        headers: dict[str, str] | None = None,
    ) -> T:
        """Send `msg` and decode the reply as `reply_type`; a reply that does not decode raises
        (the caller asked, so the caller should know), as do timeouts, no responders and a part of
        a large reply that did not come (`ChunkLost`). `timeout` is for the first part of the reply;
        each further part may take `chunk_timeout_s`."""
        reply_headers, data = await self._exchange(subject, self.encode(msg), timeout, self._trace_headers(headers))
        if reply_headers and micro.request.ERROR_CODE_HEADER in reply_headers:
            raise micro.request.ServiceError(
                reply_headers[micro.request.ERROR_CODE_HEADER], reply_headers.get(micro.request.ERROR_HEADER, "")
            )
        return self.decode(data, reply_type)

    async def _exchange(
        self, subject: str, body: bytes, timeout: float, headers: dict[str, str] | None
    ) -> tuple[dict[str, str] | None, bytes]:
        """One request, in parts if it is large; the reply's headers and its whole body."""
        async with self._reply_inbox_ready:
            if self._reply_prefix is None:
                prefix = self.nc.new_inbox()
                await self.nc.subscribe(f"{prefix}.*", cb=self._on_reply)
                self._reply_prefix = prefix
        token = self.nc.new_inbox().rsplit(".", 1)[1]
        pending = self._pending[token] = _Pending(split_body(body, self.part_size), asyncio.Queue())
        try:
            if len(pending.parts) > 1:
                headers = {**(headers or {}), CHUNK_HEADER: f"0/{len(pending.parts)}"}
            await self.nc.publish(subject, pending.parts[0], reply=f"{self._reply_prefix}.{token}", headers=headers)
            try:
                first = await asyncio.wait_for(pending.replies.get(), timeout)
            except asyncio.TimeoutError:
                raise nats.errors.TimeoutError from None
            if first.headers and first.headers.get(api.Header.STATUS) == NO_RESPONDERS_STATUS:
                raise nats.errors.NoRespondersError

            async def next_part(index: int, count: int) -> bytes:
                try:
                    raw = await asyncio.wait_for(pending.replies.get(), self.chunk_timeout_s)
                except asyncio.TimeoutError:
                    raise ChunkLost(
                        f"reply on {subject}: part {index + 1} of {count} did not come "
                        f"within {self.chunk_timeout_s:g} s"
                    ) from None
                if _chunk_of(raw.headers)[0] != index:
                    raise ChunkLost(f"reply on {subject}: part {index + 1} of {count} is missing")
                return raw.data

            return first.headers, await _assemble(first.headers, first.data, next_part)
        finally:
            del self._pending[token]

    async def _on_reply(self, raw: Msg) -> None:
        """A message to our reply inbox: a reply (or part of one), or a responder asking for a part
        of our request."""
        pending = self._pending.get(raw.subject.rsplit(".", 1)[1])
        if pending is None:  # late: its request timed out
            return
        want = raw.headers.get(WANT_HEADER) if raw.headers else None
        if want is None:
            pending.replies.put_nowait(raw)
        elif raw.reply and is_inbox(raw.reply) and want.isdigit() and int(want) < len(pending.parts):
            await self.nc.publish(raw.reply, pending.parts[int(want)])

    async def _request_body(
        self, subject: str, headers: dict[str, str] | None, data: bytes, reply: str | None
    ) -> bytes | None:
        """A received request's whole body: its first part plus the others, asked of the requester;
        None (logged) when one does not come."""

        async def next_part(index: int, count: int) -> bytes:
            try:
                raw = await self.nc.request(reply, b"", timeout=self.chunk_timeout_s, headers={WANT_HEADER: str(index)})
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                raise ChunkLost(
                    f"request on {subject}: part {index + 1} of {count} did not come within {self.chunk_timeout_s:g} s"
                ) from None
            return raw.data

        try:
            if _chunk_of(headers)[1] > 1 and not reply:
                log.warning("a message on %s in parts has no reply subject to ask for the rest; dropped", subject)
                return None
            return await asyncio.wait_for(_assemble(headers, data, next_part), ASSEMBLY_TIMEOUT_S)
        except (ChunkLost, ValueError) as error:  # ChunkLost first: it is a TimeoutError too
            log.warning("%s: %s; the request is dropped", subject, error)
            return None
        except asyncio.TimeoutError:
            log.warning("%s: a request in parts did not come in within %.0f s; dropped", subject, ASSEMBLY_TIMEOUT_S)
            return None

    def _receive(
        self,
        subject: str,
        headers: dict[str, str] | None,
        reply: str | None,
        parts: bool,
        serve: Callable[[dict[str, str] | None, bytes], Awaitable[None]],
        data: bytes,
        refuse: Callable[[str], Awaitable[None]] | None,
    ) -> Awaitable[None] | None:
        """How one received message is served: at once (a whole body), in a task of its own (a
        request in parts, which must not hold up the others), refused (`refuse(reason)`; None:
        logged only), or dropped (None: a reply subject that is not an inbox)."""
        if reply and not is_inbox(reply):
            log.warning("a request on %s asks for its reply on %r, which is not an inbox; dropped", subject, reply[:80])
            return None

        def refused(reason: str) -> Awaitable[None] | None:
            log.warning("a request on %s is refused: %s", subject, reason)
            return refuse(reason) if reply and refuse is not None else None

        try:
            count = _chunk_of(headers)[1]
        except ValueError as error:
            return refused(str(error))
        if count == 1:
            return serve(headers, data)
        if not parts:
            return refused(f"{subject} takes a request in one message, not in {count} parts")
        requester = _requester(reply or "")
        if (
            self._assembling.get(requester, 0) >= MAX_ASSEMBLIES
            or sum(self._assembling.values()) >= MAX_ASSEMBLIES_IN_ALL
        ):
            return refused(
                "too many requests in parts are coming in already (from this requester, or in all); "
                "send this one when they are done"
            )
        self._assembling[requester] = self._assembling.get(requester, 0) + 1

        async def assemble_then_serve() -> None:
            try:
                whole = await self._request_body(subject, headers, data, reply)
            finally:
                self._assembling[requester] -= 1
                if not self._assembling[requester]:
                    del self._assembling[requester]
            if whole is not None:
                await serve({k: v for k, v in (headers or {}).items() if k != CHUNK_HEADER}, whole)

        task = asyncio.ensure_future(assemble_then_serve())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return None

    async def _respond(self, reply: str, body: bytes, headers: dict[str, str] | None) -> None:
        """Answer a request, in numbered parts when the body is larger than one message."""
        parts = split_body(body, self.part_size)
        for index, part in enumerate(parts):
            part_headers = dict(headers or {}) if index == 0 else {}
            if len(parts) > 1:
                part_headers[CHUNK_HEADER] = f"{index}/{len(parts)}"
            await self.nc.publish(reply, part, headers=part_headers or None)
