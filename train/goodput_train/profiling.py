"""The profiling run (Sia §3.3), its parts; the sweep itself is `AdaptiveTraining.profile`. A job's
own script, started by the profiler on one GPU (a CPU slot here), times a few steps at ~10 per-GPU batch sizes, smallest first, and reports them. The first
batch that runs out of memory ends the sweep — a data point (the largest batch that fits is the one
before it), not a crash.

On a GPU the memory is the device's. A CPU slot has none of its own, so a slot's memory
(`GOODPUT_SLOT_MEMORY_MB`) is made real for the profiling run: the process's address space may grow
by that much past what it holds once the model is built, and an allocation beyond it fails as an
out-of-memory would on a GPU.
"""

from __future__ import annotations

import gc
import re
import resource

import numpy as np
import torch

PROFILE_POINTS = 10
PROFILE_STEPS = 3  # timed steps per batch size, after one warm-up step
PROFILE_BUDGET_S = 15.0  # stop sweeping past this much step time (Sia: < 20 GPU-s per type)


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


def release_memory() -> None:
    """What the batch that ran out of memory held, given back before the sweep ends."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
