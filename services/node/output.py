"""What a node agent's workers print, kept for their submitter (`goodput logs`): each rank's stdout
lines that are not the protocol's and its stderr lines, cut to MAX_LINE_BYTES, stored in batches in
the logs stream (`goodput.logs.<job>.<rank>`, rotated by the storage plan's limits).

The workers' reader threads hand lines to `Output` (never blocking on the bus); the agent's loop
stores what it holds every FLUSH_S, or as soon as a rank has a full batch (`keep_storing`). What
waits is bounded (MAX_PENDING_LINES): past it, lines are dropped and a line says how many.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import IO

from shared import subjects
from shared.bus import Bus
from shared.schema.logs import BATCH_LINES, MAX_LINE_BYTES, LogBatch, OutputLine, batches, cut

FLUSH_S = 0.5  # a line waits at most this long before it is stored
MAX_PENDING_LINES = 20_000  # lines waiting to be stored, every rank's together
STORE_TIMEOUT_S = 5.0
WARN_EVERY_S = 60.0
log = logging.getLogger(__name__)


class Output:
    """Lines of this node's workers, waiting to be stored; thread-safe. `wake()`: a rank has a full
    batch (called from the reader's thread)."""

    def __init__(
        self,
        wake: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
        max_pending: int = MAX_PENDING_LINES,
    ) -> None:
        self.wake, self.clock, self.max_pending = wake, clock, max_pending
        self.lock = threading.Lock()
        self.pending: dict[str, list[OutputLine]] = {}  # subject -> lines
        self.dropped: dict[str, int] = {}
        self.count = 0

    def keeper(self, job_id: str, rank: int | str, stream: str) -> Callable[[str], None]:
        """What a reader calls with each line of one rank's `stream`."""
        subject = subjects.job_logs(job_id, rank)
        return lambda text: self.add(subject, stream, text)

    def add(self, subject: str, stream: str, text: str) -> None:
        line = OutputLine(self.clock(), stream, cut(text))
        with self.lock:
            if self.count >= self.max_pending:
                self.dropped[subject] = self.dropped.get(subject, 0) + 1
                return
            lines = self.pending.setdefault(subject, [])
            lines.append(line)
            self.count += 1
            full = len(lines) == BATCH_LINES
        if full:
            with contextlib.suppress(RuntimeError):  # the agent's loop is closed: it is stopping
                self.wake()

    def take(self) -> list[tuple[str, LogBatch]]:
        """Every waiting line, as (subject, batch) in the order each rank printed them; a rank that
        lost lines gets a last line saying how many."""
        with self.lock:
            pending, dropped = self.pending, self.dropped
            self.pending, self.dropped, self.count = {}, {}, 0
        for subject, lost in dropped.items():
            pending.setdefault(subject, []).append(
                OutputLine(
                    self.clock(),
                    "stderr",
                    f"[goodput: {lost} lines dropped here: the job printed faster than they could be stored]",
                )
            )
        return [(subject, batch) for subject, lines in pending.items() for batch in batches(lines)]


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
    """The agent's side: what `Output` holds, stored in the logs stream."""

    def __init__(self, bus: Bus, output: Output) -> None:
        self.bus, self.output = bus, output
        self.warned = -WARN_EVERY_S
        self.finishing = False  # `finish`: the store under way completes, and no other begins

    async def store(self) -> None:
        """Every waiting line, now; lines the stream does not take are lost, and said so in the log."""
        lost = 0
        for subject, batch in self.output.take():
            try:
                await self.bus.js_publish(subject, batch, timeout=STORE_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - the job runs on; its output is what is lost
                lost += len(batch.lines)
                reason = f"{type(error).__name__}: {error}"
        if lost and time.monotonic() - self.warned >= WARN_EVERY_S:
            self.warned = time.monotonic()
            log.warning("%d lines of jobs' output could not be stored in %s (%s)", lost, subjects.LOGS_STREAM, reason)

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
