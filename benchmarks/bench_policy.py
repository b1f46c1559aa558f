"""Benchmark of the policies' runtime and the simulator, measured inside simulator runs on the reference data.

    .venv/bin/python benchmarks/bench_policy.py [--policies sia goodput] [--scale-hours 1.0] [--reference DIR]

Each policy in turn (default `sia`, then `goodput`), so their figures come from one run:

1. One 160-job, 8-hour Philly workload on sia-hetero-64, run whole: the policy's time per round
   (p50/p95; targets 10 / 20 ms) and the whole simulation's wall time (target <= 30 s).
2. The scale workload scale_32x (5,120 jobs) on the 2,048-GPU sia-hetero-2048 cluster, its first
   hours simulated: the policy's time per round (target p95 <= 1 s), and the whole round's
   (goodput matrix + policy + placer).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from policies.base import policy_spec
from shared.reference import reference_root
from sim.run import job_sources, simulate


def report(label: str, result: dict, took: float) -> None:
    policy, rnd = result["policy_runtime_ms"], result["round_runtime_ms"]
    print(f"{label}")
    print(
        f"  rounds {result['rounds']}, jobs finished {result['jobs_finished']}/{len(result['jobs'])}, "
        f"mean active jobs {result['contention']:.0f}, wall time {took:.1f} s"
    )
    print(f"  policy ms  p50 {policy['p50']:8.1f}   p95 {policy['p95']:8.1f}   max {policy['max']:8.1f}")
    print(f"  round ms   p50 {rnd['p50']:8.1f}   p95 {rnd['p95']:8.1f}   max {rnd['max']:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="reference folder (default: $GOODPUT_REFERENCE, else ../shared/reference)")
    parser.add_argument("--scale-hours", type=float, default=1.0, help="simulated hours of the scale run")
    parser.add_argument("--policies", nargs="+", default=["sia", "goodput"], help="policies to measure, in turn")
    args = parser.parse_args()
    for policy in args.policies:  # a bad name refused before minutes of runs
        try:
            policy_spec(policy)
        except ValueError as error:
            parser.error(str(error))
    root = reference_root(args.reference)
    workloads = Path(root) / "sia" / "sia-simulator" / "workloads"
    sources = job_sources(args.reference)

    for policy in args.policies:
        start = time.perf_counter()
        result = simulate(
            workloads / "philly" / "workload-1.csv", "sia-hetero-64", policy, sources=sources, fairness=False
        )  # the simulation itself, without each job's alone run
        report(
            f"{policy}, Philly workload-1 (160 jobs), sia-hetero-64 — targets: policy p50 <= 10 ms, "
            "p95 <= 20 ms; simulation <= 30 s",
            result,
            time.perf_counter() - start,
        )

    for policy in args.policies:
        start = time.perf_counter()
        result = simulate(
            workloads / "scale" / "scale_32x" / "workload-1.csv",
            "sia-hetero-2048",
            policy,
            sources=sources,
            horizon_s=args.scale_hours * 3600,
            fairness=False,
        )
        report(
            f"{policy}, scale_32x workload-1 (5,120 jobs), sia-hetero-2048, first {args.scale_hours:g} h — "
            "target: policy p95 <= 1 s",
            result,
            time.perf_counter() - start,
        )


if __name__ == "__main__":
    main()
