"""Benchmark of the model cores: the goodput matrix a round needs, and one fit of a job's model.

    .venv/bin/python benchmarks/bench_models.py [--repeat 50]

Targets (issue: goodput models): matrix for 160 jobs x the sia-hetero-64 configuration set <= 20 ms;
one fit of a job's model <= 50 ms. Uses the built-in model zoo, so it needs no reference data.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from goodput_train.goodput import Observation, fit_throughput, iteration_time
from policies.table import goodput_table
from services.estimator.core import profile_observations, type_models
from shared.cluster import load_cluster
from shared.schema.rounds import JobModels
from sim.profiles import model_profile
from sim.zoo import load_zoo

ADAPTIVE = ["bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3"]


def timed(fn, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def summary(times: list[float]) -> str:
    q = np.quantile(times, [0.5, 0.95])
    return f"p50 {q[0]:6.2f} ms   p95 {q[1]:6.2f} ms   min {min(times):6.2f} ms"


def jobs_for(cluster, count: int, explored: bool):
    zoo = load_zoo()
    rng = np.random.default_rng(0)
    jobs = []
    for i in range(count):
        model = zoo[ADAPTIVE[i % len(ADAPTIVE)]]
        types = {t: model.types[t] for t in cluster.gpu_types}
        profiles = {t: model_profile(z.params, model.name, t, z.min_local, z.max_local) for t, z in types.items()}
        sqr, var = model.stats_at(rng.uniform(0, model.total_progress))
        jobs.append(
            JobModels(
                job_id=f"{model.name}-{i}",
                params={t: z.params for t, z in types.items()} if explored else type_models(profiles, {}),
                local_limits={t: (z.min_local, z.max_local) for t, z in types.items()},
                init_batch=model.init_batch,
                max_batch=model.max_batch,
                grad_sqr=sqr,
                grad_var=var,
                # explored: every cell allowed (the worst case); else a mix of ages
                max_gpus_seen=64 if explored else int(rng.choice([0, 1, 2, 4, 8, 16])),
            )
        )
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()

    cluster = load_cluster("sia-hetero-64")
    configs = cluster.configurations()
    print(f"goodput matrix, 160 jobs x {len(configs)} configurations of sia-hetero-64 (target <= 20 ms)")
    for label, explored in [("every cell allowed", True), ("mixed job ages", False)]:
        jobs = jobs_for(cluster, 160, explored)
        goodput_table(jobs, configs)  # warm-up
        print(f"  {label:<20} {summary(timed(lambda: goodput_table(jobs, configs), args.repeat))}")

    zoo = load_zoo()
    print("one fit of a job's model (target <= 50 ms)")
    for name in ("cifar10", "imagenet", "bert"):
        z = zoo[name].types["aws"]
        profile = model_profile(z.params, name, "aws", z.min_local, z.max_local)
        ran = [
            Observation(n, g, m, s, float(iteration_time(z.params, n, g, m, s)))
            for n, g in [(1, 2), (1, 4), (2, 8), (4, 16)]
            for m in (z.min_local, z.max_local)
            for s in (0, 1)
        ]
        observations = profile_observations(profile) + ran
        print(
            f"  {name:<9} {len(observations):3d} observations  "
            f"{summary(timed(lambda: fit_throughput(observations), args.repeat))}"
        )


if __name__ == "__main__":
    main()
