"""`goodput up` — the embedded stack; `goodput status` — what it knows of the jobs.

`goodput up` starts a NATS server (JetStream on, data under --data) and the five services as child
processes, on a simulated cluster (simulated executors), waits until each answers ping, prints where
everything is, replays a workload through them (the built-in one unless told otherwise) and prints
the results; then, unless --once, it serves: jobs submitted with `goodput submit` are scheduled
live, a round every --round seconds of the wall clock (sped up by --speed), and each decision is
printed, until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import time
from pathlib import Path

from shared import credentials
from shared.bus import DEFAULT_SERVER, SERVER_ENV
from shared.schema import RunRequest

LIVE_RUN = "live"
BUILT_IN_WORKLOAD = Path(__file__).resolve().parent.parent / "examples" / "workloads" / "mixed-40.csv"


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="start NATS and the five services; replay a workload through them")
    up.add_argument("--cluster", default="sia-hetero-64", help="cluster preset or YAML/JSON file (default: %(default)s)")
    up.add_argument("--workload", default=str(BUILT_IN_WORKLOAD),
                    help="workload CSV to replay (default: the built-in 40-job workload); 'none' to replay nothing")
    up.add_argument("--policy", default="sia", help="policy, with options as NAME:KEY=VALUE (default: %(default)s)")
    up.add_argument("--reference", help="reference folder for the jobs' true behaviour (default: the model zoo)")
    up.add_argument("--port", type=int, default=4222, help="NATS port on 127.0.0.1 (default: %(default)s)")
    up.add_argument("--data", default="out/stack", help="JetStream data and service logs (default: %(default)s)")
    up.add_argument("--out", default="out/up.json", help="the replay's result JSON (default: %(default)s)")
    up.add_argument("--once", action="store_true", help="stop after the replay instead of serving until Ctrl-C")
    up.add_argument("--round", type=float, default=60.0, help="live: seconds between rounds (default: %(default)s)")
    up.add_argument("--speed", type=float, default=1.0,
                    help="live: simulated seconds per wall-clock second, to watch long jobs (default: %(default)s)")
    up.add_argument("--policy-replicas", type=int, default=1,
                    help="policy replicas: one leads, the others stand by (default: %(default)s)")
    up.add_argument("--estimator-replicas", type=int, default=1, help="estimator replicas (default: %(default)s)")
    up.set_defaults(func=_up)

    status = sub.add_parser("status", help="jobs known to a running goodput")
    status.add_argument("--server", default=None, help=f"NATS URL (default: ${SERVER_ENV}, else {DEFAULT_SERVER})")
    credentials.add_arguments(status)
    status.set_defaults(func=_status)


def _up(args: argparse.Namespace) -> int:
    from deploy.nats import nats_from_binary

    if args.round <= 0 or args.speed <= 0 or args.policy_replicas < 1 or args.estimator_replicas < 1:
        raise ValueError("--round and --speed must be positive, replica counts at least 1")
    data = Path(args.data)
    # A fresh store each time: each start replays onto an empty simulated cluster.
    shutil.rmtree(data / "jetstream", ignore_errors=True)
    data.mkdir(parents=True, exist_ok=True)
    with nats_from_binary(data, port=args.port) as url:
        asyncio.run(_serve(args, url, data))
    return 0


async def _serve(args: argparse.Namespace, url: str, data: Path) -> None:
    from cli.simulate import policy_spec, report
    from deploy.stack import create_run, replay, running_services, service_arguments
    from shared.bus import Bus
    from shared.reference import load_workload
    from services.policy.base import make_policy
    from shared.cluster import load_cluster
    from sim.run import add_fairness, job_sources, replay_results, simulation_settings
    from sim.simulator import FEEDBACK_ITERATIONS

    policy, options = policy_spec(args.policy)
    arguments = service_arguments(args.cluster, args.reference, args.reference is None, None, FEEDBACK_ITERATIONS,
                                  None)
    replicas = {"policy": args.policy_replicas, "estimator": args.estimator_replicas}
    with running_services(url, arguments, data, replicas) as stack:
        bus = await Bus.connect(url, "goodput-up")
        try:
            await stack.wait_ready(bus)
            print(f"goodput is up: NATS at {url} (JetStream data in {data})")
            for name, process in stack.processes.items():
                print(f"  {name:<11} pid {process.pid:<7} log {data / (name + '.log')}")
            print(f"submit jobs with `goodput submit JOB.yaml --server {url}`; "
                  f"see them with `goodput status --server {url}`")
            if args.workload != "none":
                jobs = load_workload(args.workload)
                settings = simulation_settings(None, args.cluster)
                print(f"replaying {args.workload} ({len(jobs)} jobs) with {args.policy} on {args.cluster} ...")
                start = time.perf_counter()
                run, records = await replay(bus, stack, jobs, policy, options, settings.name)
                origin = f"reference:{args.reference}" if args.reference else "zoo"
                cluster = load_cluster(args.cluster)
                result = replay_results(jobs, cluster, make_policy(policy, **options), settings,
                                        FEEDBACK_ITERATIONS, run, records, args.workload, origin)
                await asyncio.to_thread(add_fairness, result, jobs, cluster, policy, options, settings,
                                        job_sources(args.reference, args.reference is None), FEEDBACK_ITERATIONS)
                report(result, time.perf_counter() - start, args.out)
            if not args.once:
                settings = simulation_settings(None, args.cluster)
                await create_run(bus, RunRequest(LIVE_RUN, policy, options, settings.name, (), args.round,
                                                 live=True, speed=args.speed))
                print(f"serving: submitted jobs are scheduled live with {args.policy}, a round every "
                      f"{args.round:g} s{f' (x{args.speed:g})' if args.speed != 1 else ''}; Ctrl-C stops everything")
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, stop.set)
                watch = asyncio.ensure_future(_watch(bus, LIVE_RUN))
                await stop.wait()
                watch.cancel()
        finally:
            await bus.close()
    print("goodput is down")


async def _watch(bus, run_id: str) -> None:
    """Print each live decision that changes something, and each job that finishes."""
    from deploy.stack import follow_run_steps

    shown = None
    async for step in follow_run_steps(bus, run_id, idle_timeout_s=None):
        if step.record is not None and (step.record.active, step.record.gpus) != shown:
            shown = (step.record.active, step.record.gpus)
            running = ", ".join(f"{job} {gpus} GPU{'s' * (gpus > 1)}" for job, gpus in sorted(step.record.gpus.items()))
            print(f"  t={step.now_s:>8.0f} s  {step.record.active} active, {step.record.running} running"
                  f"{': ' + running if running else ''}", flush=True)
        for job in step.finished:
            print(f"  t={step.now_s:>8.0f} s  {job} finished", flush=True)


def _status(args: argparse.Namespace) -> int:
    import os

    server = args.server or os.environ.get(SERVER_ENV, DEFAULT_SERVER)
    options = credentials.connect_options(credentials.from_args(args))   # ValueError: a missing file
    try:
        records, profiled, leader = asyncio.run(_query(server, **options))
    except Exception as exc:  # noqa: BLE001 - any failure to reach the stack is the same answer
        raise ValueError(f"cannot reach a running goodput at {credentials.redact(server)} ({exc or type(exc).__name__}); "
                         "is `goodput up` running?") from None
    finished = [r for r in records.jobs if r.finish_s is not None]
    print(f"{len(records.jobs)} jobs known to the executors, {profiled} profiled, {len(finished)} finished; "
          f"policy leader: {leader or 'none'}")
    for r in records.jobs:
        gpus = "+".join(f"{g}@{node}" for node, g in r.placement)
        state = (f"finished after {(r.finish_s - r.submit_s) / 3600:.2f} h" if r.finish_s is not None
                 else f"running on {gpus}" if gpus else "waiting")
        print(f"  {r.name:<24} {r.application:<12} {state:<28} restarts {r.restarts:<3} "
              f"GPU-h {r.gpu_seconds / 3600:.2f}")
    return 0


async def _query(server: str, **options):
    from shared import subjects
    from shared.bus import Bus
    from shared.schema import Ack, Count, JobRecords, Lease

    bus = await Bus.connect(server, "goodput-status", allow_reconnect=False, max_reconnect_attempts=1, **options)
    try:
        records = await bus.request(subjects.RECORDS, Ack(), JobRecords, timeout=5)
        profiled = await bus.request(subjects.ESTIMATOR_STATUS, Ack(), Count, timeout=5)
        leader = await bus.request(subjects.POLICY_STATUS, Ack(), Lease, timeout=5)
        return records, profiled.n, leader.holder
    finally:
        await bus.close()
