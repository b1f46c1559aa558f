"""goodput.api.logs: a job's output, read a page at a time from its team's logs stream, where its
node agents stored each rank's lines in batches (services/node/output.py). The cursor is the stream
sequence of the last batch read: a page holds whole batches, so nothing is read twice or skipped. A
login's request reads its own team's stream only: the team is the server's word (`Who`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
import nats.js.errors

from shared import subjects
from shared.bus import Bus
from shared.schema.logs import LOG_PAGE_BYTES, LogBatch, LogLine, LogsRequest

MAX_BATCHES_READ = 256  # stored batches one page reads at most (each one request to JetStream)

# (sequence, subject) -> the first stored message on `subject` (wildcards allowed) at or after the
# sequence, as (its sequence, its subject, its data); None when there is none.
NextMessage = Callable[[int, str], Awaitable[tuple[int, str, bytes] | None]]


def stream_reader(bus: Bus, team: str) -> NextMessage:
    """`NextMessage` over `team`'s logs stream (JetStream's message get, by sequence and subject);
    none while the stream is not made (no line of the team's stored yet)."""

    async def next_message(sequence: int, subject: str) -> tuple[int, str, bytes] | None:
        try:
            found = await bus.js.get_msg(subjects.logs_stream(team), seq=sequence, subject=subject, next=True)
        except nats.js.errors.NotFoundError:  # no such message, or no such stream
            return None
        return found.seq, found.subject, found.data or b""

    return next_message


def reply_bytes(line: LogLine) -> int:
    """What a line takes in the page's reply: its JSON, the larger encoding (a control character
    is 6 bytes there, `\\u0001`), and a comma."""
    return len(msgspec.json.encode(line)) + 1


async def job_page(bus: Bus, team: str, job_id: str, request: LogsRequest) -> tuple[list[LogLine], int, bool]:
    """`read_page` of `team`'s job `job_id` (its id within the cluster), as `request` asks."""
    subject = subjects.job_logs(team, job_id)
    return await read_page(stream_reader(bus, team), subject, request.after, request.limit, rank=request.rank)


async def read_page(
    next_message: NextMessage,
    subject: str,
    after: int,
    limit: int,
    page_bytes: int = LOG_PAGE_BYTES,
    rank: int | str | None = None,
) -> tuple[list[LogLine], int, bool]:
    """The lines stored on `subject` after the cursor `after` (`rank`'s only, or every rank's): at
    most `limit` lines and `page_bytes` of the reply, as it is encoded (whole batches; a first batch
    larger than that, alone), the cursor after them, and whether more are stored past it (a page
    of another rank's batches only may hold none, and more)."""
    lines: list[LogLine] = []
    size, cursor = 0, after
    for _ in range(MAX_BATCHES_READ):
        found = await next_message(cursor + 1, subject)
        if found is None:
            return lines, cursor, False
        sequence, _, data = found
        try:
            batch = msgspec.msgpack.decode(data, type=LogBatch)
        except msgspec.DecodeError:  # not an agent's: nothing to show of it
            batch = None
        if batch is None or rank not in (None, batch.rank):
            cursor = sequence
            continue
        read = [LogLine(batch.rank, line.time, line.stream, line.text) for line in batch.lines]
        weight = sum(reply_bytes(line) for line in read)
        if lines and (len(lines) + len(batch.lines) > limit or size + weight > page_bytes):
            return lines, cursor, True
        lines += read
        size, cursor = size + weight, sequence
    return lines, cursor, True
