"""A real job's progress as `goodput status JOB` shows it, from what its workers reported: steps and
statistical epochs against its target, its throughput measured at its current configuration and
its goodput there (Pollux's: throughput x statistical efficiency, once its gradient noise is
measured), and its expected end at the epoch rate of its current run. Pure functions over the
reports."""

from __future__ import annotations

import math

from goodput_train.goodput import efficiency, pgns
from goodput_train.protocol import JobStats
from shared.schema.records import Progress


def job_progress(
    stats: JobStats | None,
    init_batch: int | None,
    parts: tuple[tuple[str, tuple[int, ...]], ...] = (),
    rate: float | None = None,
    declared: float | None = None,
) -> Progress | None:
    """Its progress from its last `stats` (None: it has not reported); `parts`, the nodes and ranks
    its workers run on now (none: not running, so no speed), `rate` its epochs per second;
    `declared`, its submission's target, which the scheduler plans with over the one its code
    reports. No end is expected once it trained past its target."""
    if stats is None:
        return None
    target = declared if declared is not None else stats.target_epochs
    replicas, nodes = sum(len(ranks) for _, ranks in parts), len(parts)
    batch = replicas * stats.m * (stats.s + 1)
    step_time = next(
        (
            o.t_iter
            for o in stats.observations
            if (o.nodes, o.gpus, o.m, o.s) == (nodes, replicas, stats.m, stats.s) and o.t_iter > 0
        ),
        None,
    )
    throughput = goodput = remaining = None
    if replicas and step_time is not None:
        throughput = batch / step_time
        phi = pgns(stats.grad_sqr, stats.grad_var, init_batch) if init_batch else math.inf
        if math.isfinite(phi):
            goodput = throughput * float(efficiency(phi, init_batch, batch))
    if replicas and target is not None and stats.epochs < target and rate:
        remaining = (target - stats.epochs) / rate
    return Progress(
        stats.steps,
        round(stats.epochs, 4),
        target,
        _rounded(throughput),
        _rounded(goodput),
        _rounded(remaining),
    )


def trained_batches(stats: JobStats | None) -> tuple[int, ...]:
    """Every total batch it trained at (its measured configurations), smallest first."""
    return tuple(sorted({o.gpus * o.m * (o.s + 1) for o in stats.observations})) if stats else ()


def main_metric(outcome: dict | None, metrics: dict[str, float | str]) -> float | None:
    """Its one number of success (the records' `metric`): its outcome's or its metrics' `metric`,
    else the first number it reported."""
    named = (outcome or {}).get("metric", metrics.get("metric"))
    if isinstance(named, (int, float)) and not isinstance(named, bool):
        return float(named)
    return next((float(v) for v in metrics.values() if isinstance(v, (int, float)) and not isinstance(v, bool)), None)


def _rounded(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 3)
