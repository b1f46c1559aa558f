"""Throughput from any training loop: a script that does not train through `AdaptiveTraining` (a
torchrun script, say) calls `goodput_train.report(samples=N)` once a step, N the examples the step
took across every rank (its global batch). Rank 0 tells its executor, every GOODPUT_REPORT_S, how
long a step takes at its size (a `goodput-stats` line), from which the estimator fits the job's
throughput on its GPU type in place of what the job declared; the other ranks' calls do nothing.
It imports no PyTorch: any script may call it, and outside goodput it does nothing but count.
"""

from __future__ import annotations

import os
import statistics
import time

from goodput_train.goodput import Observation
from goodput_train.protocol import (
    GPU_TYPE_ENV,
    JOB_ENV,
    REPORT_ENV,
    REPORT_EVERY_S,
    STATS_PREFIX,
    JobStats,
    protocol_line,
)

STEPS_KEPT = 1_000  # a report's step time is the median of the last this many


class Reporter:
    """One worker's steps since its start: their times at its size, printed every `every_s` (rank 0)."""

    def __init__(self, environ: dict[str, str] | os._Environ = os.environ, clock=time.monotonic):
        self.clock = clock
        self.printing = environ.get("RANK", "0") == "0" and JOB_ENV in environ
        self.job_id, self.gpu_type = environ.get(JOB_ENV, ""), environ.get(GPU_TYPE_ENV, "")
        self.world = int(environ.get("WORLD_SIZE", "1"))
        self.nodes = int(environ.get("GROUP_WORLD_SIZE", "1"))
        self.every_s = float(environ.get(REPORT_ENV, REPORT_EVERY_S))
        self.steps, self.times = 0, []
        self.last = self.printed = None

    def step(self, samples: int) -> JobStats | None:
        """Count a step of `samples` examples; the stats to print when a report is due, else None."""
        if samples < 1:
            raise ValueError(f"a step trains at least one example, not {samples}")
        now = self.clock()
        if self.last is not None:  # the first step's time holds the start's: never counted
            self.times = [*self.times[-STEPS_KEPT + 1 :], now - self.last]
        self.last, self.steps = now, self.steps + 1
        if not (self.printing and self.times) or (self.printed is not None and now - self.printed < self.every_s):
            return None
        self.printed = now
        local = max(1, round(samples / self.world))
        observation = Observation(self.nodes, self.world, local, 0, statistics.median(self.times))
        return JobStats(self.job_id, self.gpu_type, (observation,), None, None, 0.0, self.steps, local, 0)


_reporter: Reporter | None = None


def report(samples: int) -> None:
    """Count one training step of `samples` examples (the global batch): see the module's docstring."""
    global _reporter
    _reporter = _reporter or Reporter()
    stats = _reporter.step(samples)
    if stats is not None:
        print(protocol_line(STATS_PREFIX, stats), flush=True)
