"""Benchmark of the bus: one workload through the six services over NATS against the direct wiring.

    .venv/bin/python benchmarks/bench_bus.py [--workload PATH] [--zoo]

Bus overhead per round = (wall time over NATS - wall time direct) / rounds, measured side by side
in one run; the NATS run's time includes starting the server and the six services and submitting
the jobs, so the figure is an upper bound. Target: <= 20 ms a round at 64 GPUs and 160 jobs.
Also checks that both wirings gave the same per-job schedule.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from launcher.replay import replay_over_nats
from services.simulated.truth import job_sources
from shared.settings import DEFAULT_POLICY
from sim.reference import reference_root
from sim.run import Simulation, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", help="workload CSV (default: the Sia Philly workload-1, 160 jobs)")
    parser.add_argument("--zoo", action="store_true", help="the model zoo as the jobs' truth")
    parser.add_argument("--policy", default=DEFAULT_POLICY)
    args = parser.parse_args()
    workload = args.workload or str(Path(reference_root()) / "sia/sia-simulator/workloads/philly/workload-1.csv")
    sources = job_sources(use_zoo=args.zoo)
    walls, runs = {}, {}
    for bus in ("direct", "nats"):
        start = time.perf_counter()
        over = replay_over_nats if bus == "nats" else None
        # No fairness: the alone runs are the same work either way.
        runs[bus] = simulate(
            Simulation(workload, "sia-hetero-64", args.policy), sources=sources, over=over, fairness=False
        )
        walls[bus] = time.perf_counter() - start
    rounds = runs["direct"]["rounds"]
    same = runs["nats"]["jobs"] == runs["direct"]["jobs"]
    print(
        f"{args.policy}, {len(runs['direct']['jobs'])} jobs, {rounds} rounds, sia-hetero-64: "
        f"direct {walls['direct']:.1f} s, over NATS {walls['nats']:.1f} s (six services and the server started)"
    )
    print(
        f"bus overhead per round: {(walls['nats'] - walls['direct']) / rounds * 1e3:.1f} ms (target <= 20 ms); "
        f"identical per-job schedule: {same}"
    )


if __name__ == "__main__":
    main()
