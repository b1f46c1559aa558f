"""Goodput-driven cloud auto-scaling of one long job (Pollux §5.4.1), and a throughput-only baseline.

A cloud cluster adds or removes whole nodes (`gpus_per_node` GPUs of one type). Every decision
period the auto-scaler predicts, from the job's goodput model, the goodput G(n) of every node count
n (the best batch and accumulation for n nodes, `GoodputModel.best_batch`) and its scaling
efficiency

    E(n) = G(n) / (n * G(1))          predicted goodput per node over the ideal (perfect scaling)

At the current size c it scales up when E(c) > U, down when E(c) < L, and otherwise stays; a
rescale goes to the largest n whose every size 1..n keeps E >= L, so it never passes the size
where goodput per node falls below L of ideal. Pollux: U = 2/3, L = 1/2.

The two policies differ in what they count as goodput:
- `goodput` (Pollux): the job's goodput model with its gradient statistics now (PGNS), at the best
  (m, s) for each size, so E(n) counts the statistical efficiency lost to the larger batch that more
  nodes bring. PGNS grows during training, and so does the job.
- `throughput` (Or et al., MLSys'20): system throughput alone (no statistical efficiency) at a fixed
  per-GPU batch, by default the largest the GPU's memory allows (the batch of highest throughput;
  `baseline_local_batch` sets another), no accumulation: each node adds R times that batch to the
  total batch, as scaling out with linear batch scaling does. E(n) = X(n) / (n X(1)) does not
  change with training progress, and neither does the size it picks.

Both runs play the job's TRUE behaviour (`services.simulated.truth.ModelTruth`) through `services.simulated.world.SimulatedJob`,
as the simulator does: `apply` pays the restart delay of a rescale and re-tunes (m, s) with the
policy's model, `advance` trains epoch by epoch at the true goodput.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from goodput_train.goodput import BatchLimits, GoodputModel, Observation, ThroughputParams, fit_throughput, throughput
from services.simulated.truth import ModelTruth
from services.simulated.world import SimulatedJob
from shared.cluster import Cluster
from shared.schema.base import Node, Spots
from shared.schema.rounds import JobModels
from shared.settings import SimSettings
from sim.reference import WorkloadJob

UPPER = 2 / 3  # scale up above this fraction of ideal goodput per node (Pollux §5.4.1)
LOWER = 1 / 2  # ... to the size where it is about this fraction; scale down below it
POLLUX_REPORTED = {"cost_ratio": 0.75, "time_ratio": 1.06}  # §5.4.1: 25% cheaper, 6% longer
HORIZON_S = 60 * 24 * 3600.0  # a run still going after 60 days is reported unfinished
_FIT_BATCHES = 6  # per-GPU batches sampled per node count to fit the scaler's throughput model


@dataclass(frozen=True)
class ScalingOptions:
    """The auto-scaler's knobs, checked once: thresholds, node size and the most nodes it may rent."""

    upper: float = UPPER
    lower: float = LOWER
    gpus_per_node: int = 4
    max_nodes: int = 16
    period_s: float = 60.0
    baseline_local_batch: int | None = None  # the throughput scaler's per-GPU batch (None: the largest)

    def __post_init__(self):
        if not 0 < self.lower:
            raise ValueError(f"lower threshold L must be > 0, got {self.lower}")
        if not self.lower < self.upper:
            raise ValueError(f"upper threshold U must be above the lower L, got U={self.upper} <= L={self.lower}")
        if self.upper > 1:
            raise ValueError(f"upper threshold U must be <= 1 (a fraction of ideal goodput), got {self.upper}")
        if self.gpus_per_node < 1:
            raise ValueError(f"a node needs at least 1 GPU, got gpus_per_node={self.gpus_per_node}")
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        if not self.period_s > 0:
            raise ValueError(f"the decision period must be > 0 s, got {self.period_s}")
        if self.baseline_local_batch is not None and self.baseline_local_batch < 1:
            raise ValueError(f"the baseline's per-GPU batch must be >= 1, got {self.baseline_local_batch}")


# --- the decision --------------------------------------------------------------------------------


def _sizes(options: ScalingOptions) -> np.ndarray:
    return np.arange(1, options.max_nodes + 1)


def _per_node(rate: np.ndarray, what: str, options: ScalingOptions) -> np.ndarray:
    """rate(n) / (n rate(1)): the fraction of perfect scaling from one node that n nodes keep."""
    if rate[0] <= 0:
        raise ValueError(f"no {what} on one node of {options.gpus_per_node} GPUs")
    return rate / (_sizes(options) * rate[0])


def goodput_scaling(model: GoodputModel, limits: BatchLimits, options: ScalingOptions) -> np.ndarray:
    """E(n) = G(n) / (n G(1)) for n = 1 .. max_nodes (index n - 1), G at the best batch for n nodes
    under the model's gradient statistics; 0 where no batch fits n nodes."""
    nodes = _sizes(options)
    return _per_node(
        model.best_batch(nodes, nodes * options.gpus_per_node, limits).goodput, f"batch in {limits} fits", options
    )


