"""Synthetic workloads in the reference format (`name,time,application,num_replicas,batch_size`,
and `team,priority` when the jobs have them).

The embedded default needs a workload without the reference data. This one follows the shape of
the Philly-derived workloads: arrivals spread uniformly over a window (a Poisson process given its
count), a mix dominated by short jobs, and a user request (GPUs, batch) per job that scales the
model's initial batch with the GPU count.
"""

from __future__ import annotations

import csv
import dataclasses
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

from shared.subjects import DEFAULT_TEAM
from shared.teams import scoped_id, team_problem
from sim.reference import WorkloadJob
from sim.zoo import load_zoo

# The built-in workload (40 jobs of the zoo's models over 2 hours): what `goodput up` and
# `goodput simulate` replay when no --workload is given. Shipped as package data.
BUILT_IN_WORKLOAD = Path(__file__).resolve().parent.parent / "examples" / "workloads" / "mixed-40.csv"

# Share of each model among jobs: short jobs dominate, as in the Philly-derived workloads.
DEFAULT_MIX = {"cifar10": 0.55, "deepspeech2": 0.14, "bert": 0.12, "ncf": 0.08, "yolov3": 0.08, "imagenet": 0.03}
REQUESTED_GPUS = (1, 2, 4, 8)
REQUESTED_WEIGHTS = (0.4, 0.3, 0.2, 0.1)


def generate_workload(
    jobs: int = 40,
    hours: float = 2.0,
    seed: int = 0,
    mix: dict[str, float] | None = None,
    teams: tuple[str, ...] = (),
) -> list[WorkloadJob]:
    """`jobs` jobs of the zoo's models over `hours`; with `teams`, each job is one of theirs, drawn
    uniformly (its name `team.model-i`)."""
    if jobs < 1 or hours <= 0:
        raise ValueError("a workload needs at least one job and a positive window")
    for team in teams:
        problem = team_problem(team)
        if problem is not None:
            raise ValueError(problem)
    mix = mix or DEFAULT_MIX
    zoo = load_zoo()
    unknown = sorted(set(mix) - set(zoo))
    if unknown:
        raise ValueError(f"models not in the zoo: {', '.join(unknown)}")
    rng = np.random.default_rng(seed)
    names = sorted(mix)
    weights = np.array([mix[n] for n in names], dtype=float)
    times = np.sort(rng.uniform(0, hours * 3600, size=jobs)).round()
    apps = rng.choice(names, size=jobs, p=weights / weights.sum())
    gpus = rng.choice(REQUESTED_GPUS, size=jobs, p=REQUESTED_WEIGHTS)
    owners = rng.choice(teams, size=jobs) if teams else [DEFAULT_TEAM] * jobs  # drawn last: the rest as without
    out = []
    for i, (t, app, g, team) in enumerate(zip(times, apps, gpus, owners)):
        model = zoo[app]
        batch = int(min(model.init_batch * g, model.max_batch))
        out.append(WorkloadJob(scoped_id(str(team), f"{app}-{i}"), float(t), str(app), int(g), batch, str(team)))
    return out


def write_workload(jobs: list[WorkloadJob], path: str | Path) -> None:
    """The jobs as a workload CSV; with `team` and `priority` columns when any job has a team or a
    priority other than the default, and `target_epochs` when any declares its work."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    teams = any(j.team != DEFAULT_TEAM or j.priority for j in jobs)
    targets = any(j.target_epochs is not None for j in jobs)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            ["name", "time", "application", "num_replicas", "batch_size"]
            + ["team", "priority"] * teams
            + ["target_epochs"] * targets
        )
        for j in jobs:
            row = [j.name, int(j.time), j.application, j.num_replicas, j.batch_size]
            target = "" if j.target_epochs is None else f"{j.target_epochs:g}"
            writer.writerow(row + [j.team, j.priority] * teams + [target] * targets)


# What `--targets` does to each job's declared work (target_epochs): keep what the workload says;
# fill a missing one with the application's real target (its epochs in the truth: what its user
# would state); drop them all.
TARGETS = ("given", "from-truth", "none")


def declare_targets(
    jobs: list[WorkloadJob],
    epochs_of: Callable[[str], float],
    targets: str = "given",
    noise: tuple[float, float] | None = None,
    seed: int = 0,
) -> list[WorkloadJob]:
    """The jobs with their declarations as `targets` says (TARGETS; `epochs_of(application)`: its
    real target), each then scaled by `noise` (lo, hi): a factor drawn log-uniformly in [lo, hi],
    seeded by `seed` and the job's name (the same job gets the same factor in every run)."""
    if targets not in TARGETS:
        raise ValueError(f"targets must be one of {', '.join(TARGETS)}, got {targets!r}")
    if noise is not None and not 0 < noise[0] <= noise[1]:
        raise ValueError(f"target noise must be LO,HI with 0 < LO <= HI, got {noise[0]:g},{noise[1]:g}")
    out = []
    for job in jobs:
        target = None if targets == "none" else job.target_epochs
        if target is None and targets == "from-truth":
            target = float(epochs_of(job.application))
        if target is not None and noise is not None:
            draw = np.random.default_rng([seed, zlib.crc32(job.name.encode())]).uniform(*np.log(noise))
            target *= float(np.exp(draw))
        out.append(dataclasses.replace(job, target_epochs=target))
    return out
