"""What the framework integrations (`goodput_train.lightning`, `goodput_train.huggingface`) share: a
framework's loop owns the data, the forward and backward passes and the optimizer step, and calls a
`StepMeter` around each optimizer step, which does the rest of what `AdaptiveTraining` does:

- `before_step`, the gradients averaged over the replicas and ready: every `noise_every` steps
  (PAIR_EVERY, 16), a pair of consecutive steps' gradients gives the noise scale's sample (`pgns.from_consecutive`, in
  Adam's preconditioned metric for the optimizers with `exp_avg_sq`); the learning rate of each
  group is multiplied by its rule's factor (`lr`) for this step's total batch;
- `after_step`, the optimizer step done: the learning rates set back (the framework's scheduler
  goes on from its own), the step timed, progress counted in M0-examples, `JobStats` reported every
  `report_every_s`; every `agree_every` steps (4) the replicas agree, in one small all-reduce, whether
  any was told to stop (SIGTERM, the lifeline's end: `worker.watch_stops`) or a periodic checkpoint
  is due (rank 0's clock), so all save or stop at the same step.

`start_batch` decides the per-replica batch and accumulation a run starts with, from the checkpoint
of the run before (the same total batch split over the new replicas, re-picked for goodput from
the step times measured), and `profile_run` times the profiler's sweep. Each framework's module says
which of these its loop lets it apply.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from goodput_train import profiling
from goodput_train.goodput import BatchLimits, FitError, GoodputModel, Observation, fit_throughput, split_batch
from goodput_train.lr import LrScaling, default_rule
from goodput_train.pgns import NoiseSample, NoiseScale, from_replicas, sum_of_squares
from goodput_train.protocol import (
    ADAPTIVE_ENV,
    CHECKPOINT_ENV,
    CHECKPOINT_PATH_ENV,
    JOB_ENV,
    PROFILE_PREFIX,
    REPORT_ENV,
    SLOT_MEMORY_ENV,
    STOPPED_MARK,
    JobStats,
    ProfileRun,
)
from goodput_train.trainer import (
    CHECKPOINT_EVERY_S,
    MAX_BATCH_REPLICAS,
    NOISE_EVERY,
    TIMINGS_KEPT,
    Placement,
    Stopped,
    gpu_type,
)
from goodput_train.worker import print_line, print_stats, say, sweep, watch_stops

# Steps between a framework loop's noise samples: a pair of consecutive steps' averaged gradients
# (a copy of one, the preconditioner and two norms: about a tenth of a small model's step on a CPU
# slot), so a sample every 16 steps costs about 1% of a step; the estimate smooths over as many samples.
PAIR_EVERY = 16


def checkpoint_path() -> str | None:
    """The contract's checkpoint file (GOODPUT_CHECKPOINT), None when unset."""
    return os.environ.get(CHECKPOINT_PATH_ENV) or None


def adaptive_env() -> bool:
    """False when the executor keeps this job's batch (GOODPUT_ADAPTIVE=0: rigid, or a policy that does not adapt)."""
    return os.environ.get(ADAPTIVE_ENV) != "0"


def limits_for(init_batch: int, max_local: int, max_batch: int | None = None) -> BatchLimits:
    """The job's batch limits, by AdaptiveTraining's defaults: up to `max_local` a replica on MAX_BATCH_REPLICAS."""
    return BatchLimits(init_batch, max_batch or max(init_batch, max_local * MAX_BATCH_REPLICAS), 1, max_local)


def start_batch(
    state: dict | None, placement: Placement, m: int, s: int, limits: BatchLimits, adaptive: bool
) -> tuple[int, int]:
    """(m, s) for this run: the script's own at the first start or when the batch is kept; resumed on
    another allocation, the total batch of the run before split over this one, then re-picked for
    goodput from the step times measured (as `AdaptiveTraining` resumes)."""
    if state is None or not adaptive:
        return m, s
    world, m0, s0 = state["batch"]
    m, s = split_batch(world * m0 * (s0 + 1), placement.world, limits.max_local)
    noise = NoiseScale(limits.init_batch)
    noise.load_state_dict(state["noise"])
    stats = noise.stats()
    observations = observations_of(_timings(state))
    try:
        model = GoodputModel(fit_throughput(observations), *(stats or (None, None)), limits.init_batch)
        _, m1, s1 = model.retune(placement.nodes, placement.world, limits, (m, s))
        if m1 > 0:
            m, s = m1, s1
    except FitError:
        pass
    return m, s


