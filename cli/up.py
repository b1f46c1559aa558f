"""`goodput up` — the embedded stack: NATS, the six services and, for real jobs, the node agents.

`goodput up` starts a NATS server (JetStream on, data under --data) and the six services (the user
API, profiler, estimator, policy, placer and executors) as child processes, on a simulated cluster (simulated executors), waits until each answers ping, prints where
everything is, replays a workload through them (the built-in one unless told otherwise, under ids
of the replay's own) and prints the results; then, unless --once, it serves: jobs submitted with
`goodput submit` are scheduled live, a round every --round seconds of the wall clock (each --speed
times as long on the simulated cluster), and each decision is printed, until Ctrl-C. While it
serves, the live web dashboard (`goodput dashboard`'s page) is served on a free loopback port and its
URL printed, its token in it (--dashboard-port chooses the port, --no-dashboard serves none).

It is secured by default: each service logs in to NATS as its role, with a password made at first
start under DATA/secrets and kept; `goodput up` writes DATA/user.env, with which a user's client logs
in as `user` (`goodput submit` and `goodput status` read the default data folder's by themselves).
Anonymous clients are refused. --insecure turns authentication off, and says so at every start.

With `--teams FILE` the teams share the cluster (shared/teams.py): the file is checked against the
cluster, and the policy must honour teams, before anything starts; it is kept as DATA/teams.yaml
(the file in force, which a later start on DATA goes on with, and `goodput teams apply` changes) and
stored for the policy and the API; each team gets its own login, DATA/teams/TEAM.env. Without a
team file every job is the default team's.

The data folder is kept: started again on it, `goodput up` goes on with every job of the live run
(the start-up replay is not run again); --fresh starts from an empty store. One `goodput up` holds
a data folder at a time, and a taken port is refused before anything starts.

With `--executors real` the jobs are real: a node agent per node runs on this machine (--nodes,
each its own node of --slots CPU slots; one node of 4 by default: the `local` cluster), the example
jobs (or --jobs YAML files; none with `--jobs none`, `--workload none` or another --jobs-package) are
submitted, profiled on one slot through an agent, and trained on
the nodes as the scheduler allocates them — a job may span nodes, its workers finding each other
over loopback — each change of allocation printed; --once stops when every job has ended and
writes each job's outcome (time, restarts, batches, its metric, its placements) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import os
import shutil
import signal
import sys
from pathlib import Path

from shared import credentials
from shared.runner import EXECUTORS, executors_kind, positive_float
from shared.runtime import JOBS_PACKAGE
from shared.schema.jobs import CANCELLED
from shared.settings import DEFAULT_POLICY
from sim.workload import BUILT_IN_WORKLOAD

LOCK_FILE = "goodput-up.lock"  # held by the `goodput up` serving from a data folder
WATCH_JOBS = 8  # jobs named on one line of the live output
EXAMPLE_JOBS = sorted((Path(__file__).resolve().parent.parent / "examples" / "jobs").glob("*.yaml"))
ROUND_S = {"simulated": 60.0, "real": 10.0}


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="start NATS and the six services; replay a workload through them")
    up.add_argument(
        "--executors",
        type=executors_kind,
        choices=EXECUTORS,
        default="simulated",
        help="simulated jobs, or real ones on this machine's CPU slots (default: %(default)s)",
    )
    up.add_argument("--cluster", help="cluster preset or YAML/JSON file (default: sia-hetero-64; real: local)")
    up.add_argument(
        "--workload",
        default=str(BUILT_IN_WORKLOAD),
        help="workload CSV to replay (default: the built-in 40-job workload); 'none' to replay nothing",
    )
    up.add_argument(
        "--policy", default=DEFAULT_POLICY, help="policy, with options as NAME:KEY=VALUE (default: %(default)s)"
    )
    up.add_argument(
        "--teams",
        type=Path,
        help="team file (YAML): each team's guaranteed GPUs per type, borrowing and weight, and a login "
        "each (default: the one in force on --data, if any)",
    )
    up.add_argument("--reference", help="reference folder for the jobs' true behaviour (default: the model zoo)")
    up.add_argument("--port", type=int, default=4222, help="NATS port on 127.0.0.1 (default: %(default)s)")
    up.add_argument(
        "--metrics-port",
        type=int,
        help="serve each process's Prometheus metrics on 127.0.0.1, ports from this one on, listed in "
        "DATA/metrics.json, to a scrape with the bearer token in DATA/secrets/metrics-token (default: none)",
    )
    up.add_argument(
        "--data",
        help=f"JetStream data, secrets and service logs (default: {credentials.DEFAULT_DATA}; with --once out/replay)",
    )
    up.add_argument(
        "--insecure",
        action="store_true",
        help="no authentication: any local process may act as any service (for debugging only)",
    )
    up.add_argument(
        "--sync-always",
        action="store_true",
        help="fsync every JetStream write (default: every 2 minutes; a killed process loses nothing "
        "either way, a power cut up to that much)",
    )
    up.add_argument("--out", default="out/up.json", help="the replay's result JSON (default: %(default)s)")
    up.add_argument("--once", action="store_true", help="stop after the replay instead of serving until Ctrl-C")
    up.add_argument(
        "--dashboard-port",
        type=int,
        default=0,
        help="while serving: the live web dashboard's port on 127.0.0.1, its URL printed (default: 0, any free one)",
    )
    up.add_argument("--no-dashboard", action="store_true", help="while serving: no web dashboard")
    up.add_argument(
        "--fresh",
        action="store_true",
        help="start from an empty store: forget every job of the earlier starts on --data",
    )
    up.add_argument("--round", type=float, help="live: wall-clock seconds between rounds (default: 60; real: 10)")
    up.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="live: simulated seconds per wall-clock second, to watch long jobs: a round is then "
        "round x speed seconds of the simulated cluster (default: %(default)s)",
    )
    up.add_argument(
        "--policy-replicas",
        type=int,
        default=1,
        help="policy replicas: one leads, the others stand by (default: %(default)s)",
    )
    up.add_argument("--estimator-replicas", type=int, default=1, help="estimator replicas (default: %(default)s)")
    up.add_argument(
        "--api-replicas", type=int, default=1, help="user API replicas, one queue group (default: %(default)s)"
    )
    up.add_argument(
        "--jobs",
        nargs="+",
        help="real: job YAML files to submit at start, or 'none' (default: the example jobs, unless "
        "--workload none or another --jobs-package)",
    )
    up.add_argument(
        "--jobs-package",
        default=JOBS_PACKAGE,
        help="real: the package whose modules jobs may run (default: %(default)s)",
    )
    up.add_argument(
        "--slot-memory", type=positive_float, help="real: one slot's memory in MB, as a GPU's (default: unlimited)"
    )
    up.add_argument(
        "--box",
        choices=("runc", "off"),
        default="runc",
        help="real: each job in a box of its own (runc: its own user, cgroup and namespaces; needs root), or "
        "'off': every job's code as you, in no box, only for code you trust (default: %(default)s)",
    )
    up.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="real: node agents to run on this machine, each its own node of CPU slots (default: %(default)s)",
    )
    up.add_argument(
        "--slots",
        type=int,
        help="real: CPU slots per node (default: 4 on one node; on more, this "
        "machine's cores shared out, 1 to 4 each: a slot is a core)",
    )
    up.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    from launcher.nats import port_in_use
    from shared.files import private_files

    real = args.executors == "real"
    if args.nodes < 1 or (args.slots is not None and args.slots < 1):
        raise ValueError("--nodes and --slots must be at least 1")
    if not real and (args.nodes != 1 or args.slots is not None):
        raise ValueError("--nodes and --slots are for real jobs (--executors real)")
    if real and args.cluster and (args.nodes != 1 or args.slots is not None):
        raise ValueError("--cluster names the nodes to run agents for: it takes no --nodes or --slots")
    args.round = args.round or ROUND_S[args.executors]
    if args.round <= 0 or args.speed <= 0 or min(args.policy_replicas, args.estimator_replicas, args.api_replicas) < 1:
        raise ValueError("--round and --speed must be positive, replica counts at least 1")
    if real and args.speed != 1:
        raise ValueError("real jobs run in real time: --speed must be 1 with --executors real")
    if real and args.once and not start_jobs(args.jobs, args.workload, args.jobs_package):
        raise ValueError("--once waits for the jobs submitted at start, and there are none: name them with --jobs")
    _check_dashboard_port(args)
    if real:
        _check_boxes(args)
    data = Path(args.data or ("out/replay" if args.once and not real else credentials.DEFAULT_DATA))
    if not data.exists() and port_in_use(args.port):  # refused before a new folder is made
        raise ValueError(_port_taken(args.port))
    data.parent.mkdir(parents=True, exist_ok=True)  # the folders above DATA are made as before
    with private_files():  # what this process and its children write: logs, work, checkpoints
        return _up_on(args, data, real)


def prepare(data: Path, fresh: bool) -> None:
    """DATA's folders before the stack starts: with `fresh`, the explicit wipe (an empty cluster, real
    jobs from scratch). DATA stays its owner's alone: a job sees its own folders in its box, not DATA."""
    if fresh:
        for folder in ("jetstream", "work"):
            shutil.rmtree(data / folder, ignore_errors=True)


