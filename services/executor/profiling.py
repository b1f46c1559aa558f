"""The profiling run (Sia §3.3): a job's own script, started by the profiler on one GPU (a CPU slot
here), times a few steps at ~10 per-GPU batch sizes, smallest first, and reports them. The first
batch that runs out of memory ends the sweep — a data point (the largest batch that fits is the one
before it), not a crash.

On a GPU the memory is the device's. A CPU slot has none of its own, so a slot's memory
(`GOODPUT_SLOT_MEMORY_MB`) is made real for the profiling run: the process's address space may grow
by that much past what it holds once the model is built, and an allocation beyond it fails as an
out-of-memory would on a GPU.
"""

from __future__ import annotations

import gc
import os
import re
import resource
import statistics
import time
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from services.executor.protocol import SLOT_MEMORY_ENV
from shared.schema import ProfilePoint, ProfileRun

if TYPE_CHECKING:
    from services.executor.trainer import AdaptiveTraining

PROFILE_POINTS = 10
PROFILE_STEPS = 3                          # timed steps per batch size, after one warm-up step
PROFILE_BUDGET_S = 15.0                    # stop sweeping past this much step time (Sia: < 20 GPU-s per type)


def batch_sizes(smallest: int, largest: int, points: int = PROFILE_POINTS) -> list[int]:
    """Up to `points` per-GPU batch sizes from `smallest` to `largest`, evenly spread in log scale."""
    return sorted({int(b) for b in np.round(np.geomspace(smallest, largest, points))})


def is_out_of_memory(error: BaseException) -> bool:
    """A GPU's OOM, or a CPU allocation refused (the slot's memory limit)."""
    if isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and bool(re.search(r"out of memory|can't allocate memory", str(error)))


def limit_memory(megabytes: float) -> None:
    """Let this process's address space grow by `megabytes` from now on, no more."""
    with open("/proc/self/status") as status:
        size_kb = int(re.search(r"VmSize:\s+(\d+)", status.read()).group(1))
    limit = size_kb * 1024 + int(megabytes * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def profile(training: AdaptiveTraining, loss_of: Callable[[torch.nn.Module, tuple], torch.Tensor],
            points: int = PROFILE_POINTS, steps: int = PROFILE_STEPS,
            budget_s: float = PROFILE_BUDGET_S) -> ProfileRun:
    """Time `steps` optimizer steps (one replica, no accumulation) at each batch size from the
    job's smallest to its largest per-GPU batch, until one runs out of memory or the budget is spent."""
    if training.placement.world != 1:
        raise ValueError(f"a profiling run takes one GPU, not {training.placement.world}")
    if os.environ.get(SLOT_MEMORY_ENV):
        limit_memory(float(os.environ[SLOT_MEMORY_ENV]))
    training.adaptive, training.report = False, None       # the batch is ours to choose; nothing to report
    measured, out_of_memory, spent = [], None, 0.0
    for m in batch_sizes(training.limits.min_local, training.limits.max_local, points):
        training.m, training.s = m, 0
        try:
            times = []
            for _ in range(steps + 1):
                start = time.perf_counter()
                training.train_step(loss_of)
                times.append(time.perf_counter() - start)
        except Exception as error:  # noqa: BLE001 - only an out-of-memory is a data point
            if not is_out_of_memory(error):
                raise
            out_of_memory = m
            training.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            break
        spent += sum(times)
        measured.append(ProfilePoint(m, statistics.median(times[1:])))
        if spent > budget_s:
            break
    return ProfileRun(tuple(measured), training.limits.init_batch, training.limits.max_batch, out_of_memory,
                      spent)
