"""A burst of live submissions: thousands of valid jobs at once on a serving stack, judged, and run
until every one finished.

    .venv/bin/python benchmarks/bench_burst.py [--jobs 2000] [--round 2] [--speed 600]
    .venv/bin/python benchmarks/bench_burst.py --jobs 10000 --until verdicts [--replicas 2] [--policy sia]

The embedded stack serves as `goodput up --workload none --round R --speed S` does (a NATS server,
the six services as processes, `--replicas` profilers and estimators, the live run on
`sia-hetero-64` under `--policy`, the product's default unless given). Clients with nats-py alone publish `--jobs` small JobSpecs (cifar10, msgpack,
Nats-Msg-Id = the id) all at once, from as many logins as that takes (`user`, then `burst2` …: a
login has at most 5,000 waiting on the intake stream); the benchmark counts the jobs with the
profiler's verdict (the executors' count, every 50 ms), then (`--until finished`) follows the run
until every job has finished. Prints:

- N and the seconds until every submission was stored (each acknowledged by JetStream);
- the seconds until the last verdict, and until the last job finished;
- the rounds during the burst: the decision's time (facts, models, the policy, the placer;
  RoundRecord.round_ms) and the wall time between two rounds on the run's log, p50/p95/max,
  against the round period;
- each service's and the NATS server's peak resident memory (VmHWM), and the CPU seconds each
  spent from the first submission to the last verdict, with their sum per verdict;
- last, the headline: `verdicts_per_s=… answered=… jobs=…`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import msgspec
import nats
import numpy as np
from bench_load import nats_server_pid, rss_mb

from launcher.live_run import live_request
from launcher.nats import embedded_nats
from launcher.stack import another_login, ensure_run, follow_run_steps, running_services, service_arguments
from shared import subjects
from shared.lifecycle import JobState
from shared.schema.base import Count
from shared.schema.records import JobRecords, JobsQuery
from shared.settings import DEFAULT_POLICY, FEEDBACK_ITERATIONS
from shared.storage import LOGIN_LIMITS

CLUSTER = "sia-hetero-64"


def quantiles(values) -> str:
    if not len(values):
        return "-"
    p50, p95 = np.percentile(values, [50, 95])
    return f"{p50:.0f} / {p95:.0f} / {max(values):.0f} ms"


def cpu_s(pid: int) -> float:
    """CPU seconds (user and system) a process has spent so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def logins_for(server, folder: Path, jobs: int) -> list[tuple[str, object]]:
    """Enough logins for `jobs` submissions at once, each with its nats-py connection: `user`, then
    `burst2`, … as `goodput login add` adds them (one login's backlog on the intake stream is at
    most LOGIN_LIMITS.backlog: the server refuses the next, "maximum messages per subject exceeded")."""
    logins = [("user", await nats.connect(server.url, **server.options("user")))]
    for n in range(2, -(-jobs // LOGIN_LIMITS.backlog) + 1):
        logins.append((f"burst{n}", await another_login(folder, f"burst{n}", server.url)))
    return logins


async def submit_burst(logins: list[tuple[str, object]], jobs: int) -> float:
    """Seconds until every submission was stored (as users' clients: nats-py, msgpack), the jobs
    dealt out to the logins in turn."""
    streams = [(login, nc.jetstream()) for login, nc in logins]
    started = time.perf_counter()
    acks = []
    for i in range(jobs):
        login, js = streams[i % len(streams)]
        acks.append(
            js.publish_async(
                subjects.submit(login),
                msgspec.msgpack.encode({"id": f"burst-{i}", "application": "cifar10"}),
                headers={"Nats-Msg-Id": f"burst-{i}"},
            )
        )
    # publish_async hands back each message's future ack once it is sent: stored once they resolve.
    stored = await asyncio.gather(*await asyncio.gather(*acks))
    if len({(ack.stream, ack.seq) for ack in stored}) != jobs:
        raise SystemExit(f"{jobs} submissions sent, {len({(a.stream, a.seq) for a in stored})} stored")
    return time.perf_counter() - started


async def run(args: argparse.Namespace, folder: Path) -> None:
    arguments = service_arguments(CLUSTER, None, True, None, FEEDBACK_ITERATIONS, None)
    replicas = {"profiler": args.replicas, "estimator": args.replicas}
    with embedded_nats(folder) as server, running_services(server, arguments, folder, replicas) as stack:
        bus = await server.connect("bench-burst")
        try:
            await stack.wait_ready(bus)
            await ensure_run(bus, live_request(subjects.LIVE_RUN, args.policy, CLUSTER, args.round, args.speed))
            steps = []

            async def follow() -> None:
                async for step in follow_run_steps(bus, subjects.LIVE_RUN, idle_timeout_s=None):
                    steps.append((time.perf_counter(), step))

            following = asyncio.ensure_future(follow())
            logins = await logins_for(server, folder, args.jobs)
            pids = {name: process.pid for name, process in stack.processes.items()}
            pids["nats-server"] = nats_server_pid()
            cpu_before = {name: cpu_s(pid) for name, pid in pids.items()}
            try:
                started = time.perf_counter()
                stored_s = await submit_burst(logins, args.jobs)
            finally:
                for _, nc in logins:
                    await nc.close()
            print(
                f"{args.jobs} submissions stored in {stored_s:.2f} s ({args.jobs / stored_s:,.0f}/s), "
                f"from {len(logins)} login{'s' * (len(logins) > 1)}",
                flush=True,
            )
            # The executors' count of the jobs with the profiler's verdict, asked every 50 ms: cheap
            # beside the work it counts, and what a user's status shows (no longer "profiling").
            answered = 0
            while answered < args.jobs and time.perf_counter() - started < args.timeout:
                await asyncio.sleep(0.05)
                answered = (await bus.request(subjects.EXECUTOR_STATUS, JobsQuery("burst-"), Count, timeout=60)).n
            profiled_s = time.perf_counter() - started
            cpu = {name: cpu_s(pid) - cpu_before[name] for name, pid in pids.items()}
            print(
                f"{answered} of {args.jobs} submissions judged {profiled_s:.1f} s after the first one "
                f"({answered / profiled_s:,.0f} verdicts a second)",
                flush=True,
            )
            finished_s = None
            while args.until == "finished" and answered == args.jobs:
                records = (await bus.request(subjects.RECORDS, JobsQuery("burst-"), JobRecords, timeout=60)).jobs
                states = [r.state for r in records]
                if len(states) == args.jobs and all(s == JobState.FINISHED for s in states):
                    finished_s = time.perf_counter() - started
                    break
                if time.perf_counter() - started > args.timeout:
                    raise SystemExit(
                        f"not finished after {args.timeout:.0f} s: { {s: states.count(s) for s in set(states)} }"
                    )
                await asyncio.sleep(1.0)
            following.cancel()
            memory = {name: rss_mb(process.pid)["VmHWM"] for name, process in stack.processes.items()}
            memory["nats-server"] = rss_mb(nats_server_pid())["VmHWM"]
        finally:
            await bus.close()
    burst = [(t, s) for t, s in steps if t >= started]
    decide = [s.record.round_ms for _, s in burst if s.record is not None]
    gaps = np.diff([t for t, _ in burst]) * 1e3
    if finished_s is not None:
        print(f"every job finished {finished_s:.1f} s after the first submission")
    print(
        f"{len(burst)} rounds during the burst, one every {args.round:g} s of wall time "
        f"({args.round * args.speed:g} s of the cluster's clock)"
    )
    print(f"  deciding a round (p50 / p95 / max): {quantiles(decide)}")
    for _, step in burst:
        if step.record is not None and step.record.stages_ms:
            stages = ", ".join(f"{stage} {ms:.0f}" for stage, ms in step.record.stages_ms.items())
            print(f"    {step.record.active} active jobs: {stages} ms")
    print(f"  between two rounds  (p50 / p95 / max): {quantiles(gaps)}  (period {args.round * 1e3:.0f} ms)")
    print(
        f"CPU to the last verdict: {sum(cpu.values()):.1f} s, {sum(cpu.values()) / max(1, answered) * 1e3:.2f} ms a "
        "verdict: " + ", ".join(f"{name} {s:.1f}" for name, s in sorted(cpu.items(), key=lambda kv: -kv[1]))
    )
    print("peak resident memory (VmHWM): " + ", ".join(f"{name} {mb:.0f} MiB" for name, mb in memory.items()))
    print(
        f"verdicts_per_s={answered / profiled_s:.0f} answered={answered} jobs={args.jobs} replicas={args.replicas}"
        + (f" finished_s={finished_s:.1f}" if finished_s is not None else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--round", type=float, default=2.0, help="wall-clock seconds between rounds")
    parser.add_argument("--speed", type=float, default=600.0, help="the cluster's seconds per wall-clock second")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument(
        "--until",
        choices=["verdicts", "finished"],
        default="finished",
        help="stop once every job has its verdict, or once every job has finished (default)",
    )
    parser.add_argument("--replicas", type=int, default=1, help="profilers and estimators, each (default: 1)")
    parser.add_argument("--policy", default=DEFAULT_POLICY, help=f"the live run's policy (default: {DEFAULT_POLICY})")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(run(args, Path(folder)))


if __name__ == "__main__":
    main()
