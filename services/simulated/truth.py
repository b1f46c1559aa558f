"""How a simulated job really behaves: its true step times and gradient statistics.

The scheduler never reads this module; it sees only profiles and what the job reports. Two sources:

- `reference_truth`: the measured profiles, as the Pollux and Sia simulators use them. A placement
  that was measured (digits = GPUs per node, stored in their smallest rotation) is linearly
  interpolated over the per-GPU batch; any other placement is interpolated over (nodes, GPUs,
  per-GPU batch) from the scalability table joined with the placements' means. Gradient statistics
  per epoch are interpolated linearly in the batch size between the validation runs that bracket
  it (a job measures them at the batch it runs); epoch boundaries are the smallest progress over
  all validation runs.
- `zoo_truth`: the built-in zoo's fitted models and PGNS curves (at the initial batch), for the
  embedded default that has no reference data.

Progress is counted in iterations at the initial batch M0 (the `progress` column): a step at batch
M advances it by EFFICIENCY(M) * M / M0.

Step times are always asked for a physical placement (GPUs per node) and a per-replica batch; a
hybrid-parallel model's replica is its model-parallel group of `group_gpus[type]` GPUs (its measured
rows are keyed by GPUs per node too; the zoo's models count replicas).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np
from scipy.interpolate import LinearNDInterpolator, NearestNDInterpolator

from goodput_train.goodput import ThroughputParams, compute_time, efficiency, iteration_time, pgns
from sim.profiles import profile_source
from sim.reference import Measurements, ModelTrace, discover_models
from sim.zoo import ZooModel, load_zoo


def canonical_placement(gpus_per_node: list[int]) -> str:
    """The digit string of a placement in its lexicographically smallest rotation (how it is stored)."""
    digits = "".join(str(g) for g in gpus_per_node)
    return min(digits[i:] + digits[:i] for i in range(len(digits)))


class TypeTruth:
    """True (step_time, sync_time) of one model on one GPU type."""

    def times(self, gpus_per_node: list[int], local_bsz: int) -> tuple[float, float]:
        raise NotImplementedError

    def iteration_time(self, gpus_per_node: list[int], m: int, s: int) -> tuple[float, float]:
        """(seconds per optimizer step with s accumulation steps, seconds of one micro-batch)."""
        step, sync = self.times(gpus_per_node, m)
        compute = max(step - sync, 1e-6)
        return s * compute + step, compute


class MeasuredType(TypeTruth):
    def __init__(self, placements: Measurements, scalability: Measurements | None):
        self.by_placement: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for key in sorted(set(placements.placement)):
            rows = placements.select(np.array([p == key for p in placements.placement]))
            order = np.argsort(rows.local_bsz, kind="stable")
            self.by_placement[key] = (rows.local_bsz[order].astype(float), rows.step_time[order], rows.sync_time[order])
        self._placements = placements
        self._scalability = scalability
        self._cache: dict[tuple[str, int], tuple[float, float]] = {}

    @cached_property
    def _interpolators(self):
        """(nodes, GPUs, per-GPU batch) -> (step, sync): scalability rows plus placement means."""
        p = self._placements
        keys: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
        for n, g, b, t, y in zip(p.nodes, p.gpus, p.local_bsz, p.step_time, p.sync_time):
            keys.setdefault((int(n), int(g), int(b)), []).append((t, y))
        points = [k for k in keys]
        values = [np.mean(v, axis=0) for v in keys.values()]
        if self._scalability is not None:
            s = self._scalability
            points += [(int(n), int(g), int(b)) for n, g, b in zip(s.nodes, s.gpus, s.local_bsz)]
            values += [(t, y) for t, y in zip(s.step_time, s.sync_time)]
        pts = np.asarray(points, dtype=float)
        vals = np.asarray(values, dtype=float)
        # Scale the axes to comparable ranges so that the triangulation is not dominated by batch size.
        scale = np.maximum(pts.max(axis=0), 1.0)
        return scale, LinearNDInterpolator(pts / scale, vals), NearestNDInterpolator(pts / scale, vals)

    def times(self, gpus_per_node: list[int], local_bsz: int) -> tuple[float, float]:
        key = canonical_placement(gpus_per_node)
        hit = self._cache.get((key, local_bsz))
        if hit is not None:
            return hit
        if key in self.by_placement:
            bsz, step, sync = self.by_placement[key]
            result = float(np.interp(local_bsz, bsz, step)), float(np.interp(local_bsz, bsz, sync))
        else:
            scale, linear, nearest = self._interpolators
            x = np.array([len(gpus_per_node), sum(gpus_per_node), local_bsz], dtype=float) / scale
            value = linear(x)[0]
            if not np.all(np.isfinite(value)):
                value = nearest(x)[0]
            result = float(value[0]), float(value[1])
        self._cache[(key, local_bsz)] = result
        return result


class ModelledType(TypeTruth):
    """A fitted model per replica of `group` GPUs."""

    def __init__(self, params: ThroughputParams, group: int = 1):
        self.params = params
        self.group = group

    def times(self, gpus_per_node: list[int], local_bsz: int) -> tuple[float, float]:
        nodes, replicas = len(gpus_per_node), sum(gpus_per_node) // self.group
        step = float(iteration_time(self.params, nodes, replicas, local_bsz))
        return step, step - float(compute_time(self.params, local_bsz))


@dataclass(frozen=True)
class ModelTruth:
    """Everything true about one model: per-type step times and limits, statistics, length."""

    name: str
    types: dict[str, TypeTruth]
    local_limits: dict[str, tuple[int, int]]
    init_batch: int
    max_batch: int
    boundaries: np.ndarray  # cumulative progress at the end of each epoch
    batches: np.ndarray  # (B,) batch sizes with measured gradient statistics
    grad_sqr: np.ndarray  # (B, epochs)
    grad_var: np.ndarray  # (B, epochs)
    group_gpus: dict[str, int] = field(default_factory=dict)  # hybrid-parallel: GPUs of a replica per type

    @property
    def total_progress(self) -> float:
        return float(self.boundaries[-1])

    @cached_property
    def _boundary_list(self) -> list[float]:
        return self.boundaries.tolist()

    def epoch(self, progress: float) -> int:
        # bisect over a list answers as np.searchsorted(side="right") does, at a tenth of its cost
        return min(bisect.bisect_right(self._boundary_list, progress), len(self._boundary_list) - 1)

    @property
    def epochs_total(self) -> int:
        """Its statistical epochs to the end: the target its user would declare."""
        return len(self.boundaries)

    def epochs(self, progress: float) -> float:
        """Statistical epochs done at `progress` (fractional): what the job reports as its epochs."""
        e = self.epoch(progress)
        start = float(self.boundaries[e - 1]) if e else 0.0
        return e + min(max(progress - start, 0.0) / max(float(self.boundaries[e]) - start, 1e-12), 1.0)

    def epoch_samples(self, progress: float) -> float:
        """Examples at M0 in the epoch under way (its progress in iterations at M0, times M0)."""
        e = self.epoch(progress)
        return (float(self.boundaries[e]) - (float(self.boundaries[e - 1]) if e else 0.0)) * self.init_batch

    def stats(self, progress: float, batch: float) -> tuple[float, float]:
        """(grad_sqr, grad_var) in the current epoch, as measured at this batch size."""
        sqr, var, _ = self._at(self.epoch(progress), batch)
        return sqr, var

    def efficiency(self, progress: float, batch: float) -> float:
        return self.efficiency_in(self.epoch(progress), batch)

    def efficiency_in(self, epoch: int, batch: float) -> float:
        """The statistical efficiency at `batch` all through `epoch`."""
        return self._at(epoch, batch)[2]

    def _at(self, epoch: int, batch: float) -> tuple[float, float, float]:
        """(grad_sqr, grad_var, efficiency) all through `epoch` at `batch`, kept: a simulation asks
        them of every job every round and of every running job at every step of its progress."""
        key = (epoch, batch)
        known = self._kept.get(key)
        if known is None:
            sqr = float(np.interp(batch, self.batches, self.grad_sqr[:, epoch]))
            var = float(np.interp(batch, self.batches, self.grad_var[:, epoch]))
            phi = pgns(sqr, var, self.init_batch)
            known = self._kept[key] = (sqr, var, float(efficiency(phi, self.init_batch, batch)))
        return known

    @cached_property
    def _kept(self) -> dict[tuple[int, float], tuple[float, float, float]]:
        return {}


def reference_truth(trace: ModelTrace) -> ModelTruth:
    epochs = len(trace.validation[trace.init_batch])
    runs = [trace.validation[b] for b in sorted(trace.validation) if len(trace.validation[b]) >= epochs]
    return ModelTruth(
        name=trace.name,
        types={t: MeasuredType(m, trace.scalability.get(t)) for t, m in trace.placements.items()},
        local_limits={t: trace.local_bsz_limits(t) for t in trace.placements},
        init_batch=trace.init_batch,
        max_batch=trace.max_batch,
        boundaries=np.min([r.progress[:epochs] for r in runs], axis=0).astype(float),
        batches=np.array([r.batch_size for r in runs], dtype=float),
        grad_sqr=np.array([r.grad_sqr[:epochs] for r in runs], dtype=float),
        grad_var=np.array([r.grad_var[:epochs] for r in runs], dtype=float),
        group_gpus=trace.group_gpus,
    )


def zoo_truth(model: ZooModel) -> ModelTruth:
    return ModelTruth(
        name=model.name,
        types={t: ModelledType(z.params, model.group_gpus.get(t, 1)) for t, z in model.types.items()},
        local_limits={t: (z.min_local, z.max_local) for t, z in model.types.items()},
        init_batch=model.init_batch,
        max_batch=model.max_batch,
        boundaries=np.asarray(model.progress, dtype=float),
        batches=np.array([model.init_batch], dtype=float),  # the zoo keeps the curve at M0
        grad_sqr=np.asarray(model.grad_sqr, dtype=float)[None, :],
        grad_var=np.asarray(model.grad_var, dtype=float)[None, :],
        group_gpus=dict(model.group_gpus),
    )


@dataclass(frozen=True)
class JobSources:
    """True behaviour per model, and the 1-GPU profile a profiling run would measure per (model, type)."""

    origin: str  # "reference:<folder>" or "zoo"
    truths: dict[str, ModelTruth]
    profile: Callable[[str, str], object]


def job_sources(reference: str | None = None, use_zoo: bool = False) -> JobSources:
    """The jobs' truth and their profiles, from one source: the reference profiles when the
    reference folder is there, else the built-in model zoo."""
    source = profile_source(reference, use_zoo)
    if source.origin == "zoo":
        truths = {name: zoo_truth(m) for name, m in load_zoo().items()}
    else:
        truths = {name: reference_truth(t) for name, t in discover_models(reference).items()}
    return JobSources(source.origin, truths, source.profile)
