"""How deep a message body nests, bounded before it is read.

No message of this project nests more than a few levels (a submission: 2). A body nested thousands
of levels deep is a probe: reading it recurses (msgspec raises RecursionError, and so would any
walk over what it decoded). Every caller already refuses a DecodeError, so that is what a body too
deep becomes, with the reason:

- JSON, what clients outside send: `check_json` refuses one deeper than MAX_DEPTH before it is
  read. Cheap on ordinary bodies: one nests no deeper than it has `[` and `{`, counted in C, so a
  body with at most MAX_DEPTH of them is not scanned; one with more has its escapes and strings
  dropped (a `[` in a string is no nesting) and its brackets' running depth taken, in C too.
- msgpack, what the services send each other (large, every round): no scan, which would cost
  several times the decode; a body too deep for msgspec (or for Python, walking what it decoded)
  is refused where it raises RecursionError (`too_deep`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from itertools import accumulate

import msgspec

MAX_DEPTH = 64  # the deepest a JSON message may nest (the body itself is depth 1)
TOO_DEEP = f"a message nests at most {MAX_DEPTH} levels deep; this one nests deeper"


def _all_but(kept: bytes) -> bytes:
    """The bytes `bytes.translate(None, ...)` deletes to keep only `kept`."""
    return bytes(sorted(set(range(256)) - set(kept)))


_ALL_BUT_OPENERS = _all_but(b"[{")
_ALL_BUT_MARKS = _all_but(b'[]{}"')
_STEP = [1 if byte in b"[{" else -1 if byte in b"]}" else 0 for byte in range(256)]


def _depth(data: bytes) -> int:
    """The deepest a JSON body's brackets nest, those in strings left out. Escapes go first (`\\\\`,
    then `\\"`, as a JSON reader pairs backslashes), so every quote left begins or ends a string,
    and what is outside strings is every other piece between quotes."""
    marks = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _ALL_BUT_MARKS)
    outside = b"".join(marks.split(b'"')[::2])
    return max(accumulate(map(_STEP.__getitem__, outside)), default=0)


def check_json(data: bytes) -> None:
    """msgspec.DecodeError, with the reason, when a JSON body nests deeper than MAX_DEPTH."""
    data = data if isinstance(data, bytes) else bytes(data)  # a msgspec.Raw, a memoryview
    if len(data.translate(None, _ALL_BUT_OPENERS)) > MAX_DEPTH and _depth(data) > MAX_DEPTH:
        raise msgspec.DecodeError(TOO_DEEP)


@contextlib.contextmanager
def too_deep() -> Iterator[None]:
    """A RecursionError while a body is read is a DecodeError with the reason."""
    try:
        yield
    except RecursionError:
        raise msgspec.DecodeError(TOO_DEEP) from None
