"""The embedded stack: the six services as child processes of this one, on one NATS server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import EllipsisType

import nats.errors

from launcher.nats import SECRETS, EmbeddedNats, port_in_use
from launcher.setup import provision_now
from shared import storage, subjects
from shared.bus import Bus
from shared.bus.kv import RevisionConflict
from shared.cluster import load_cluster, real_nodes
from shared.credentials import ENV_PREFIX as CREDENTIALS_ENV_PREFIX
from shared.metrics import TOKEN_FILE_ENV, MetricsUnavailable, read_token
from shared.runner import METRICS_PORT_ENV, PARENT_ENV, ended_with_this_process
from shared.schema.base import Ack
from shared.schema.records import JobRecord, JobRecords
from shared.schema.runs import PolicyStatus, RunCheckpoint, RunReport, RunRequest, RunStep
from shared.schema.teams import TeamFile

SERVICES = ("api", "profiler", "estimator", "policy", "placer", "executor")
NODE_PREFIX = "node-"  # a node agent's instance name: node-<its node>
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
WATCH_EVERY_S = 1.0  # how often `Stack.supervise` looks at its processes
QUICK_EXIT_S = 30.0  # an instance that exits this soon after its start ...
QUICK_EXITS = 3  # ... this many times in a row is not started again
RUN_IDLE_TIMEOUT_S = 600.0  # no round logged for this long: the run is stuck
METRICS_FILE = "metrics.json"  # beside the logs: each process's Prometheus endpoint, {instance: URL}
METRICS_HOST = "127.0.0.1"  # the stack's metrics endpoints, like its NATS server, are loopback only
METRICS_TOKEN = "metrics-token"  # under the data folder's secrets: the bearer token every metrics endpoint asks
LAST_PORT = 65535


class Stack:
    """Service processes by instance name: a service's first replica is named after it, the others
    `<service>-2`, `<service>-3` …"""

    def __init__(
        self, commands: Mapping[str, list[str]], logs: Path, environments: Mapping[str, Mapping[str, str]] | None = None
    ):
        self.commands = dict(commands)
        self.logs = logs
        self.environments = dict(environments or {})  # instance -> its environment (None: ours)
        self.processes: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}  # instance -> when it was last started (monotonic)
        self.stopping = False
        self.metrics: dict[str, str] = {}  # instance -> its metrics endpoint's URL (none without a port)
        self.metrics_token: Path | None = None  # the file of the token their scrapes send (with a port)

    def start(self, name: str) -> None:
        """Start (or start again) one service instance; its log is appended to."""
        self.started[name] = time.monotonic()
        with open(self.logs / f"{name}.log", "ab") as log:
            # A session of its own: Ctrl-C in a terminal reaches the driver only, which stops the
            # services before the NATS server they need to stop cleanly.
            self.processes[name] = subprocess.Popen(
                self.commands[name],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.environments.get(name),
                preexec_fn=ended_with_this_process(),  # its parent killed -9: it stops (as it does polling)
            )

    def kill(self, name: str) -> None:
        """kill -9: the service gets no chance to clean up."""
        self.processes[name].kill()
        self.processes[name].wait()

    async def policy_leader(self, bus: Bus) -> str:
        """The policy instance holding the lease now (holders are named `<host>-<pid>`)."""
        holder = (await bus.request(subjects.POLICY_STATUS, Ack(), PolicyStatus, timeout=10)).leader
        pid = int(holder.rsplit("-", 1)[1]) if holder else None
        leader = next((name for name, process in self.processes.items() if process.pid == pid), None)
        if leader is None:
            raise RuntimeError(f"no policy instance of this stack leads (the lease holder is {holder!r})")
        return leader

    async def wait_ready(self, bus: Bus, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until every instance answers the NATS service API's ping; a clear error if one died."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        waiting = {service_of(name) for name in self.processes}
        while waiting:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"service {name} exited with {process.returncode}:\n" + self.log(name))
            for service in sorted(waiting):
                instances = sum(service_of(name) == service for name in self.processes)
                if await _pings(bus, service) >= instances:
                    waiting.discard(service)
            if waiting and asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"services {sorted(waiting)} did not answer ping within {timeout_s:.0f} s")
            if waiting:
                await asyncio.sleep(0.1)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-4000:]

    async def supervise(self, restart: Callable[[str], bool], say: Callable[[str], None]) -> None:
        """Until cancelled (or the stack stops): each instance that exits unasked is told of
        (`say`, one line), and started again if `restart(name)` — unless it exited within
        QUICK_EXIT_S of its start QUICK_EXITS times in a row (it would only fail again)."""
        quick: dict[str, int] = {}
        told: set[tuple[str, int]] = set()
        while not self.stopping:
            for name, process in list(self.processes.items()):
                code = process.poll()
                if code is None or self.stopping or (name, process.pid) in told:
                    continue
                told.add((name, process.pid))
                quick[name] = quick.get(name, 0) + 1 if time.monotonic() - self.started[name] < QUICK_EXIT_S else 0
                what = f"{name} (pid {process.pid}) exited: {exit_status(code)}; its log: {self.logs / (name + '.log')}"
                if not restart(name):
                    say(f"{what}; not restarted")
                elif quick[name] >= QUICK_EXITS:
                    say(
                        f"{what}; it exited within {QUICK_EXIT_S:.0f} s of its start {quick[name]} times in a "
                        "row: not restarted again"
                    )
                else:
                    self.start(name)
                    say(f"{what}; restarted (pid {self.processes[name].pid})")
            await asyncio.sleep(WATCH_EVERY_S)

    def stop(self) -> None:
        self.stopping = True
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def exit_status(code: int) -> str:
    """`exit code 1`, `killed by SIGKILL`: how a process ended, as its returncode says."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def service_of(instance: str) -> str:
    """`policy-2` -> `policy`; a node agent `node-<name>` -> `node` (the micro service it answers as)."""
    return subjects.NODE_SERVICE if instance.startswith(NODE_PREFIX) else instance.split("-")[0]


