"""Every message on the bus, one place: msgspec Structs, validated on decode.

Ranges are part of the type (msgspec `Meta`), so a negative batch size never reaches a core.
"""

from __future__ import annotations

from typing import Annotated, Any, Iterable

import msgspec

from goodput_train.goodput import GoodputModel, Observation, ThroughputParams

# The messages a job prints for its executor are the training library's (written once, there).
from goodput_train.protocol import JobStats, NonNegativeFloat, PositiveFloat, PositiveInt, ProfilePoint, ProfileRun

SCHEMA_VERSION = 1

MAX_ID = 128
# Ids travel in subjects and KV keys: letters, digits, '-', '_' and single '.' between them (a key's
# tokens), at most MAX_ID. The pattern ends in "nothing follows" rather than `$`, which would also
# match before a final newline.
Identifier = Annotated[
    str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]+)*(?![\s\S])", max_length=MAX_ID)
]
# What one submission may ask for, whatever the cluster (the profiler holds it to the cluster's size).
MAX_GPUS = 65_536
MAX_BATCH = 1 << 24
MAX_GPU_TYPES = 32
MAX_SUBMIT_S = 10 * 365 * 24 * 3600.0  # a replayed workload's span
GpuCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_GPUS)]
# A GPU type as a user names it: the cluster's key (`aws`) or the hardware ("T4", "RTX 2080 Ti").
GpuName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._-]*(?![\s\S])", max_length=64)]
BatchSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH)]


class JobSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A job submission (`goodput submit JOB.yaml`). Unknown fields are refused, not ignored: a typo
    in a field name must not silently change a job.

    By default a job is adaptive: the scheduler picks its GPUs (type and count) and batch size.
    `rigid` fixes its GPU count at requested_gpus; `strong_scaling` fixes its total batch at
    requested_batch (goodput is then throughput).
    """

    id: Identifier
    application: Identifier  # the model: a profile name (zoo or reference data)
    requested_gpus: GpuCount = 1
    requested_batch: BatchSize | None = None
    min_gpus: GpuCount = 1
    rigid: bool = False
    strong_scaling: bool = False
    gpu_types: Annotated[tuple[GpuName, ...], msgspec.Meta(max_length=MAX_GPU_TYPES)] = ()  # allowed; empty: any
    # A replayed workload's submission time; None: live (now). Only replays may set it.
    submit_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SUBMIT_S)] | None = None
    version: Annotated[int, msgspec.Meta(ge=1, le=SCHEMA_VERSION)] = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.strong_scaling and self.requested_batch is None:
            raise ValueError("a strong-scaling job needs requested_batch")
        if self.min_gpus > self.requested_gpus and self.rigid:
            raise ValueError("a rigid job runs at requested_gpus, which must be at least min_gpus")
        if len(set(self.gpu_types)) != len(self.gpu_types):
            raise ValueError("gpu_types lists a type twice")


class Rejected(msgspec.Struct, frozen=True):
    """Why a message was refused, kept on the dead-letter subject with what could be read of it."""

    subject: str
    reason: str
    job_id: str | None = None
    payload: str = ""  # the start of the message, for the record
    version: int = SCHEMA_VERSION
    # The stream sequence of the submission refused; None when none could be read as one (malformed).
    # A verdict touches only the job of that very submission, never one another submission holds.
    submission: int | None = None
    application: str | None = None  # the refused submission's, when it could be read


MAX_RECORDED_PAYLOAD = 512


def readable_fields(data: bytes) -> dict[str, str]:
    """The id and the application of a submission that is otherwise malformed (a typo'd field, a bad
    value, too large), those that can be read: its refusal is then listed as the job's own."""
    from shared.bus import is_json
    from shared.nesting import check_json, too_deep

    try:
        with too_deep():  # as the bus reads it: one nested too deep is not read
            if is_json(data):
                check_json(data)
            document = (msgspec.json.decode if is_json(data) else msgspec.msgpack.decode)(data)
    except msgspec.DecodeError:
        return {}
    found = {}
    for field in ("id", "application") if isinstance(document, dict) else ():
        try:
            found[field] = msgspec.convert(document[field], Identifier)
        except (msgspec.ValidationError, KeyError):
            pass
    return found