def _up_on(args: argparse.Namespace, data: Path, real: bool) -> int:
    """`goodput up` on its data folder, made private with what an earlier version left there."""
    from launcher.nats import embedded_nats, port_in_use, stop_orphan_server
    from shared.files import make_private

    make_private(data)
    local = real and not args.cluster  # this machine's nodes: their spec is written in DATA/work
    args.cluster = args.cluster or (_local_cluster(data, args.nodes, args.slots) if real else "sia-hetero-64")
    teams = _teams_in_force(args, data)  # refused here, before anything starts
    with _holding(data):
        orphan = stop_orphan_server(data)
        if orphan is not None:
            print(f"stopped the NATS server (pid {orphan}) that a killed goodput up left serving {data}", flush=True)
        if port_in_use(args.port):
            raise ValueError(_port_taken(args.port))
        prepare(data, args.fresh)
        if local and args.fresh:  # the wipe took its spec with it
            _local_cluster(data, args.nodes, args.slots)
        resumed = (data / "jetstream").is_dir()
        if args.insecure:
            print(
                "WARNING: --insecure: NATS runs without authentication; any process that reaches "
                f"127.0.0.1:{args.port} may act as any service (submit, place, delete every stream)",
                flush=True,
            )
        _keep_teams(args, data, teams)
        try:
            with embedded_nats(data, args.port, secure=not args.insecure, sync_always=args.sync_always) as nats:
                asyncio.run(_serve(args, nats, data, resumed, teams))
        except KeyboardInterrupt:  # Ctrl-C while NATS was starting: nothing was running yet
            pass
    print("goodput is down")
    return 0