def instance_names(service: str, replicas: int) -> list[str]:
    return [service] + [f"{service}-{i}" for i in range(2, replicas + 1)]


def metrics_ports(instances: Sequence[str], first: int) -> dict[str, int]:
    """Each instance's metrics port, `first` on in their order. ValueError, before any of them
    starts, when the range leaves the ports or a port of it is taken (saying which, and whose)."""
    last = first + len(instances) - 1
    wanted = f"its {len(instances)} processes take ports {first}-{last}"
    if first < 1 or last > LAST_PORT:
        raise ValueError(f"--metrics-port {first}: {wanted}, and ports run from 1 to {LAST_PORT}")
    ports = {name: first + i for i, name in enumerate(instances)}
    taken = [f"{port} (for {name})" for name, port in ports.items() if port_in_use(port)]
    if taken:
        raise ValueError(
            f"--metrics-port {first}: {wanted}, and {', '.join(taken)} on {METRICS_HOST} "
            f"{'is' if len(taken) == 1 else 'are'} taken; choose a free range with --metrics-port"
        )
    return ports


def metrics_url(port: int) -> str:
    return f"http://{METRICS_HOST}:{port}/metrics"


def metrics_token(folder: Path) -> Path:
    """The file of the operator's metrics token in `folder` (the data folder's secrets, 0700): made
    there (0600, a random 256-bit token) the first time, then kept; ValueError, saying why, when it
    cannot be made or read, before any service starts (none serves its metrics without it)."""
    from shared.permissions import write_private

    path = folder / METRICS_TOKEN
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists():
            write_private(path, secrets.token_urlsafe(32) + "\n")
        read_token(path)
    except MetricsUnavailable as error:
        raise ValueError(f"the metrics endpoints are not served: {error}") from None
    except OSError as error:
        raise ValueError(f"the metrics token file {path} cannot be made: {error.strerror or error}") from None
    return path


