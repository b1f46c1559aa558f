"""A job's 1-GPU bootstrap profile on each GPU type (Sia §3.3).

A real profiling run (the executor issue) times a few steps at ~10 batch sizes on one GPU of each
type and finds the largest batch that fits memory. A hybrid-parallel job is profiled on one replica:
its model-parallel group of GPUs on one node. Here it is trace-backed: the profile a real
run would have measured, read from the reference profiles (or predicted by the built-in model zoo
when there is no reference data), so the simulator and the embedded stack bootstrap like Sia does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from goodput_train.goodput import ThroughputParams, compute_time, iteration_time
from goodput_train.protocol import ProfilePoint
from shared.schema.estimates import Profile
from sim.reference import ModelTrace, ReferenceDataMissing, discover_models
from sim.zoo import load_zoo

PROFILE_POINTS = 10  # batch sizes per GPU type
STEPS_PER_POINT = 10  # timed steps at each batch size (what profiling costs in GPU time)


def _spread(values: np.ndarray, count: int) -> np.ndarray:
    """Up to `count` of the sorted unique values, evenly spread, always with both ends."""
    unique = np.unique(values)
    if unique.size <= count:
        return unique
    return unique[np.unique(np.round(np.linspace(0, unique.size - 1, count)).astype(int))]


def _profile(job_id: str, model: str, gpu_type: str, points: list[ProfilePoint], group: int) -> Profile:
    return Profile(
        job_id=job_id,
        model=model,
        gpu_type=gpu_type,
        points=tuple(points),
        min_local=min(p.local_bsz for p in points),
        max_local=max(p.local_bsz for p in points),
        gpu_seconds=STEPS_PER_POINT * group * sum(p.step_time for p in points),
        group_gpus=group,
    )


def trace_profile(trace: ModelTrace, gpu_type: str, job_id: str = "", points: int = PROFILE_POINTS) -> Profile:
    """The profile of one replica of `trace`'s model on `gpu_type` (one GPU, or a hybrid-parallel
    model's group on one node), from its measured steps there.

    The largest measured batch stands for the largest batch that fits memory.
    """
    if gpu_type not in trace.placements:
        raise ValueError(f"no {gpu_type!r} measurements for model {trace.name!r} (has {trace.gpu_types})")
    meas = trace.placements[gpu_type]
    group = trace.group_gpus.get(gpu_type, 1)
    single = meas.select((meas.gpus == group) & (meas.nodes == 1))
    if len(single) == 0:
        raise ValueError(f"model {trace.name!r} has no {group}-GPU measurement on one {gpu_type!r} node")
    chosen = []
    for bsz in _spread(single.local_bsz, points):
        at = single.local_bsz == bsz
        # Repeated measurements of one batch: their median, as a profiler would report.
        chosen.append(
            ProfilePoint(int(bsz), float(np.median(single.step_time[at])), float(np.median(single.sync_time[at])))
        )
    return _profile(job_id, trace.name, gpu_type, chosen, group)


def model_profile(
    params: ThroughputParams,
    model: str,
    gpu_type: str,
    min_local: int,
    max_local: int,
    job_id: str = "",
    points: int = PROFILE_POINTS,
    group: int = 1,
) -> Profile:
    """The profile of one replica (of `group` GPUs) a fitted model predicts: geometric batch sizes
    in [min_local, max_local]."""
    sizes = np.unique(np.round(np.geomspace(min_local, max_local, points)).astype(int))
    chosen = [
        ProfilePoint(
            int(b),
            float(iteration_time(params, 1, 1, b)),
            float(iteration_time(params, 1, 1, b) - compute_time(params, b)),
        )
        for b in sizes
    ]
    return _profile(job_id, model, gpu_type, chosen, group)


@dataclass(frozen=True)
class ProfileSource:
    """The trace-backed profiler's data: per application, the GPU types it has measurements of, and
    the profile a profiling run would measure on each."""

    origin: str  # "reference:<folder>" or "zoo"
    types: Mapping[str, tuple[str, ...]]  # application -> its GPU types
    profile: Callable[[str, str], Profile]  # (application, GPU type) -> its 1-GPU profile


def profile_source(reference: str | None = None, use_zoo: bool = False) -> ProfileSource:
    """The reference profiles when the reference folder is there (or `reference` names it), else
    (or with `use_zoo`) the built-in model zoo's predictions."""
    if not use_zoo:
        try:
            traces = discover_models(reference)
        except ReferenceDataMissing:
            if reference is not None:
                raise
        else:
            # Each (model, type)'s profile made once: every job of a burst asks for the same ones.
            return ProfileSource(
                f"reference:{next(iter(traces.values())).folder.parent}",
                {name: tuple(t.gpu_types) for name, t in traces.items()},
                functools.cache(lambda model, gpu_type: trace_profile(traces[model], gpu_type)),
            )
    zoo = load_zoo()

    @functools.cache
    def profile(model: str, gpu_type: str) -> Profile:
        z = zoo[model].types[gpu_type]
        return model_profile(
            z.params, model, gpu_type, z.min_local, z.max_local, group=zoo[model].group_gpus.get(gpu_type, 1)
        )

    return ProfileSource("zoo", {name: tuple(m.types) for name, m in zoo.items()}, profile)
