"""Benchmark of Sia's ILP core (policies/sia_ilp/) on random realistic rounds.

    .venv/bin/python benchmarks/bench_sia_ilp.py [--small 200] [--large 20] [--seed 0] [--p -0.5]

Targets (issue 3): p50 <= 10 ms and p95 <= 20 ms per solve for 20-60 active jobs x the sia-hetero-64
configuration set (19 columns); p95 <= 1 s for 1,000-3,000 jobs on a 2,048-GPU cluster (the
sia-hetero-64 node groups x 32: 360 columns). Times are whole `solve` calls (validation, model
building, HiGHS), one fresh instance each, after one warm-up solve; wall-clock time and this
process's CPU time (the second is steadier on a shared machine; HiGHS runs on one thread here).

A realistic round:
- goodput rows rise with GPU count with diminishing returns, (speed of the type) * k / (1 + (k-1)/k0),
  per-type speeds log-normal, knee k0 in [2, 64], then row-normalised as Sia does (row min over valid
  entries = the job's minimum GPU count);
- valid entries as Sia's max_rep rule gives them: GPUs <= min(64, 2 x the most the job ever had),
  with most jobs old enough that this is 16-64 GPUs, so most of the <= 64-GPU columns are valid; a
  few rigid jobs (one GPU count, any type); at 2,048 GPUs that is at most 40 of the 360 columns;
- about 80% of the jobs ran last round (a feasible previous allocation), restart factors from
  r = max(age - restarts * S, 0) / (age + S) (r = 1 while age < S), 3% of running jobs locked;
- total demand far above capacity (each job would take up to 64 GPUs).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from policies.sia_ilp import solve
from policies.sia_ilp.problem import IlpProblem
from shared.cluster import PRESETS, Cluster, build_cluster, load_cluster

MAX_GPUS = 64  # Sia's max_rep cap


def cluster_arrays(cluster: Cluster) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    configs = cluster.configurations()
    types = list(cluster.gpu_types)
    config_type = np.array([types.index(c.gpu_type) for c in configs])
    config_gpus = np.array([c.gpus for c in configs])
    capacity = np.array([cluster.capacity(t) for t in types])
    return config_type, config_gpus, capacity


def random_round(rng: np.random.Generator, jobs: int, config_type, config_gpus, capacity) -> IlpProblem:
    T = len(capacity)
    k = config_gpus[None, :].astype(float)
    speed = rng.lognormal(0.0, 0.5, size=(jobs, T))[:, config_type]
    knee = rng.uniform(2, 64, size=(jobs, 1))
    raw = speed * k / (1 + (k - 1) / knee)

    ever = 2 ** rng.choice(7, size=jobs, p=[0.1, 0.05, 0.05, 0.1, 0.2, 0.25, 0.25])  # most GPUs ever had
    max_rep = np.minimum(2 * ever, MAX_GPUS)
    valid = config_gpus[None, :] <= max_rep[:, None]
    rigid = rng.random(jobs) < 0.1
    rigid_gpus = 2 ** rng.integers(0, 4, size=jobs)
    valid[rigid] = config_gpus[None, :] == rigid_gpus[rigid, None]
    valid[~valid.any(axis=1), np.argmin(config_gpus)] = True

    goodput = np.where(valid, raw, np.nan)
    n_min = np.array([config_gpus[row].min() for row in valid])
    goodput = n_min[:, None] * goodput / np.nanmin(goodput, axis=1, keepdims=True)

    current = np.full(jobs, -1)
    used = np.zeros(T, dtype=int)
    for i in rng.permutation(jobs):
        if rng.random() < 0.2:
            continue  # new or queued job
        options = np.flatnonzero(valid[i] & (config_gpus <= ever[i]))
        if options.size == 0:
            continue
        j = rng.choice(options)
        if used[config_type[j]] + config_gpus[j] <= capacity[config_type[j]]:
            current[i] = j
            used[config_type[j]] += config_gpus[j]

    age = rng.lognormal(np.log(3600), 1.0, size=jobs)
    restart_cost = rng.uniform(25, 250, size=jobs)
    restarts = rng.poisson(age / 3600)
    restart = np.where(age < restart_cost, 1.0, np.maximum(age - restarts * restart_cost, 0) / (age + restart_cost))
    locked = (current >= 0) & (rng.random(jobs) < 0.03)
    return IlpProblem(goodput, valid, current, restart, locked, config_type, config_gpus, capacity)


def run(name: str, cluster: Cluster, jobs: tuple[int, int], count: int, seed: int, p: float, solver: str) -> None:
    config_type, config_gpus, capacity = cluster_arrays(cluster)
    rng = np.random.default_rng(seed)
    solve(random_round(rng, jobs[0], config_type, config_gpus, capacity), p=p, solver=solver)  # warm-up
    times, cpu, statuses, allocated, demand = [], [], {}, [], []
    for _ in range(count):
        problem = random_round(rng, int(rng.integers(jobs[0], jobs[1] + 1)), config_type, config_gpus, capacity)
        start, start_cpu = time.perf_counter(), time.process_time()
        result = solve(problem, p=p, solver=solver)
        times.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
        statuses[result.status.split(":")[0]] = statuses.get(result.status.split(":")[0], 0) + 1
        allocated.append(float(np.mean(result.choice >= 0)))
        demand.append(problem.valid.sum(axis=1).mean())
    print(
        f"{name}: {len(config_type)} configurations, {capacity.sum()} GPUs, {jobs[0]}-{jobs[1]} jobs, "
        f"{count} rounds, ~{np.mean(demand):.0f} valid columns a job, "
        f"jobs allocated {np.mean(allocated):.0%}, status {statuses}"
    )
    for label, values in (("wall", times), ("cpu ", cpu)):
        q50, q95 = np.quantile(values, [0.5, 0.95])
        print(f"    {label} p50 {q50:8.1f} ms   p95 {q95:8.1f} ms   max {max(values):8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=200, help="rounds at 64 GPUs (0 to skip)")
    parser.add_argument("--large", type=int, default=20, help="rounds at 2,048 GPUs (0 to skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--p", type=float, default=-0.5)
    parser.add_argument("--solver", default="HIGHS")
    args = parser.parse_args()
    if args.small:
        run("sia-hetero-64", load_cluster("sia-hetero-64"), (20, 60), args.small, args.seed, args.p, args.solver)
    if args.large:
        big = build_cluster("sia-hetero-64x32", [dict(g, count=g["count"] * 32) for g in PRESETS["sia-hetero-64"]])
        run("sia-hetero-64 x 32", big, (1000, 3000), args.large, args.seed, args.p, args.solver)


if __name__ == "__main__":
    main()
