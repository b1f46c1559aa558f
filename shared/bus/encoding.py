"""How a message is written and read: msgpack via msgspec, or JSON for a client that sends it; a body
larger than one message, in numbered parts; and the errors a handler raises to refuse a request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats.errors

from shared.nesting import check_json, too_deep

T = TypeVar("T")


class NotFound(LookupError):
    """A handler's answer that what the request names is not there (service error 404)."""


class Refused(ValueError):
    """A request refused with an answer (a handler's, or an endpoint's `on_invalid`'s): service error
    `code` (400: the requester's fault), the reason in the error headers, and `answer` as the body,
    so a client that reads headers and one that reads only the body both learn why."""

    def __init__(self, reason: str, answer: Any, code: str = "400") -> None:
        super().__init__(reason)
        self.answer, self.code = answer, code


# A body in parts: each message says "i/n" (part i from 0, of n); a responder asks for part i of a
# request with an empty request carrying WANT_HEADER: i to the requester's inbox.
CHUNK_HEADER = "Goodput-Chunk"
WANT_HEADER = "Goodput-Want"
HEADER_ROOM = 16 * 1024  # max_payload counts headers too: trace context, error descriptions
MAX_PARTS = 256  # the most parts a body may come in (256 MiB at the default max_payload)


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


async def _assemble(
    headers: dict[str, str] | None, first: bytes, next_part: Callable[[int, int], Awaitable[bytes]]
) -> bytes:
    """A body from its first part and `next_part(i, n)` for each other part."""
    _, count = _chunk_of(headers)
    if count == 1:
        return first
    return b"".join([first] + [await next_part(index, count) for index in range(1, count)])


class Codec:
    """A bus's encoding: msgpack out (JSON when asked), msgpack or JSON in, and the part size of its
    connection (the encoders and the decoders' cache are made in `Connection.__init__`)."""

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