def throughput_scaling(params: ThroughputParams, per_gpu_batch: int, options: ScalingOptions) -> np.ndarray:
    """X(n) / (n X(1)) for n = 1 .. max_nodes: system throughput scaling at a fixed per-GPU batch."""
    nodes = _sizes(options)
    return _per_node(throughput(params, nodes, nodes * options.gpus_per_node, per_gpu_batch), "throughput", options)


def efficient_size(scaling: np.ndarray, lower: float) -> int:
    """The most nodes n whose every size 1..n keeps scaling >= lower (at least 1 node)."""
    below = np.flatnonzero(scaling < lower)
    return max(int(below[0]) if below.size else len(scaling), 1)


def next_size(nodes: int, scaling: np.ndarray, options: ScalingOptions) -> int:
    """Hold while L <= scaling(now) <= U; otherwise (and past the largest size) the largest that keeps
    scaling >= L: up when there is headroom above U, down when below L."""
    if nodes < 1:
        raise ValueError(f"a job runs on at least 1 node, got {nodes}")
    if nodes <= len(scaling) and options.lower <= scaling[nodes - 1] <= options.upper:
        return nodes
    return efficient_size(scaling, options.lower)


def decide(nodes: int, model: GoodputModel, limits: BatchLimits, options: ScalingOptions) -> int:
    """The goodput auto-scaler's node count after `nodes`, for the job's model with the gradient
    statistics it measures now."""
    return next_size(nodes, goodput_scaling(model, limits, options), options)


def baseline_per_gpu_batch(limits: BatchLimits, options: ScalingOptions) -> int:
    """The throughput scaler's fixed per-GPU batch: the option's within the job's per-GPU limits,
    else the largest (throughput grows with the per-GPU batch: that is the one a throughput-only
    scaler runs)."""
    return int(np.clip(options.baseline_local_batch or limits.max_local, limits.min_local, limits.max_local))


# --- the job's throughput model ------------------------------------------------------------------


def fitted_throughput(truth: ModelTruth, gpu_type: str, options: ScalingOptions) -> ThroughputParams:
    """The throughput model the job would have learnt having run every size it can be given: fitted
    (`fit_throughput`) to its true step times on one GPU and on 1..max_nodes whole nodes."""
    lo, hi = truth.local_limits[gpu_type]
    batches = np.unique(np.geomspace(lo, hi, _FIT_BATCHES).round().astype(int))
    placements = [[1]] + [[options.gpus_per_node] * n for n in range(1, options.max_nodes + 1)]
    kind = truth.types[gpu_type]
    observations = []
    for placement in placements:
        for m in batches:
            t_iter, t_compute = kind.iteration_time(placement, int(m), 0)
            observations.append(Observation(len(placement), sum(placement), int(m), 0, t_iter, t_compute))
    return fit_throughput(observations)


# --- a run ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One decision period of a run: what it ran with, and the true statistical efficiency of it."""

    t_s: float
    nodes: int
    batch: int
    efficiency: float  # true EFFICIENCY of the batch at the job's progress
    progress: float  # fraction of training done at the period's start


@dataclass(frozen=True)
class AutoscaleRun:
    policy: str
    model: str
    gpu_type: str
    samples: tuple[Sample, ...]
    finish_s: float | None  # None: not finished within the horizon
    gpu_hours: float  # every GPU rented, restarts included: the cost
    restarts: int

    def node_changes(self) -> list[tuple[float, int]]:
        """(time, nodes) at the start and at every rescale."""
        return [(x.t_s, x.nodes) for i, x in enumerate(self.samples) if i == 0 or x.nodes != self.samples[i - 1].nodes]

    def mean_efficiency(self) -> float:
        """True statistical efficiency averaged over the run's decision periods (equal lengths)."""
        return float(np.mean([x.efficiency for x in self.samples]))

    def mean_nodes(self) -> float:
        return float(np.mean([x.nodes for x in self.samples]))


def node_pool(gpu_type: str, options: ScalingOptions) -> Cluster:
    """The cloud's nodes the job may rent, named so that n nodes are always the first n."""
    return Cluster(
        "autoscale", tuple(Node(f"{gpu_type}-{i}", gpu_type, options.gpus_per_node) for i in range(options.max_nodes))
    )


def spots(cluster: Cluster, nodes: int) -> Spots:
    return tuple((node.name, node.gpus) for node in cluster.nodes[:nodes])


def batch_limits(truth: ModelTruth, gpu_type: str, settings: SimSettings) -> BatchLimits:
    """The job's batch limits on the type, with the calibration's per-model cap on the per-GPU batch."""
    lo, hi = truth.local_limits[gpu_type]
    hi = min(hi, settings.max_local.get(truth.name, hi))
    return BatchLimits(truth.init_batch, truth.max_batch, lo, hi)