def readable_id(data: bytes) -> str | None:
    """The job id of a submission that is otherwise malformed, when one can be read: its rejection
    is then the job's own (it ends failed, with the reason), not only a dead letter."""
    return readable_fields(data).get("id")


def rejection(
    subject: str,
    reason: str,
    data: bytes | Any = b"",
    job_id: str | None = None,
    submission: int | None = None,
    application: str | None = None,
) -> Rejected:
    """The record of a refused submission; its application, unless given, read from `data` when it can be."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else repr(data)
    if application is None and isinstance(data, bytes):
        application = readable_fields(data).get("application")
    return Rejected(
        subject, reason, job_id, text[:MAX_RECORDED_PAYLOAD], submission=submission, application=application
    )


Spots = tuple[tuple[str, int], ...]  # a physical placement: ((node name, GPUs on it), ...), sorted by node


class Node(msgspec.Struct, frozen=True):
    """One (possibly virtual) node: `gpus` GPUs of one type."""

    name: str
    gpu_type: str
    gpus: PositiveInt


class Config(msgspec.Struct, frozen=True):
    """An allocation, and a column of the goodput matrix: `gpus` GPUs of `gpu_type` on `nodes` nodes."""

    gpu_type: str
    nodes: PositiveInt
    gpus: PositiveInt

    def __str__(self) -> str:
        return f"{self.gpu_type}:{self.nodes}x{self.gpus // self.nodes}"


class Profile(msgspec.Struct, frozen=True):
    """A job's bootstrap profile on one GPU type: ~10 batch sizes on one replica (Sia §3.3): one
    GPU, or for a hybrid-parallel job its model-parallel group of `group_gpus` GPUs on one node.

    max_local is the largest per-replica batch that fits in memory; gpu_seconds what profiling cost.
    """

    job_id: str
    model: str
    gpu_type: str
    points: tuple[ProfilePoint, ...]
    min_local: PositiveInt
    max_local: PositiveInt
    gpu_seconds: NonNegativeFloat = 0.0
    group_gpus: PositiveInt = 1


class JobFacts(msgspec.Struct, frozen=True):
    """What the executors know of a job at a round: its request, history, placement and the gradient
    statistics it measured. With the estimator's models it makes a policy's view of the job."""

    job_id: str
    application: str
    submit_s: float
    age_s: float
    requested_gpus: PositiveInt
    requested_batch: PositiveInt
    rigid: bool  # runs at exactly requested_gpus and requested_batch
    init_batch: PositiveInt  # M0, the batch its gradient statistics refer to
    max_batch: PositiveInt
    min_gpus: PositiveInt = 1  # the fewest GPUs it may run on (its JobSpec's)
    restarts: int = 0
    attained_gpu_s: NonNegativeFloat = 0.0
    attained_by_type: dict[str, float] = {}
    placement: tuple[tuple[str, int], ...] = ()
    mid_restart: bool = False
    iterations: NonNegativeFloat = 0.0
    slice_iterations: NonNegativeFloat = 0.0  # since its current placement began
    idle_since_s: float | None = None  # when it last stopped running; None while running
    max_gpus_seen: int = 0  # replicas for a hybrid-parallel job (see JobModels)
    grad_sqr: float | None = None
    grad_var: float | None = None
    estimate_revision: int = 0  # the estimator's record of the job is at least this new
    trace: str = ""  # its submission's W3C traceparent ("" when none came)


class JobModels(msgspec.Struct, frozen=True):
    """What the estimator knows of one job this round: all a policy and the goodput matrix need.

    A hybrid-parallel job (Sia §5.3) runs fixed model-parallel groups of `group_gpus[type]` GPUs,
    scaled only by data-parallel replication. Its unit is a replica (one group): its throughput
    models, batch limits and GPU counts here (min_gpus, max_gpus_seen, fixed_gpus) count replicas,
    and per-replica batches. A type absent from `group_gpus` has groups of one GPU.
    """

    job_id: str
    params: dict[str, ThroughputParams]  # per GPU type
    local_limits: dict[str, tuple[int, int]]  # per GPU type: (min, max) per-GPU batch
    init_batch: PositiveInt
    max_batch: PositiveInt
    grad_sqr: float | None = None
    grad_var: float | None = None
    min_gpus: PositiveInt = 1
    max_gpus_seen: int = 0  # most GPUs (replicas) ever allocated (0: never ran)
    fixed_gpus: int | None = None  # rigid job: this many GPUs, any type
    fixed_batch: int | None = None  # strong-scaling job: this total batch, goodput = throughput
    group_gpus: dict[str, int] = {}  # hybrid-parallel job: GPUs of one replica per type
    start_gpus: PositiveInt = 1  # the most a job that never ran may start on (Sia: 1)

    def model(self, gpu_type: str) -> GoodputModel:
        return GoodputModel(self.params[gpu_type], self.grad_sqr, self.grad_var, self.init_batch)

    def group(self, gpu_type: str) -> int:
        return self.group_gpus.get(gpu_type, 1)

    @property
    def gpu_limit(self) -> int:
        """Sia's scaling rule: at most twice the most GPUs it ever had (a job that never ran: at most
        `start_gpus`), never below its minimum."""
        return max(2 * self.max_gpus_seen if self.max_gpus_seen else self.start_gpus, self.min_gpus, 1)


class PlaceRequest(msgspec.Struct, frozen=True):
    """Policy -> placer: the round's allocations, where the jobs run now, and the GPUs of one
    model-parallel group of each hybrid-parallel job on its allocated type (never split by a node)."""

    round: int
    allocations: dict[str, Config]
    previous: dict[str, Spots] = {}
    groups: dict[str, int] = {}
    nodes: tuple[Node, ...] | None = None  # the round's nodes, when they are not the placer's own cluster


class PlacementResult(msgspec.Struct, frozen=True):
    """Placer -> executors: where each allocated job runs.

    restarts: jobs placed before and now placed differently (moved, resized, or displaced); a job
      starting for the first time is not a restart, and neither is one that left the allocation.
    evicted: allocated jobs that got no GPUs because no placement holds them all; empty whenever
      `services.placer.core.is_placeable` holds for the allocations.
    """

    placements: dict[str, Spots]
    restarts: tuple[str, ...] = ()
    evicted: tuple[str, ...] = ()


# --- the round over the bus (docs/services.md) ------------------------------------------------


class FactsRequest(msgspec.Struct, frozen=True):
    """Policy -> executors: the facts of these jobs now."""

    now_s: float
    jobs: tuple[str, ...]


class FactsReply(msgspec.Struct, frozen=True):
    """The facts of the jobs the executors can run now; `held`: jobs they know but cannot run yet
    (e.g. not profiled), and why; `failed`: jobs that will never run (rejected, unknown), and why."""

    facts: tuple[JobFacts, ...]
    held: dict[str, str] = {}
    failed: dict[str, str] = {}


class ModelsRequest(msgspec.Struct, frozen=True):
    """Policy -> estimator: the models of the jobs these facts describe."""

    facts: tuple[JobFacts, ...]


class ModelsReply(msgspec.Struct, frozen=True):
    """The models of the jobs the estimator knows; `held`: those it has no profile of yet, and why."""

    models: tuple[JobModels, ...]
    held: dict[str, str] = {}


class ApplyRequest(msgspec.Struct, frozen=True):
    """Policy -> executors: the round's placements (jobs absent get nothing) and each job's models,
    which adaptive jobs re-tune their batch size with; `failed`: jobs the round gave up on, and why
    (the executors record them as failed)."""

    now_s: float
    placements: dict[str, Spots]
    models: dict[str, JobModels]
    adaptive: bool
    failed: dict[str, str] = {}


class AdvanceRequest(msgspec.Struct, frozen=True):
    """Policy -> simulated executors: run these jobs for a round of the virtual clock."""

    now_s: float
    step_s: float
    jobs: tuple[str, ...]


class LiveJobsRequest(msgspec.Struct, frozen=True):
    """Live clock -> simulated executors: jobs submitted live (with no time) arrive at `now_s` if
    they have not arrived yet; reply with every live job not finished."""

    now_s: float


class LiveJobs(msgspec.Struct, frozen=True):
    jobs: tuple[str, ...]  # in arrival order
    # Real executors: the nodes their agents serve now (live, not drained), the cluster this round
    # schedules. None: the executors' cluster is the fixed one the services were started with.
    nodes: tuple[Node, ...] | None = None


class AdvanceReply(msgspec.Struct, frozen=True):
    finished: tuple[str, ...]
    failed: dict[str, str] = {}  # jobs that ended without finishing, and why


class Profiled(msgspec.Struct, frozen=True):
    """Profiler -> executors (JetStream): the job's profiles are with the estimator, it may run. A
    real profiling run also says the batch sizes the job declares (M0 and its largest)."""

    job_id: str
    init_batch: PositiveInt | None = None
    max_batch: PositiveInt | None = None
    submission: int | None = None  # the stream sequence of the submission profiled


def spec_digest(spec: JobSpec) -> str:
    """A submission's fingerprint, whatever its encoding: the same job sent again has the same."""
    import hashlib

    return hashlib.sha256(msgspec.msgpack.encode(spec)).hexdigest()


