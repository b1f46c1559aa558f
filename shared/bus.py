"""A thin typed layer over NATS: every message a msgspec Struct, every hop a traced span.

Why a layer at all: five services must agree on three things that nats-py leaves open — how a
message is encoded, what happens to one that does not decode, and how trace context travels. This
module settles them once, and stays generic over message types (the Structs live in
`shared/schema.py`, the names in `shared/subjects.py`).

- Encoding is msgpack via msgspec (smaller and faster to encode/decode than JSON, and msgspec
  validates types and `Meta` ranges while it decodes). A body that is a JSON object is read as
  JSON, on every subject (`is_json`: a message is always an object, and no msgpack message begins
  with `{`), and a request in JSON (or in nothing msgpack: an empty body, `"hello"`) is answered
  in JSON, so any client (`nats req`, Go, TypeScript) needs no msgpack. An empty request is the
  empty object. JSON is read as its published schema says (`from_builtins`): an integral float is
  an int, since JSON-minded clients cannot tell 2 from 2.0, but a string is no number and 1 is no
  boolean. msgpack (our services' own) is decoded with msgspec's `strict=False`.
- A durable consumer never dies silently: a fetch that fails is tried again (with backoff); a
  message whose handler fails is redelivered with growing delays, and on its last delivery
  (`max_deliver`) it is dead-lettered once, with the reason, and never delivered again.
- A payload that does not decode as the subscriber's type (msgspec.DecodeError or its subclass
  ValidationError) never reaches the handler: it goes to `on_invalid(subject, data, error)` and the
  subscription carries on. What `on_invalid` returns (a Struct, e.g. a Rejected) is sent back as
  the reply when the message was a request; a JetStream message that does not decode is
  terminated, since redelivering it cannot make it valid.
- Every publish, request and JetStream publish writes the current span's W3C `traceparent` into
  the message headers; every handler runs in a span whose parent is the producer's span, so one
  scheduling round is one trace across processes.
- A body larger than the connection's `max_payload` travels in parts, so no message size is a
  service's concern: a reply is sent as numbered parts to the requester's inbox; a request's first
  part goes to the service, whose responder then asks the requester for the others (so every part
  reaches the one replica of a queue group that took the request). A KV value that large is kept in
  part keys beside its key (`TypedKV`). A part that does not come in time raises `ChunkLost`.
  A request in parts is put together beside the endpoint's other requests, never in their way:
  within ASSEMBLY_TIMEOUT_S, at most MAX_ASSEMBLIES per requester at a time; an endpoint that takes
  no parts (`parts=False`: the status endpoints) refuses one at once.
- Replies go only to inboxes (`_INBOX…`, or `_R_.…`, where the server maps the reply of a request
  that came through an account's import): a request whose reply subject is anything else (a
  JetStream API subject, a KV key) is dropped and logged, so no one can make a service publish
  where the requester may not.
- Who sent a request is the server's word, never the message's: a request that came through an
  import shared with the requester's info carries the server's `Nats-Request-Info` (its account and
  user), which an endpoint's handler reads as `requester()`. Every such requester is held to
  `RequesterLimits` on every endpoint (a rate, and requests in hand at once), answered 429 beyond
  them before anything is decoded, so no one login holds the endpoint from the others.
- Connections reconnect forever (`max_reconnect_attempts=-1`), so a service outlives a restart of
  the server; pass `max_reconnect_attempts=0` to fail fast instead (a command-line client).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats import micro
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, TracerProvider

from shared.nesting import check_json, too_deep
from shared.tracing import extract_trace_context, inject_trace_context

__all__ = [
    "Bus",
    "ChunkLost",
    "Delivery",
    "InvalidHandler",
    "KVEntry",
    "NotFound",
    "PullConsumer",
    "Requester",
    "RequesterLimits",
    "RevisionConflict",
    "TypedKV",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# What a subscriber learns about a payload it cannot decode; may return a reply (e.g. Rejected).
InvalidHandler = Callable[[str, bytes, Exception], Any]


class NotFound(LookupError):
    """A handler's answer that what the request names is not there (service error 404)."""


class Refused(ValueError):
    """A request refused with an answer (a handler's, or an endpoint's `on_invalid`'s): service error
    `code` (400: the requester's fault), the reason in the error headers, and `answer` as the body,
    so a client that reads headers and one that reads only the body both learn why."""

    def __init__(self, reason: str, answer: Any, code: str = "400") -> None:
        super().__init__(reason)
        self.answer, self.code = answer, code


# A KV create on an existing key, or an update/delete with a stale revision: someone else won.
RevisionConflict = nats.js.errors.KeyWrongLastSequenceError

MSG_ID_HEADER = api.Header.MSG_ID.value  # "Nats-Msg-Id": JetStream drops repeats in its window
TRACEPARENT = "traceparent"  # the W3C trace context header (shared.tracing writes it)
_STREAM_EXISTS_WITH_OTHER_CONFIG = 10058
_WRONG_LAST_SEQUENCE = (10071, 10164)
_TRACER_NAME = "goodput.bus"