@dataclass(frozen=True)
class JobSetting:
    """What both auto-scalers know of the job: its type, batch limits and fitted throughput model."""

    truth: ModelTruth
    gpu_type: str
    options: ScalingOptions
    limits: BatchLimits
    params: ThroughputParams

    def models(self, grad_sqr: float | None = None, grad_var: float | None = None) -> JobModels:
        """The job's models as the executor re-tunes with them; no statistics: throughput only."""
        lim = self.limits
        return JobModels(
            self.truth.name,
            {self.gpu_type: self.params},
            {self.gpu_type: (lim.min_local, lim.max_local)},
            lim.init_batch,
            lim.max_batch,
            grad_sqr,
            grad_var,
        )


def goodput_choice(job: SimulatedJob, nodes: int, setting: JobSetting, now: float) -> tuple[int, JobModels, bool]:
    """Pollux: decide on the goodput model with the gradient statistics the job measures now (at the
    batch it runs); the executor re-tunes (m, s) for goodput (adaptive)."""
    facts = job.facts(setting.truth, now)
    models = setting.models(facts.grad_sqr, facts.grad_var)
    return decide(nodes, models.model(setting.gpu_type), setting.limits, setting.options), models, True


def throughput_choice(job: SimulatedJob, nodes: int, setting: JobSetting, now: float) -> tuple[int, JobModels, bool]:
    """Or et al.: decide on throughput scaling at the fixed per-GPU batch; the job runs that batch on
    every GPU (non-adaptive: `apply` splits the requested total batch into micro-batches that fit)."""
    options = setting.options
    m = baseline_per_gpu_batch(setting.limits, options)
    nodes = next_size(nodes, throughput_scaling(setting.params, m, options), options)
    gpus = nodes * options.gpus_per_node
    # A non-adaptive executor runs the batch its job requests: the request follows the size.
    job.spec = replace(job.spec, num_replicas=gpus, batch_size=gpus * m)
    return nodes, setting.models(), False


CHOICES = {"goodput": goodput_choice, "throughput": throughput_choice}
POLICIES = tuple(CHOICES)


def run_autoscaler(
    truth: ModelTruth,
    policy: str,
    gpu_type: str,
    options: ScalingOptions,
    settings: SimSettings,
    horizon_s: float = HORIZON_S,
) -> AutoscaleRun:
    """Train the job to completion on an auto-scaled cloud cluster: every period, decide the node
    count, apply it (a change costs the restart delay), run the period at the true goodput."""
    if policy not in CHOICES:
        raise ValueError(f"unknown auto-scaling policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if gpu_type not in truth.types:
        raise ValueError(f"model {truth.name} has no profile on GPU type {gpu_type!r} (has: {', '.join(truth.types)})")
    choose, cluster = CHOICES[policy], node_pool(gpu_type, options)
    job_setting = JobSetting(
        truth, gpu_type, options, batch_limits(truth, gpu_type, settings), fitted_throughput(truth, gpu_type, options)
    )
    job = SimulatedJob(
        WorkloadJob(truth.name, 0.0, truth.name, options.gpus_per_node, truth.init_batch),
        None,
        settings.restart_delay(truth.name),
        settings.goodput_factor(truth.name),
    )
    nodes, now, samples = 1, 0.0, []
    while job.finish_s is None and now < horizon_s:
        nodes, models, adaptive = choose(job, nodes, job_setting, now)
        job.apply(cluster, spots(cluster, nodes), models, adaptive, now, settings.retune_threshold)
        batch = job.batch
        samples.append(
            Sample(now, nodes, batch, truth.efficiency(job.progress, batch), job.progress / truth.total_progress)
        )
        job.advance(truth, now, options.period_s, 1)
        now += options.period_s
    return AutoscaleRun(
        policy, truth.name, gpu_type, tuple(samples), job.finish_s, job.gpu_seconds / 3600, job.restarts
    )


def compare(
    truth: ModelTruth, gpu_type: str, options: ScalingOptions, settings: SimSettings, horizon_s: float = HORIZON_S
) -> dict[str, AutoscaleRun]:
    """Both policies on the same job, cluster and settings."""
    return {policy: run_autoscaler(truth, policy, gpu_type, options, settings, horizon_s) for policy in POLICIES}


def ratios(runs: dict[str, AutoscaleRun]) -> dict[str, float | None]:
    """Goodput over throughput: cost (GPU-hours) and completion time; None unless both finished
    (an unfinished run's cost is not the cost of training the job)."""
    good, base = runs["goodput"], runs["throughput"]
    if good.finish_s is None or base.finish_s is None:
        return {"cost_ratio": None, "time_ratio": None}
    return {"cost_ratio": good.gpu_hours / base.gpu_hours, "time_ratio": good.finish_s / base.finish_s}
