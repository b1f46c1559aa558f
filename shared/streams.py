"""The JetStream streams every service and command relies on, each with its configuration in one
place (`Bus.ensure_stream` is idempotent, so each user ensures the streams it needs at start)."""

from __future__ import annotations

from shared import subjects
from shared.bus import Bus


async def ensure_jobs(bus: Bus) -> None:
    """The submissions and the profiler's verdicts, de-duplicated on the job id."""
    await bus.ensure_stream(subjects.JOBS_STREAM, subjects.JOBS_STREAM_SUBJECTS,
                            duplicate_window=subjects.DEDUP_WINDOW_S)


async def ensure_dead_letters(bus: Bus) -> None:
    """Messages no consumer could process, kept a week (at most DEAD_LETTER_MAX_MSGS)."""
    await bus.ensure_stream(subjects.DEAD_LETTER_STREAM, subjects.DEAD_LETTER_SUBJECTS,
                            max_age=subjects.DEAD_LETTER_MAX_AGE_S, max_msgs=subjects.DEAD_LETTER_MAX_MSGS)


async def ensure_run_log(bus: Bus) -> None:
    """Each run's log of rounds."""
    await bus.ensure_stream(subjects.RUN_LOG_STREAM, subjects.RUN_LOG_SUBJECTS,
                            duplicate_window=subjects.RUN_LOG_DEDUP_S)
