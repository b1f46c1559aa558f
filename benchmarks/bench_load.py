"""Load: thousands of jobs queued at once on the 2,048-GPU cluster, through the six services over NATS.

    .venv/bin/python benchmarks/bench_load.py [--jobs 10000] [--rounds 8] [--policy goodput] [--estimators 1]

All jobs are submitted at t = 0 (a mix of zoo models, `sim.workload.generate_workload`) and replayed
on `sia-hetero-2048` by the embedded stack (a NATS server and the six services as processes) for
`--rounds` rounds of the virtual clock; most jobs are still queued when it stops. Prints:

- the round's latency, p50/p95, against the round period: `decide` is RoundRecord.round_ms (facts,
  models, the policy, the placer), `policy` its solve alone, `whole round` the wall time between
  two rounds on the run's log (deciding, applying, advancing the executors, the checkpoints);
- where a round's time goes: each stage's p50 over the rounds after the first (`RoundRecord.stages_ms`:
  facts, models, solve, place, checkpoint, apply, advance), and each round's;
- each service's and the NATS server's resident memory: its peak (VmHWM) and its size after the
  first round and at the end, so growth from round to round shows.

The last line is the headline, as key=value: round_p50_s, round_p95_s, decide_p95_s, peak_mib (the
largest service's peak), jobs.

Starting the stack, submitting and profiling the jobs come before the first round and are timed apart.
`--estimators N` runs N estimator replicas (a round's advance waits for the estimator to fit each
configuration new to it: thousands in the first rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from launcher.nats import embedded_nats
from launcher.replay import replay
from launcher.stack import running_services, service_arguments
from shared.settings import DEFAULT_POLICY, FEEDBACK_ITERATIONS, settings_for
from sim.workload import generate_workload

CLUSTER = "sia-hetero-2048"
ROUND_S = 60.0


def rss_mb(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak) of a process, in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024
    return fields


def nats_server_pid() -> int:
    """Our child nats-server (launcher.nats starts it without telling its pid)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" ", 1)
        except OSError:
            continue
        comm, _, after = rest.rpartition(")")
        if comm.endswith("nats-server") and int(after.split()[1]) == os.getpid():
            return int(pid)
    raise RuntimeError("no nats-server child process found")


def quantiles(values: list[float]) -> str:
    p50, p95 = np.percentile(values, [50, 95])
    return f"p50 {p50:9.1f}   p95 {p95:9.1f}   max {max(values):9.1f}"


async def run(jobs: int, rounds: int, policy: str, seed: int, estimators: int = 1) -> None:
    workload = [dataclasses.replace(j, time=0.0) for j in generate_workload(jobs, seed=seed)]
    calibration = settings_for(None, CLUSTER).name
    arguments = service_arguments(CLUSTER, None, True, calibration, FEEDBACK_ITERATIONS, None)
    step_walls: list[float] = []
    memory: dict[str, list[dict[str, float]]] = {}

    with tempfile.TemporaryDirectory() as folder, embedded_nats(Path(folder)) as nats:
        with running_services(nats, arguments, Path(folder), replicas={"estimator": estimators}) as stack:
            pids = {name: process.pid for name, process in stack.processes.items()} | {"nats-server": nats_server_pid()}

            def sample() -> None:
                for name, pid in pids.items():
                    memory.setdefault(name, []).append(rss_mb(pid))

            def progress(now_s: float, done: int, total: int) -> None:
                step_walls.append(time.perf_counter())
                sample()

            bus = await nats.connect("bench-load")
            try:
                start = time.perf_counter()
                await stack.wait_ready(bus)
                step_walls.append(time.perf_counter())
                sample()
                report, records = await replay(
                    bus,
                    stack,
                    workload,
                    policy,
                    {},
                    calibration,
                    ROUND_S,
                    horizon_s=(rounds - 1) * ROUND_S,
                    request_timeout_s=120.0,
                    progress=progress,
                )
            finally:
                await bus.close()
            sample()

    decided = report.rounds
    print(
        f"{policy}, {jobs} jobs queued at t=0 ({', '.join(sorted({j.application for j in workload}))}), {CLUSTER}: "
        f"{len(decided)} rounds, {sum(r.running for r in decided[-1:])} jobs running after the last, "
        f"{sum(r.finish_s is not None for r in records.jobs)} finished"
    )
    print(
        f"  until the first round was logged (the stack started, {jobs} jobs submitted and profiled, "
        f"the first round): {step_walls[1] - start:.1f} s"
    )
    print(f"  round period {ROUND_S:.0f} s; per round, ms:")
    print(f"    decide       {quantiles([r.round_ms for r in decided])}")
    print(f"    policy       {quantiles([r.policy_ms for r in decided])}")
    kept = [e for e in report.events if "previous allocation kept" in e]
    print(f"    solver fell back to the previous allocation (time limit, error) in {len(kept)} rounds")
    # Wall time between rounds logged: the first round's start is not seen, and the horizon's step is no round.
    walls = np.diff(step_walls[1 : 1 + len(decided)]) * 1e3
    if len(walls):
        print(f"    whole round  {quantiles(list(walls))}  (rounds 2..{len(decided)})")
    later = decided[1:] or decided
    stages = {
        stage: float(np.median([r.stages_ms.get(stage, 0.0) for r in later])) for r in later for stage in r.stages_ms
    }
    print(f"  each stage's p50, ms (rounds 2..{len(decided)}):")
    print("    " + ", ".join(f"{stage} {ms:.0f}" for stage, ms in sorted(stages.items(), key=lambda s: -s[1])))
    print("  each round's stages, ms:")
    for number, r in enumerate(decided, 1):
        print(f"    {number:2d}: " + ", ".join(f"{stage} {ms:.0f}" for stage, ms in r.stages_ms.items()))
    print("  resident memory, MiB: peak (VmHWM) / after the first round / at the end")
    for name, samples in memory.items():
        print(f"    {name:12s} {samples[-1]['VmHWM']:8.0f} / {samples[1]['VmRSS']:8.0f} / {samples[-1]['VmRSS']:8.0f}")
    p50, p95 = np.percentile(walls, [50, 95]) / 1e3 if len(walls) else (float("nan"), float("nan"))
    peak = max(samples[-1]["VmHWM"] for name, samples in memory.items() if name != "nats-server")
    print(
        f"round_p50_s={p50:.2f} round_p95_s={p95:.2f} "
        f"decide_p95_s={np.percentile([r.round_ms for r in decided], 95) / 1e3:.2f} peak_mib={peak:.0f} jobs={jobs}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs queued at t=0 (default: %(default)s)")
    parser.add_argument(
        "--rounds", type=int, default=8, help="rounds of the virtual clock to run (default: %(default)s)"
    )
    parser.add_argument("--policy", default=DEFAULT_POLICY)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--estimators", type=int, default=1, help="estimator replicas (default: %(default)s)")
    args = parser.parse_args()
    if args.jobs < 1 or args.rounds < 2 or args.estimators < 1:
        parser.error("--jobs and --estimators must be at least 1, --rounds at least 2")
    asyncio.run(run(args.jobs, args.rounds, args.policy, args.seed, args.estimators))


if __name__ == "__main__":
    main()