def submission_msg_id(spec: JobSpec) -> str:
    """The Nats-Msg-Id a submission is stored under: JetStream drops the same body sent again (a
    retry), and takes a corrected body under the same job id (docs/api.md)."""
    return f"{spec.id}.{spec_digest(spec)[:16]}"


class JobOwner(msgspec.Struct, frozen=True):
    """Profiler (KV, by job id): the submission that holds a job's id, from its first valid
    submission on; a refused one gives the id up. `submission` 0 is the API's mark while it stores
    a submission (`since`: when, wall-clock): the first one stored under the id takes it over."""

    submission: int  # its stream sequence (0: being stored by the API)
    digest: str  # of its JobSpec: the same job sent again is a repeat
    subject: str  # where it came (a login's stored submission, an operator's replay)
    since: float = 0.0  # a mark's time: one older than MARK_TTL_S is void

    @property
    def marking(self) -> bool:
        return self.submission == 0

    @property
    def login(self) -> str:
        """The login whose job it is ("": the operator's replay)."""
        from shared.subjects import of_login

        return of_login(self.subject)[1]


MARK_TTL_S = 30.0  # a mark whose API replica died before it stored the submission stops holding the id


def verdict_for(verdict_submission: int | None, held_by: int) -> bool:
    """Whether a verdict is on the submission that holds the job (a verdict naming none is not)."""
    return verdict_submission is not None and verdict_submission == held_by


