"""A bus's connection: made (a service's reconnects forever; a one-shot client's fails fast and keeps
the server's refusals), closed (its close callbacks first, then drained), flushed, and the trace
context every message it sends carries."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from opentelemetry import trace
from opentelemetry.trace import TracerProvider

from shared.bus.requests import CHUNK_TIMEOUT_S
from shared.bus.spans import _TRACER_NAME, InvalidHandler, _report_invalid
from shared.tracing import inject_trace_context

if TYPE_CHECKING:
    from shared.bus import Bus
    from shared.bus.consumers import PullConsumer
    from shared.bus.requests import _Pending

log = logging.getLogger(__package__)  # "shared.bus" in every file: one logger to configure

MAX_REFUSALS_KEPT = 8  # a one-shot client keeps this many of the server's refusals (Bus.refusals)
DEFAULT_SERVER = "nats://127.0.0.1:4222"
SERVER_ENV = "GOODPUT_NATS_URL"  # where every service and command finds NATS
# How many servers keep each stream and KV bucket a service creates (3 on a 3-server cluster: the
# data stays available while one server is down); 1 on a single server.
REPLICAS_ENV = "GOODPUT_JETSTREAM_REPLICAS"


class Connection:
    """A bus's NATS connection and JetStream context, and the state the other parts of `Bus` share."""

    def __init__(
        self,
        nc: NatsClient,
        *,
        tracer_provider: TracerProvider | None = None,
        on_invalid: InvalidHandler | None = None,
        replicas: int = 1,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"JetStream replicas must be at least 1, got {replicas}")
        self.nc = nc
        self.replicas = replicas
        # A one-shot client's (connect_once): what the server refused it, and set at a permissions violation.
        self.refusals: list[Exception] = []
        self.refused = asyncio.Event()
        self.js: JetStreamContext = nc.jetstream()
        # None means the process's provider (shared.tracing.setup_tracing); tests pass their own.
        self._tracer = trace.get_tracer(_TRACER_NAME, tracer_provider=tracer_provider)
        self._on_invalid = on_invalid or _report_invalid
        self._encoder = msgspec.msgpack.Encoder()
        self._json_encoder = msgspec.json.Encoder()
        self._decoders: dict[tuple[Any, bool], msgspec.msgpack.Decoder | msgspec.json.Decoder] = {}
        # Pull subscriptions are unsubscribed before a drain: nats-py's drain would otherwise
        # wait its full timeout on their inboxes, which nothing reads between fetches.
        self._pull_consumers: set[PullConsumer[Any]] = set()
        self._closing: list[Callable[[], Awaitable[None]]] = []
        # Replies come to one wildcard inbox, by token (nats-py's own request keeps only the first
        # message of a reply; a reply in parts is several).
        self._reply_prefix: str | None = None
        self._reply_inbox_ready = asyncio.Lock()
        self._pending: dict[str, _Pending] = {}
        self.chunk_timeout_s = CHUNK_TIMEOUT_S
        self._assembling: dict[str, int] = {}  # requester -> its requests in parts coming in
        self._background: set[asyncio.Task] = set()
        # The connection a service's endpoints take requests on (`listener`): this one, unless
        # `connect` says how to open one of their own.
        self._listener: NatsClient | None = None
        self._open_listener: Callable[[], Awaitable[NatsClient]] | None = None

    @classmethod
    async def connect(
        cls,
        servers: str | list[str],
        name: str,
        *,
        tracer_provider: TracerProvider | None = None,
        on_invalid: InvalidHandler | None = None,
        replicas: int | None = None,
        **options: Any,
    ) -> Bus:
        """Connect as `name` (shown in server monitoring); TLS and auth options (`tls`, `user`,
        `password`, `token`, `user_credentials`, `nkeys_seed` …) pass through to nats-py.
        `replicas`: the servers that keep each stream and KV bucket this bus creates (default:
        $GOODPUT_JETSTREAM_REPLICAS, else 1)."""
        if replicas is None:
            replicas = int(os.environ.get(REPLICAS_ENV, "1"))
        nc = await _connect(servers, name, options)
        bus = cls(nc, tracer_provider=tracer_provider, on_invalid=on_invalid, replicas=replicas)
        if options.get("allow_reconnect", True):
            bus._open_listener = lambda: _connect(servers, f"{name} requests", options)
        return bus

    @classmethod
    async def connect_once(cls, servers: str | list[str], name: str, **options: Any) -> Bus:
        """A one-shot client's connection (a command): it fails when the server is not there rather
        than retry forever (nats-py reads max_reconnect_attempts=0 as "no limit" while choosing a
        server; 1 gives up after one try), and a refusal is the caller's error to explain, not
        also a warning of nats-py's on stderr. What the server refuses it later (a subject its login
        may not publish to: the request then goes unanswered) is kept in `refusals`, for the
        caller's error to name."""
        refusals: list[Exception] = []
        refused = asyncio.Event()

        async def remember(error: Exception) -> None:
            log.debug("NATS: %s", error)
            denied = "permissions violation" in str(error).lower()
            if denied or len(refusals) < MAX_REFUSALS_KEPT:
                refusals.append(error)
            if denied:
                refused.set()

        bus = await cls.connect(
            servers, name, allow_reconnect=False, max_reconnect_attempts=1, error_cb=remember, **options
        )
        bus.refusals, bus.refused = refusals, refused
        return bus

    async def listener(self) -> NatsClient:
        """The connection a service's endpoints take requests on: a service's own second one, so that
        the server closing it (a slow consumer: logins flooding a service faster than it reads) loses
        only the requests queued on it; what is in hand goes on, on this one, and it reconnects."""
        if self._listener is None:
            self._listener = self.nc if self._open_listener is None else await self._open_listener()
        return self._listener

    async def close(self) -> None:
        """Run the close callbacks, stop taking requests, drain (finish handlers in flight, flush what
        was published), then close."""
        if self.nc.is_closed:
            return
        for callback in reversed(self._closing):  # e.g. a service stopping its endpoints
            await callback()
        if self._listener is not None and self._listener is not self.nc:
            with contextlib.suppress(nats.errors.Error):
                await self._listener.drain()
        for consumer in list(self._pull_consumers):
            with contextlib.suppress(nats.errors.Error):
                await consumer.unsubscribe()
        for task in list(self._background):  # requests in parts still coming in: dropped
            task.cancel()
        try:
            await self.nc.drain()
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
            await self.nc.close()

    def on_close(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run `callback` first when the bus closes (e.g. give up a lease while still connected)."""
        self._closing.append(callback)

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def flush(self, timeout: float = 2.0) -> None:
        """Return once the server has processed everything sent so far on this bus's connections
        (e.g. a subscription, an endpoint's on the listener).

        Two round trips, because nats-py 2.16 writes its PING straight to the socket, ahead of
        commands still in its send buffer: after the first PONG the buffer has been written, so
        the second PING follows it.
        """
        connections = [self.nc] if self._listener in (None, self.nc) else [self.nc, self._listener]
        for nc in connections:
            await nc.flush(timeout)
            await nc.flush(timeout)

    @staticmethod
    def _trace_headers(headers: dict[str, str] | None = None) -> dict[str, str] | None:
        """The caller's headers plus the current trace context; None keeps a plain PUB."""
        merged = inject_trace_context(dict(headers) if headers else {})
        return merged or None


async def _connect(servers: str | list[str], name: str, options: dict[str, Any]) -> NatsClient:
    """A connection as `name` that reconnects for ever (unless `options` say otherwise) and logs why it drops."""
    options = {
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 2,
        "error_cb": _log_error,
        "disconnected_cb": _log_event(f"{name}: disconnected from NATS"),
        "reconnected_cb": _log_event(f"{name}: reconnected to NATS"),
        **options,
    }
    return await nats.connect(servers, name=name, **options)


async def _log_error(error: Exception) -> None:
    log.warning("NATS: %s", error)


def _log_event(text: str) -> Callable[[], Awaitable[None]]:
    async def callback() -> None:
        log.info(text)

    return callback
