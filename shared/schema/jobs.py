"""The jobs stream: a submission (JobSpec) from a user or a replay, the profiler's claim on its id
(JobOwner) and its verdict on it (Profiled, or Rejected on the dead-letter subject), and a user's
Cancel; the executors read them all."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec

from goodput_train.protocol import PositiveInt
from shared.schema.base import (
    MAX_GPU_TYPES,
    MAX_PRIORITY,
    MAX_SUBMIT_S,
    MAX_TARGET_EPOCHS,
    SCHEMA_VERSION,
    BatchSize,
    GpuCount,
    GpuName,
    Identifier,
    TeamName,
)
from shared.schema.code import Arguments, Digest, Entrypoint, Requirements

# How a job's own code runs: through the training library's contract (profiled, adaptive), or as
# torchrun runs a script (its ranks given torchrun's environment; rigid).
Launcher = Literal["goodput", "torchrun"]
GOODPUT, TORCHRUN = get_args(Launcher)


class Elastic(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A torchrun job's range of GPUs: the policy resizes it within them, by checkpoint-restart."""

    min_gpus: GpuCount
    max_gpus: GpuCount

    def __post_init__(self) -> None:
        if self.min_gpus > self.max_gpus:
            raise ValueError(f"elastic: min_gpus {self.min_gpus} is more than max_gpus {self.max_gpus}")


class JobSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A job submission (`goodput submit JOB.yaml`). Unknown fields are refused, not ignored: a typo
    in a field name must not silently change a job.

    By default a job is adaptive: the scheduler picks its GPUs (type and count) and batch size.
    `rigid` fixes its GPU count at requested_gpus; `strong_scaling` fixes its total batch at
    requested_batch (goodput is then throughput). A job that carries its code runs through the
    training library (`launcher: goodput`, profiled and adaptive), or as torchrun would run it
    (`launcher: torchrun`: any DDP script, unchanged, rigid at requested_gpus of its gpu_types).
    """

    id: Identifier
    # The model: a profile name (zoo or reference data), or the operator's job module. A job that
    # carries its code (`code`) names one only to be profiled as that model.
    application: Identifier | None = None
    requested_gpus: GpuCount = 1
    requested_batch: BatchSize | None = None
    min_gpus: GpuCount = 1
    rigid: bool = False
    strong_scaling: bool = False
    gpu_types: Annotated[tuple[GpuName, ...], msgspec.Meta(max_length=MAX_GPU_TYPES)] = ()  # allowed; empty: any
    # A replayed workload's submission time; None: live (now). Only replays may set it.
    submit_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SUBMIT_S)] | None = None
    # Its own code (`goodput submit --code DIR`): the archive in the code store (its digest), what in
    # it runs (a script or module), and that script's arguments.
    code: Digest | None = None
    entrypoint: Entrypoint | None = None
    args: Arguments = ()
    # The Python packages its code needs beyond the node's: each node builds them once, into an
    # environment over its own packages that every job asking the same shares (docs/jobs.md).
    requirements: Requirements = ()
    # The team it belongs to: the login's, as the server says (the API sets it; a body naming another
    # team is refused), DEFAULT_TEAM's for the operator's jobs. `priority` orders who gets the team's
    # guarantee first (higher first); jobs of equal priority share by goodput.
    team: TeamName | None = None
    priority: Annotated[int, msgspec.Meta(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0
    # The work its user declares: statistical epochs at M0 (goodput_train's `target_epochs`); None:
    # none. The scheduler plans with it while the job is within it, and never stops a job for it.
    target_epochs: Annotated[float, msgspec.Meta(gt=0, le=MAX_TARGET_EPOCHS)] | None = None
    launcher: Launcher = GOODPUT
    # A torchrun job the policy may resize (within these GPUs, its global batch kept); None: rigid.
    elastic: Elastic | None = None
    version: Annotated[int, msgspec.Meta(ge=1, le=SCHEMA_VERSION)] = SCHEMA_VERSION

    def __post_init__(self) -> None:
        from shared.code_archive import entrypoint_problem
        from shared.requirements import requirement_problem

        if self.code is None and self.application is None:
            raise ValueError("a job names its application, or carries its code (code and entrypoint)")
        if (self.code is None) != (self.entrypoint is None):
            raise ValueError("a job that carries its code names both the archive (code) and its entrypoint")
        if self.code is None and self.args:
            raise ValueError("args are for a job that carries its code (its entrypoint's arguments)")
        if self.entrypoint is not None and (problem := entrypoint_problem(self.entrypoint)) is not None:
            raise ValueError(problem)
        if self.requirements and self.code is None:
            raise ValueError("requirements are for a job that carries its code (the packages it imports)")
        for line in self.requirements:
            if (problem := requirement_problem(line)) is not None:
                raise ValueError(problem)
        if self.strong_scaling and self.requested_batch is None:
            raise ValueError("a strong-scaling job needs requested_batch")
        if self.launcher == TORCHRUN and self.code is None:
            raise ValueError("a torchrun job carries its code: code and entrypoint (goodput submit --code DIR)")
        if self.elastic is not None and self.launcher != TORCHRUN:
            raise ValueError("elastic is for a torchrun job (the library's jobs are adaptive by themselves)")
        if self.elastic is not None and self.rigid:
            raise ValueError("a job is rigid or elastic, not both")
        if self.min_gpus > self.requested_gpus and self.fixed_gpus:
            raise ValueError("a rigid job runs at requested_gpus, which must be at least min_gpus")
        if len(set(self.gpu_types)) != len(self.gpu_types):
            raise ValueError("gpu_types lists a type twice")

    @property
    def model(self) -> str:
        """What the job is known as among models (its profiles, the policy's settings): its application,
        else its entrypoint."""
        return self.application or str(self.entrypoint)

    @property
    def fixed_gpus(self) -> bool:
        """Whether it runs at requested_gpus only: rigid, or a torchrun script not declared elastic."""
        return self.rigid or (self.launcher == TORCHRUN and self.elastic is None)

    @property
    def gpu_range(self) -> tuple[int, int | None]:
        """The fewest and the most GPUs it may run on (None: as many as its goodput asks)."""
        if self.fixed_gpus:
            return self.requested_gpus, self.requested_gpus
        if self.elastic is not None:
            return self.elastic.min_gpus, self.elastic.max_gpus
        return self.min_gpus, None

    @property
    def fixed_batch(self) -> bool:
        """Whether its global batch stays at requested_batch: strong scaling, or an elastic torchrun job."""
        return self.strong_scaling or self.elastic is not None

    @property
    def own_code(self) -> tuple[str, str, tuple[str, ...], tuple[str, ...]]:
        """Its own code as the node agents take it (StartWorkers, ProfileRequest): (archive,
        entrypoint, args, requirements); ("", "", (), ()) for a job module's."""
        return (self.code, str(self.entrypoint), self.args, self.requirements) if self.code else ("", "", (), ())


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
    from shared.bus.encoding import is_json
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
    application: str | None = None  # its submission's: shown before the executors have read it

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


class Profiled(msgspec.Struct, frozen=True):
    """Profiler -> executors (JetStream): the job's profiles are with the estimator, it may run. A
    real profiling run also says the batch sizes the job declares (M0 and its largest)."""

    job_id: str
    init_batch: PositiveInt | None = None
    max_batch: PositiveInt | None = None
    submission: int | None = None  # the stream sequence of the submission profiled


CANCELLED = "cancelled by its user"  # the reason a cancelled job ended


class Cancel(msgspec.Struct, frozen=True):
    """API -> the jobs stream (CANCEL) -> executors: stop this job. A queued one never starts, a
    running one's workers checkpoint and stop; it ends `cancelled`. Cancelling an ended job does
    nothing."""

    job_id: Identifier
    version: int = SCHEMA_VERSION