async def _pings(bus: Bus, service: str, wait_s: float = 0.25) -> int:
    """How many instances of `service` answer the service API's ping within `wait_s`."""
    inbox = bus.nc.new_inbox()
    subscription = await bus.nc.subscribe(inbox)
    try:
        await bus.nc.publish(f"$SRV.PING.{service}", b"", reply=inbox)
        answers = 0
        with contextlib.suppress(nats.errors.TimeoutError):
            while True:
                answers += bool((await subscription.next_msg(timeout=wait_s)).data)  # not "no responders"
        return answers
    finally:
        await subscription.unsubscribe()


def module_of(service: str, arguments: Sequence[str]) -> str:
    """The module a service runs as: `services.<name>`, but the executors of a simulated cluster
    (whose arguments do not ask for `--executors real`) are `services.simulated`."""
    if service == "executor" and "--executors" not in arguments:
        return "services.simulated"
    return f"services.{service}"


@contextmanager
def running_services(
    server: str | EmbeddedNats,
    arguments: Mapping[str, Sequence[str]],
    logs: Path,
    replicas: Mapping[str, int] | None = None,
    lease_ttl_s: float = storage.LEASE_TTL_S,
    agents: Mapping[str, Sequence[str]] | None = None,
    teams: TeamFile | None | EllipsisType = ...,
    metrics_port: int | None = None,
) -> Iterator[Stack]:
    """Set up the storage (as the operator) and store `teams` (launcher.setup.provision: None, no
    teams; left out, the stored team file as it is), then start `python -m services.<name> --server
    URL <arguments>` for each service, `replicas[name]` times (once by default), and each node agent
    of `agents` (instance -> its `services.node` options), each logged in as its role on a
    secured embedded server; stop them all after. With `metrics_port`, each process serves its
    metrics on a port of its own from it on (`metrics_ports`: a taken one is refused before any
    starts), listed in `logs`/metrics.json and `Stack.metrics`, for the bearer of the token in
    `logs`/secrets/metrics-token (`metrics_token`, `Stack.metrics_token`)."""
    nats = server if isinstance(server, EmbeddedNats) else EmbeddedNats(server, None)
    # Whatever credentials this process holds are not the services' (each has its role's), nor is
    # a metrics port one for all (each has its own, or none).
    inherited = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(CREDENTIALS_ENV_PREFIX) and key not in (METRICS_PORT_ENV, TOKEN_FILE_ENV)
    }
    instances = {
        instance: name for name in SERVICES for instance in instance_names(name, (replicas or {}).get(name, 1))
    }
    commands = {
        instance: [
            sys.executable,
            "-m",
            module_of(name, arguments.get(name, ())),
            "--server",
            nats.url,
            *arguments.get(name, ()),
        ]
        for instance, name in instances.items()
    }
    commands.update(
        {
            instance: [sys.executable, "-m", "services.node", "--server", nats.url, *options]
            for instance, options in (agents or {}).items()
        }
    )
    roles = {**instances, **{instance: "executor" for instance in agents or {}}}  # agents log in as executors
    ports = metrics_ports(list(commands), metrics_port) if metrics_port is not None else {}
    token = metrics_token(logs / SECRETS).resolve() if ports else None
    for instance, port in ports.items():
        commands[instance] += ["--metrics-port", str(port), "--metrics-host", METRICS_HOST]
        commands[instance] += ["--metrics-token-file", str(token)]
    provision_now(nats.url, lease_ttl_s, teams, **nats.options("operator"))
    # Each stops when this process is gone, killed -9 included: no service outlives its stack.
    stack = Stack(
        commands,
        logs,
        {instance: {**inherited, **nats.env(role), PARENT_ENV: str(os.getpid())} for instance, role in roles.items()},
    )
    stack.metrics = {instance: metrics_url(port) for instance, port in ports.items()}
    stack.metrics_token = token
    metrics_file = logs / METRICS_FILE
    if ports:
        metrics_file.write_text(json.dumps(stack.metrics, indent=2) + "\n")
    else:  # an earlier start's endpoints are not this one's
        metrics_file.unlink(missing_ok=True)
    try:
        for instance in stack.commands:
            (logs / f"{instance}.log").unlink(missing_ok=True)
            stack.start(instance)
        yield stack
    finally:
        stack.stop()


