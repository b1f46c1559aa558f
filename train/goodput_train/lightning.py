"""PyTorch Lightning under goodput: one callback.

The one line (`pip install './train[lightning]'`):

    trainer = L.Trainer(..., callbacks=[GoodputCallback()])   # from goodput_train.lightning

and `trainer.fit(model, ...)` as before. With it the script, run as a goodput worker:

- prints `goodput-stats` every GOODPUT_REPORT_S: its step times (each configuration's median), the
  gradient noise (two consecutive steps' averaged gradients every `noise_every` = 16 steps, in
  Adam's preconditioned metric for Adam and its kin) and its statistical progress;
- checkpoints to GOODPUT_CHECKPOINT (Lightning's own checkpoint, written atomically by rank 0): on
  SIGTERM or its lifeline's end (agreed by all ranks within 4 steps), every
  GOODPUT_CHECKPOINT_S (5 minutes) and at the end; after a stop it prints `goodput-stopped` and
  ends the script with exit code 0 (`goodput_train.trainer.Stopped`, a SystemExit: nothing after
  `fit` runs);
- resumes from that file at every start, at any world size: weights, optimizer, schedulers, loops
  (the global step goes on), other callbacks' state and goodput's measurements;
- in the profiling run (GOODPUT_PROFILE=1) times a few steps of its own `training_step` at each
  per-GPU batch, prints the `goodput-profile` line and ends the script (exit code 0).

What is adaptive. The learning rate always: each step's is the optimizer's (and its schedulers')
times the rule's factor for the total batch (replicas × per-replica batch × accumulation) against
the first run's (`lr_rule`: AdaScale for SGD, square root for Adam). The batch where the data loader
allows, as Lightning's own batch-size finder does: when the LightningModule (or its datamodule)
has a `batch_size` attribute (or `hparams.batch_size`; `batch_arg` names another) that its
`train_dataloader` reads, each start sets it, and `trainer.accumulate_grad_batches`, to the batch
goodput picks: the total batch of the run before split over the new replicas and re-picked for
goodput from the step times measured; the profiling run sweeps per-GPU batches up to `max_local`
(by default the script's). Without such an attribute the batch is rigid (the loader's, on every
replica): the job still reports, stops, resumes and scales its learning rate to its total batch,
and the profile has that one batch. The batch changes at a start only, never inside a run.

What is not: the data position. Resumed mid-epoch, Lightning starts the epoch's data again (its
loaders are not stateful unless they are torchdata's StatefulDataLoader); the step count and the
epoch go on. The Trainer's `devices` and `num_nodes` must be the worker's placement: a script that
names them takes them from the environment, `L.Trainer(**placement(), callbacks=[GoodputCallback()])`.
Multiple optimizers (manual optimization): only the first is measured and scaled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from torch.utils.data import DataLoader

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


def placement() -> dict[str, Any]:
    """The Trainer's `devices` and `num_nodes` for this worker's place (torchrun's environment):
    `L.Trainer(**placement(), ...)`; one process alone: one device."""
    env = os.environ
    nodes = int(env.get("GROUP_WORLD_SIZE", env.get("GOODPUT_NODES", 1)))
    return {"devices": int(env.get("LOCAL_WORLD_SIZE", 1)), "num_nodes": nodes}


class GoodputCallback(pl.Callback):
    """See the module doc. `init_batch`: M0, the total batch the job is tuned for (by default the
    first run's); `max_local`, `max_batch`: the per-GPU and total batch it may grow to (by default
    the script's per-GPU batch, on 16 replicas); `target_epochs`: statistical epochs it declares
    (reported; the Trainer's max_epochs or max_steps still end it)."""

    def __init__(
        self,
        *,
        init_batch: int | None = None,
        max_local: int | None = None,
        max_batch: int | None = None,
        lr_rule: str | None = None,
        warmup_epochs: float = 0.0,
        target_epochs: float | None = None,
        batch_arg: str = "batch_size",
        noise_every: int = PAIR_EVERY,
        checkpoint_every_s: float | None = CHECKPOINT_EVERY_S,
    ):
        self.init_batch, self.max_local, self.max_batch = init_batch, max_local, max_batch
        self.meter_options = {  # the StepMeter's, at each start
            "lr_rule": lr_rule,
            "warmup_epochs": warmup_epochs,
            "target_epochs": target_epochs,
            "noise_every": noise_every,
            "checkpoint_every_s": checkpoint_every_s,
        }
        self.batch_arg = batch_arg
        self.meter: StepMeter | None = None
        self._saved_state: dict | None = None  # goodput's part of the checkpoint resumed from
        self._stepped = False  # the optimizer stepped in this batch (not an accumulation's)
        self._hook = None

    # ---- start: resume, the batch -------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before the loops and the data loaders: resume from the contract's checkpoint (the trainer
        restores the optimizers, schedulers and loops from it next), then set this run's batch."""
        path = checkpoint_path()
        # (a `fit(ckpt_path=...)` of the script's own is restored by the trainer instead)
        if not os.environ.get(PROFILE_ENV) and path and os.path.exists(path) and not trainer.ckpt_path:
            connector = trainer._checkpoint_connector  # what `fit(ckpt_path=...)` does, from a callback
            connector.resume_start(path)
            connector.restore_model()
            connector.restore_datamodule()
            connector.restore_callbacks()  # our own state too: `load_state_dict`
        if self._adaptive_batch(trainer):
            m = int(lightning_getattr(pl_module, self.batch_arg))
            s = trainer.accumulate_grad_batches - 1
            self.max_local = self.max_local or m
            limits = limits_for(self._init_batch(m, s), self.max_local, self.max_batch)
            m, s = start_batch(self._saved_state, Placement.from_env(), m, s, limits, adaptive_env())
            lightning_setattr(pl_module, self.batch_arg, m)
            trainer.accumulate_grad_batches = s + 1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = _loader(trainer)
        m = loader.batch_size or 1 if loader is not None else 1
        s = trainer.accumulate_grad_batches - 1
        optimizer = trainer.optimizers[0]
        if os.environ.get(PROFILE_ENV):
            self._profile(trainer, pl_module, loader, optimizer, m, s)
        self.meter = StepMeter(
            optimizer,
            batch=(m, s),
            init_batch=self._init_batch(m, s),
            dataset_size=_dataset_size(loader, trainer, m),
            **self.meter_options,
            device=pl_module.device,
        )  # its SIGTERM handler replaces Lightning's (registered as the fit began)
        if self._saved_state:
            self.meter.load_state_dict(self._saved_state)
        self._hook = optimizer.register_step_post_hook(lambda *_: self._after_optimizer_step())

    def _adaptive_batch(self, trainer: pl.Trainer) -> bool:
        return lightning_hasattr(trainer.lightning_module, self.batch_arg)

    def _init_batch(self, m: int, s: int) -> int:
        if self._saved_state:
            return self._saved_state["init_batch"]
        return self.init_batch or Placement.from_env().world * m * (s + 1)

    # ---- each step ----------------------------------------------------------------------------

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.meter is not None and optimizer is self.meter.optimizer:
            self.meter.before_step()

    def _after_optimizer_step(self) -> None:
        self.meter.restore_lr()  # before Lightning steps its schedulers
        self._stepped = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._stepped:
            return
        self._stepped = False
        if self.meter.end_step(lambda: self._save(trainer)):
            trainer.should_stop = True

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.meter is not None:
            self.meter.pause()  # the evaluation is not the next step's time

    def on_train_end(self, trainer, pl_module) -> None:
        if self.meter is not None:
            self._save(trainer)
        if self._hook is not None:
            self._hook.remove()

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self._hook is not None:
            self._hook.remove()

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.meter.state_dict() if self.meter is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved_state = state_dict or None

    def _save(self, trainer: pl.Trainer) -> None:
        """Lightning's full checkpoint, written atomically by rank 0 to GOODPUT_CHECKPOINT (no path: none)."""
        path = checkpoint_path()
        if path:
            state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            if trainer.is_global_zero:
                checkpoint.save(state, path)
            trainer.strategy.barrier("goodput checkpoint")
        self.meter.report()
        self.meter.saved()

    # ---- the profiling run --------------------------------------------------------------------

    def _profile(self, trainer, pl_module, loader, optimizer, m: int, s: int) -> None:
        """Time the module's own training step at each per-GPU batch (the loader's alone when the
        batch is rigid), print the profile and end the script."""
        if loader is None:
            raise ValueError("a profiling run needs the training data loader")
        if self._adaptive_batch(trainer):
            sizes = profiling.batch_sizes(1, self.max_local or m)
        else:
            sizes = [m]
        batches = Batches(loader)

        def step_at(size: int) -> None:
            batch = trainer.strategy.batch_to_device(batches.next(size))
            output = call._call_strategy_hook(trainer, "training_step", batch, 0)
            loss = output["loss"] if isinstance(output, Mapping) else output
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)

        init_batch = self._init_batch(m, s)
        max_batch = limits_for(init_batch, max(sizes), self.max_batch).max_batch
        profile_and_end(step_at, sizes, init_batch, max_batch, optimizer)


def _loader(trainer: pl.Trainer) -> DataLoader | None:
    """The training DataLoader (the first, when there are several)."""
    loaders = trainer.train_dataloader
    if isinstance(loaders, Mapping):
        loaders = next(iter(loaders.values()), None)
    elif isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    return loaders if isinstance(loaders, DataLoader) else None


def _dataset_size(loader: DataLoader | None, trainer: pl.Trainer, m: int) -> int:
    try:
        return len(loader.dataset)
    except (TypeError, AttributeError):
        batches = trainer.num_training_batches
        return int(batches * m * Placement.from_env().world) if batches != float("inf") else 1
