"""The Hugging Face Trainer under goodput: one callback.

The one line (`pip install './train[huggingface]'`), after the Trainer is made:

    trainer.add_callback(GoodputCallback(trainer))   # from goodput_train.huggingface

and `trainer.train()` as before (any Trainer subclass too). The callback takes the trainer itself:
a `TrainerCallback` is handed no optimizer or scheduler that the Trainer made, and the batch is
fixed in the Trainer's constructor. With it the script, run as a goodput worker:

- prints `goodput-stats` every GOODPUT_REPORT_S: its step times (each configuration's median), the
  gradient noise (two consecutive steps' averaged gradients every `noise_every` = 16 steps, after
  the Trainer's gradient clipping, in Adam's preconditioned metric for AdamW and its kin) and its
  statistical progress;
- checkpoints to GOODPUT_CHECKPOINT (one file, written atomically by rank 0: the model's weights,
  the optimizer, the scheduler, the global step and goodput's measurements): on SIGTERM or its
  lifeline's end (agreed by all ranks within 4 steps), every GOODPUT_CHECKPOINT_S
  (5 minutes) and at the end; after a stop it prints `goodput-stopped` and ends the script with
  exit code 0 (`goodput_train.trainer.Stopped`, a SystemExit: nothing after `train()` runs);
- resumes from that file at every start, at any world size: weights, optimizer, scheduler and the
  global step go on (the Trainer stops at its max_steps, or its epochs' steps, counted from there);
- in the profiling run (GOODPUT_PROFILE=1) times a few steps of the Trainer's own `compute_loss`
  at each per-GPU batch, prints the `goodput-profile` line and ends the script (exit code 0).

What is adaptive. The learning rate always: each step's is the scheduler's times the rule's factor
for the total batch (replicas × per_device_train_batch_size × gradient_accumulation_steps) against
the first run's (`lr_rule`: AdaScale for SGD, square root for AdamW). The batch at each start, when
`per_device_train_batch_size` is the job's to change (`adaptive_batch=True`, the default): the total
batch of the run before split over the new replicas (`per_device_train_batch_size` and
`gradient_accumulation_steps`) and re-picked for goodput from the step times measured; the
profiling run sweeps per-GPU batches up to `max_local` (by default the script's). The batch
changes at a start only, never inside a run. With `adaptive_batch=False` (or GOODPUT_ADAPTIVE=0)
the batch is the script's on every replica: the job still reports, stops, resumes and scales its
learning rate to its total batch, and the profile has that one batch.

What is not: the data position and the random state. A resumed run draws its data from the
beginning of the Trainer's sampler order again (the Trainer fast-forwards only from its own folder
checkpoints); the step count goes on and ends where it would have. `auto_find_batch_size`, DeepSpeed
and FSDP are not supported: the Trainer resizes or shards what the callback saves.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from goodput_train import checkpoint, profiling
from goodput_train.integration import (
    PAIR_EVERY,
    Batches,
    StepMeter,
    adaptive_env,
    checkpoint_path,
    limits_for,
    profile_and_end,
    start_batch,
)
from goodput_train.protocol import PROFILE_ENV
from goodput_train.trainer import CHECKPOINT_EVERY_S, Placement


class GoodputCallback(TrainerCallback):
    """See the module doc. `init_batch`: M0, the total batch the job is tuned for (by default the
    first run's); `max_local`, `max_batch`: the per-GPU and total batch it may grow to (by default
    the script's per-GPU batch, on 16 replicas); `target_epochs`: statistical epochs it declares
    (reported; the Trainer's max_steps or num_train_epochs still end it)."""

    def __init__(
        self,
        trainer: Trainer,
        *,
        adaptive_batch: bool = True,
        init_batch: int | None = None,
        max_local: int | None = None,
        max_batch: int | None = None,
        lr_rule: str | None = None,
        warmup_epochs: float = 0.0,
        target_epochs: float | None = None,
        noise_every: int = PAIR_EVERY,
        checkpoint_every_s: float | None = CHECKPOINT_EVERY_S,
    ):
        self.trainer = trainer
        self.placement = Placement.from_env()
        self.meter_options = {  # the StepMeter's, at each start
            "lr_rule": lr_rule,
            "warmup_epochs": warmup_epochs,
            "target_epochs": target_epochs,
            "noise_every": noise_every,
            "checkpoint_every_s": checkpoint_every_s,
        }
        self.meter: StepMeter | None = None
        self.profiling = bool(os.environ.get(PROFILE_ENV))
        path = checkpoint_path()
        self.saved = checkpoint.load(path) if path and not self.profiling else None
        goodput = self.saved["goodput"] if self.saved else None
        args = trainer.args
        m, s = args.per_device_train_batch_size, args.gradient_accumulation_steps - 1
        self.init_batch = goodput["init_batch"] if goodput else init_batch or self.placement.world * m * (s + 1)
        self.max_local = max_local or m
        self.limits = limits_for(self.init_batch, self.max_local, max_batch)
        self.adaptive_batch = adaptive_batch
        if adaptive_batch and adaptive_env() and goodput:
            self._set_batch(*start_batch(goodput, self.placement, m, s, self.limits, True))

    def _set_batch(self, m: int, s: int) -> None:
        """This run's per-device batch and accumulation, before `train()` makes its data loader."""
        trainer = self.trainer
        trainer.args.per_device_train_batch_size = m
        trainer._train_batch_size = trainer.args.train_batch_size  # what its data loader takes
        trainer.args.gradient_accumulation_steps = s + 1
        trainer.accelerator.gradient_accumulation_steps = s + 1

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        trainer = self.trainer
        optimizer = _torch_optimizer(trainer.optimizer)
        m, s = args.per_device_train_batch_size, args.gradient_accumulation_steps - 1
        if self.profiling:
            self._profile(train_dataloader, optimizer, m)
        if self.saved:
            trainer.model.load_state_dict(self.saved["model"])
            optimizer.load_state_dict(self.saved["optimizer"])
            if trainer.lr_scheduler is not None and self.saved.get("scheduler"):
                trainer.lr_scheduler.load_state_dict(self.saved["scheduler"])
            state.global_step = self.saved["global_step"]
        self.meter = StepMeter(
            optimizer,
            batch=(m, s),
            init_batch=self.init_batch,
            dataset_size=_dataset_size(train_dataloader, m * self.placement.world),
            **self.meter_options,
            device=args.device,
        )
        if self.saved:
            self.meter.load_state_dict(self.saved["goodput"])
            self.saved = None  # what the run resumed from, loaded: its memory back

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.meter.before_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.meter.restore_lr()  # before the Trainer steps its scheduler

    def on_step_end(self, args, state, control, **kwargs):
        if self.meter.end_step(lambda: self._save(state)):
            control.should_training_stop = True

    def on_evaluate(self, args, state, control, **kwargs):
        if self.meter is not None:
            self.meter.pause()  # the evaluation is not the next step's time

    def on_train_end(self, args, state, control, **kwargs):
        if self.meter is not None:
            self._save(state)

    def _save(self, state) -> None:
        """The model, optimizer, scheduler, global step and goodput's measurements, written
        atomically by rank 0 to GOODPUT_CHECKPOINT (no path: none)."""
        path = checkpoint_path()
        if path and self.placement.rank == 0:
            trainer = self.trainer
            scheduler = trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None
            checkpoint.save(
                {
                    "model": trainer.model.state_dict(),
                    "optimizer": _torch_optimizer(trainer.optimizer).state_dict(),
                    "scheduler": scheduler,
                    "global_step": state.global_step,
                    "goodput": self.meter.state_dict(),
                },
                path,
            )
        if path and self.placement.world > 1 and dist.is_initialized():
            dist.barrier()
        self.meter.report()
        self.meter.saved()

    def _profile(self, loader, optimizer: torch.optim.Optimizer, m: int) -> None:
        """Time the Trainer's own loss, backward and optimizer step at each per-GPU batch (the
        script's alone when the batch is rigid), print the profile and end the script."""
        trainer = self.trainer
        adaptive = self.adaptive_batch and adaptive_env()
        sizes = profiling.batch_sizes(1, self.max_local) if adaptive else [m]
        batches = Batches(loader)
        trainer.model.train()

        def step_at(size: int) -> None:
            inputs = trainer._prepare_inputs(batches.next(size))
            trainer.compute_loss(trainer.model, inputs).backward()
            optimizer.step()
            optimizer.zero_grad()
            if trainer.args.device.type == "cuda":
                torch.cuda.synchronize(trainer.args.device)

        max_batch = limits_for(self.init_batch, max(sizes), self.limits.max_batch).max_batch
        profile_and_end(step_at, sizes, self.init_batch, max_batch, optimizer)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's wrapper (its state and groups are the real ones)."""
    return getattr(optimizer, "optimizer", optimizer)


def _dataset_size(loader, batch: int) -> int:
    try:
        return len(loader.dataset)
    except (TypeError, AttributeError):
        return len(loader) * batch
