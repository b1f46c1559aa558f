"""What jobs print: a node agent stores each rank's output lines in its team's logs stream
(`LogBatch`, on `goodput.logs.<team>.<job>`), and the user API reads them back to the job's team
(goodput.api.logs: `LogsRequest` -> `LogsPage`)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.schema.base import Identifier

KIB = 1024
MAX_LINE_BYTES = 4 * KIB  # a longer line is cut to this (UTF-8), and says so (CUT_MARK)
CUT_MARK = " [goodput: line cut at {limit} bytes of {length}]"
BATCH_LINES = 64  # a batch is stored when it has this many lines ...
BATCH_BYTES = 32 * KIB  # ... or this much text, or after the agent's flush interval
MAX_LOG_LINES = 5000  # the most lines one page holds
LOG_PAGE_BYTES = 512 * KIB  # ... and the most reply, as encoded (under the server's 1 MiB max payload)
Stream = Literal["stdout", "stderr"]
# A worker's rank, PROFILE_RANK ("profile"): the job's profiling runs, or ENVIRONMENT_RANK ("env"):
# the installer of its requirements.
Rank = Annotated[int, msgspec.Meta(ge=0)] | Literal["profile", "env"]


class OutputLine(msgspec.Struct, frozen=True, array_like=True):
    """One line a process printed: when the agent read it (wall-clock seconds), where, its text."""

    time: float
    stream: Stream
    text: str


class LogBatch(msgspec.Struct, frozen=True):
    """A node agent -> its team's logs stream (goodput.logs.<team>.<job>): a rank's next lines, in order."""

    rank: Rank
    lines: tuple[OutputLine, ...]


class LogsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """-> goodput.api.logs: a job's output lines after the cursor `after` (0: from the oldest kept),
    of one rank or of all; at most `limit` lines a page (a little more when a stored batch runs past it)."""

    id: Identifier
    rank: Rank | None = None
    after: Annotated[int, msgspec.Meta(ge=0)] = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_LOG_LINES)] = 1000


class LogLine(msgspec.Struct, frozen=True):
    rank: int | str  # the worker's rank, or "profile"
    time: float  # wall-clock seconds (Unix time) when its node agent read it
    stream: Stream
    text: str


class LogsPage(msgspec.Struct, frozen=True):
    """goodput.api.logs's answer: the lines in the order each rank printed them, ranks interleaved
    as their agents stored them. Ask again with `after: next` for the lines that follow."""

    lines: tuple[LogLine, ...]
    next: int  # the cursor after these lines
    more: bool  # more lines are stored past `next` already: ask again at once
    end: bool  # the job has ended: once `more` is false, no line will follow


def cut(text: str, limit: int = MAX_LINE_BYTES) -> str:
    """`text`, cut to at most `limit` bytes of UTF-8 (on a character's boundary) with a mark saying so."""
    data = text.encode(errors="replace")
    if len(data) <= limit:
        return text
    mark = CUT_MARK.format(limit=limit, length=len(data))
    return data[: max(0, limit - len(mark))].decode(errors="ignore") + mark


def line_bytes(line: OutputLine) -> int:
    """What a line weighs in a batch or a page (its text, and a little for the rest)."""
    return len(line.text.encode(errors="replace")) + 32


def batches(
    rank: int | str, lines: list[OutputLine], max_lines: int = BATCH_LINES, max_bytes: int = BATCH_BYTES
) -> list[LogBatch]:
    """`rank`'s `lines` in order, as batches of at most `max_lines` lines and `max_bytes` (a single
    line over it, a batch of its own)."""
    found: list[LogBatch] = []
    current: list[OutputLine] = []
    size = 0
    for line in lines:
        weight = line_bytes(line)
        if current and (len(current) >= max_lines or size + weight > max_bytes):
            found.append(LogBatch(rank, tuple(current)))
            current, size = [], 0
        current.append(line)
        size += weight
    if current:
        found.append(LogBatch(rank, tuple(current)))
    return found