# A body in parts: each message says "i/n" (part i from 0, of n); a responder asks for part i of a
# request with an empty request carrying WANT_HEADER: i to the requester's inbox.
CHUNK_HEADER = "Goodput-Chunk"
WANT_HEADER = "Goodput-Want"
HEADER_ROOM = 16 * 1024  # max_payload counts headers too: trace context, error descriptions
CHUNK_TIMEOUT_S = 5.0  # the most a part may lag the one before it
ASSEMBLY_TIMEOUT_S = 30.0  # the most a whole request in parts may take to come in
MAX_ASSEMBLIES = 2  # requests in parts one requester may have coming in at a time
MAX_ASSEMBLIES_IN_ALL = 16  # ... and all requesters together, on one connection
INBOX = "_INBOX"  # what every reply subject begins with (nats-py's default, or _INBOX_<role>)
RESPONSE = "_R_"  # ... or, for a request that came through an import, the server's mapping of it
REQUEST_INFO_HEADER = "Nats-Request-Info"  # the server's word of who sent a request through an import
TOO_MANY = "429"
MAX_PARTS = 256  # the most parts a body may come in (256 MiB at the default max_payload)
MAX_REFUSALS_KEPT = 8  # a one-shot client keeps this many of the server's refusals (Bus.refusals)
# Durable consumers: deliveries of one message before it is dead-lettered, and the redelivery delays.
MAX_DELIVER = 5
REDELIVER_AFTER_S = 1.0  # doubled at each redelivery, up to REDELIVER_MAX_S
REDELIVER_MAX_S = 30.0
FETCH_RETRY_MAX_S = 10.0  # a failing fetch is tried again after 0.5 s, doubling up to this
DRAIN_TIMEOUT_S = 0.05  # after a fetch's first message, how long the others may take
DEAD_REASON_HEADER = "Goodput-Dead-Reason"
DEAD_SUBJECT_HEADER = "Goodput-Dead-Subject"
NO_RESPONDERS_STATUS = "503"


class ChunkLost(nats.errors.TimeoutError):
    """A part of a body sent in parts did not arrive in time (the sender died, or it was dropped)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def split_body(body: bytes, size: int) -> list[bytes]:
    """`body` in parts of at most `size` bytes (one part, maybe empty, when it fits)."""
    if len(body) > MAX_PARTS * size:
        raise ValueError(f"a body of {len(body)} bytes is over {MAX_PARTS} parts of {size} bytes")
    return [body[i : i + size] for i in range(0, len(body), size)] or [body]


def is_json(data: bytes) -> bool:
    """Whether a body is JSON: an object, as every message is, begins with `{` (after white space).
    A msgpack message never does: those bytes are msgpack's small integers, never a whole message."""
    first = memoryview(data)[:1].tobytes()  # every message is decoded: look no further than needed
    if first in (b"{", b""):
        return first == b"{"
    return first in b" \t\r\n" and memoryview(data)[:64].tobytes().lstrip(b" \t\r\n")[:1] == b"{"


def from_builtins(document: Any, msg_type: type[T]) -> T:
    """A message from a JSON or YAML document, as its schema says: integral floats are ints (2.0 is
    2), and nothing else is coerced ("2" is no number, 1 no boolean); ValidationError with the field."""
    return msgspec.convert(_integral_floats_as_ints(document), msg_type, strict=True)


def _integral_floats_as_ints(document: Any) -> Any:
    if isinstance(document, float) and document.is_integer():
        return int(document)
    if isinstance(document, dict):
        return {key: _integral_floats_as_ints(value) for key, value in document.items()}
    if isinstance(document, list):
        return [_integral_floats_as_ints(value) for value in document]
    return document


def explained(error: msgspec.DecodeError, data: bytes) -> msgspec.DecodeError:
    """Why a body is no message, as its sender reads it in any language: one neither a JSON object
    nor a msgpack map is told what a message is, not msgpack's detail ("Expected `object`, got `int`")."""
    if is_json(data) or is_msgpack_message(data):
        return error
    return msgspec.DecodeError(
        f"a message is a JSON object (or a msgpack map); this body "
        f"{'is empty' if not data else f'begins {bytes(data[:24])!r}'}"
    )


def is_msgpack_message(data: bytes) -> bool:
    """Whether a body may be a msgpack message: every message is a map (fixmap, map16, map32)."""
    first = memoryview(data)[:1].tobytes()
    return bool(first) and (0x80 <= first[0] <= 0x8F or first[0] in (0xDE, 0xDF))


def answers_in_json(data: bytes) -> bool:
    """Whether a request is answered in JSON: it is JSON, or no msgpack message at all (`"hello"`,
    `[1, 2]`, an empty body): its sender is no msgpack client, so JSON is what it can read."""
    return not is_msgpack_message(data)


def is_inbox(reply: str) -> bool:
    """Whether a reply subject is an inbox (`_INBOX.…`, `_INBOX_<role>.…`, the server's `_R_.…`), the
    only place a service answers: never a JetStream API subject or a KV key a requester names."""
    first, dot, rest = reply.partition(".")
    return (first.startswith(INBOX) or first == RESPONSE) and bool(dot and rest)


