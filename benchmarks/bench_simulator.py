"""The simulator's own speed on a two-day trace: one policy, 960 jobs, 48 hours.

    .venv/bin/python benchmarks/bench_simulator.py [--policy goodput] [--save FILE] [--expect FILE]

Sia's 48-hour `newTrace` is not among the reference data, so the benchmark builds a trace of the
same size from it: Philly workloads 1 to 6 (../shared/reference/sia/sia-simulator/workloads/philly/,
160 jobs over about 8 hours each) one after another, the k-th shifted by 8 h × k, the jobs renamed
`<name>@<k>`: 960 jobs over 48 hours on `sia-hetero-64`. It runs the simulation (no finish-time
fairness) and prints its wall time, then `took_s=… jobs=… rounds=… avg_jct_s=…` last.

`--save FILE` writes each job's JCT and restarts; `--expect FILE` checks this run's against a saved
one, job by job, and says how many differ (a speed-up must leave every job's result as it was).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from services.simulated.truth import job_sources
from sim.reference import load_workload, reference_root
from sim.run import Simulation, simulate

SPAN_S = 8 * 3600.0  # each Philly file's span, and the shift between them
FILES = 6


def two_days(reference: str | None) -> list:
    """Philly workloads 1..6 one after another: 960 jobs over 48 hours."""
    folder = Path(reference_root(reference)) / "sia" / "sia-simulator" / "workloads" / "philly"
    jobs = []
    for k in range(FILES):
        for job in load_workload(folder / f"workload-{k + 1}.csv"):
            jobs.append(dataclasses.replace(job, name=f"{job.name}@{k}", time=job.time + k * SPAN_S))
    return sorted(jobs, key=lambda j: j.time)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="goodput")
    parser.add_argument("--reference", help="reference folder (default: $GOODPUT_REFERENCE, else ../shared/reference)")
    parser.add_argument("--save", help="write each job's JCT and restarts here (JSON)")
    parser.add_argument("--expect", help="compare each job's JCT and restarts with a file --save wrote")
    args = parser.parse_args()
    jobs = two_days(args.reference)
    sources = job_sources(args.reference)  # read before the clock starts, as `goodput simulate` does
    start = time.perf_counter()
    result = simulate(Simulation(jobs, "sia-hetero-64", args.policy), sources=sources, fairness=False, progress=True)
    took = time.perf_counter() - start
    per_job = {j["name"]: [j["jct_s"], j["restarts"]] for j in result["jobs"]}
    print(
        f"{args.policy}: {len(jobs)} jobs over {FILES * SPAN_S / 3600:.0f} h on sia-hetero-64, "
        f"{result['rounds']} rounds, {result['jobs_unfinished']} unfinished, avg JCT {result['avg_jct_s']:.1f} s; "
        f"policy ms p50/p95 {result['policy_runtime_ms']['p50']:.1f}/{result['policy_runtime_ms']['p95']:.1f}"
    )
    if args.save:
        Path(args.save).write_text(json.dumps(per_job, indent=0, sort_keys=True))
    if args.expect:
        expected = json.loads(Path(args.expect).read_text())
        differ = sorted(name for name in expected.keys() | per_job.keys() if expected.get(name) != per_job.get(name))
        print(f"per-job results against {args.expect}: {len(differ)} of {len(expected)} differ {differ[:5]}")
        if differ:
            return 1
    print(f"took_s={took:.1f} jobs={len(jobs)} rounds={result['rounds']} avg_jct_s={result['avg_jct_s']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