def _teams_in_force(args: argparse.Namespace, data: Path):
    """The team file this start goes on with (--teams FILE, else the one in force on DATA, else
    None), checked against the cluster; ValueError, before anything starts, for an invalid one, a
    policy that cannot honour teams, or a team whose login would take another login's name."""
    from launcher.nats import SECRETS, TEAM_FILE, Access
    from launcher.setup import checked_teams, refuse_policy_without_teams

    path = args.teams or (data / TEAM_FILE if (data / TEAM_FILE).is_file() else None)
    if path is None:
        return None
    teams = checked_teams(str(path), args.cluster)
    try:
        refuse_policy_without_teams(args.policy, teams, args.cluster)
    except ValueError as error:
        raise ValueError(f"{error} (the teams: {path})") from None
    if not args.insecure and (data / SECRETS).is_dir():
        problems = Access(data / SECRETS).team_login_problems(teams.teams)
        if problems:
            raise ValueError("; ".join(problems))
    return teams


def _keep_teams(args: argparse.Namespace, data: Path, teams) -> None:
    """Record the cluster for `goodput teams apply`; keep the team file given as the one in force,
    and give each team its own login (made the first time; with this start's URL)."""
    from cli.teams import record_cluster
    from launcher.nats import SECRETS, TEAM_FILE, Access
    from shared.permissions import write_private

    record_cluster(data, args.cluster)
    if teams is None:
        return
    if args.teams is not None:
        write_private(data / TEAM_FILE, args.teams.read_text())
    if not args.insecure:
        Access.kept_in(data / SECRETS).add_team_logins(teams.teams, f"nats://127.0.0.1:{args.port}")