def observations_of(timings: dict) -> list[Observation]:
    """Each configuration run, with the median of its recent step times."""
    return [
        Observation(nodes, gpus, m, s, float(torch.tensor(times).median()))
        for (nodes, gpus, m, s), times in sorted(timings.items())
    ]


def _timings(state: dict) -> dict:
    """The step times a checkpoint holds, when they were this GPU type's (else measured afresh)."""
    if state.get("gpu_type") != gpu_type():
        return defaultdict(list)
    return defaultdict(list, {tuple(key): times for key, times in state["timings"]})


def adam_scales(optimizer: torch.optim.Optimizer) -> list[torch.Tensor | None] | None:
    """For each parameter of `optimizer` with a gradient, in its groups' order, the square root of
    Adam's diagonal preconditioner 1 / (sqrt(v̂) + eps) (None without its state yet: SGD, or
    before the first step); None when no parameter has one: the plain metric. With v̂ = v / c
    (c = 1 - beta2^step, the bias correction) it is c^¼ · (sqrt(v) + eps·sqrt(c))^-½, taken over
    each group's tensors at once (a few fused passes: a tenth of the time of one pass per tensor
    and operation, on a CPU slot)."""
    scales: list[torch.Tensor | None] = []
    for group in optimizer.param_groups:
        at, moments, correction = [], [], None
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state.get(p, {})
            scales.append(None)
            if "betas" in group and "exp_avg_sq" in state:
                c = 1 - group["betas"][1] ** float(state["step"])
                if correction not in (None, c):  # steps differ within the group: one at a time
                    scales[-1] = _scale(state["exp_avg_sq"], c, group["eps"])
                    continue
                correction = c
                at.append(len(scales) - 1)
                moments.append(state["exp_avg_sq"])
        if moments:
            roots = torch._foreach_sqrt(moments)
            torch._foreach_add_(roots, group["eps"] * correction**0.5)
            torch._foreach_rsqrt_(roots)
            torch._foreach_mul_(roots, correction**0.25)
            for i, root in zip(at, roots):
                scales[i] = root
    return None if all(scale is None for scale in scales) else scales


def _scale(moment: torch.Tensor, correction: float, eps: float) -> torch.Tensor:
    return (moment.sqrt() + eps * correction**0.5).rsqrt() * correction**0.25


