"""The training library: a few lines in an ordinary PyTorch script make it adaptive.

    training = AdaptiveTraining(model, optimizer, dataset, init_batch=128, target_epochs=20)
    training.run(lambda model, batch: loss_fn(model(batch[0]), batch[1]))
    training.report(accuracy=evaluate(model))  # any metrics, under any name

(`run` is the loop below, with a clean stop on SIGTERM, and the profiling run when the profiler
started the script: `profile`.) Under goodput the script needs nothing more: the checkpoint file
comes from GOODPUT_CHECKPOINT (so a rescaled job resumes where it stopped), its place from
torchrun's variables, and its exit code is its word: 0 is done (or stopped, when the library
printed its stopped mark: see `Stopped`), anything else a crash. docs/jobs.md has the contract.

    while not training.done():
        for inputs, targets in training.micro_batches():
            training.backward(loss_fn(training.model(inputs), targets))
        training.step()

It trains data-parallel (torch.distributed: gloo on CPU, NCCL on GPUs) with the rank and world size
that the executor gives it in torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT; GOODPUT_NODES for the node count), and each step:

- takes its share of the next B = world · m · (s + 1) examples (`data.ElasticOrder`);
- estimates the gradient noise scale from what it computed anyway (`pgns`): the replicas' local
  gradients (a DDP communication hook takes each local norm before the all-reduce, every
  `noise_every` steps), else the accumulation steps', else two consecutive steps' gradients; in
  Adam's preconditioned metric; a step with a NaN or Inf in its gradient is skipped;
- scales the learning rate by its rule (`lr`) and counts statistical progress in M0-examples;
- measures the step's time, and every `retune_every` steps fits the throughput model to what it
  measured (goodput_train.goodput.fit_throughput) and re-picks (m, s) for the most goodput (rank 0
  decides and broadcasts, so every rank runs the same batch);
- every `report_every_s` (30 s) hands `report` a `JobStats`: the configurations it ran with their
  step times, its gradient statistics and its statistical progress (rank 0 only).

`save()` checkpoints atomically (model, optimizer, data position, noise scale, progress, what it
measured); a job resumes from it at any world size. SIGTERM makes the next `step()` save, print
the stopped mark and raise `Stopped`, so a rescale or a preemption loses at most one step; a checkpoint every
`checkpoint_every_s` (5 min) bounds what a crash loses. Both are agreed by all replicas through
the last gradient bucket's all-reduce of a sampling step (every `noise_every`), so all save at the
same step.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import math
import os
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, TensorDataset, default_collate

from goodput_train import checkpoint, profiling
from goodput_train.data import ElasticOrder
from goodput_train.goodput import BatchLimits, FitError, GoodputModel, Observation, fit_throughput, split_batch
from goodput_train.lr import LrScaling, default_rule
from goodput_train.pgns import NoiseScale, from_consecutive, from_replicas, sum_of_squares
from goodput_train.protocol import (
    ADAPTIVE_ENV,
    CHECKPOINT_ENV,
    CHECKPOINT_PATH_ENV,
    COLLECTIVE_TIMEOUT_ENV,
    COLLECTIVE_TIMEOUT_S,
    GPU_TYPE_ENV,
    JOB_ENV,
    METRICS_PREFIX,
    PROFILE_ENV,
    PROFILE_PREFIX,
    REPORT_ENV,
    REPORT_EVERY_S,
    SLOT_MEMORY_ENV,
    STOPPED_MARK,
    JobStats,
    ProfileRun,
    clean_metrics,
)
from goodput_train.worker import print_line, print_stats, say, sweep, watch_stops

RETUNE_EVERY = 20  # steps between re-fits of the throughput model
# steps between the replicas' noise samples (their local norms: a pass over the gradient each)
NOISE_EVERY = 4
CHECKPOINT_EVERY_S = 300.0  # a periodic checkpoint: what a crash can lose at most
TIMINGS_KEPT = 5  # step times kept per configuration (their median is the observation)
# max_batch by default: the largest per-GPU batch (max_local) on this many replicas
MAX_BATCH_REPLICAS = 16
log = logging.getLogger(__name__)


class Stopped(SystemExit):
    """SIGTERM arrived (or the lifeline ended): the state was saved and the stopped mark printed.
    Uncaught, it ends the script with exit code 0, and the executor resumes the job; a SystemExit,
    so no `except Exception` in the script's own loop swallows it."""

    def __init__(self, reason: str = "stopped: state saved"):
        super().__init__(0)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class Placement:
    """Where this worker runs, as the executor tells it (torchrun's environment)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    nodes: int = 1

    @classmethod
    def from_env(cls) -> Placement:
        env = os.environ
        return cls(
            int(env.get("RANK", 0)),
            int(env.get("WORLD_SIZE", 1)),
            int(env.get("LOCAL_RANK", 0)),
            int(env.get("GOODPUT_NODES", 1)),
        )


class _Exchange:
    """The state of `_exchange_hook`: this step's squared norms, bucket by bucket (0-dim tensors on
    the device: nothing waits for it during the backward pass), what this replica asks for (to
    stop; to checkpoint), and what all replicas agreed on."""

    def __init__(
        self,
        scales: Callable[[list[torch.Tensor]], list[torch.Tensor | None] | None] | None,
        requests: Callable[[], tuple[bool, bool]],
        world: int,
    ):
        self.scales = scales  # the metric (Adam's preconditioner); None: always the plain one (SGD)
        self.requests = requests
        self.world = world
        self.local: list[torch.Tensor] = []  # this replica's gradient, before the all-reduce
        self.mean: list[torch.Tensor] = []  # the averaged gradient, after it
        # (the local squared norms, the stop requests, the checkpoint requests), each summed over
        # the replicas: a 3-element tensor, read by `step`
        self.agreed: torch.Tensor | None = None
        self.sample = True  # take the local norms this step (the estimator's sample)
        self._no_requests: torch.Tensor | None = None

    def reset(self) -> None:
        self.local, self.mean, self.agreed = [], [], None

    def squared(self, bucket, buffer: torch.Tensor, grads: list[torch.Tensor] | None) -> torch.Tensor:
        """The bucket's squared norm in the optimizer's metric: one pass over its flat buffer."""
        scales = self.scales(bucket.parameters()) if self.scales is not None else None
        return sum_of_squares([buffer]) if scales is None else sum_of_squares(grads or bucket.gradients(), scales)

    def request_flags(self, like: torch.Tensor) -> torch.Tensor:
        """Stop and checkpoint requests as two numbers (zeros, the usual case, made once: no host
        to device copy a step)."""
        stop, save = self.requests()
        if stop or save:
            return torch.tensor([float(stop), float(save)], dtype=like.dtype, device=like.device)
        if (
            self._no_requests is None
            or self._no_requests.dtype != like.dtype
            or self._no_requests.device != like.device
        ):
            self._no_requests = torch.zeros(2, dtype=like.dtype, device=like.device)
        return self._no_requests


def _release_distributed(training: weakref.ref) -> None:
    """At exit, while the interpreter still runs: drop the DDP wrapper (its reducer holds the process
    group, past `destroy_process_group`) and then the group. Left to the interpreter's teardown, the
    group's threads may free tensors that need the GIL and the process aborts after its last line."""
    if (alive := training()) is not None and isinstance(alive.model, DistributedDataParallel):
        alive.model = alive.model.module
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _exchange_hook(state: _Exchange, bucket):
    """DDP communication hook. The loss was divided by the number of replicas (`backward`), so a
    bucket's sum over the replicas is their average: no pass over the bucket to divide it. Each
    bucket's local squared norm is taken before its all-reduce (the replica estimator's samples, at
    no extra pass over the data), the averaged bucket's once the all-reduce is done, both over the
    bucket's flat buffer. On a sampling step the last bucket carries three more numbers in its
    all-reduce — the local norms' sum, the stop requests and the checkpoint requests — so agreeing
    on them costs no collective of its own; the other steps skip that copy in and out."""
    buffer = bucket.buffer()
    grads = bucket.gradients() if state.scales is not None else None  # views of the buffer
    if state.sample:
        state.local.append(state.squared(bucket, buffer, grads))
    if not (bucket.is_last() and state.sample):

        def averaged(future):
            reduced = future.value()[0]
            state.mean.append(state.squared(bucket, reduced, grads))
            return reduced

        return dist.all_reduce(buffer, async_op=True).get_future().then(averaged)
    if not state.local:
        local = torch.zeros(1, dtype=buffer.dtype, device=buffer.device)
    else:
        local = state.local[0] if len(state.local) == 1 else torch.stack(state.local).sum()
        local = (local * state.world**2).reshape(1).to(buffer.dtype)  # the norm of the undivided gradient
    state.local = []
    combined = torch.cat([buffer, local, state.request_flags(buffer)])

    def settle(future):
        reduced = future.value()[0]
        buffer.copy_(reduced[:-3])
        state.agreed = reduced[-3:].clone()
        state.mean.append(state.squared(bucket, buffer, grads))
        return buffer

    return dist.all_reduce(combined, async_op=True).get_future().then(settle)