@dataclass(frozen=True)
class Requester:
    """Who sent a request, as the server says: its account and user."""

    account: str
    user: str


_current_requester: ContextVar[Requester | None] = ContextVar("requester", default=None)


def requester() -> Requester | None:
    """Who sent the request being handled, as the server says (one that came through an import of
    another account); None for a request from within the service's own account, or on a server
    without accounts."""
    return _current_requester.get()


def requester_of(headers: dict[str, str] | None) -> Requester | None:
    """The requester a request's `Nats-Request-Info` names (None: it has none)."""
    info = (headers or {}).get(REQUEST_INFO_HEADER)
    if info is None:
        return None
    try:
        document = json.loads(info)
        return Requester(str(document["acc"]), str(document.get("user", "")))
    except (ValueError, KeyError, TypeError):  # only a client of the service's own account writes it itself
        return Requester("", "")


@dataclass(frozen=True)
class RequesterLimits:
    """What each requester the server names may ask of one endpoint's replica (see `Bus.add_endpoint`)."""

    rate_per_s: float = 100.0  # requests a second (a token bucket) ...
    burst: int = 500  # ... this many at once after a quiet while
    in_flight: int = 16  # requests in hand at once


class _Admission:
    """Each requester's token bucket and requests in hand, for one endpoint."""

    def __init__(self, limits: RequesterLimits) -> None:
        self.limits = limits
        self.tokens: dict[Requester, tuple[float, float]] = {}  # requester -> (tokens, when)
        self.in_hand: dict[Requester, int] = {}

    def refusal(self, who: Requester) -> str | None:
        """Why `who`'s request is refused now, or None (then it is counted in hand: `done` when answered)."""
        if self.in_hand.get(who, 0) >= self.limits.in_flight:
            return f"over your limit: at most {self.limits.in_flight} requests in hand at once; wait for their answers"
        now = time.monotonic()
        tokens, then = self.tokens.get(who, (float(self.limits.burst), now))
        tokens = min(float(self.limits.burst), tokens + (now - then) * self.limits.rate_per_s)
        if tokens < 1.0:
            self.tokens[who] = (tokens, now)
            return (
                f"over your limit: at most {self.limits.rate_per_s:g} requests a second ({self.limits.burst} "
                f"at once); try again in {(1.0 - tokens) / self.limits.rate_per_s:.2f} s"
            )
        self.tokens[who] = (tokens - 1.0, now)
        self.in_hand[who] = self.in_hand.get(who, 0) + 1
        return None

    def done(self, who: Requester) -> None:
        self.in_hand[who] -= 1
        if not self.in_hand[who]:
            del self.in_hand[who]


def _requester(reply: str) -> str:
    """Who asked: the reply subject without its last token (one client's inbox)."""
    return reply.rpartition(".")[0]


def _chunk_of(headers: dict[str, str] | None) -> tuple[int, int]:
    """(part, parts) of a message: (0, 1) for a whole body. ValueError for a header that is not
    `i/n` with 0 <= i < n <= MAX_PARTS: a peer's header is never trusted to size a buffer."""
    mark = (headers or {}).get(CHUNK_HEADER)
    if mark is None:
        return 0, 1
    index, _, count = mark.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count) <= MAX_PARTS):
        raise ValueError(f"bad {CHUNK_HEADER} header {mark[:40]!r} (want i/n, n at most {MAX_PARTS})")
    return int(index), int(count)


@dataclass
class _Pending:
    """A request of ours waiting for its reply: the request's parts (a responder may ask for them)
    and the reply's messages as they come."""

    parts: list[bytes]
    replies: asyncio.Queue


async def _settle(result: Any) -> Any:
    """Await `result` if a callback was async; lets handlers be plain functions or coroutines."""
    if inspect.isawaitable(result):
        return await result
    return result


def _report_invalid(subject: str, data: bytes, error: Exception) -> None:
    """Default `on_invalid`: say which subject sent what kind of garbage, then move on."""
    log.warning("invalid message on %s (%d bytes): %s", subject, len(data), error)


def _receive_attributes(raw: Msg) -> dict[str, Any]:
    return {
        "messaging.system": "nats",
        "messaging.destination.name": raw.subject,
        "messaging.message.body.size": len(raw.data),
    }


DEFAULT_SERVER = "nats://127.0.0.1:4222"
SERVER_ENV = "GOODPUT_NATS_URL"  # where every service and command finds NATS
# How many servers keep each stream and KV bucket a service creates (3 on a 3-server cluster: the
# data stays available while one server is down); 1 on a single server.
REPLICAS_ENV = "GOODPUT_JETSTREAM_REPLICAS"


@dataclass
class _Outcome:
    """How one received message was handled."""

    answer: Any  # the reply, or on_invalid's answer to an undecodable message
    refusal: str | None  # why it was refused (undecodable, or the handler's ValueError)
    headers: dict[str, str] | None  # reply headers carrying the handling span's context
    code: str = "400"  # the refusal's service error code (404: what it asks for is not there)


