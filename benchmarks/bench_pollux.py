"""Benchmark of the Pollux policy: milliseconds a round on realistic chains of rounds.

    .venv/bin/python benchmarks/bench_pollux.py [--rounds 40] [--jobs 10 30 50] [--population 100 --generations 100]

Target (issue: policy and placer cores): p50 <= 300 ms a round at 64 GPUs and ~30 jobs with population
100 x 100 generations (Pollux's own code: ~0.76 s a round; the Sia paper: 2.2 s median, 4.8 s p95).

A chain: `jobs` active jobs of the zoo's models; each round the policy decides, every job then runs
where it was put (placements become the current ones, restarts and attained service counted, the
most GPUs seen grows, so the 2x scale-up limit loosens), about 5% of jobs finish and are replaced by
new ones (no GPUs, limit 1 GPU), and ~5% are mid checkpoint-restart. The policy keeps its
population between rounds, as in the simulator. Only `allocate` is timed (the goodput table the
state carries is the estimator's work). Uses the built-in model zoo: no reference data needed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from policies.base import Decision, JobView, RoundState
from policies.pollux import PolluxPolicy
from shared.cluster import Cluster, load_cluster
from sim.rounds import job_view, round_state
from sim.zoo import load_zoo

ZOO = load_zoo()
ADAPTIVE = ["bert", "cifar10", "deepspeech2", "imagenet", "yolov3"]
FINISH_PROB = 0.05
RESTART_PROB = 0.05


def new_job(rng: np.random.Generator, cluster: Cluster, index: int, now_s: float) -> JobView:
    model = ADAPTIVE[int(rng.integers(len(ADAPTIVE)))]
    return job_view(
        f"job-{index}",
        model,
        cluster,
        age_s=0.0,
        submit_s=now_s,
        progress=float(rng.uniform(0, 0.3)) * ZOO[model].total_progress,
    )


def next_state(rng: np.random.Generator, state: RoundState, decision: Decision, counter: list[int]) -> RoundState:
    now = state.now_s + 60.0
    jobs = []
    for job in state.jobs:
        if rng.random() < FINISH_PROB:
            counter[0] += 1
            jobs.append(new_job(rng, state.cluster, counter[0], now))
            continue
        spots = decision.placements.get(job.job_id, ())
        current = decision.allocations.get(job.job_id)
        moved = bool(spots) and spots != job.placement
        progress = min(1.0, float(rng.uniform(0, 1)))
        jobs.append(
            job_view(
                job.job_id,
                job.model,
                state.cluster,
                age_s=job.age_s + 60.0,
                restarts=job.restarts + moved,
                attained_gpu_s=job.attained_gpu_s + 60.0 * (current.gpus if current else 0),
                current=current,
                placement=spots,
                mid_restart=bool(spots) and rng.random() < RESTART_PROB,
                submit_s=job.submit_s,
                progress=progress * ZOO[job.model].total_progress,
                max_gpus_seen=max(job.models.max_gpus_seen, current.gpus if current else 0),
            )
        )
    return round_state(jobs, state.cluster, now)


def bench(cluster_name: str, n_jobs: int, rounds: int, population: int, generations: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    cluster = load_cluster(cluster_name)
    # A warm cluster: jobs have run a while at a few GPUs, so their limits allow scaling.
    jobs = [
        job_view(
            f"job-{i}",
            ADAPTIVE[int(rng.integers(len(ADAPTIVE)))],
            cluster,
            age_s=float(rng.uniform(600, 7200)),
            submit_s=float(-i * 60),
            attained_gpu_s=float(rng.uniform(0, 5e4)),
            max_gpus_seen=int(rng.choice([1, 2, 4, 8])),
        )
        for i in range(n_jobs)
    ]
    state = round_state(jobs, cluster)
    counter = [n_jobs]
    policy = PolluxPolicy(population=population, generations=generations, seed=seed)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        decision = policy.allocate(state)
        times.append((time.perf_counter() - start) * 1e3)
        state = next_state(rng, state, decision, counter)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--jobs", type=int, nargs="+", default=[10, 30, 50])
    parser.add_argument("--clusters", nargs="+", default=["pollux-homo-64", "sia-hetero-64"])
    parser.add_argument("--population", type=int, default=100)
    parser.add_argument("--generations", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"pollux policy, population {args.population} x {args.generations} generations, {args.rounds} rounds a chain")
    for cluster in args.clusters:
        for n_jobs in args.jobs:
            times = bench(cluster, n_jobs, args.rounds, args.population, args.generations, args.seed)
            p50, p95 = np.quantile(times, [0.5, 0.95])
            print(f"{cluster:15s} {n_jobs:3d} jobs   p50 {p50:7.1f} ms   p95 {p95:7.1f} ms   max {max(times):7.1f} ms")


if __name__ == "__main__":
    main()