class NodeJob(msgspec.Struct):
    """A real job as its node agent keeps it (KV): what the scheduler is told of it besides what its
    workers report, and what they reported last, so a restarted agent goes on with it (its workers
    resume from their checkpoint)."""

    spec: JobSpec
    profiled: Profiled | None = None
    submission: int = 0  # the stream sequence of its submission
    seen: int = 0  # ... of what it was first read from: listed in that order
    trace: str = ""  # its submission's traceparent (else its verdict's)
    cancelled: bool = False  # its user cancelled it (its failure says so)
    owner: str = ""  # the login that submitted it ("": the operator's)
    submitted_at: float = 0.0  # when it was read here, wall-clock (epoch) seconds
    arrival_s: float | None = None  # on the run's clock: when it entered the rounds, profiled
    submitted_s: float | None = None  # ... and when it was submitted, on the same clock
    finish_s: float | None = None
    failure: str | None = None
    ended_in: float | None = None  # the round (its now_s) whose advance reported the end
    advanced_to: float | None = None  # its slot-seconds are counted up to here
    gpu_seconds: float = 0.0
    by_type: dict[str, float] = {}
    idle_since_s: float | None = None
    max_gpus_seen: int = 0
    slice_steps: int = 0  # its steps when the current placement began
    estimate_revision: int = 0
    reported: tuple[tuple[int, int, int, int], ...] = ()  # configurations (nodes, GPUs, m, s) the estimator has
    placement: Spots = ()  # where its workers ran when this was saved
    placements: tuple[Placed, ...] = ()  # every placement its workers were started on
    generation: int = 0  # its workers' starts so far (a node ignores an older order)
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()  # the nodes its workers run on, and their ranks
    restarts: int = 0
    crashes: int = 0
    stats: JobStats | None = None
    metric: float | None = None  # its own measure of success, once finished
    batches: tuple[int, ...] = ()  # the total batches it trained at, once finished
    unnamed: bool = False  # a refusal whose id could not be read (its spec: a stand-in)

    @property
    def key(self) -> str:
        """Where it is kept (KV) and listed from: its id; a refusal without one, its place in the stream."""
        return unnamed_key(self.seen) if self.unnamed else self.spec.id


UNNAMED = "_rejected"  # keys of refusals kept apart from any job (no job id starts with _): by their sequence