class Bus:
    """One NATS connection with typed messages, JetStream and KV, traced end to end."""

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

    # ---- connection -------------------------------------------------------------------------

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
        options.setdefault("max_reconnect_attempts", -1)
        options.setdefault("reconnect_time_wait", 0.5)
        options.setdefault("connect_timeout", 2)
        options.setdefault("error_cb", _log_error)
        options.setdefault("disconnected_cb", _log_event(f"{name}: disconnected from NATS"))
        options.setdefault("reconnected_cb", _log_event(f"{name}: reconnected to NATS"))
        nc = await nats.connect(servers, name=name, **options)
        return cls(nc, tracer_provider=tracer_provider, on_invalid=on_invalid, replicas=replicas)

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

    async def close(self) -> None:
        """Drain (finish handlers in flight, flush what was published), then close."""
        if self.nc.is_closed:
            return
        for callback in reversed(self._closing):
            await callback()
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
        """Return once the server has processed everything sent so far (e.g. a subscription).

        Two round trips, because nats-py 2.16 writes its PING straight to the socket, ahead of
        commands still in its send buffer: after the first PONG the buffer has been written, so
        the second PING follows it.
        """
        await self.nc.flush(timeout)
        await self.nc.flush(timeout)

    # ---- encoding ---------------------------------------------------------------------------

    def encode(self, msg: Any, json: bool = False) -> bytes:
        return (self._json_encoder if json else self._encoder).encode(msg)

    def decode(self, data: bytes, msg_type: type[T]) -> T:
        """Decode (msgpack, or JSON when the body is a JSON object) and validate; raises
        msgspec.ValidationError / DecodeError with a reason. A body nested too deep is a DecodeError
        that says so (shared/nesting.py): JSON before it is read, msgpack where reading it recurses."""
        key = (msg_type, is_json(data))
        if key[1]:
            check_json(data)
        decoder = self._decoders.get(key)
        if decoder is None:
            kind = msgspec.json.Decoder if key[1] else msgspec.msgpack.Decoder
            decoder = self._decoders[key] = kind(msg_type, strict=key[1])
        with too_deep():
            try:
                return decoder.decode(data)
            except msgspec.ValidationError:
                if not key[1]:
                    raise
                return from_builtins(msgspec.json.decode(data), msg_type)  # 2.0 for an int: read again

    @property
    def part_size(self) -> int:
        """The largest part of a body that fits one message of this connection, headers included."""
        return max(self.nc.max_payload - HEADER_ROOM, self.nc.max_payload // 2)

    @staticmethod
    def _trace_headers(headers: dict[str, str] | None = None) -> dict[str, str] | None:
        """The caller's headers plus the current trace context; None keeps a plain PUB."""
        merged = inject_trace_context(dict(headers) if headers else {})
        return merged or None

    # ---- core NATS --------------------------------------------------------------------------

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

    async def _handle(
        self,
        subject: str,
        headers: dict[str, str] | None,
        data: bytes,
        msg_type: type[T],
        handler: Callable[[T], Any],
        name: str,
        kind: SpanKind,
        attributes: dict[str, Any],
        report_invalid: InvalidHandler,
    ) -> _Outcome | None:
        """Decode and handle one message inside a span parented on the producer's; None when the
        handler failed (recorded on the span and logged: one bad message must not stop the rest)."""
        with self._tracer.start_as_current_span(
            name,
            context=extract_trace_context(headers),
            kind=kind,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                message = self.decode(data, msg_type)
            except msgspec.DecodeError as decode_error:
                error = explained(decode_error, data)
                _mark_invalid(span, error)
                try:
                    answer = await _settle(report_invalid(subject, data, error))
                except Refused as refused:
                    return _Outcome(refused.answer, str(refused), self._trace_headers(), refused.code)
                return _Outcome(answer, f"invalid {msg_type.__name__}: {error}", self._trace_headers())
            try:
                answer = await _settle(handler(message))
            except Refused as error:  # refused, with an answer that says why
                _mark_invalid(span, error)
                return _Outcome(error.answer, str(error), self._trace_headers(), error.code)
            except ValueError as error:  # well formed, but it cannot be served: say why
                _mark_invalid(span, error)
                return _Outcome(None, str(error), self._trace_headers())
            except NotFound as error:  # what it asks for is not there
                _mark_invalid(span, error)
                return _Outcome(None, error.args[0] if error.args else str(error), self._trace_headers(), "404")
            except Exception as error:
                _mark_failed(span, error)
                log.exception("handler for %s failed", subject)
                return None
            return _Outcome(answer, None, self._trace_headers())

    async def add_endpoint(
        self,
        service: micro.Service,
        name: str,
        subject: str,
        msg_type: type[T],
        handler: Callable[[T], Any],
        *,
        queue: str | None = None,
        span_name: str | None = None,
        on_invalid: InvalidHandler | None = None,
        parts: bool = True,
        metadata: dict[str, str] | None = None,
        concurrency: int = 1,
        limits: RequesterLimits = RequesterLimits(),
    ) -> None:
        """A typed request endpoint of a NATS service (`nats.micro`: it shows in $SRV.INFO and
        $SRV.STATS): `handler(request)` returns the reply. A request that does not decode is
        answered as a service error 400 with `on_invalid`'s answer (e.g. a Rejected) as its data,
        one the handler refuses with ValueError as error 400 with that reason (a `Refused`, from the
        handler or `on_invalid`: its code, and its answer as the body), and a handler that
        fails otherwise as error 500; `Bus.request` raises them as micro's ServiceError. A handler's
        NotFound is error 404. A JSON request refused without an answer gets `{"error", "code"}`
        as its body too, for clients that do not read headers. Replicas share `queue` (default: the
        service's own queue group). `parts=False`: the requests are small (a status), and one in
        parts is refused at once. `metadata`: the endpoint's, in $SRV.INFO. `concurrency`: how many
        requests are served at once (1: one after another, in the order they came; more, for a
        handler that mostly waits on other services: each in a task, the next one waiting while
        that many are in hand). `limits`: what each requester the server names (`requester()`) may
        ask of this replica; beyond them a request is answered error 429 with why, undecoded."""
        span = span_name or f"{subject} receive"
        report_invalid = on_invalid or self._on_invalid
        gate = asyncio.Semaphore(concurrency) if concurrency > 1 else None
        admission = _Admission(limits)

        async def on_request(request: micro.Request) -> None:
            reply = request._msg.reply
            if not reply:
                return
            who = requester_of(request.headers)
            if who is not None and is_inbox(reply):
                refusal = admission.refusal(who)
                if refusal is not None:
                    await request.respond_error(TOO_MANY, refusal)
                    return
            served = self._receive(
                request.subject,
                request.headers,
                reply,
                parts,
                lambda headers, data: serve(request, reply, headers, data, who),
                request.data,
                lambda reason: request.respond_error("400", reason),
            )
            if served is None or gate is None:
                if served is not None:
                    await served
                if who is not None and is_inbox(reply):
                    admission.done(who)  # answered (or in parts: held to MAX_ASSEMBLIES instead)
                return
            await gate.acquire()
            task = asyncio.ensure_future(served)
            self._background.add(task)

            def finished(done: asyncio.Future) -> None:
                self._background.discard(done)
                gate.release()
                if who is not None:
                    admission.done(who)

            task.add_done_callback(finished)

        async def serve(
            request: micro.Request,
            reply: str,
            request_headers: dict[str, str] | None,
            data: bytes,
            who: Requester | None,
        ) -> None:
            _current_requester.set(who)
            # An empty request is the empty object: every field its default (`nats req SUBJECT ''`).
            outcome = await self._handle(
                request.subject,
                request_headers,
                data or b"{}",
                msg_type,
                handler,
                span,
                SpanKind.SERVER,
                {"messaging.destination.name": request.subject},
                report_invalid,
            )
            if outcome is None:
                await request.respond_error("500", f"{name} failed on this request")
                return
            answer = outcome.answer
            if answer is None and outcome.refusal is not None and answers_in_json(data):
                answer = {"error": outcome.refusal, "code": int(outcome.code)}
            body = b"" if answer is None else self.encode(answer, json=answers_in_json(data))
            headers = dict(outcome.headers or {})
            if outcome.refusal is not None:  # as micro's respond_error, in parts if need be
                headers.update(
                    {micro.request.ERROR_HEADER: outcome.refusal, micro.request.ERROR_CODE_HEADER: outcome.code}
                )
            await self._respond(reply, body, headers)

        options = {"queue_group": queue} if queue else {}
        await service.add_endpoint(name=name, subject=subject, handler=on_request, metadata=metadata, **options)
        await self.flush()  # when this returns, the server routes requests to the endpoint

    async def subscribe(
        self,
        subject: str,
        msg_type: type[T],
        handler: Callable[..., Any],
        *,
        queue: str | None = None,
        with_raw: bool = False,
        span_name: str | None = None,
        on_invalid: InvalidHandler | None = None,
    ) -> Subscription:
        """Call `handler(message)` (or `handler(message, raw_msg)` with `with_raw`) for each
        message that decodes as `msg_type`, inside a span parented on the producer's. The
        subscription is live on the server when this returns.

        A queue group spreads messages over replicas. If the message is a request and the
        handler returns a value, that value is the reply. A handler that raises is recorded on
        its span and logged; the subscription keeps going.
        """
        name = span_name or f"{subject} receive"
        report_invalid = on_invalid or self._on_invalid

        async def on_message(raw: Msg) -> None:
            # A plain subscription answers nothing it did not handle: a refusal is only logged.
            served = self._receive(
                raw.subject,
                raw.headers,
                raw.reply,
                True,
                lambda headers, data: serve(raw, headers, data),
                raw.data,
                None,
            )
            if served is not None:
                await served

        async def serve(raw: Msg, headers: dict[str, str] | None, data: bytes) -> None:
            kind = SpanKind.SERVER if raw.reply else SpanKind.CONSUMER
            call = (lambda message: handler(message, raw)) if with_raw else handler
            outcome = await self._handle(
                raw.subject, headers, data, msg_type, call, name, kind, _receive_attributes(raw), report_invalid
            )
            if raw.reply and outcome is not None and outcome.answer is not None:
                await self._respond(raw.reply, self.encode(outcome.answer, json=answers_in_json(data)), outcome.headers)

        subscription = await self.nc.subscribe(subject, queue=queue or "", cb=on_message)
        await self.flush()  # when subscribe returns, the server routes to it
        return subscription

    # ---- JetStream --------------------------------------------------------------------------

    async def ensure_stream(self, name: str, subjects: Iterable[str], **config: Any) -> api.StreamInfo:
        """Create the stream, or bring an existing one to this configuration (idempotent, so
        every replica can call it at start). `config` is nats-py's StreamConfig fields, e.g.
        `duplicate_window=120` (seconds), `max_age`, `storage=api.StorageType.FILE`."""
        config.setdefault("num_replicas", self.replicas)
        stream = api.StreamConfig(name=name, subjects=list(subjects), **config)
        try:
            return await self.js.add_stream(stream)
        except nats.js.errors.BadRequestError as error:
            if error.err_code != _STREAM_EXISTS_WITH_OTHER_CONFIG:
                raise
            return await self.js.update_stream(stream)

    async def js_publish(
        self,
        subject: str,
        msg: Any,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        stream: str | None = None,
    ) -> api.PubAck:
        """Store `msg` in the stream that owns `subject` and return the server's PubAck.

        With `msg_id`, a second publish of the same id inside the stream's duplicate window is
        not stored again: its PubAck has `duplicate=True` and the first message's sequence.
        """
        merged = dict(headers) if headers else {}
        if msg_id is not None:
            merged[MSG_ID_HEADER] = msg_id
        return await self.js.publish(
            subject, self.encode(msg), timeout=timeout, stream=stream, headers=self._trace_headers(merged)
        )

    async def pull_consumer(
        self,
        stream: str,
        durable: str,
        subject_filter: str | Iterable[str],
        msg_type: type[T],
        *,
        span_name: str | None = None,
        on_invalid: InvalidHandler | None = None,
        dead_letters: str | None = None,
        **consumer_config: Any,
    ) -> PullConsumer[T]:
        """A durable pull consumer with explicit ack on `stream`, created or updated to this
        configuration. `subject_filter` is one subject or several. `consumer_config` is nats-py's
        ConsumerConfig fields, e.g. `ack_wait` (seconds before an unacked message is redelivered)
        and `max_deliver` (default MAX_DELIVER). A message dead-lettered is stored on the subject
        `dead_letters` (a JetStream subject), as it came, with the reason in its headers."""
        consumer_config.setdefault("max_deliver", MAX_DELIVER)
        filters = [subject_filter] if isinstance(subject_filter, str) else list(subject_filter)
        config = api.ConsumerConfig(
            name=durable,
            durable_name=durable,
            **({"filter_subject": filters[0]} if len(filters) == 1 else {"filter_subjects": filters}),
            ack_policy=api.AckPolicy.EXPLICIT,
            **consumer_config,
        )
        await self.js.add_consumer(stream, config)
        return await self.bind_consumer(
            stream,
            durable,
            msg_type,
            span_name=span_name or f"{filters[0]} receive",
            on_invalid=on_invalid,
            dead_letters=dead_letters,
        )

    async def bind_consumer(
        self,
        stream: str,
        durable: str,
        msg_type: type[T],
        *,
        span_name: str | None = None,
        on_invalid: InvalidHandler | None = None,
        dead_letters: str | None = None,
    ) -> PullConsumer[T]:
        """The durable pull consumer `durable` of `stream`, as it exists on the server (created by
        whoever may: `pull_consumer`, or the operator's setup); nats-py's NotFoundError if it does not."""
        info = await self.js.consumer_info(stream, durable)
        subscription = await self.js.pull_subscribe_bind(durable=durable, stream=stream)
        consumer = PullConsumer(
            bus=self,
            subscription=subscription,
            msg_type=msg_type,
            span_name=span_name or f"{durable} receive",
            on_invalid=on_invalid or self._on_invalid,
            max_deliver=info.config.max_deliver or MAX_DELIVER,
            ack_wait_s=info.config.ack_wait or 30.0,
            dead_letters=dead_letters,
        )
        self._pull_consumers.add(consumer)
        return consumer

    async def pull(
        self,
        stream: str,
        durable: str,
        subject_filter: str,
        msg_type: type[T],
        *,
        batch: int = 10,
        timeout: float = 1.0,
        **consumer_options: Any,
    ) -> AsyncIterator[Delivery[T]]:
        """Deliveries from a durable pull consumer, without end: `async for d in bus.pull(...)`.
        Process each inside `with d.span():` and settle it with `ack`, `nak` or `term`."""
        consumer = await self.pull_consumer(stream, durable, subject_filter, msg_type, **consumer_options)
        try:
            while True:
                for delivery in await consumer.fetch(batch, timeout):
                    yield delivery
        finally:
            with contextlib.suppress(nats.errors.Error):
                await consumer.unsubscribe()

    async def follow(
        self, subject: str, msg_type: type[T], *, idle_timeout: float | None = 3600.0, new_only: bool = False
    ) -> AsyncIterator[T]:
        """Every message stored on `subject`, from the first (`new_only`: from now on), then each as
        it is stored (an ordered consumer: no acks, nothing missed or repeated). TimeoutError after
        `idle_timeout` seconds without one (None: wait for ever)."""
        policy = api.DeliverPolicy.NEW if new_only else api.DeliverPolicy.ALL
        subscription = await self.js.subscribe(subject, ordered_consumer=True, deliver_policy=policy)
        try:
            while True:
                raw = await subscription.next_msg(timeout=idle_timeout)
                yield self.decode(raw.data, msg_type)
        finally:
            with contextlib.suppress(nats.errors.Error):
                await subscription.unsubscribe()

    # ---- KV ---------------------------------------------------------------------------------

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


class Delivery(Generic[T]):
    """One decoded JetStream message and the means to settle it."""

    def __init__(self, message: T, raw: Msg, tracer: trace.Tracer, span_name: str) -> None:
        self.message = message
        self.raw = raw
        self._tracer = tracer
        self._span_name = span_name
        self.settled = False

    @property
    def subject(self) -> str:
        return self.raw.subject

    @property
    def num_delivered(self) -> int:
        """1 on first delivery; more when it was redelivered (not acked in time, or nakked)."""
        return self.raw.metadata.num_delivered

    @property
    def stream_sequence(self) -> int:
        return self.raw.metadata.sequence.stream

    @property
    def traceparent(self) -> str:
        """The producer's W3C trace context ("" when it sent none)."""
        return (self.raw.headers or {}).get(TRACEPARENT, "")

    @contextlib.contextmanager
    def span(self, name: str | None = None) -> Iterator[trace.Span]:
        """Make the processing of this message a span whose parent is the producer's span."""
        with self._tracer.start_as_current_span(
            name or self._span_name,
            context=extract_trace_context(self.raw.headers),
            kind=SpanKind.CONSUMER,
            attributes=_receive_attributes(self.raw),
        ) as span:
            yield span

    async def ack(self) -> None:
        await self.raw.ack()
        self.settled = True

    async def nak(self, delay: float | None = None) -> None:
        """Ask for redelivery now (or after `delay` seconds)."""
        await self.raw.nak(delay)
        self.settled = True

    async def term(self) -> None:
        """Never redeliver this message."""
        await self.raw.term()
        self.settled = True

    async def in_progress(self) -> None:
        """Still working: restart the ack_wait timer."""
        await self.raw.in_progress()


class PullConsumer(Generic[T]):
    """A bound durable pull consumer that decodes as it fetches."""

    def __init__(
        self,
        *,
        bus: Bus,
        subscription: JetStreamContext.PullSubscription,
        msg_type: type[T],
        span_name: str,
        on_invalid: InvalidHandler,
        max_deliver: int = MAX_DELIVER,
        ack_wait_s: float = 30.0,
        dead_letters: str | None = None,
    ) -> None:
        self._bus = bus
        self.ack_wait_s = ack_wait_s
        self._subscription = subscription
        self._msg_type = msg_type
        self._span_name = span_name
        self._on_invalid = on_invalid
        self.max_deliver = max_deliver
        self._dead_letters = dead_letters
        self._stopped = False

    async def fetch(self, batch: int = 10, timeout: float = 1.0) -> list[Delivery[T]]:
        """Up to `batch` messages, waiting at most `timeout` seconds for the first; [] when none came.
        Messages that do not decode go to `on_invalid` and are terminated, not returned."""
        # nats-py's waiting fetch of n returns only once n came or the time is up: wait for one,
        # then take what else is there at once.
        try:
            raws = await self._subscription.fetch(1, timeout)
        except asyncio.TimeoutError:  # nats.errors.TimeoutError is one
            return []
        if batch > 1:
            with contextlib.suppress(asyncio.TimeoutError):
                raws += await self._subscription.fetch(batch - 1, DRAIN_TIMEOUT_S)
        deliveries = []
        for raw in raws:
            try:
                message = self._bus.decode(raw.data, self._msg_type)
            except msgspec.DecodeError as error:
                await self._reject(raw, explained(error, raw.data))
                continue
            deliveries.append(Delivery(message, raw, self._bus._tracer, self._span_name))
        return deliveries

    async def consume(
        self,
        handler: Callable[..., Any],
        *,
        batch: int = 10,
        timeout: float = 5.0,
        with_delivery: bool = False,
        on_dead: Callable[[Delivery[T], Exception], Any] | None = None,
    ) -> None:
        """Run `handler(message)` (or `handler(message, delivery)`) for every message until
        cancelled, each inside its span: ack when it returns (unless it settled the delivery
        itself), nak when it raises, so the message comes back to this or another replica after a
        delay that doubles each time. On its last delivery a message whose handler raises is
        dead-lettered: `on_dead(delivery, error)` (e.g. the job's rejection), stored on the dead
        letters subject, and terminated. A fetch that fails is tried again; nothing ends the loop
        but cancellation. `timeout` is how long one fetch waits for a message (it returns at once
        when one comes): an idle consumer asks once per `timeout`."""
        retry_s = 0.5
        while True:
            try:
                deliveries = await self.fetch(batch, timeout)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - NATS away, the consumer gone: try again, say so
                if self._stopped or self._bus.nc.is_closed or self._bus.nc.is_draining:
                    return  # stopped on purpose: nothing to say
                log.warning(
                    "fetching from %s failed (%s: %s); trying again in %.1f s",
                    self._span_name,
                    type(error).__name__,
                    error,
                    retry_s,
                )
                await asyncio.sleep(retry_s)
                retry_s = min(2 * retry_s, FETCH_RETRY_MAX_S)
                continue
            retry_s = 0.5
            for delivery in deliveries:
                with delivery.span() as span:
                    working = asyncio.ensure_future(self._working(delivery))
                    try:
                        args = (delivery.message, delivery) if with_delivery else (delivery.message,)
                        await _settle(handler(*args))
                    except Exception as error:  # noqa: BLE001 - redeliver, keep consuming
                        _mark_failed(span, error)
                        if not delivery.settled:
                            await self._failed(delivery, error, on_dead)
                        continue
                    finally:
                        working.cancel()
                    if not delivery.settled:
                        with contextlib.suppress(nats.errors.Error):  # unacked: it comes back
                            await delivery.ack()

    async def _working(self, delivery: Delivery[T]) -> None:
        """While a handler works (a job profiled on real slots takes minutes), tell the server the
        message is in hand, so it is not redelivered to another replica meanwhile."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            with contextlib.suppress(nats.errors.Error):
                await delivery.in_progress()

    async def _failed(
        self, delivery: Delivery[T], error: Exception, on_dead: Callable[[Delivery[T], Exception], Any] | None
    ) -> None:
        """A delivery whose handler raised: redelivered later, or on its last delivery dead-lettered."""
        attempt = delivery.num_delivered
        reason = f"{type(error).__name__}: {error}"
        if attempt < self.max_deliver:
            delay = min(REDELIVER_AFTER_S * 2 ** (attempt - 1), REDELIVER_MAX_S)
            log.warning(
                "handler for %s failed (delivery %d of %d: %s); redelivered in %.0f s",
                delivery.subject,
                attempt,
                self.max_deliver,
                reason,
                delay,
            )
            with contextlib.suppress(nats.errors.Error):
                await delivery.nak(delay)
            return
        log.error(
            "handler for %s failed on the last of %d deliveries (%s); dead-lettered", delivery.subject, attempt, reason
        )
        try:
            if on_dead is not None:
                await _settle(on_dead(delivery, error))
        except Exception as failed:  # noqa: BLE001 - it is dead-lettered all the same
            log.warning("the dead-letter handler of %s failed: %s", delivery.subject, failed)
        try:
            if self._dead_letters is not None:
                await self._bus.js.publish(
                    self._dead_letters,
                    delivery.raw.data,
                    headers={DEAD_REASON_HEADER: reason[:1000], DEAD_SUBJECT_HEADER: delivery.subject},
                )
        except Exception as failed:  # noqa: BLE001 - the message is dropped all the same: it cannot be processed
            log.warning("storing a dead letter of %s failed: %s", delivery.subject, failed)
        with contextlib.suppress(nats.errors.Error):
            await delivery.term()

    async def unsubscribe(self) -> None:
        """Stop fetching; the durable consumer stays on the server for the next replica."""
        self._stopped = True
        self._bus._pull_consumers.discard(self)
        await self._subscription.unsubscribe()

    async def _reject(self, raw: Msg, error: msgspec.DecodeError) -> None:
        with self._bus._tracer.start_as_current_span(
            self._span_name,
            context=extract_trace_context(raw.headers),
            kind=SpanKind.CONSUMER,
            attributes=_receive_attributes(raw),
        ) as span:
            _mark_invalid(span, error)
            try:
                await _settle(self._on_invalid(raw.subject, raw.data, error))
            finally:
                await raw.term()


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


async def _assemble(
    headers: dict[str, str] | None, first: bytes, next_part: Callable[[int, int], Awaitable[bytes]]
) -> bytes:
    """A body from its first part and `next_part(i, n)` for each other part."""
    _, count = _chunk_of(headers)
    if count == 1:
        return first
    return b"".join([first] + [await next_part(index, count) for index in range(1, count)])


def _mark_invalid(span: trace.Span, error: Exception) -> None:
    span.set_attribute("goodput.invalid_reason", str(error))
    span.set_status(Status(StatusCode.ERROR, f"invalid message: {error}"))


def _mark_failed(span: trace.Span, error: Exception) -> None:
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, str(error)))


async def _log_error(error: Exception) -> None:
    log.warning("NATS: %s", error)


def _log_event(text: str) -> Callable[[], Awaitable[None]]:
    async def callback() -> None:
        log.info(text)

    return callback
