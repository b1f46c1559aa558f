"""What every worker does under goodput, whatever loop trains it (`AdaptiveTraining`, or a framework's
through `goodput_train.lightning` and `goodput_train.huggingface`): print the protocol's lines for
its executor, heed a stop (SIGTERM, or its lifeline's end), and sweep batch sizes for the profiler.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
import time
from typing import Callable

import msgspec

from goodput_train import profiling
from goodput_train.protocol import LIFELINE_ENV, STATS_PREFIX, JobStats, ProfilePoint, protocol_line


def print_line(prefix: str, message: msgspec.Struct) -> None:
    """One line on stdout for the executor (`protocol.protocol_line`: base64 msgpack, which keeps NaN)."""
    print(protocol_line(prefix, message), flush=True)


def print_stats(stats: JobStats) -> None:
    print_line(STATS_PREFIX, stats)


def say(line: str) -> bool:
    """A line on stdout for the executor; False if no one reads it any more (the agent is gone):
    stdout then goes to /dev/null, so what is left in its buffer fails no later print, nor the exit."""
    try:
        print(line, flush=True)
        return True
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return False


def watch_stops(stop: Callable[[], None]) -> None:
    """Call `stop()` on SIGTERM and, when GOODPUT_LIFELINE is 1, at stdin's end (the executor that
    started this worker is gone): either way the job checkpoints and stops at its next step."""
    signal.signal(signal.SIGTERM, lambda signum, frame: stop())
    if os.environ.get(LIFELINE_ENV) == "1":
        threading.Thread(target=_watch_lifeline, args=(stop,), daemon=True).start()


def _watch_lifeline(stop: Callable[[], None]) -> None:
    """Wait for stdin's end. (The file descriptor itself: a daemon thread blocked in sys.stdin's
    buffer would hold its lock at exit, and the interpreter would abort.)"""
    fd = sys.stdin.fileno()
    while os.read(fd, 4096):
        pass
    stop()


def sweep(
    step_at: Callable[[int], None],
    sizes: list[int],
    steps: int,
    budget_s: float,
    release: Callable[[], None] = lambda: None,
) -> tuple[list[ProfilePoint], int | None, float]:
    """The profiling sweep: `steps` timed optimizer steps (after one warm-up) of `step_at(m)` at each
    per-GPU batch m of `sizes`, smallest first, until one runs out of memory (`release` then drops
    what the step held) or `budget_s` of step time is spent. The points measured, the batch that
    ran out of memory (None: none did), and the seconds spent."""
    measured, out_of_memory, spent = [], None, 0.0
    for m in sizes:
        try:
            times = []
            for _ in range(steps + 1):
                start = time.perf_counter()
                step_at(m)
                times.append(time.perf_counter() - start)
        except Exception as error:
            if not profiling.is_out_of_memory(error):
                raise
            out_of_memory = m
            release()
            profiling.release_memory()
            break
        spent += sum(times)
        measured.append(ProfilePoint(m, statistics.median(times[1:])))
        if spent > budget_s:
            break
    return measured, out_of_memory, spent
