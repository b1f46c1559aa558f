"""The loop every example job shares: train until the target, stop cleanly on SIGTERM, print one
line with the outcome (`goodput-outcome ` and JSON: the tests read it, and its numbers are the
job's metrics in `goodput status`). Under the executor the outcome line is optional: the exit code
says how the run ended (docs/jobs.md)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable

import torch

from goodput_train import AdaptiveTraining
from goodput_train.protocol import CHECKPOINT_PATH_ENV, OUTCOME_PREFIX


def job_arguments(
    description: str,
    epochs: float,
    argv: list[str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The options every example job takes: its target in statistical epochs and its checkpoint."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--epochs", type=float, default=epochs, help="statistical epochs to train (default: %(default)s)"
    )
    parser.add_argument(
        "--checkpoint",
        default=os.environ.get(CHECKPOINT_PATH_ENV),
        help=f"checkpoint file, resumed from if present (default: ${CHECKPOINT_PATH_ENV}, which the executor sets)",
    )
    if extra:
        extra(parser)
    return parser.parse_args(argv)


def train(
    training: AdaptiveTraining, loss_of: Callable[[torch.nn.Module, tuple], torch.Tensor], evaluate: Callable[[], float]
) -> dict:
    """Run `training` to its target epochs; `loss_of(model, batch)` is one micro-batch's loss."""
    outcome = training.run(loss_of)
    result = {"stopped": outcome == "stopped", "epochs": training.epochs, "steps": training.steps}
    if outcome == "done":
        result.update(
            batches=training.batches,
            metric=evaluate(),
            noise=training.noise.stats(),
            world=training.placement.world,
            skipped=training.skipped,
        )
    if outcome != "profiled":
        print(OUTCOME_PREFIX + json.dumps(result), flush=True)
    return result
