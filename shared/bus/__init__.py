"""A thin typed layer over NATS: every message a msgspec Struct, every hop a traced span.

Why a layer at all: six services must agree on three things that nats-py leaves open — how a
message is encoded, what happens to one that does not decode, and how trace context travels. This
package settles them once, and stays generic over message types (the Structs live in
`shared/schema/`, the names in `shared/subjects.py`).

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

The package, one concern a file (`Bus` is made of one part from each of the first six):

- `connection.py`: connecting, closing and flushing; the state the other parts share; trace headers.
- `encoding.py`: JSON and msgpack in and out, `is_json`, `from_builtins`, `explained`; a body in
  parts (`split_body`, `ChunkLost`); `Refused` and `NotFound`, a handler's refusals.
- `requests.py`: `publish` and `request`; a received request's parts put together, and its answer
  sent in parts.
- `endpoints.py`: `add_endpoint` and `subscribe`, and how a received message is decoded and handled.
- `jetstream.py`: streams, `js_publish`, durable pull consumers made or bound, `follow`.
- `kv.py`: `kv`, `open_kv`, and `TypedKV`, its large values in part keys.
- `consumers.py`: `Delivery` and `PullConsumer` (redelivery, dead letters).
- `requesters.py`: `requester()`, `RequesterLimits` and their admission, `is_inbox`.
- `spans.py`: a received message's span, marked invalid or failed; the default `on_invalid`.
"""

from __future__ import annotations

from shared.bus.connection import Connection
from shared.bus.encoding import Codec
from shared.bus.endpoints import Endpoints
from shared.bus.jetstream import JetStream
from shared.bus.kv import KeyValues
from shared.bus.requests import Requests


class Bus(Connection, Codec, Requests, Endpoints, JetStream, KeyValues):
    """One NATS connection with typed messages, JetStream and KV, traced end to end."""
