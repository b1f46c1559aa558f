"""One scheduling round over the bus (docs/services.md): the policy leader asks the executors for
the jobs' facts, the estimator for their models, the placer where they go, then the executors to
apply the placements and (simulated) to advance the virtual clock."""

from __future__ import annotations

from typing import Iterable

import msgspec

from goodput_train.goodput import GoodputModel, ThroughputParams
from goodput_train.protocol import NonNegativeFloat, PositiveInt
from shared.schema.base import Config, Node, Spots
from shared.subjects import DEFAULT_TEAM


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
    # Its progress as it reports it: statistical epochs at M0 done, the work its user declared
    # (JobSpec.target_epochs; None: none), and examples at M0 in an epoch (0: not known yet).
    epochs: NonNegativeFloat = 0.0
    target_epochs: float | None = None
    epoch_samples: NonNegativeFloat = 0.0
    estimate_revision: int = 0  # the estimator's record of the job is at least this new
    trace: str = ""  # its submission's W3C traceparent ("" when none came)
    team: str = DEFAULT_TEAM  # the team it belongs to, and its priority there (its JobSpec's)
    priority: int = 0
    max_gpus: PositiveInt | None = None  # the most GPUs it may run on (None: no bound of its own)
    fixed_batch: bool = False  # keeps requested_batch at every size (strong scaling)


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
    max_gpus: PositiveInt | None = None  # the most it may run on, whatever its goodput (None: no bound)
    # Examples at M0 left to its declared target, from the progress it reports (goodput x time =
    # examples at M0); None: it declared none, its epoch's size is not known yet, or it has run
    # past its declaration (and with it lost the priority the declaration bought).
    remaining_samples: float | None = None

    def model(self, gpu_type: str) -> GoodputModel:
        return GoodputModel(self.params[gpu_type], self.grad_sqr, self.grad_var, self.init_batch)

    def group(self, gpu_type: str) -> int:
        return self.group_gpus.get(gpu_type, 1)

    @property
    def gpu_limit(self) -> int:
        """Sia's scaling rule: at most twice the most GPUs it ever had (a job that never ran: at most
        `start_gpus`), never below its minimum nor above its maximum."""
        limit = max(2 * self.max_gpus_seen if self.max_gpus_seen else self.start_gpus, self.min_gpus, 1)
        return limit if self.max_gpus is None else min(limit, self.max_gpus)


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


class Reclaim(msgspec.Struct, frozen=True):
    """A job shrunk or stopped in a round so that another team got back GPUs of its guarantee."""

    round: int
    at_s: float
    by_team: str  # whose guarantee
    gpu_type: str
    gpus_before: int
    gpus_after: int


class ApplyRequest(msgspec.Struct, frozen=True):
    """Policy -> executors: the round's placements (the round's `decided` jobs absent get nothing)
    and each placed job's models, which adaptive jobs re-tune their batch size with; `failed`: jobs
    the round gave up on, and why (the executors record them as failed). With teams: `borrowed`,
    the GPUs each job holds beyond its team's guarantee (absent: none), `reclaims`, the jobs this
    round shrank or stopped to give a team back its guarantee, and `waits`, the jobs it left
    waiting on their team's limits, and why (what the executors say they wait for)."""

    now_s: float
    placements: dict[str, Spots]
    models: dict[str, JobModels]
    adaptive: bool
    failed: dict[str, str] = {}
    borrowed: dict[str, int] = {}
    reclaims: dict[str, Reclaim] = {}
    # The jobs the round decided on (thousands queued: their models are not sent); empty: those
    # of `models`.
    jobs: tuple[str, ...] = ()
    waits: dict[str, str] = {}

    @property
    def decided(self) -> Iterable[str]:
        return self.jobs or self.models.keys()


class AdvanceRequest(msgspec.Struct, frozen=True):
    """Policy -> simulated executors: run these jobs for a round of the virtual clock."""

    now_s: float
    step_s: float
    jobs: tuple[str, ...]


class AdvanceReply(msgspec.Struct, frozen=True):
    finished: tuple[str, ...]
    failed: dict[str, str] = {}  # jobs that ended without finishing, and why


class LiveJobsRequest(msgspec.Struct, frozen=True):
    """Live clock -> simulated executors: jobs submitted live (with no time) arrive at `now_s` if
    they have not arrived yet; reply with every live job not finished."""

    now_s: float


class LiveJobs(msgspec.Struct, frozen=True):
    jobs: tuple[str, ...]  # in arrival order
    # Real executors: the nodes their agents serve now (live, not drained), the cluster this round
    # schedules. None: the executors' cluster is the fixed one the services were started with.
    nodes: tuple[Node, ...] | None = None