def unnamed_key(sequence: int) -> str:
    """The key (executors' KV, their records) of a refusal kept apart from any job: a body whose id
    could not be read, or another body under an id a job holds."""
    return f"{UNNAMED}.{sequence}"


# ---- node agents (one per node; the executor service drives them) ------------------------------


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
    error: str = ""  # the last line a crashed worker wrote to stderr


class NodeReport(msgspec.Struct, frozen=True):
    node: str
    jobs: tuple[WorkersReport, ...]


class ProfileRequest(msgspec.Struct, frozen=True):
    """Profiler -> a node agent of the type: run the job's script in profiling mode on one GPU."""

    job_id: str
    application: str
    slot_memory_mb: float | None = None
    timeout_s: PositiveFloat = 300.0


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


class Observed(msgspec.Struct, frozen=True):
    """Executors -> estimator: a configuration a job ran, and its measured iteration time."""

    job_id: str
    gpu_type: str
    observation: Observation


class JobProfiles(msgspec.Struct, frozen=True):
    """Profiler -> estimator: a job's bootstrap profiles, one per GPU type it can run on."""

    job_id: str
    profiles: tuple[Profile, ...]


class Ack(msgspec.Struct, frozen=True):
    ok: bool = True


# A job's lifecycle: submitted and being profiled, then queued (accepted, waiting for GPUs), running,
# and one of the ends; `rejected` is the profiler's refusal of a submission.
JOB_STATES = ("queued", "profiling", "running", "finished", "failed", "rejected", "cancelled")


class JobRecord(msgspec.Struct, frozen=True):
    """A job's outcome, as the results report it."""

    name: str
    application: str
    submit_s: float
    finish_s: float | None
    restarts: int
    gpu_seconds: float
    feedback_s: float | None
    placement: tuple[tuple[str, int], ...] = ()  # where it runs now
    failure: str | None = None  # why it ended without finishing
    metric: float | None = None  # a real job's own measure of success, when it finished
    batches: tuple[int, ...] = ()  # a real job's total batches, as it re-tuned them
    state: str = ""  # its place in the lifecycle: one of JOB_STATES
    gpu_type: str | None = None  # while running: the type of its GPUs
    batch: int | None = None  # while running: its total batch
    placements: tuple[Placed, ...] = ()  # a real job's placements over time, each from its start
    reason: str | None = None  # a job not ended: what it waits for (where it is profiled)
    owner: str = ""  # the login that submitted it ("": the operator's)


class Placed(msgspec.Struct, frozen=True, array_like=True):
    """A placement a real job's workers were started on, and when (on the run's clock)."""

    at_s: float
    spots: tuple[tuple[str, int], ...]


class Count(msgspec.Struct, frozen=True):
    n: int


CANCELLED = "cancelled by its user"  # the reason a cancelled job ended


class Cancel(msgspec.Struct, frozen=True):
    """API -> the jobs stream (CANCEL) -> executors: stop this job. A queued one never starts, a
    running one's workers checkpoint and stop; it ends `cancelled`. Cancelling an ended job does
    nothing."""

    job_id: Identifier
    version: int = SCHEMA_VERSION


class JobStatus(msgspec.Struct, frozen=True):
    """A job as a user sees it (`goodput status --json`, `goodput.api.job`). Times are seconds on
    the run's clock; `jct_s` is from its submission to its end."""

    id: str | None  # None: a refused submission whose id could not be read
    state: str  # one of JOB_STATES
    reason: str = ""  # why it ended without finishing, or was refused; while
    # profiling or queued, where it is profiled or what it waits for
    application: str | None = None
    gpu_type: str | None = None  # while running: its GPUs' hardware (T4, A100, ...)
    gpu_alias: str | None = None  # ... and their type's key in the cluster (aws, dgx-ext, ...)
    gpus: int = 0  # while running
    nodes: tuple[str, ...] = ()  # while running
    batch: int | None = None  # while running: its total batch
    submit_s: float | None = None
    finish_s: float | None = None
    jct_s: float | None = None
    restarts: int = 0
    gpu_seconds: float = 0.0