def gpu_type() -> str:
    """The GPU type the job runs on, as its executor names it (its step times are this type's)."""
    return os.environ.get(GPU_TYPE_ENV, "cpu")


def _plain(value: Any) -> Any:
    """A metric's value as JSON takes it: a one-element tensor or a NumPy scalar as a number."""
    if not isinstance(value, (str, int, float)) and hasattr(value, "item"):
        try:
            return value.item()
        except (ValueError, RuntimeError):  # more than one element: dropped as it is
            return value
    return value


class AdaptiveTraining:
    """Adaptive data-parallel training of `model` on `dataset` (see the module doc).

    - `init_batch`: the total batch the job is tuned for (M0), its first and smallest.
    - `max_batch`: the largest total batch it may grow to. By default what the profile allows:
      the largest per-GPU batch (`max_local`, by default `max_batch`, else `init_batch`: the
      profiling run sweeps up to it and finds what fits in memory) on MAX_BATCH_REPLICAS (16)
      replicas, at least `init_batch`. The goodput model grows the batch only while it pays.
    - `target_epochs`: statistical epochs to train (None: until stopped); `run` ends there.
    - `checkpoint_path`: the file it saves to and resumes from; by default GOODPUT_CHECKPOINT,
      which the executor sets (None, unset: no checkpoints).
    - `report`, `report_every_s`: where its `JobStats` go, and how often (the executor's choice
      by default: printed, every GOODPUT_REPORT_S). Metrics of the script's own: `report(...)`.
    - `noise_every`: steps between the replicas' noise samples (NOISE_EVERY, 4; 1: every step).
      Each sample costs a pass over the local gradient and a copy of the last bucket in and out
      (the agreement on stopping and checkpoints rides on it, so a SIGTERM is heeded within that
      many steps); the estimate averages as many samples either way, so it is as accurate, and
      follows a change of the noise over that many times more steps. One replica samples every
      step.

    On several replicas DDP keeps the gradients in its buckets (`gradient_as_bucket_view`): a
    parameter's `.grad` is a view of one, to be changed in place, never replaced or detach_()ed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset,
        *,
        init_batch: int,
        max_batch: int | None = None,
        max_local: int | None = None,
        min_local: int = 1,
        lr_rule: str | None = None,
        warmup_epochs: float = 0.0,
        target_epochs: float | None = None,
        checkpoint_path: str | Path | None = None,
        seed: int = 0,
        retune_every: int = RETUNE_EVERY,
        noise_every: int = NOISE_EVERY,
        collate: Callable = default_collate,
        adaptive: bool = True,
        report: Callable[[JobStats], None] | None = None,
        report_every_s: float = REPORT_EVERY_S,
        checkpoint_every_s: float | None = CHECKPOINT_EVERY_S,
    ):
        self.placement = Placement.from_env()
        # A GPU per worker where there are GPUs (the executor makes one visible to each), else the CPU.
        self.device = (
            torch.device("cuda", self.placement.local_rank % torch.cuda.device_count())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.dataset, self.collate = dataset, collate
        self.optimizer = optimizer
        max_local = max_local or max_batch or init_batch
        self.limits = BatchLimits(
            init_batch, max_batch or max(init_batch, max_local * MAX_BATCH_REPLICAS), min_local, max_local
        )
        self.lr = LrScaling(lr_rule or default_rule(type(optimizer).__name__), init_batch, warmup_epochs)
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self._group_of = self._groups()
        # Adam and its kin (the optimizers with exp_avg_sq) have betas; SGD's metric is the plain one.
        self._adaptive_metric = any("betas" in group for group in optimizer.param_groups)
        self._scale_of: dict[torch.Tensor, torch.Tensor | None] = {}  # this step's, looked up once
        self.target_epochs = target_epochs
        checkpoint_path = checkpoint_path or os.environ.get(CHECKPOINT_PATH_ENV)
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.checkpoint_every_s = float(os.environ.get(CHECKPOINT_ENV, 0)) or checkpoint_every_s
        self._saved = time.monotonic()
        self.retune_every = retune_every
        self.noise_every = max(1, noise_every)
        self.adaptive = adaptive and os.environ.get(ADAPTIVE_ENV) != "0"
        if report is None and os.environ.get(REPORT_ENV):
            report, report_every_s = print_stats, float(os.environ[REPORT_ENV])
        self._reporter, self.report_every_s = report, report_every_s
        self._dropped: set[str] = set()  # why metrics were dropped, each said once
        self._reported = time.monotonic()
        self.order = ElasticOrder(len(dataset), seed)
        self.noise = NoiseScale(init_batch)
        self.progress = 0.0  # statistical progress, in M0-examples
        self.steps = 0
        self.timings: dict[tuple[int, int, int, int], list[float]] = defaultdict(list)
        self.m, self.s = self._initial_batch()
        self.model, self._exchange = self._distribute(model.to(self.device))
        self._params = list(self.model.parameters())
        self._previous: list[torch.Tensor] | None = None  # the last gradient (differenced estimator)
        self._micro = 0  # micro-batches done in this step
        self._loss_divisor = 1  # micro-batches a step, times the replicas (`backward`)
        self._micro_norms: list[torch.Tensor] = []  # and their own gradients' squared norms
        self.skipped = 0  # steps with a non-finite gradient
        self._started = 0.0
        self._stop = False
        self._order_before = self.order.state_dict()
        watch_stops(self._on_stop)
        self._resume()

    # ---- the loop -------------------------------------------------------------------------

    def run(self, loss_of: Callable[[torch.nn.Module, Any], torch.Tensor]) -> str:
        """Train to the target epochs, `loss_of(model, micro_batch)` a micro-batch's loss: "done"
        (checkpointed), or "stopped" (SIGTERM: checkpointed, to be resumed); or, started by the
        profiler, profile instead and print the result for it: "profiled"."""
        if os.environ.get(PROFILE_ENV):
            print_line(PROFILE_PREFIX, self.profile(loss_of))
            return "profiled"
        try:
            while not self.done():
                self.train_step(loss_of)
        except Stopped:
            return "stopped"
        self.save()
        return "done"

    def profile(
        self,
        loss_of: Callable[[torch.nn.Module, Any], torch.Tensor],
        points: int = profiling.PROFILE_POINTS,
        steps: int = profiling.PROFILE_STEPS,
        budget_s: float = profiling.PROFILE_BUDGET_S,
    ) -> ProfileRun:
        """The profiling run: time `steps` optimizer steps (one replica, no accumulation) at each
        batch size from the job's smallest to its largest per-GPU batch, until one runs out of
        memory or the budget is spent."""
        if self.placement.world != 1:
            raise ValueError(f"a profiling run takes one GPU, not {self.placement.world}")
        if os.environ.get(SLOT_MEMORY_ENV):
            profiling.limit_memory(float(os.environ[SLOT_MEMORY_ENV]))
        self.adaptive, self._reporter = False, None  # the batch is ours to choose; nothing to report

        def step_at(m: int) -> None:
            self.m, self.s = m, 0
            self.train_step(loss_of)
            self._synchronize()

        measured, out_of_memory, spent = sweep(
            step_at,
            profiling.batch_sizes(self.limits.min_local, self.limits.max_local, points),
            steps,
            budget_s,
            lambda: self.optimizer.zero_grad(set_to_none=True),
        )
        return ProfileRun(tuple(measured), self.limits.init_batch, self.limits.max_batch, out_of_memory, spent)

    def train_step(self, loss_of: Callable[[torch.nn.Module, Any], torch.Tensor]) -> None:
        for batch in self.micro_batches():
            self.backward(loss_of(self.model, batch))
        self.step()

    def micro_batches(self) -> Iterator[Any]:
        """This rank's s + 1 micro-batches for the next optimizer step."""
        self._started = time.perf_counter()
        self._micro, self._micro_norms = 0, []
        self._loss_divisor = (self.s + 1) * (self.placement.world if self._exchange is not None else 1)
        self._order_before = self.order.state_dict()
        if self._exchange is not None:
            self._exchange.reset()
            self._exchange.sample = self.steps % self.noise_every == 0
        p = self.placement
        ddp = self.model if isinstance(self.model, DistributedDataParallel) else None
        try:
            for j, indices in enumerate(self.order.step(p.rank, p.world, self.m, self.s)):
                if isinstance(self.dataset, TensorDataset):  # tensors in memory: one gather each
                    batch = tuple(tensor.index_select(0, indices) for tensor in self.dataset.tensors)
                else:
                    batch = self.collate([self.dataset[int(i)] for i in indices])
                if ddp is not None and ddp.require_backward_grad_sync != (j == self.s):
                    ddp.require_backward_grad_sync = j == self.s  # no_sync()'s switch, read in the forward pass
                yield _to(batch, self.device)
        finally:
            if ddp is not None and not ddp.require_backward_grad_sync:
                ddp.require_backward_grad_sync = True

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through one micro-batch: averaged over the step's micro-batches and, divided by
        the number of replicas, summed over them by the all-reduce (`_exchange_hook`); replicas
        synchronise on the last micro-batch only (`micro_batches` tells DDP so before each forward
        pass: DDP decides there, not in the backward pass)."""
        (loss / self._loss_divisor if self._loss_divisor != 1 else loss).backward()
        if self.placement.world == 1 and self.s > 0:
            self._record_micro_gradient()
        self._micro += 1  # (no loss.item(): on a GPU it would wait for the step)

    def step(self) -> None:
        """The optimizer step, with everything around it (see the module doc)."""
        local_sqr, mean_sqr, stop, save, params, grads = self._agree()
        if stop:  # this step is dropped: resume re-runs its examples
            self.order = ElasticOrder.from_state(len(self.dataset), self._order_before)
            self.optimizer.zero_grad(set_to_none=False)
            self.save()
            if not say(STOPPED_MARK):
                self._reporter = None
            raise Stopped("stopped (SIGTERM, or the executor is gone): state saved")
        batch = self.batch
        if not math.isfinite(mean_sqr):  # NaN/Inf somewhere: skipped, never learned from
            self.optimizer.zero_grad(set_to_none=False)
            self._scale_of.clear()
            self.skipped += 1
            self._previous = None
            return
        self._estimate_noise(batch, local_sqr, params, grads, mean_sqr)
        stats = self.noise.stats()
        sqr, var = stats if stats else (None, None)
        factor = self.lr.factor(batch, sqr, var, self.epochs)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self._scale_of.clear()  # the preconditioner moved with the step
        self.progress += self.lr.progress(batch, sqr, var)
        self.steps += 1
        self._synchronize()
        self._time(time.perf_counter() - self._started)
        if self.adaptive and self.steps % self.retune_every == 0:
            self.retune()
        if time.monotonic() - self._reported >= self.report_every_s:
            self._report()
        if save:  # a crash then loses at most checkpoint_every_s of training
            self.save()

    def done(self) -> bool:
        return self.target_epochs is not None and self.epochs >= self.target_epochs

    def report(self, **metrics: float | str) -> None:
        """The script's own metrics, under any name: `training.report(test_mse=0.12, accuracy=0.9)`.
        Rank 0 prints them (a line for the executor, which keeps the latest value of each name and
        shows them in `goodput status`); the other ranks' are ignored. Numbers (a one-element
        tensor too) or short strings, at most MAX_METRICS names; anything else is dropped, logged."""
        if self.placement.rank != 0 or os.environ.get(PROFILE_ENV):
            return
        kept, dropped = clean_metrics({name: _plain(value) for name, value in metrics.items()})
        for why in set(dropped) - self._dropped:  # once each: a script reports the same every step
            self._dropped.add(why)
            log.warning("metric dropped: %s", why)
        if kept and not say(METRICS_PREFIX + json.dumps(kept)):
            self._reporter, self._stop = None, True  # the executor is gone: stop, checkpointed

    @property
    def epochs(self) -> float:
        """Statistical epochs: progress in M0-examples over the dataset's size."""
        return self.progress / len(self.dataset)

    @property
    def batch(self) -> int:
        return self.placement.world * self.m * (self.s + 1)

    @property
    def batches(self) -> list[int]:
        """Every total batch it has trained at, over all its allocations."""
        return sorted({world * m * (s + 1) for _, world, m, s in self.timings})

    # ---- adaptation -----------------------------------------------------------------------

    def stats(self) -> JobStats:
        """What the job has measured, as it reports it (`report`, every `report_every_s`)."""
        noise = self.noise.stats()
        return JobStats(
            os.environ.get(JOB_ENV, "job"),
            gpu_type(),
            tuple(self.observations()),
            *(noise or (None, None)),
            self.epochs,
            self.steps,
            self.m,
            self.s,
            self.skipped,
            self.target_epochs,
        )

    def observations(self) -> list[Observation]:
        """Each configuration run, with the median of its recent step times."""
        return [
            Observation(nodes, gpus, m, s, float(torch.tensor(times).median()))
            for (nodes, gpus, m, s), times in sorted(self.timings.items())
        ]

    def retune(self) -> None:
        """Re-pick (m, s) for the most goodput on this placement (rank 0 decides for all)."""
        choice = torch.tensor([self.m, self.s], device=self.device)
        if self.placement.rank == 0:
            stats = self.noise.stats()
            try:
                model = GoodputModel(
                    fit_throughput(self.observations()), *(stats or (None, None)), self.limits.init_batch
                )
                _, m, s = model.retune(self.placement.nodes, self.placement.world, self.limits, (self.m, self.s))
                if m > 0:
                    choice = torch.tensor([m, s], device=self.device)
            except FitError:
                pass
        if self.placement.world > 1:
            dist.broadcast(choice, src=0)
        self.m, self.s = int(choice[0]), int(choice[1])

    def _initial_batch(self) -> tuple[int, int]:
        m, s = split_batch(self.limits.init_batch, self.placement.world, self.limits.max_local)
        return max(m, self.limits.min_local), s

    def _synchronize(self) -> None:
        """A step is timed once the GPU has done it (its kernels run after the Python that queued them)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time(self, seconds: float) -> None:
        """Each rank keeps its own step times; rank 0's are the ones fitted (it decides)."""
        key = (self.placement.nodes, self.placement.world, self.m, self.s)
        self.timings[key] = (self.timings[key] + [seconds])[-TIMINGS_KEPT:]

    # ---- the noise scale ------------------------------------------------------------------

    def _groups(self) -> dict[int, dict]:
        """Each parameter's optimizer group, looked up once: the preconditioner needs it for every
        parameter every step."""
        return {id(p): group for group in self.optimizer.param_groups for p in group["params"]}

    def _scale(self, param: torch.Tensor) -> torch.Tensor | None:
        """The square root of Adam's diagonal preconditioner 1 / (sqrt(v̂) + eps): the norms are
        taken of the gradient times it. None for SGD or before its first step; once a step."""
        if param in self._scale_of:
            return self._scale_of[param]
        state = self.optimizer.state.get(param, {})
        scale = None
        if "exp_avg_sq" in state:
            group = self._group_of[id(param)]
            v_hat = state["exp_avg_sq"] / (1 - group["betas"][1] ** float(state["step"]))
            scale = (1.0 / (v_hat.sqrt() + group["eps"])).sqrt()
        self._scale_of[param] = scale
        return scale

    def _scales(self, params: list[torch.Tensor]) -> list[torch.Tensor | None] | None:
        """Each parameter's `_scale`; None when all are None: the plain metric."""
        if not self._adaptive_metric:
            return None
        scales = [self._scale(p) for p in params]
        return None if all(scale is None for scale in scales) else scales

    def _parameters(self) -> list[torch.Tensor]:
        return [p for p in self._params if p.grad is not None]

    def _norm(self, grads: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
        return sum_of_squares(grads, self._scales(params))

    def _record_micro_gradient(self) -> None:
        """The latest micro-batch's own gradient is the growth of the accumulated one."""
        params = self._parameters()
        grads = torch._foreach_mul([p.grad.detach() for p in params], float(self.s + 1))
        previous = self._previous if self._micro else None
        own = grads if previous is None else torch._foreach_sub(grads, previous)
        self._micro_norms.append(self._norm(own, params))
        self._previous = grads

    def _agree(self) -> tuple[float, float, bool, bool, list[torch.Tensor], list[torch.Tensor]]:
        """The replicas' mean local squared norm, the averaged gradient's, and whether any replica,
        before this step's gradients were exchanged, was told to stop or asked for a checkpoint (so
        all do it at the same step: a sampling step, every `noise_every`); and on one replica the parameters and their gradients. The
        norms were taken as tensors, read here at once: one wait for the device a step."""
        if self.placement.world == 1:
            params = self._parameters()
            grads = [p.grad.detach() for p in params]
            return 0.0, float(self._norm(grads, params)), self._stop, self._save_due(), params, grads
        exchange = self._exchange
        if not exchange.mean or (exchange.sample and exchange.agreed is None):
            raise RuntimeError("step() without a backward() through the model on its last micro-batch")
        mean = exchange.mean[0] if len(exchange.mean) == 1 else torch.stack(exchange.mean).sum()
        agreed = exchange.agreed.double() if exchange.agreed is not None else mean.new_zeros(3, dtype=torch.float64)
        local_sqr, stop, save, mean_sqr = torch.cat([agreed, mean.reshape(1).double()]).tolist()
        exchange.reset()
        return local_sqr / self.placement.world, mean_sqr, stop > 0, save > 0, [], []

    def _save_due(self) -> bool:
        """Rank 0's clock decides when a periodic checkpoint is due (the others agree through it)."""
        return (
            self.checkpoint_path is not None
            and self.checkpoint_every_s is not None
            and self.placement.rank == 0
            and time.monotonic() - self._saved >= self.checkpoint_every_s
        )

    def _estimate_noise(
        self, batch: int, local_sqr: float, params: list[torch.Tensor], grads: list[torch.Tensor], mean_sqr: float
    ) -> None:
        if self.placement.world > 1:
            sample = None
            if self.steps % self.noise_every == 0:  # the replicas took their local norms
                sample = from_replicas(local_sqr, mean_sqr, self.m * (self.s + 1), self.placement.world)
        elif self.s > 0:
            micro_mean = float(torch.stack(self._micro_norms).mean())
            sample = from_replicas(micro_mean, mean_sqr, self.m, self.s + 1)
            self._previous = None
        else:
            sample = None
            if self._previous is not None and len(self._previous) == len(grads):
                sample = from_consecutive(self._previous, grads, batch, scales=self._scales(params))
            self._previous = [g.clone() for g in grads]
        if sample is not None:
            self.noise.update(sample)

    # ---- state ----------------------------------------------------------------------------

    def _distribute(self, model: torch.nn.Module):
        if self.placement.world == 1:
            return model, None
        if not dist.is_initialized():
            # A bounded wait for peers: a lost one fails the step (the job restarts from its
            # checkpoint) rather than hanging for torch's 30 minutes.
            timeout = timedelta(seconds=float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, COLLECTIVE_TIMEOUT_S)))
            if self.device.type == "cuda":
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", timeout=timeout)
            atexit.register(_release_distributed, weakref.ref(self))
        ddp = DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            gradient_as_bucket_view=True,  # the gradients live in the buckets: no copy in, none out
        )
        exchange = _Exchange(
            self._scales if self._adaptive_metric else None,
            lambda: (self._stop, self._save_due()),
            self.placement.world,
        )
        ddp.register_comm_hook(exchange, _exchange_hook)
        return ddp, exchange

    def _module(self) -> torch.nn.Module:
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def state_dict(self) -> dict:
        return {
            "model": self._module().state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "order": self.order.state_dict(),
            "noise": self.noise.state_dict(),
            "progress": self.progress,
            "steps": self.steps,
            "batch": [self.m, self.s],
            "base_lrs": self.base_lrs,
            "placement": [self.placement.world, self.placement.nodes],
            "gpu_type": gpu_type(),
            "timings": [[list(key), times] for key, times in self.timings.items()],
        }

    def save(self) -> None:
        """Checkpoint (rank 0 writes; every rank holds the same state), and report what it
        measured: the last word before a stop or at the end."""
        if self.checkpoint_path and self.placement.rank == 0:
            checkpoint.save(self.state_dict(), self.checkpoint_path)
        self._saved = time.monotonic()
        self._report()
        if self.placement.world > 1:
            dist.barrier()

    def _report(self) -> None:
        """Hand `report` what it measured (rank 0). If the executor reading the reports is gone,
        stop (checkpointed) at the next step: no one would know what this job does."""
        if self._reporter and self.placement.rank == 0:
            self._reported = time.monotonic()
            try:
                self._reporter(self.stats())
            except BrokenPipeError:
                self._reporter, self._stop = None, True

    def _resume(self) -> None:
        state = checkpoint.load(self.checkpoint_path) if self.checkpoint_path else None
        if state is None:
            return
        self._module().load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._group_of = self._groups()  # loading made new group dicts
        self.base_lrs = state["base_lrs"]  # the optimizer's lr was the scaled one
        self.order = ElasticOrder.from_state(len(self.dataset), state["order"])
        self.noise.load_state_dict(state["noise"])
        self.progress, self.steps = state["progress"], state["steps"]
        if state.get("gpu_type") == gpu_type():
            self.timings = defaultdict(list, {tuple(key): times for key, times in state["timings"]})
        # else the step times were another GPU type's: this one is measured afresh (its fits, and
        # the estimator's, take each configuration's times as this type's)
        self.m, self.s = state["batch"]
        if [self.placement.world, self.placement.nodes] != state["placement"]:
            # Another allocation: the same total batch split over it, then re-picked for it.
            m, s = state["batch"]
            self.m, self.s = split_batch(
                state["placement"][0] * m * (s + 1), self.placement.world, self.limits.max_local
            )
            self.m = max(self.m, self.limits.min_local)
            if self.adaptive:
                self.retune()

    def _on_stop(self) -> None:
        """SIGTERM, or the lifeline's end (`worker.watch_stops`): stop, checkpointed, at the next step."""
        self._stop = True


def _to(batch: Any, device: torch.device) -> Any:
    """A micro-batch on the training device (tensors moved; anything else as it is)."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: _to(value, device) for key, value in batch.items()}
    return batch