def _port_taken(port: int) -> str:
    return f"port {port} on 127.0.0.1 is taken (another goodput up, or another server?); choose another with --port"


def _local_cluster(data: Path, nodes: int, slots: int | None) -> str:
    """The cluster of `--nodes` agents on this machine: the `local` preset (one node of 4 slots), or
    a file of N nodes named cpu-0, cpu-1, ... of `slots` each (by default the cores shared out)."""
    slots = slots or (4 if nodes == 1 else max(1, min(4, (os.cpu_count() or 1) // nodes)))
    if (nodes, slots) == (1, 4):
        return "local"
    path = data / "work" / f"local-{nodes}x{slots}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"name: local-{nodes}x{slots}\nnodes:\n  - {{gpu_type: cpu, count: {nodes}, gpus_per_node: {slots}}}\n"
    )
    return str(path)


@contextlib.contextmanager
def _holding(data: Path):
    """Hold the data folder for this `goodput up`; ValueError if another one holds it."""
    import fcntl

    lock = (data / LOCK_FILE).open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise ValueError(
            f"data folder {data} is in use by another `goodput up` (pid {holder}); stop it, or choose another --data"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    try:
        yield
    finally:
        lock.close()


async def _serve(args: argparse.Namespace, nats, data: Path, resumed: bool, teams) -> None:
    """Start the services, replay, serve; Ctrl-C (or SIGTERM) at any moment stops everything."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await _stack(args, nats, data, resumed, teams)
    except asyncio.CancelledError:
        print("stopping goodput ...", flush=True)


async def _stack(args: argparse.Namespace, nats, data: Path, resumed: bool, teams) -> None:
    from launcher.live_run import describe, live_request
    from launcher.replay import replay_workload
    from launcher.stack import (
        METRICS_FILE,
        ensure_run,
        live_run_exists,
        local_node_arguments,
        local_service_arguments,
        records_once_ended,
        running_services,
        service_arguments,
    )
    from shared.settings import FEEDBACK_ITERATIONS
    from shared.subjects import LIVE_RUN

    real = args.executors == "real"
    if real:
        # Jobs report what they measured twice a round: the estimator learns a new allocation in one.
        arguments = local_service_arguments(
            args.cluster, data / "work", args.round / 2, args.slot_memory, args.jobs_package
        )
        agents = local_node_arguments(args.cluster, data / "work", args.jobs_package, args.box, args.slot_memory)
        specs = [_job(path) for path in start_jobs(args.jobs, args.workload, args.jobs_package)]  # refused here
    else:
        agents = {}
        arguments = service_arguments(
            args.cluster, args.reference, args.reference is None, None, FEEDBACK_ITERATIONS, None
        )
    # Real jobs are short: the policy re-decides every round.
    live = live_request(
        LIVE_RUN, args.policy, args.cluster, args.round, args.speed, {"round_s": args.round} if real else None
    )
    replicas = {"policy": args.policy_replicas, "estimator": args.estimator_replicas, "api": args.api_replicas}
    # The team file is stored before the services start (None: none stored), so every round has it.
    with running_services(
        nats, arguments, data, replicas, agents=agents, teams=teams, metrics_port=args.metrics_port
    ) as stack:
        bus = await nats.connect("goodput-up")
        supervising = None
        try:
            await stack.wait_ready(bus)
            user_env = credentials.write_user_env(data, nats.url, nats.access and nats.access.password_file("user"))
            print(
                f"goodput is up: NATS at {nats.url} (JetStream data in {data}"
                f"{', kept from the last start: --fresh starts empty' if resumed else ''}"
                f"{'; NO AUTHENTICATION (--insecure)' if nats.access is None else ''})"
            )
            for name, process in stack.processes.items():
                print(f"  {name:<11} pid {process.pid:<7} log {data / (name + '.log')}")
            if stack.metrics:
                print(
                    f"  metrics: each process's Prometheus endpoint is in {data / METRICS_FILE}; a scrape sends "
                    f"the bearer token in {stack.metrics_token} (Authorization: Bearer)"
                )
            if real:
                print(
                    "  jobs: each in a box of its own (runc: its own user, cgroup, namespaces)"
                    if args.box == "runc"
                    else f"  jobs: in NO box (--box off): every job's code runs as {getpass.getuser()}, unconfined",
                    flush=True,
                )
            # A node agent that dies is started again, as a node's own supervisor would; a service is told of.
            supervising = asyncio.ensure_future(
                stack.supervise(lambda name: name in agents, lambda line: print(f"  {line}", flush=True))
            )
            if not real and args.workload != "none" and (args.once or not resumed):
                if resumed and await live_run_exists(bus):
                    raise ValueError(
                        f"{data} holds a live run, which the policy leader serves before any replay: "
                        "replay on another --data, or start it empty with --fresh"
                    )
                await replay_workload(
                    bus,
                    stack,
                    args.workload,
                    args.cluster,
                    live.policy,
                    dict(live.policy_options),
                    args.reference,
                    args.out,
                )
            if real or not args.once:
                existing = await ensure_run(bus, live)
                if existing is not None and (existing.policy, existing.policy_options, existing.round_s) != (
                    live.policy,
                    live.policy_options,
                    live.round_s,
                ):
                    print(f"the live run goes on as it was created ({describe(existing)}), not with {describe(live)}")
                running = existing or live
                print(_how_to_connect(data, user_env))
                if teams is not None:
                    print(_teams_line(data, teams, nats.access))
                dashboard = await _start_dashboard(args, nats.url, user_env)
                print(
                    f"serving: {'resumed with its jobs; ' if existing else ''}submitted jobs are scheduled live with "
                    f"{describe(running)}; Ctrl-C stops everything",
                    flush=True,
                )
                watch = asyncio.ensure_future(_watch(bus, LIVE_RUN))
                try:
                    if real:
                        await _submit_local(bus, specs)
                    if real and args.once:
                        ended = await records_once_ended(bus, [spec.id for spec in specs], args.round)
                        _report_local(args, list(ended.values()))
                    else:
                        await asyncio.Event().wait()  # until Ctrl-C
                finally:
                    watch.cancel()
                    if dashboard is not None:
                        await dashboard.aclose()
        finally:
            if supervising is not None:
                supervising.cancel()
            await bus.close()


def _how_to_connect(data: Path, user_env: Path) -> str:
    """How a user reaches this stack: its commands find the default data folder's user.env."""
    found = "" if data.resolve() == credentials.DEFAULT_DATA.resolve() else f"set -a; . {user_env}; set +a; then "
    return (
        f"as a user ({user_env} holds the URL and login; other clients: its user, password file and "
        f"inbox prefix): {found}`goodput submit JOB.yaml`, `goodput status`"
    )


def _check_dashboard_port(args: argparse.Namespace) -> None:
    """A --dashboard-port that cannot be had is refused before anything starts."""
    from launcher.nats import port_in_use

    port = args.dashboard_port
    if not 0 <= port <= 65535:
        raise ValueError(f"--dashboard-port {port}: a port is 0 (any free one) to 65535")
    if port and not args.no_dashboard and not args.once and port_in_use(port):
        raise ValueError(
            f"--dashboard-port {port}: port {port} on 127.0.0.1 is taken; choose another (0: any free one)"
        )


async def _start_dashboard(args: argparse.Namespace, url: str, user_env: Path):
    """The web dashboard while serving (`goodput dashboard`'s), logged in with DATA/user.env's login:
    what stops it, or None when not asked for; one that cannot start is said, and the stack serves on."""
    if args.no_dashboard or args.once:
        return None
    from cli.dashboard import start
    from dashboard.serve import listen

    environ = credentials.read_env(user_env)
    try:
        sock = listen("127.0.0.1", args.dashboard_port)
        try:
            page, running = await start(url, credentials.connect_options(credentials.from_env(environ), environ), sock)
        except BaseException:
            sock.close()
            raise
    except ValueError as error:
        print(f"dashboard: not served ({error})", flush=True)
        return None
    print(f"dashboard: {page} (the jobs {user_env}'s login sees; whoever has this URL gets in)", flush=True)
    return running


def _teams_line(data: Path, teams, access) -> str:
    """The teams in force, and where each team's login is."""
    from launcher.nats import TEAM_FILE

    logins = (
        "; each team's login: "
        + ", ".join(f"{team} {access.teams_folder / (team + '.env')}" for team in teams.teams)
        + f" (export {credentials.LOGIN_ENV}=FILE)"
        if access is not None
        else " (no logins: --insecure)"
    )
    return f"teams ({data / TEAM_FILE}, `goodput teams apply FILE` changes them): {', '.join(teams.teams)}{logins}"


def _job(path: str):
    from cli.submit import load_job

    spec = load_job(path)
    if spec.submit_s is not None:
        raise ValueError(f"{path}: a live job has no submit_s")
    return spec


def start_jobs(jobs: list[str] | None, workload: str | None, jobs_package: str) -> list[str]:
    """The job files real executors start with: those named (`none`: none); else the example jobs,
    the start-up workload of real executors, unless no workload is asked for (`--workload none`) or
    the jobs come from another package (which the examples are not modules of)."""
    if jobs is not None:
        if "none" in jobs and len(jobs) > 1:
            raise ValueError("--jobs none submits nothing: it takes no job files beside it")
        return [] if jobs == ["none"] else jobs
    return [] if workload == "none" or jobs_package != JOBS_PACKAGE else [str(p) for p in EXAMPLE_JOBS]


async def _submit_local(bus, specs) -> None:
    """Submit the jobs; one the executors know already (a restart on the same --data) is not
    submitted again: its state is printed."""
    import nats.errors

    from shared import subjects
    from shared.schema.api import job_statuses
    from shared.schema.jobs import submission_msg_id
    from shared.schema.records import JobRecords, JobsQuery
    from shared.text import printable

    for _ in range(300):  # the executor answers ping a moment before its endpoints
        try:
            records = await bus.request(subjects.RECORDS, JobsQuery(), JobRecords, timeout=30)
            break
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.1)
    else:
        raise RuntimeError("the executor service does not answer goodput.executor.records")
    known = {status.id: status for status in job_statuses(records.jobs)}
    for spec in specs:
        status = known.get(spec.id)
        if status is not None:
            print(
                printable(
                    f"  {spec.id} ({spec.application}): submitted before, {status.state}"
                    f"{': ' + status.reason if status.reason else ''}"  # a crash's reason: its stderr
                ),
                flush=True,
            )
            continue
        await bus.js_publish(
            subjects.stored(subjects.DEFAULT_TEAM, subjects.OPERATOR), spec, msg_id=submission_msg_id(spec)
        )
        print(f"  submitted {spec.id} ({spec.application}): profiling it on one slot", flush=True)


def _report_local(args: argparse.Namespace, records) -> None:
    from cli.output import rounded, write_results
    from shared.text import printable

    jobs = [
        {
            "name": r.name,
            "application": r.application,
            "submit_s": r.submit_s,
            "finish_s": r.finish_s,
            "jct_s": None if r.finish_s is None else r.finish_s - r.submit_s,
            "restarts": r.restarts,
            "gpu_seconds": r.gpu_seconds,
            "batches": list(r.batches),
            "metric": r.metric,
            "failure": r.failure,
            # where its workers ran, from when: each placement a list of [node, GPUs]
            "placements": [{"at_s": p.at_s, "nodes": [list(spot) for spot in p.spots]} for p in r.placements],
        }
        for r in records
    ]
    lines = [f"{len(jobs)} real jobs with {args.policy} on {args.cluster}:"]
    for job in jobs:
        outcome = (
            f"finished in {job['jct_s']:.0f} s, metric {job['metric']:.3f}"
            if job["failure"] is None
            else f"failed: {job['failure']}"
        )
        nodes = sorted({node for p in job["placements"] for node, _ in p["nodes"]})
        lines.append(
            f"  {job['name']:<14} {outcome}; restarts {job['restarts']}, "
            f"batches {job['batches']}, slot-seconds {job['gpu_seconds']:.0f}, on {', '.join(nodes) or 'no node'}"
        )
    write_results(
        rounded({"executors": "real", "cluster": args.cluster, "policy": args.policy, "jobs": jobs}, 4),
        args.out,
        "\n".join(map(printable, lines)),  # a failure is the job's stderr; the file keeps it exact
    )


async def _watch(bus, run_id: str) -> None:
    """Print each live decision that changes something (from now on: a resumed run's past is in
    `goodput status`), and each job that finishes or fails."""
    from launcher.stack import follow_run_steps
    from shared.text import printable

    shown = None
    async for step in follow_run_steps(bus, run_id, idle_timeout_s=None, new_only=True):
        if step.record is not None and (step.record.active, step.record.gpus) != shown:
            shown = (step.record.active, step.record.gpus)
            running = sorted(step.record.gpus.items())
            listed = "; ".join(_running(job, gpus, step.record) for job, gpus in running[:WATCH_JOBS])
            more = f" and {len(running) - WATCH_JOBS} more" if len(running) > WATCH_JOBS else ""
            print(
                f"  t={step.now_s:>8.0f} s  {step.record.active} active, {step.record.running} running"
                f"{': ' + listed + more if running else ''}",
                flush=True,
            )
        if step.finished:
            names = ", ".join(step.finished[:WATCH_JOBS])
            more = f" and {len(step.finished) - WATCH_JOBS} more" if len(step.finished) > WATCH_JOBS else ""
            print(f"  t={step.now_s:>8.0f} s  finished: {names}{more}", flush=True)
        for event in step.events:
            if " failed: " in event or event.endswith(f" was {CANCELLED}"):
                print(f"  {printable(event)}", flush=True)  # a failure quotes the job's stderr


def _check_boxes(args: argparse.Namespace) -> None:
    """Real jobs only where the node agents can box each one, or --box off said in so many words:
    refused before anything starts, with the reason and the fix."""
    from services.node.agent import box_problem

    problem, _ = box_problem(args.box, sys.executable, args.jobs_package)
    if problem:
        raise ValueError(f"real jobs cannot run here: {problem}")


def _running(job: str, gpus: int, record) -> str:
    """`job 2 x A100 (planned batch 512)`, `job 8 x A100 on 2 nodes`: a running job on a live round's
    line, with the batch the policy planned (a real job's workers report theirs: `goodput status`)."""
    from shared.hardware import hardware_name

    kind = record.types.get(job)
    batch = record.batches.get(job)
    nodes = record.nodes.get(job)
    return (
        (f"{job} {gpus} x {hardware_name(kind)}" if kind else f"{job} {gpus} GPU{'s' * (gpus > 1)}")
        + (f" on {nodes} nodes" if nodes else "")
        + (f" (planned batch {batch})" if batch else "")
    )