def service_arguments(
    cluster: str,
    reference: str | None,
    use_zoo: bool,
    calibration: str | None,
    feedback_iterations: int,
    restart_delay_s: float | None,
    interference: float = 0.0,
    profile_request: bool = False,
) -> dict[str, list[str]]:
    """Each service's options for a simulated cluster (its jobs' truth, its calibration)."""
    truth = (["--reference", reference] if reference else []) + (["--zoo"] if use_zoo else [])
    calib = ["--calibration", calibration] if calibration else []
    delay = ["--restart-delay", str(restart_delay_s)] if restart_delay_s is not None else []
    profiled = ["--profile-request"] if profile_request else []
    return {
        "api": ["--cluster", cluster, *truth],
        "profiler": ["--cluster", cluster, *truth],
        "estimator": ["--cluster", cluster, *calib],
        "policy": ["--cluster", cluster],
        "placer": ["--cluster", cluster],
        "executor": [
            "--cluster",
            cluster,
            *truth,
            *calib,
            "--feedback-iterations",
            str(feedback_iterations),
            *delay,
            *profiled,
            "--interference",
            str(interference),
        ],
    }


def local_service_arguments(
    cluster: str,
    workdir: Path,
    report_every_s: float,
    slot_memory_mb: float | None = None,
    jobs_package: str | None = None,
    checkpoints: str | None = None,
) -> dict[str, list[str]]:
    """Each service's options for real jobs on this machine (`--executors real`): the executor
    drives node agents (`local_node_arguments`), whose nodes must be the cluster's; `checkpoints`
    (default: a folder under `workdir`) as the executor's --checkpoints."""
    memory = ["--slot-memory", str(slot_memory_mb)] if slot_memory_mb is not None else []
    package = ["--jobs-package", jobs_package] if jobs_package else []
    return {
        "api": ["--cluster", cluster, "--executors", "real"],
        "profiler": ["--cluster", cluster, "--executors", "real", *memory],
        "estimator": ["--cluster", cluster],
        "policy": ["--cluster", cluster],
        "placer": ["--cluster", cluster],
        "executor": [
            "--cluster",
            cluster,
            "--executors",
            "real",
            "--checkpoints",
            checkpoints or str(workdir / "checkpoints"),
            "--report-every",
            str(report_every_s),
            *package,
        ],
    }


def local_node_arguments(
    cluster: str,
    workdir: Path,
    jobs_package: str | None = None,
    box: str = "runc",
    slot_memory: float | None = None,
) -> dict[str, list[str]]:
    """One node agent per machine of the cluster, on this one: `node-<name>` -> its options (each its
    own CPU slots, work folder and process tree; the checkpoints folder is the executor's), each job
    in a box (`box`: runc, or off) of `slot_memory` MB a slot (None: the machine's shared by slots)."""
    package = ["--jobs-package", jobs_package] if jobs_package else []
    package += ["--box", box, *(("--slot-memory", f"{slot_memory:g}") if slot_memory else ())]
    return {
        f"{NODE_PREFIX}{name}": [
            "--node",
            name,
            "--gpus",
            str(node.gpus),
            "--gpu-type",
            node.gpu_type,
            "--workdir",
            str(workdir / f"node-{name}"),
            *package,
        ]
        for name, node in real_nodes(load_cluster(cluster)).items()
    }


async def create_run(bus: Bus, request: RunRequest) -> None:
    """Hand a run to the policy leader: its first checkpoint, in KV."""
    runs = await storage.open_kv(bus, subjects.RUNS_BUCKET, RunCheckpoint)
    await runs.create(request.run_id, RunCheckpoint(request))


async def live_run_exists(bus: Bus) -> bool:
    """Whether the stack has a live run (which never ends: a leader serving it leads nothing else)."""
    return await (await storage.open_kv(bus, subjects.RUNS_BUCKET, RunCheckpoint)).get(subjects.LIVE_RUN) is not None