def job_status(record: JobRecord) -> JobStatus:
    """What a user sees of a job, from the executors' record of it."""
    import math

    from shared.hardware import hardware_name

    submitted = record.submit_s if record.submit_s is not None and math.isfinite(record.submit_s) else None
    running = record.state == "running"
    return JobStatus(
        record.name or None,
        record.state,
        record.failure or record.reason or "",
        record.application or None,
        record.gpu_type and hardware_name(record.gpu_type),
        record.gpu_type,
        sum(g for _, g in record.placement) if running else 0,
        tuple(node for node, _ in record.placement) if running else (),
        record.batch,
        submitted,
        record.finish_s,
        None if record.finish_s is None or submitted is None else record.finish_s - submitted,
        record.restarts,
        round(record.gpu_seconds, 3),
    )


def job_rows(records: Iterable[JobRecord]) -> list[JobRecord]:
    """The records a user sees, in their order: one per id, the job the id belongs to (the executors
    also keep refusals of other bodies sent under a taken id: those are left out); refusals whose id
    could not be read, each."""
    rows: dict[object, JobRecord] = {}
    for n, record in enumerate(records):
        key = record.name or n
        held = rows.get(key)
        if held is None or (held.state == "rejected" and record.state != "rejected"):
            rows[key] = record
    return list(rows.values())


def job_statuses(records: Iterable[JobRecord]) -> list[JobStatus]:
    """What a user sees of the jobs (`job_rows`), as statuses."""
    return [job_status(record) for record in job_rows(records)]


def select(records: Iterable[JobRecord], query: JobsQuery) -> JobRecords:
    """What the executors answer a query with: the records of its owner's jobs whose id begins with
    its prefix; with a state, an application or a limit, one page of the rows a user sees
    (`job_rows`) and how many match in all."""
    chosen = [r for r in records if r.name.startswith(query.prefix) and query.owner in (None, r.owner)]
    if query.limit is None and query.state is None and query.application is None:
        return JobRecords(tuple(chosen))
    rows = [
        r for r in job_rows(chosen) if query.state in (None, r.state) and query.application in (None, r.application)
    ]
    end = query.offset + (len(rows) if query.limit is None else query.limit)
    return JobRecords(tuple(rows[query.offset : end]), len(rows))


# ---- the user API (goodput.api.*): what a client in any language sends and gets ------------------


class JobRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """-> goodput.api.job (its JobStatus), goodput.api.cancel (a CancelAnswer)."""

    id: Identifier


MAX_PAGE = 500


class JobsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """-> goodput.api.jobs: a page of the jobs, in submission order, of those matching every filter
    given (state: one of JOB_STATES; application; an id prefix)."""

    state: str | None = None
    application: str | None = None
    prefix: str = ""
    offset: Annotated[int, msgspec.Meta(ge=0)] = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGE)] = 100


class JobsPage(msgspec.Struct, frozen=True):
    jobs: tuple[JobStatus, ...]
    total: int  # jobs matching the filters, in all pages
    next_offset: int | None = None  # the next page's offset; None: this was the last


class SubmitAnswer(msgspec.Struct, frozen=True):
    """goodput.api.submit's answer. accepted: the submission is stored (or was, the same body
    before) and goes to the profiler; refused: `reason` says why, and nothing was stored, so the
    corrected body may use the same id."""

    accepted: bool
    id: str | None
    state: str  # profiling when just stored; else the job's state now
    reason: str = ""
    notes: tuple[str, ...] = ()  # what the submitter may not expect (e.g. a GPU count is a hint)


class CancelAnswer(msgspec.Struct, frozen=True):
    """goodput.api.cancel's answer: `cancelled` once the order is stored (or the job already was);
    false for a job that has ended, with why. No job of that id: error 404."""

    cancelled: bool
    id: str
    state: str
    reason: str = ""


class JobsQuery(msgspec.Struct, frozen=True):
    """-> executors: their jobs (JobRecords, `select`) or how many have the profiler's verdict
    (Count), of those whose id begins with `prefix` (all: ""); `owner`: only that login's (None:
    every login's); `state`, `application`, `offset` and `limit`: one page of those. An `Ack`
    reads as the query for all."""

    prefix: str = ""
    owner: str | None = None
    state: str | None = None
    application: str | None = None
    offset: int = 0
    limit: int | None = None


class JobRecords(msgspec.Struct, frozen=True):
    jobs: tuple[JobRecord, ...]
    total: int | None = None  # a page's: the jobs that match, in all pages


