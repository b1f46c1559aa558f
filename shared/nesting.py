"""How deep a message body nests, bounded before it is decoded.

No message of this project nests more than a few levels (a submission: 2). A body nested thousands
of levels deep is a probe: decoding it recurses (msgspec raises RecursionError, and so would any
walk over what it decoded). `check_nesting` refuses a body deeper than MAX_DEPTH before any of
that, as a DecodeError that says why, since every caller already refuses a DecodeError.

Cheap on ordinary messages: a body nests no deeper than it has containers, and every container
begins with a byte counted in C (`[` or `{` in JSON; a map or array header in msgpack), so a body
with at most MAX_DEPTH such bytes is not scanned. A body with more is:

| body    | scan                                                                                   |
|---------|----------------------------------------------------------------------------------------|
| JSON    | escapes and strings dropped (a `[` in a string is no nesting), then the brackets'       |
|         | running depth: `bytes.replace`, `translate`, `split` and `itertools.accumulate`, in C  |
| msgpack | a walk over the items' headers, in Python, that skips what they hold and stops once    |
|         | too deep                                                                               |

A malformed body is left to the decoder, which refuses it where the scan stopped understanding
it, so the decoder never goes deeper than the scan looked.
"""

from __future__ import annotations

from itertools import accumulate

import msgspec

__all__ = ["MAX_DEPTH", "check_nesting"]

MAX_DEPTH = 64               # the deepest a message may nest (the body itself is depth 1)


def _all_but(kept: bytes) -> bytes:
    """The bytes `bytes.translate(None, ...)` deletes to keep only `kept`."""
    return bytes(sorted(set(range(256)) - set(kept)))


_JSON_OPENERS = _all_but(b"[{")
_JSON_MARKS = _all_but(b'[]{}"')
_JSON_STEP = [1 if byte in b"[{" else -1 if byte in b"]}" else 0 for byte in range(256)]

# The first bytes of a msgpack map or array: fixmap, fixarray, array 16/32, map 16/32.
_MSGPACK_OPENERS = _all_but(bytes([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF]))


def _msgpack_heads() -> list[tuple[int, int, int] | None]:
    """How a msgpack item reads, by its first byte: (length bytes, extra, per). The first byte is
    followed by `length bytes` holding a length n (n is 0 when there are none); then a scalar holds
    extra + n bytes, a container (per > 0) extra + per * n items. None: 0xc1, which begins nothing."""
    heads: list[tuple[int, int, int] | None] = [(0, 0, 0)] * 256       # fixints, nil, booleans
    for byte in range(0x80, 0x90):
        heads[byte] = (0, 2 * (byte & 0x0F), 2)                          # fixmap: keys and values
    for byte in range(0x90, 0xA0):
        heads[byte] = (0, byte & 0x0F, 1)                                # fixarray
    for byte in range(0xA0, 0xC0):
        heads[byte] = (0, byte & 0x1F, 0)                                # fixstr
    heads[0xC1] = None
    heads[0xC4:0xE0] = [
        (1, 0, 0), (2, 0, 0), (4, 0, 0),                                 # bin 8/16/32
        (1, 1, 0), (2, 1, 0), (4, 1, 0),                                 # ext 8/16/32, and a type byte
        (0, 4, 0), (0, 8, 0),                                            # float 32/64
        (0, 1, 0), (0, 2, 0), (0, 4, 0), (0, 8, 0),                      # uint 8/16/32/64
        (0, 1, 0), (0, 2, 0), (0, 4, 0), (0, 8, 0),                      # int 8/16/32/64
        (0, 2, 0), (0, 3, 0), (0, 5, 0), (0, 9, 0), (0, 17, 0),          # fixext 1/2/4/8/16, and a type byte
        (1, 0, 0), (2, 0, 0), (4, 0, 0),                                 # str 8/16/32
        (2, 0, 1), (4, 0, 1), (2, 0, 2), (4, 0, 2),                      # array 16/32, map 16/32
    ]
    return heads


_MSGPACK_HEADS = _msgpack_heads()
# The whole size of an item that is a scalar of fixed size (the most common: small ints, short
# strings, floats), so the walk reads no more of it; 0 for the others.
_MSGPACK_FIXED = [1 + head[1] if head is not None and head[0] == head[2] == 0 else 0 for head in _MSGPACK_HEADS]


def _json_depth(data: bytes) -> int:
    """The deepest a JSON body's brackets nest, those in strings left out. Escapes go first (`\\\\`,
    then `\\"`, as a JSON reader pairs backslashes), so every quote left begins or ends a string,
    and what is outside strings is every other piece between quotes."""
    marks = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _JSON_MARKS)
    outside = b"".join(marks.split(b'"')[::2])
    return max(accumulate(map(_JSON_STEP.__getitem__, outside)), default=0)


def _msgpack_deeper(data: bytes, limit: int) -> bool:
    """Whether a msgpack body's first item nests deeper than `limit`, as far as the body reads as
    msgpack (one that ends early, or holds 0xc1, is the decoder's to refuse)."""
    left = [1]               # the items still to come at each level: the body's one, then each open container's
    at, end = 0, len(data)
    while left and at < end:
        first = data[at]
        left[-1] -= 1
        if _MSGPACK_FIXED[first]:
            at += _MSGPACK_FIXED[first]
        else:
            head = _MSGPACK_HEADS[first]
            if head is None:
                return False
            length_bytes, extra, per = head
            length = int.from_bytes(data[at + 1:at + 1 + length_bytes], "big")
            at += 1 + length_bytes
            if per:
                if len(left) > limit:         # it opens a container at depth len(left) + 1
                    return True
                left.append(extra + per * length)
            else:
                at += extra + length
        while left and not left[-1]:
            left.pop()
    return False


def check_nesting(data: bytes, json: bool) -> None:
    """msgspec.DecodeError, with the reason, when a body (JSON if `json`, else msgpack) nests deeper
    than MAX_DEPTH."""
    data = data if isinstance(data, bytes) else bytes(data)      # a msgspec.Raw, a memoryview
    if len(data.translate(None, _JSON_OPENERS if json else _MSGPACK_OPENERS)) <= MAX_DEPTH:
        return
    if _json_depth(data) > MAX_DEPTH if json else _msgpack_deeper(data, MAX_DEPTH):
        raise msgspec.DecodeError(f"a message nests at most {MAX_DEPTH} levels deep; this one nests deeper")
