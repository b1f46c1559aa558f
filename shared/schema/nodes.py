"""Node agents (one per node; the executor service drives them) and the nodes as an operator sees
them: an agent's liveness (NodeInfo, KV), the executor's orders to it and its reports, the
profiler's profiling runs on it, and `goodput drain` / `goodput nodes`."""

from __future__ import annotations

from typing import Iterable

import msgspec

from goodput_train.protocol import PositiveFloat, PositiveInt, ProfileRun
from shared.schema.base import TeamName
from shared.subjects import DEFAULT_TEAM


class NodeInfo(msgspec.Struct, frozen=True):
    """A node agent -> KV (`NODES_BUCKET`, renewed every NODE_HEARTBEAT_S): its node, alive. The
    entry lapses NODE_TTL_S after the agent's last renewal: the node is lost."""

    name: str
    gpu_type: str
    gpus: PositiveInt
    address: str  # where its workers listen (rank 0's rendezvous)
    agent: str = ""  # this agent's instance (a restarted agent is another)
    applications: tuple[str, ...] = ()  # the jobs its agent may run (its jobs package's); () unsaid


def node_applications(nodes: Iterable[NodeInfo]) -> dict[str, tuple[str, ...]] | None:
    """Application -> the GPU types of the live nodes whose agents run it, as the profiler checks a
    submission (`models` of submission_problem); None while no agent says what it runs."""
    found: dict[str, list[str]] = {}
    for node in nodes:
        for application in node.applications:
            found.setdefault(application, [])
            if node.gpu_type not in found[application]:
                found[application].append(node.gpu_type)
    return {application: tuple(types) for application, types in found.items()} if found else None


class StartWorkers(msgspec.Struct, frozen=True):
    """Executor -> a node agent: start a job's workers for one generation (a placement), ranks
    `ranks` of `world`. Without `master_addr` this node hosts rank 0: its agent picks the
    rendezvous port and answers it (`Rendezvous`), and the other nodes are told it."""

    job_id: str
    application: str
    generation: int  # one per start of the job's workers: a stale order is ignored
    ranks: tuple[int, ...]
    world: PositiveInt
    nodes: PositiveInt
    gpu_type: str
    checkpoint: str  # the checkpoint file, in a folder every node reads ("": `store`)
    env: dict[str, str] = {}  # the executor's settings for the job (report, checkpoint period)
    master_addr: str = ""
    master_port: int = 0
    # The checkpoint's object in the checkpoints store (no shared folder): the agent copies it in
    # before the workers start and, where rank 0 runs, out whenever the workers save a new one.
    store: str = ""
    # A job that carries its code: the archive in the code store (its digest; "": the application is
    # a module of the agent's jobs package), what in it runs and that script's arguments.
    code: str = ""
    entrypoint: str = ""
    args: tuple[str, ...] = ()
    requirements: tuple[str, ...] = ()  # its Python packages (JobSpec's): the environment its workers run in
    # The number of the job's user on every node (its submission's, never the submitter's choice: its
    # workers' uid is the agent's first plus it); None: an older executor's order (a hash of the id).
    user: int | None = None
    team: TeamName = DEFAULT_TEAM  # the job's team: its output is stored in that team's logs stream
    group: int = 0  # this node's place among the job's `nodes`, rank 0's first (torchrun's GROUP_RANK)


class Rendezvous(msgspec.Struct, frozen=True):
    address: str
    port: int


class StopWorkers(msgspec.Struct, frozen=True):
    """Executor -> a node agent: stop a job's workers (SIGTERM: they checkpoint), killing them
    after `grace_s`; `kill`: at once (a peer was lost, nothing to save)."""

    job_id: str
    grace_s: float = 60.0
    kill: bool = False


class WorkersReport(msgspec.Struct, frozen=True):
    """A node agent's word on a job's workers there: the generation, each local rank's exit code
    (None: running), and the latest report and outcome lines they printed."""

    job_id: str
    generation: int
    ranks: tuple[int, ...]
    codes: tuple[int | None, ...]
    stats: str = ""
    outcome: str = ""
    error: str = ""  # the last lines a crashed worker wrote to stderr
    # One printed the library's stopped mark, or the agent was asked to stop them while one ran: an
    # exit 0 is a stop, not the end.
    stopped: bool = False
    metrics: dict[str, float | str] = {}  # the latest value of each metric rank 0 reported


class NodeReport(msgspec.Struct, frozen=True):
    node: str
    jobs: tuple[WorkersReport, ...]
    # The jobs whose environment (their requirements) this node is building for a start: since how
    # many seconds.
    preparing: dict[str, float] = {}


# The error code of a node's answer to a start it refused for good: the job cannot run (its
# requirements could not be installed), and no other node would do better.
CANNOT_RUN = "422"


class ProfileRequest(msgspec.Struct, frozen=True):
    """Profiler -> a node agent of the type: run the job's script in profiling mode on one GPU."""

    job_id: str
    application: str
    slot_memory_mb: float | None = None
    timeout_s: PositiveFloat = 300.0
    code: str = ""  # as StartWorkers': the job's own code, when it carries it
    entrypoint: str = ""
    args: tuple[str, ...] = ()
    requirements: tuple[str, ...] = ()
    user: int | None = None  # as StartWorkers'
    team: TeamName = DEFAULT_TEAM  # as StartWorkers'


class ProfileAnswer(msgspec.Struct, frozen=True):
    run: ProfileRun | None = None
    failure: str = ""  # why the run gave no profile (the job is refused for it)


class DrainRequest(msgspec.Struct, frozen=True):
    """Operator -> executor: move every job off `node` and place nothing new there (`undo`: use it again)."""

    node: str
    undo: bool = False


class DrainAnswer(msgspec.Struct, frozen=True):
    node: str
    drained: bool
    jobs: tuple[str, ...] = ()  # the jobs there now, which the next round moves
    known: bool = True  # whether an agent serves the node now


ALIVE, LOST, DRAINED = "alive", "lost", "drained"
NODE_STATES = (ALIVE, LOST, DRAINED)


class NodeStatus(msgspec.Struct, frozen=True):
    """A node as its operator sees it: its GPUs, and whether the rounds use it — alive, lost (its
    agent's membership lapsed; known since the executor started) or drained (`goodput drain`)."""

    name: str
    gpu_type: str
    gpus: int
    state: str  # one of NODE_STATES
    jobs: tuple[str, ...] = ()  # the jobs whose workers run there now


class NodeStatuses(msgspec.Struct, frozen=True):
    nodes: tuple[NodeStatus, ...]