class RoundRecord(msgspec.Struct):
    """One scheduling round, for the metrics: jobs active and running, and what deciding cost."""

    now_s: float
    active: int
    running: int
    policy_ms: float
    round_ms: float
    gpus: dict[str, int]  # GPUs of each running job after the decision
    types: dict[str, str] = {}  # ... their GPU type
    batches: dict[str, int] = {}  # ... the total batch the policy planned, when it plans one
    nodes: dict[str, int] = {}  # ... the nodes of each job spread over more than one


class RunRequest(msgspec.Struct, frozen=True):
    """Driver -> policy leader (as the run's first checkpoint in KV): replay these submitted jobs
    on the virtual clock."""

    run_id: Identifier
    policy: str
    policy_options: dict[str, Any]
    calibration: str
    jobs: tuple[tuple[str, float], ...]  # (job id, submit time), in submission order
    round_s: float | None = None
    horizon_s: float | None = None
    request_timeout_s: float = 10.0  # each stage's request; a restarted service is asked again
    live: bool = False  # no end: the jobs submitted live, rounds paced by the wall clock
    speed: PositiveFloat = 1.0  # live: virtual seconds per wall-clock second


class DecidedRound(msgspec.Struct, frozen=True):
    """A round the leader has decided but not yet run: what a standby needs to finish it."""

    apply: ApplyRequest
    record: RoundRecord
    events: tuple[str, ...]


class RunClock(msgspec.Struct, frozen=True):
    """A replay's virtual clock between two steps: where a standby leader resumes."""

    round: int = 0  # rounds run so far
    now_s: float = 0.0
    next_decision_s: float = 0.0
    admitted: int = 0  # jobs (in submission order) that have arrived
    active: tuple[str, ...] = ()
    done: int = 0
    decisions: int = 0  # placer rounds asked
    decided: DecidedRound | None = None
    policy_state: bytes = b""  # the policy's state between rounds (Policy.snapshot)


class RunCheckpoint(msgspec.Struct, frozen=True):
    """KV, one per run: the request and the clock, written by the leader after every step; the
    revision fences a deposed leader out (its next write is refused). `problem`: why the run cannot
    go on now (it is being retried since `problem_since`, wall-clock seconds), or why it failed."""

    request: RunRequest
    clock: RunClock = msgspec.field(default_factory=RunClock)
    over: bool = False
    problem: str = ""
    problem_since: float | None = None


class RunStep(msgspec.Struct, frozen=True):
    """One round run, on the run's log (a stream): the driver folds the steps into the report."""

    round: int
    now_s: float
    record: RoundRecord | None  # the round's decision, if it decided
    events: tuple[str, ...]
    finished: tuple[str, ...]
    done: int
    total: int
    over: bool = False  # the last step: every job finished, the horizon passed, or it failed
    failure: str = ""  # why the run could not go on
    failed: tuple[str, ...] = ()  # jobs that ended without finishing (why: in `events`)


class Lease(msgspec.Struct, frozen=True):
    """KV: who leads the policy rounds; the bucket's TTL ends a lease that is not renewed."""

    holder: str


class RunStatus(msgspec.Struct, frozen=True):
    """A run as `goodput status` shows it. state: `running`, `stalled` (a round keeps failing; it is
    retried, `reason` says why), `over` or `failed`."""

    id: str
    state: str
    reason: str
    round: int
    now_s: float
    jobs: int  # active now


class PolicyStatus(msgspec.Struct, frozen=True):
    """Policy -> anyone: who leads the rounds ("" when no one does) and the live run, if there is one."""

    leader: str
    run: RunStatus | None = None


class RunReport(msgspec.Struct, frozen=True):
    rounds: tuple[RoundRecord, ...]
    events: tuple[str, ...]


class Stored(msgspec.Struct, frozen=True):
    """A write's acknowledgement with the KV revision it made: a later reader asks for at least it."""

    revision: int


class EstimateRecord(msgspec.Struct, frozen=True):
    """What the estimator keeps of a job in KV: enough to rebuild its models after a restart."""

    job_id: str
    profiles: tuple[Profile, ...]
    observations: dict[str, tuple[Observation, ...]]  # per GPU type, in the order they came


# ---- the nodes of real executors (goodput.executor.nodes, `goodput nodes`) ------------------------

NODE_STATES = ("alive", "lost", "drained")


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