async def ensure_run(bus: Bus, request: RunRequest) -> RunRequest | None:
    """Create the run unless one of its id exists already: None once created, else the request the
    existing run was created with (which it keeps: a live run goes on with its jobs)."""
    try:
        await create_run(bus, request)
        return None
    except RevisionConflict:
        entry = await (await storage.open_kv(bus, subjects.RUNS_BUCKET, RunCheckpoint)).get(request.run_id)
        return entry.value.request


async def records_once_ended(
    bus: Bus, job_ids: Sequence[str], poll_s: float = 0.5, timeout_s: float | None = None
) -> dict[str, JobRecord]:
    """The executors' records once every one of these jobs has finished or failed (asked every
    `poll_s`; an executor restarting meanwhile is asked again). TimeoutError past `timeout_s`."""
    deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
    records: dict[str, JobRecord] = {}
    while True:
        with contextlib.suppress(nats.errors.NoRespondersError, nats.errors.TimeoutError):
            records = {r.name: r for r in (await bus.request(subjects.RECORDS, Ack(), JobRecords, timeout=30)).jobs}
        if all(job in records and _ended(records[job]) for job in job_ids):
            return {job: records[job] for job in job_ids}
        if deadline is not None and asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"jobs not ended after {timeout_s:.0f} s: {records}")
        await asyncio.sleep(poll_s)


def _ended(record: JobRecord) -> bool:
    """Whether the job finished or ended without finishing (a failure; a job not ended has none: what
    it waits for is its `reason`)."""
    return record.finish_s is not None or bool(record.failure)


async def follow_run_steps(
    bus: Bus, run_id: str, idle_timeout_s: float | None = RUN_IDLE_TIMEOUT_S, new_only: bool = False
) -> AsyncIterator[RunStep]:
    """A run's steps as the leader logs them, from the first (`new_only`: from now on); a round
    repeated by a new leader once. `idle_timeout_s` None: wait for ever (a live run may idle)."""
    last = -1
    async for step in bus.follow(subjects.run_log(run_id), RunStep, idle_timeout=idle_timeout_s, new_only=new_only):
        if step.round > last:
            last = step.round
            yield step


async def follow_run(
    bus: Bus,
    run_id: str,
    progress: Callable[[float, int, int], None] | None = None,
    idle_timeout_s: float = RUN_IDLE_TIMEOUT_S,
) -> RunReport:
    """The run's report, folded from its log as the leader writes it.
    RuntimeError if the run failed; TimeoutError if no round is logged for `idle_timeout_s`."""
    ordered: list[RunStep] = []
    async for step in follow_run_steps(bus, run_id, idle_timeout_s):
        ordered.append(step)
        if progress:
            progress(step.now_s, step.done, step.total)
        if step.over:
            break
    if ordered[-1].failure:
        raise RuntimeError(f"run {run_id} failed: {ordered[-1].failure}")
    return RunReport(
        tuple(s.record for s in ordered if s.record is not None), tuple(e for s in ordered for e in s.events)
    )


async def another_login(folder: Path, name: str, url: str, team: str | None = None):
    """A login (of `team`; None: DEFAULT_TEAM) added to the embedded stack on `folder` while it
    serves (as `goodput login add` does), connected with nats-py alone once the server has taken it."""
    from launcher.nats import SECRETS, Access, reload, taken
    from shared.credentials import connect_options, read_env

    access = Access(folder / SECRETS)
    settings = read_env(access.add_login(name, url, team))
    reload(folder, access)
    return await taken(url, connect_options(environ=settings))


@contextlib.asynccontextmanager
async def users_view(folder: Path, cluster: str = "sia-hetero-64"):
    """The secured embedded stack on simulated executors (zoo profiles), ready, and a connection
    logged in as `user` with nats-py alone: what a benchmark of the user's side measures through."""
    import nats

    from launcher.nats import embedded_nats

    arguments = service_arguments(cluster, None, True, None, 1, None)
    with embedded_nats(folder) as server, running_services(server, arguments, folder) as stack:
        operator = await server.connect("users-view")
        try:
            await stack.wait_ready(operator)
        finally:
            await operator.close()
        nc = await nats.connect(server.url, **server.options("user"))
        try:
            yield nc
        finally:
            await nc.close()