class StepMeter:
    """Around each optimizer step of a framework's loop: the noise scale, the learning-rate factor,
    step times, progress, reports and the agreed stop (see the module doc).

    - `batch` (m, s): this run's per-replica micro-batch and accumulation steps;
    - `init_batch`: M0, the total batch the job was tuned for (by default this run's, when no
      checkpoint says otherwise);
    - `dataset_size`: examples in an epoch (statistical epochs are M0-examples over it).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        batch: tuple[int, int],
        init_batch: int,
        dataset_size: int,
        lr_rule: str | None = None,
        warmup_epochs: float = 0.0,
        target_epochs: float | None = None,
        noise_every: int = PAIR_EVERY,
        agree_every: int = NOISE_EVERY,
        report: Callable[[JobStats], None] | None = None,
        report_every_s: float | None = None,
        checkpoint_every_s: float | None = CHECKPOINT_EVERY_S,
        device: torch.device | None = None,
    ):
        self.placement = Placement.from_env()
        self.optimizer = optimizer
        self.m, self.s = batch
        self.dataset_size = max(1, dataset_size)
        self.lr = LrScaling(lr_rule or default_rule(type(optimizer).__name__), init_batch, warmup_epochs)
        self.target_epochs = target_epochs
        self.noise_every, self.agree_every = max(1, noise_every), max(1, agree_every)
        if report is None and os.environ.get(REPORT_ENV):
            report, report_every_s = print_stats, float(os.environ[REPORT_ENV])
        self.reporter, self.report_every_s = report, report_every_s
        self.checkpoint_every_s = float(os.environ.get(CHECKPOINT_ENV, 0)) or checkpoint_every_s
        self.device = device or torch.device("cpu")
        self.noise = NoiseScale(init_batch)
        self.progress = 0.0
        self.steps = 0
        self.timings: dict[tuple[int, int, int, int], list[float]] = defaultdict(list)
        self.stop_requested = False
        self._previous: list[torch.Tensor] | None = None  # a buffer: the sampled step's gradient
        self._holding = False  # it holds the last step's gradient (the pair's first)
        self._lrs: list[float] | None = None  # the groups' own learning rates, while scaled
        self._ended: float | None = None  # when the last step ended (its successor is timed from it)
        self._reported = self._saved = time.monotonic()
        watch_stops(self.request_stop)

    def request_stop(self) -> None:
        self.stop_requested = True

    @property
    def batch(self) -> int:
        return self.placement.world * self.m * (self.s + 1)

    @property
    def epochs(self) -> float:
        return self.progress / self.dataset_size

    def done(self) -> bool:
        return self.target_epochs is not None and self.epochs >= self.target_epochs

    def before_step(self) -> None:
        """The gradients are averaged and ready: sample the noise (a pair of steps every
        `noise_every`, over the optimizer's parameters), then scale each group's learning rate for
        this step's batch."""
        sampled = self.steps % self.noise_every
        if sampled == 0 or (sampled == 1 and self._holding):
            grads = [
                p.grad.detach() for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None
            ]
            if self._holding and len(self._previous) == len(grads):
                self.noise.update(self._pair_sample(grads))
            self._holding = sampled == 0
            if self._holding:
                if self._previous is None or [b.shape for b in self._previous] != [g.shape for g in grads]:
                    self._previous = [g.clone() for g in grads]
                else:
                    torch._foreach_copy_(self._previous, grads)
        stats = self.noise.stats()
        factor = self.lr.factor(self.batch, *(stats or (None, None)), self.epochs)
        if factor != 1.0:
            self._lrs = [group["lr"] for group in self.optimizer.param_groups]
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * factor

    def _pair_sample(self, grads: list[torch.Tensor]) -> NoiseSample:
        """The differenced estimator (`pgns.from_consecutive`) of the held gradient g0 and this
        step's g1, as the replica estimator of the two (`from_replicas`: their mean squared norm is
        |g1 - g0|²/4 + |(g0 + g1)/2|²), in the preconditioner's metric. In place over the held
        buffer and the preconditioner's, so a sample allocates one gradient's worth at most."""
        difference = self._previous
        torch._foreach_sub_(difference, grads)  # g0 - g1
        scales = adam_scales(self.optimizer)
        if scales is None:
            half_sum = torch._foreach_add(grads, difference, alpha=0.5)  # (g0 + g1) / 2
        else:
            half_sum = [torch.ones_like(g) if s is None else s for g, s in zip(grads, scales)]
            torch._foreach_mul_(difference, half_sum)
            torch._foreach_mul_(half_sum, grads)
            torch._foreach_add_(half_sum, difference, alpha=0.5)
        difference_sqr, mean_sqr = torch.stack([sum_of_squares(difference), sum_of_squares(half_sum)]).tolist()
        return from_replicas(difference_sqr / 4 + mean_sqr, mean_sqr, self.batch, 2)

    def restore_lr(self) -> None:
        """The groups' own learning rates back, right after the optimizer step (before the
        framework's scheduler reads them)."""
        if self._lrs is not None:
            for group, lr in zip(self.optimizer.param_groups, self._lrs):
                group["lr"] = lr
            self._lrs = None

    def after_step(self) -> tuple[bool, bool]:
        """The optimizer step is done: the learning rates set back, the step counted and timed, a
        report if one is due. (stop, save): whether all replicas stop now, or checkpoint now."""
        self.restore_lr()
        stats = self.noise.stats()
        self.progress += self.lr.progress(self.batch, *(stats or (None, None)))
        self.steps += 1
        now = time.perf_counter()
        if self._ended is not None:
            key = (self.placement.nodes, self.placement.world, self.m, self.s)
            self.timings[key] = (self.timings[key] + [now - self._ended])[-TIMINGS_KEPT:]
        self._ended = now
        if self.reporter and time.monotonic() - self._reported >= self.report_every_s:
            self.report()
        if self.steps % self.agree_every:
            return False, False
        return self._agree()

    def end_step(self, save: Callable[[], None]) -> bool:
        """`after_step`, and what it asks: `save()` (a checkpoint) when one is due or all stop;
        on a stop, the stopped mark and `Stopped` (the script ends, exit code 0). Whether the
        statistical target is reached (the framework's loop should end)."""
        stop, due = self.after_step()
        if stop:
            save()
            say(STOPPED_MARK)
            raise Stopped("stopped (SIGTERM, or the executor is gone): state saved")
        if due:
            save()
        return self.done()

    def _agree(self) -> tuple[bool, bool]:
        save_due = (
            self.checkpoint_every_s is not None
            and self.placement.rank == 0
            and time.monotonic() - self._saved >= self.checkpoint_every_s
        )
        if self.placement.world == 1 or not dist.is_initialized():
            return self.stop_requested, save_due
        flags = torch.tensor([float(self.stop_requested), float(save_due)], device=self.device)
        dist.all_reduce(flags)
        stop, save = flags.tolist()
        return stop > 0, save > 0

    def pause(self) -> None:
        """What happens between steps now (a checkpoint, an evaluation) is not the next step's time."""
        self._ended = None

    def saved(self) -> None:
        self._saved = time.monotonic()
        self.pause()

    def report(self) -> None:
        """Hand `report` what was measured (rank 0); the executor gone: stop at the next agreement."""
        if not self.reporter or self.placement.rank != 0:
            return
        self._reported = time.monotonic()
        try:
            self.reporter(self.stats())
        except BrokenPipeError:
            self.reporter, self.stop_requested = None, True

    def stats(self) -> JobStats:
        noise = self.noise.stats()
        return JobStats(
            os.environ.get(JOB_ENV, "job"),
            gpu_type(),
            tuple(observations_of(self.timings)),
            *(noise or (None, None)),
            self.epochs,
            self.steps,
            self.m,
            self.s,
            self.noise.skipped,
            self.target_epochs,
        )

    def state_dict(self) -> dict:
        return {
            "noise": self.noise.state_dict(),
            "progress": self.progress,
            "steps": self.steps,
            "init_batch": self.lr.init_batch,
            "batch": [self.placement.world, self.m, self.s],
            "gpu_type": gpu_type(),
            "timings": [[list(key), times] for key, times in self.timings.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        self.noise.load_state_dict(state["noise"])
        self.progress, self.steps = state["progress"], state["steps"]
        self.timings = _timings(state)


class Batches:
    """Batches of any size from a loader's dataset, collated as its loader collates them, endlessly
    (the profiling sweep's)."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self.iterators: dict[int, Any] = {}

    def next(self, size: int) -> Any:
        for _ in range(2):
            if size not in self.iterators:
                fresh = DataLoader(
                    self.loader.dataset,
                    batch_size=size,
                    shuffle=not isinstance(self.loader.dataset, IterableDataset),
                    collate_fn=self.loader.collate_fn,
                    drop_last=True,
                )
                self.iterators[size] = iter(fresh)
            try:
                return next(self.iterators[size])
            except StopIteration:
                del self.iterators[size]
        raise ValueError(f"the dataset has fewer than {size} examples")


class Profiled(SystemExit):
    """The profiling run printed its profile: the script ends there, with exit code 0 (nothing
    after the framework's fit or train runs)."""

    def __init__(self):
        super().__init__(0)


def profile_and_end(
    step_at: Callable[[int], None], sizes: list[int], init_batch: int, max_batch: int, optimizer: torch.optim.Optimizer
) -> NoReturn:
    """The profiling run, as `AdaptiveTraining.profile` does it: a CPU slot's memory made real
    (GOODPUT_SLOT_MEMORY_MB), `step_at(m)` timed at each per-GPU batch m of `sizes` (`worker.sweep`),
    the profile printed for the profiler; then the script ends (`Profiled`)."""
    if os.environ.get(SLOT_MEMORY_ENV):
        profiling.limit_memory(float(os.environ[SLOT_MEMORY_ENV]))
    measured, out_of_memory, spent = sweep(
        step_at,
        sizes,
        profiling.PROFILE_STEPS,
        profiling.PROFILE_BUDGET_S,
        lambda: optimizer.zero_grad(set_to_none=True),
    )
    print_line(PROFILE_PREFIX, ProfileRun(tuple(measured), init_batch, max_batch, out_of_memory, spent))
    raise Profiled()
