"""goodput.api.logs: a job's output, read a page at a time from the logs stream, where its node
agents stored each rank's lines in batches (services/node/output.py). The cursor is the stream
sequence of the last batch read: a page holds whole batches, so nothing is read twice or skipped."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
import nats.js.errors

from shared import subjects
from shared.bus import Bus
from shared.schema.logs import LOG_PAGE_BYTES, LogBatch, LogLine

MAX_BATCHES_READ = 256  # stored batches one page reads at most (each one request to JetStream)

# (sequence, subject) -> the first stored message on `subject` (wildcards allowed) at or after the
# sequence, as (its sequence, its subject, its data); None when there is none.
NextMessage = Callable[[int, str], Awaitable[tuple[int, str, bytes] | None]]


def stream_reader(bus: Bus) -> NextMessage:
    """`NextMessage` over the logs stream (JetStream's message get, by sequence and subject)."""

    async def next_message(sequence: int, subject: str) -> tuple[int, str, bytes] | None:
        try:
            found = await bus.js.get_msg(subjects.LOGS_STREAM, seq=sequence, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return None
        return found.seq, found.subject, found.data or b""

    return next_message


def reply_bytes(line: LogLine) -> int:
    """What a line takes in the page's reply: its JSON, the larger encoding (a control character
    is 6 bytes there, `\\u0001`), and a comma."""
    return len(msgspec.json.encode(line)) + 1


def rank_of(subject: str) -> int | str:
    """The rank a logs subject names: its last token (a number, or "profile")."""
    token = subject.rpartition(".")[2]
    return int(token) if token.isdigit() else token


async def read_page(
    next_message: NextMessage, subject: str, after: int, limit: int, page_bytes: int = LOG_PAGE_BYTES
) -> tuple[list[LogLine], int, bool]:
    """The lines stored on `subject` after the cursor `after`: at most `limit` lines and `page_bytes`
    of the reply, as it is encoded (whole batches; a first batch larger than that, alone), the
    cursor after them, and whether more are stored past it."""
    lines: list[LogLine] = []
    size, cursor = 0, after
    for _ in range(MAX_BATCHES_READ):
        found = await next_message(cursor + 1, subject)
        if found is None:
            return lines, cursor, False
        sequence, where, data = found
        try:
            batch = msgspec.msgpack.decode(data, type=LogBatch)
        except msgspec.DecodeError:  # not an agent's: nothing to show of it
            cursor = sequence
            continue
        rank = rank_of(where)
        read = [LogLine(rank, line.time, line.stream, line.text) for line in batch.lines]
        weight = sum(reply_bytes(line) for line in read)
        if lines and (len(lines) + len(batch.lines) > limit or size + weight > page_bytes):
            return lines, cursor, True
        lines += read
        size, cursor = size + weight, sequence
    return lines, cursor, True
