"""What a node agent's workers print, kept for their team (`goodput logs`): each rank's stdout lines
that are not the protocol's and its stderr lines, cut to MAX_LINE_BYTES, stored in batches in the
job's team's logs stream (`goodput.logs.<team>.<job>`, rotated by the storage plan's limits: a team's
bytes, a job's share of them), which the agent makes the first time it stores a line of the team's.

The workers' reader threads hand lines to `Output` (never blocking on the bus); the agent's loop
stores what it holds every FLUSH_S, or as soon as a rank has a full batch (`keep_storing`), each
job's batches in turn. What waits is bounded per job (MAX_PENDING_LINES): past it, that job's lines
are dropped, and a line in that job's log says how many; another job's wait as they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import IO

import nats.errors

from shared import storage, subjects
from shared.bus import Bus
from shared.schema.logs import BATCH_LINES, MAX_LINE_BYTES, LogBatch, OutputLine, batches, cut

FLUSH_S = 0.5  # a line waits at most this long before it is stored
# Lines of one job waiting to be stored, its ranks' together: 64 full batches, a burst that waits
# while the agent stores, and at most 16 MiB held for a job (a line is cut at 4 KiB).
MAX_PENDING_LINES = 4_096
STORE_TIMEOUT_S = 5.0
WARN_EVERY_S = 60.0
RETRY_STREAM_S = 30.0  # a team's logs stream that could not be made is tried again after this
DROPPED = "[goodput: {lost} lines of this job dropped here: it printed faster than they could be stored]"
log = logging.getLogger(__name__)

Job = tuple[str, str]  # (its team, its id within the cluster)


class Output:
    """Lines of this node's workers, waiting to be stored; thread-safe. `wake()`: a rank has a full
    batch (called from the reader's thread). `max_pending`: the lines one job may have waiting."""

    def __init__(
        self,
        wake: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
        max_pending: int = MAX_PENDING_LINES,
    ) -> None:
        self.wake, self.clock, self.max_pending = wake, clock, max_pending
        self.lock = threading.Lock()
        self.pending: dict[Job, dict[int | str, list[OutputLine]]] = {}  # job -> rank -> lines
        self.counts: dict[Job, int] = {}  # job -> its lines waiting
        self.dropped: dict[Job, dict[int | str, int]] = {}  # job -> rank -> lines dropped

    def keeper(
        self, job_id: str, rank: int | str, stream: str, team: str = subjects.DEFAULT_TEAM
    ) -> Callable[[str], None]:
        """What a reader calls with each line of one rank's `stream`, of `team`'s job `job_id`."""
        job = (team, job_id)
        return lambda text: self.add(job, rank, stream, text)

    def add(self, job: Job, rank: int | str, stream: str, text: str) -> None:
        line = OutputLine(self.clock(), stream, cut(text))
        with self.lock:
            if self.counts.get(job, 0) >= self.max_pending:
                lost = self.dropped.setdefault(job, {})
                lost[rank] = lost.get(rank, 0) + 1
                return
            lines = self.pending.setdefault(job, {}).setdefault(rank, [])
            lines.append(line)
            self.counts[job] = self.counts.get(job, 0) + 1
            full = len(lines) == BATCH_LINES
        if full:
            with contextlib.suppress(RuntimeError):  # the agent's loop is closed: it is stopping
                self.wake()

    def take(self) -> list[tuple[str, str, LogBatch]]:
        """Every waiting line, as (team, subject, batch): each rank's in the order it printed them,
        the jobs' batches in turn (one job's many do not hold another's back). A rank that lost lines
        gets a last line saying how many, in its own job's log."""
        with self.lock:
            pending, dropped = self.pending, self.dropped
            self.pending, self.dropped, self.counts = {}, {}, {}
        for job, ranks in dropped.items():
            for rank, lost in ranks.items():
                pending.setdefault(job, {}).setdefault(rank, []).append(
                    OutputLine(self.clock(), "stderr", DROPPED.format(lost=lost))
                )
        each_job = [
            [
                (team, subjects.job_logs(team, job_id), batch)
                for rank, lines in ranks.items()
                for batch in batches(rank, lines)
            ]
            for (team, job_id), ranks in pending.items()
        ]
        return [taken for turn in itertools.zip_longest(*each_job) for taken in turn if taken is not None]


def copy_lines(pipe: IO[str], file: IO[str], keep: Callable[[str], None] | None) -> None:
    """A worker's stderr, line by line (a line longer than MAX_LINE_BYTES characters read in parts,
    so none is held whole): into its file on this node, flushed (`last_error` reads it while the
    worker runs), and to `keep`. Closes both at its end."""
    with file, pipe:
        for line in iter(lambda: pipe.readline(MAX_LINE_BYTES), ""):
            file.write(line)
            file.flush()
            if keep is not None:
                keep(line.rstrip("\r\n"))


class Storing:
    """The agent's side: what `Output` holds, stored in each team's logs stream, which it makes (the
    plan's, `storage.ensure_logs`) before it first stores a line of that team's."""

    def __init__(
        self,
        bus: Bus,
        output: Output,
        ensure: Callable[[Bus, str], Awaitable[None]] = storage.ensure_logs,
    ) -> None:
        self.bus, self.output, self.ensure = bus, output, ensure
        self.warned = -WARN_EVERY_S
        self.finishing = False  # `finish`: the store under way completes, and no other begins
        self.streams: dict[str, float | None] = {}  # team -> None: its stream is there; else when making it failed

    async def store(self) -> None:
        """Every waiting line, now; lines the stream does not take are lost, and said so in the log."""
        lost, reason = 0, ""
        for team, subject, batch in self.output.take():
            problem = await self.stream_of(team)
            try:
                if problem:
                    raise RuntimeError(problem)
                await self.bus.js_publish(subject, batch, timeout=STORE_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - the job runs on; its output is what is lost
                lost += len(batch.lines)
                reason = f"{type(error).__name__}: {error}"
                if isinstance(error, nats.errors.NoRespondersError):  # its stream is gone: made again next time
                    self.streams.pop(team, None)
        if lost and time.monotonic() - self.warned >= WARN_EVERY_S:
            self.warned = time.monotonic()
            log.warning("%d lines of jobs' output could not be stored (%s)", lost, reason)

    async def stream_of(self, team: str) -> str:
        """ "" once `team`'s logs stream is there (made, or brought to the plan, the first time); else
        why not (tried again RETRY_STREAM_S after a failure, its lines lost meanwhile)."""
        failed = self.streams.get(team, 0.0)
        if failed is None:
            return ""
        if failed and time.monotonic() - failed < RETRY_STREAM_S:
            return f"the logs stream of team {team} could not be made a moment ago"
        try:
            await self.ensure(self.bus, team)
        except Exception as error:  # noqa: BLE001 - its lines are lost, said so; the job runs on
            self.streams[team] = time.monotonic()
            return f"the logs stream of team {team} could not be made ({type(error).__name__}: {error})"
        self.streams[team] = None
        return ""

    async def keep_storing(self, woken: asyncio.Event, flush_s: float = FLUSH_S) -> None:
        """`store` every `flush_s`, or at once when a rank has a full batch (`woken`), until `finish`."""
        while not self.finishing:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(woken.wait(), flush_s)
            woken.clear()
            await self.store()

    async def finish(self, keeping: asyncio.Task, woken: asyncio.Event) -> None:
        """Stop `keeping` (its `keep_storing`) and store what is left. Not by cancelling it: a batch
        it has taken and is publishing would be lost (a stopped job's last lines, as it stops)."""
        self.finishing = True
        woken.set()
        await keeping
        await self.store()


def wake_on(loop: asyncio.AbstractEventLoop, woken: asyncio.Event) -> Callable[[], None]:
    """`Output.wake` for an agent on `loop`: sets `woken` there, from any thread."""
    return lambda: loop.call_soon_threadsafe(woken.set)
